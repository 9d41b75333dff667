"""Every example of the README runs against a live server, so the README cannot drift from the
product: each ```sh and ```python block under the headings below, as written, except that the
server's address 127.0.0.1:8000 becomes the test server's. Only the install and test lines at the
top are left out (CI runs the test line itself).

The examples run in a directory of their own that looks like a checkout: `manage.py`, and a
`.venv` whose `bin/activate` puts `python` and `taskhoster` on the PATH. `python manage.py ...`
there works on the test server's own database and data directory."""

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from client_support import client_env, live_server
from serverproc import MANAGE, PROJECT_DIR

README = PROJECT_DIR / "README.md"
TOUR, PYTHON, RETRIES, PROGRAMS = ("A five-minute tour", "Use it from Python", "Retries, delays and cancel",
                                   "Any program as a worker")
DEFAULT_ADDRESS = "127.0.0.1:8000"


def sections() -> dict[str, list[tuple[str, str]]]:
    """(language, code) of every fenced block, by the `## ` heading it is under ("" before the first)."""
    found: dict[str, list[tuple[str, str]]] = {}
    for number, part in enumerate(re.split(r"^## ", README.read_text(), flags=re.M)):
        heading = part.split("\n", 1)[0] if number else ""
        found[heading] = re.findall(r"^```(\w+)\n(.*?)^```", part, re.S | re.M)
    return found


def blocks(section: str, language: str, live=None) -> list[str]:
    codes = [code for lang, code in sections()[section] if lang == language]
    return [code.replace(DEFAULT_ADDRESS, live.url.removeprefix("http://")) if live else code for code in codes]


def test_every_runnable_block_of_the_readme_is_run_here():
    runnable = {heading for heading, found in sections().items() if any(lang in ("sh", "python") for lang, _ in found)}
    assert runnable == {"", TOUR, PYTHON, RETRIES, PROGRAMS}
    [install] = blocks("", "sh")
    assert len(install.splitlines()) == 2  # the install and test lines, run by hand and by CI


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("readme"), {}) as live:  # the examples make their queues
        yield live


