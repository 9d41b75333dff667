"""The README's client examples run against a live server, so they stay true: every ```python and
```sh block of the sections "Use it from Python", "Retries, delays and cancel" and "Any program as
a worker", as written."""

import os
import re
import signal
import subprocess
import sys

import pytest

from client_support import client_env, live_server
from serverproc import PROJECT_DIR

README = PROJECT_DIR / "README.md"


def code_blocks(section: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block under the README heading `## section`."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"^```(\w+)\n(.*?)^```", text[start:end if end != -1 else None], re.S | re.M)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("readme"), {"thumbs": {}, "shout": {}, "words": {},
                                                                   "mail": {"max_attempts": 5}}) as live:
        yield live


@pytest.fixture
def env(live, tmp_path):
    """The examples' environment: the server and token in TASKHOSTER_URL/TASKHOSTER_TOKEN, and a
    `taskhoster` command on the PATH whether or not the console script is installed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "taskhoster"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m taskhoster.cli "$@"\n')
    shim.chmod(0o755)
    return client_env(live, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def run_with_worker(live, env, tmp_path, section: str) -> list[str]:
    """Run the section's producer examples while its one worker example runs; their outputs."""
    blocks = [code for language, code in code_blocks(section) if language == "python"]
    workers = [code for code in blocks if "Worker(" in code]
    producers = [code for code in blocks if "Worker(" not in code]
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
    return [done.stdout for done in outputs]


def test_the_python_examples_work_together(live, env, tmp_path):
    outputs = run_with_worker(live, env, tmp_path, "Use it from Python")
    assert len(outputs) == 2
    sync_lines = outputs[0].splitlines()
    assert sync_lines[0] == "{'thumbnail': 'cat-128.png', 'attempt': 1}"
    assert sync_lines[1].startswith("{'scheduled': 0, 'pending': ")
    assert outputs[1].strip() == str([f"{n}-128.png" for n in range(10)])


def test_the_retry_examples_work_together(live, env, tmp_path):
    outputs = run_with_worker(live, env, tmp_path, "Retries, delays and cancel")
    # the canceled reminder, retried: its retry failed once, then went out
    assert outputs == ["{'sent to': 'ann', 'tries': 2}\n"]


def test_the_program_worker_examples_work(live, env, tmp_path):
    blocks = [code for language, code in code_blocks("Any program as a worker") if language == "sh"]
    assert len(blocks) == 2
    outputs = []
    for code in blocks:
        done = subprocess.run(["sh", "-e", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Traceback" not in done.stderr
        outputs.append(done.stdout)
        assert '"status": "finished"' in done.stdout, f"{done.stderr}\nserver: {live.server.output()[-2000:]}"

    assert '"result": "HELLO, WORLD"' in outputs[0]
    assert '"exitCode": 3' in outputs[1]
    assert '"stderr": "expected a JSON string, got 42\\n"' in outputs[1]
    assert '"message": "./measure.sh exited with status 3"' in outputs[1]
    assert '"name": "words"' in outputs[1]
