"""The example Django project (examples/django_project), copied as a user would, runs its task
through a live server: a view enqueues it, `manage.py taskhoster_worker` runs it, another view
reads its result."""

import shutil
import signal
import subprocess
import sys

import pytest

from client_support import client_env, live_server
from serverproc import PROJECT_DIR

EXAMPLE = PROJECT_DIR / "examples" / "django_project"

# what a browser or curl would do, through Django's test client
VISIT = """
import json, time
from django.test import Client
from django.test.utils import setup_test_environment
setup_test_environment()
client = Client()
answer = client.post("/welcome/", {"email": "ann@example.com", "name": "Ann"})
assert answer.status_code == 202, answer.content
result_id = answer.json()["id"]
deadline = time.monotonic() + 60
while (status := client.get(f"/tasks/{result_id}/").json())["status"] not in ("SUCCESSFUL", "FAILED"):
    assert time.monotonic() < deadline, status
    time.sleep(0.05)
print(json.dumps(status))
print(client.get("/tasks/01890000-0000-7000-8000-000000000000/").status_code)
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("django-example"), {"default": {}}) as live:
        yield live


def test_the_example_project_enqueues_runs_and_reads_its_task(live, tmp_path):
    project = shutil.copytree(EXAMPLE, tmp_path / "django_project")
    env = client_env(live)
    env.pop("DJANGO_SETTINGS_MODULE", None)
    worker = subprocess.Popen([sys.executable, "manage.py", "taskhoster_worker"], cwd=project, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        visit = subprocess.run([sys.executable, "manage.py", "shell", "-c", VISIT], cwd=project, env=env,
                               capture_output=True, text=True, timeout=120)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker_output, _ = worker.communicate(timeout=60)
    assert visit.returncode == 0, visit.stderr + worker_output
    status, not_found = visit.stdout.strip().splitlines()[-2:]
    assert status.startswith('{"id": ') and '"status": "SUCCESSFUL"' in status, status
    assert '"return_value": {"to": "ann@example.com", "subject": "Welcome, Ann!"}' in status
    assert not_found == "404"
    assert worker.returncode == 0, worker_output
    assert "on default at " + live.url in worker_output