@pytest.fixture
def env(live, tmp_path):
    """The examples' environment and working directory (tmp_path, like a checkout)."""
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, command in (("python", f'"{sys.executable}"'), ("taskhoster", f'"{sys.executable}" -m taskhoster.cli')):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        (bin_dir / name).chmod(0o755)
    (bin_dir / "activate").write_text(f'PATH="{bin_dir}:$PATH"; export PATH\n')
    (tmp_path / "manage.py").symlink_to(MANAGE)
    return {**live.deployment.environ(), **client_env(live, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")}


def run_sh(code: str, env: dict, cwd) -> str:
    done = subprocess.run(["sh", "-e", "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{code}\n{done.stdout}{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    return done.stdout


def test_the_tour_works_as_written(live, env, tmp_path):
    first, http_post, get_result, superuser = blocks(TOUR, "sh", live)
    [worker_code] = blocks(TOUR, "python", live)
    (tmp_path / "worker.py").write_text(worker_code)
    env = {k: v for k, v in env.items() if k != "TASKHOSTER_TOKEN"}  # the tour makes its own
    # one shell, as the reader's second terminal; the worker runs meanwhile, as in a third one
    script = (f"{first}\n{http_post}\n"
              f"python worker.py > worker.out 2>&1 &\nworker=$!\n"
              f"{get_result}\nkill $worker\n")

    output = run_sh(script, env, tmp_path)

    assert '"name": "thumbs"' in output
    assert re.search(r'"status": ?"pending"', output)  # the curl read, before the worker ran (compact JSON)
    assert '"result": {"thumbnail": "https://example.com/cat.jpg?w=128"}' in output
    assert "'accepted': True" in (tmp_path / "worker.out").read_text()

    # createsuperuser asks for a name and a password on a terminal; here they come from its
    # environment, and the account it makes opens the dashboard
    assert superuser.strip() == "python manage.py createsuperuser"
    run_sh(superuser.strip() + " --noinput", {**env, "DJANGO_SUPERUSER_USERNAME": "ann", "DJANGO_SUPERUSER_EMAIL":
                                              "ann@example.com", "DJANGO_SUPERUSER_PASSWORD": "a long tour pass"},
           tmp_path)
    assert "thumbs" in dashboard_page(live.url, "ann", "a long tour pass")


def dashboard_page(url: str, username: str, password: str) -> str:
    with httpx.Client(base_url=url, follow_redirects=True, timeout=30) as browser:
        login = browser.get("/")
        assert "/admin/login/" in str(login.url)
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login.text).group(1)
        page = browser.post(str(login.url), data={"csrfmiddlewaretoken": csrf, "username": username,
                                                  "password": password})
        assert page.status_code == 200 and str(page.url).rstrip("/") == url
        return page.text


def run_with_worker(live, env, tmp_path, section: str) -> list[str]:
    """Run the section's shell blocks (they make its queue), then its producer examples while its
    one worker example runs; the producers' outputs."""
    for code in blocks(section, "sh", live):
        run_sh(code, env, tmp_path)
    codes = blocks(section, "python", live)
    workers = [code for code in codes if "Worker(" in code]
    producers = [code for code in codes if "Worker(" not in code]
    assert len(workers) == 1 and producers

    worker = subprocess.Popen([sys.executable, "-c", workers[0]], cwd=tmp_path, env=env, stderr=subprocess.PIPE,
                              text=True)
    try:
        outputs = [subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=120) for code in producers]
    finally:
        worker.send_signal(signal.SIGTERM)
        _, worker_errors = worker.communicate(timeout=60)
    for done in outputs:
        assert done.returncode == 0, f"{done.stderr}\nworker: {worker_errors}\nserver: {live.server.output()[-2000:]}"
    assert worker.returncode == 0, worker_errors
    assert "taskhoster: working" in worker_errors  # it says so, with no logging set up
    return [done.stdout for done in outputs]


def test_the_python_examples_work_together(live, env, tmp_path):
    outputs = run_with_worker(live, env, tmp_path, PYTHON)
    assert len(outputs) == 1
    lines = outputs[0].splitlines()
    assert lines[0] == "{'thumbnail': 'cat-128.png', 'attempt': 1}"
    assert lines[1].startswith("{'scheduled': 0, 'pending': ")
    # the producer again, with no worker: its keyed post answers the item that ended above
    [producer] = [code for code in blocks(PYTHON, "python", live) if "Worker(" not in code]
    again = subprocess.run([sys.executable, "-c", producer], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[0] == lines[0]
    # run twice, the keyed post made one item
    queue = live.deployment.data_dir / "thumbs"
    cats = [path for state in ("pending", "processing", "done") for path in (queue / state).glob("*.json")
            if json.loads(path.read_text())["payload"] == {"image": "cat.png"}]
    assert len(cats) == 1


def test_the_retry_examples_work_together(live, env, tmp_path):
    outputs = run_with_worker(live, env, tmp_path, RETRIES)
    # the canceled reminder, retried: its retry failed once, then went out
    assert outputs == ["{'sent to': 'ann', 'tries': 2}\n"]


def test_the_program_worker_examples_work(live, env, tmp_path):
    codes = blocks(PROGRAMS, "sh", live)
    assert len(codes) == 2
    outputs = [run_sh(code, env, tmp_path) for code in codes]
    for output in outputs:
        assert '"status": "finished"' in output, f"server: {live.server.output()[-2000:]}"

    assert '"result": "HELLO, WORLD"' in outputs[0]
    assert '"exitCode": 3' in outputs[1]
    assert '"stderr": "expected a JSON string, got 42\\n"' in outputs[1]
    assert '"message": "./measure.sh exited with status 3"' in outputs[1]
    assert '"name": "words"' in outputs[1]
