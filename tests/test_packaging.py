"""A built wheel carries everything the server needs: installed apart from the checkout, it serves
the dashboard's login page (its templates) and its static files."""

import re
import shutil
import subprocess
import sys
import time

import httpx

from serverproc import PROJECT_DIR

LEFT_OUT = shutil.ignore_patterns(".venv", "var", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                  ".hypothesis", "tests", "docs")
READY = re.compile(r"ws://\S+:(\d+)/work")


def test_a_wheel_installed_apart_from_the_checkout_serves_the_dashboard_and_its_static_files(tmp_path):
    source, wheels, installed = tmp_path / "source", tmp_path / "wheels", tmp_path / "installed"
    shutil.copytree(PROJECT_DIR, source, ignore=LEFT_OUT)  # the build writes beside the sources
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), str(source)], check=True,
                   capture_output=True, timeout=300)
    [wheel] = wheels.glob("taskhoster-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(installed), str(wheel)], check=True,
                   capture_output=True, timeout=300)
    shutil.rmtree(source)  # nothing may come from the copy of the checkout

    # the wheel's packages first on the path; Django and the rest from this environment
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(installed), "PYTHONUNBUFFERED": "1",
           "DJANGO_SETTINGS_MODULE": "taskhoster_site.settings", "TASKHOSTER_VAR_DIR": str(tmp_path / "var"),
           "TASKHOSTER_FSYNC": "off"}
    log = tmp_path / "serve.log"
    with open(log, "wb") as output:
        server = subprocess.Popen([sys.executable, "-m", "django", "serve", "--port", "0"], cwd=tmp_path, env=env,
                                  stdout=output, stderr=subprocess.STDOUT)
    try:
        port = wait_for_port(log, server)
        url = f"http://127.0.0.1:{port}"
        login = httpx.get(f"{url}/admin/login/", timeout=10)
        style = httpx.get(f"{url}/static/queues/dashboard.css", timeout=10)
        where = subprocess.run([sys.executable, "-c", "import queues; print(queues.__file__)"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=60).stdout
    finally:
        server.terminate()
        server.wait(30)

    assert where.startswith(str(installed)), where
    assert login.status_code == 200 and '<div id="site-name"><a href="/">Taskhoster</a></div>' in login.text
    assert style.status_code == 200 and ".th-dashboard" in style.text


def wait_for_port(log, server) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = READY.search(log.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        assert server.poll() is None, log.read_text()
        time.sleep(0.1)
    raise AssertionError(f"serve did not start:\n{log.read_text()}")
