"""TaskhosterBackend in a Django project of its own (tests/django_project) against a live server:
the cases in tests/django_project/cases.py, run by a pytest of that project's, once here (Django
5.2 with the django-tasks package) and once under the newest Django 6 with its own django.tasks,
in a Python 3.12 venv made once under var/test-venvs."""

import glob
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client_support import client_env, live_server
from serverproc import PROJECT_DIR

CASES = Path(__file__).resolve().parent / "django_project"
DJANGO_6_VENV = PROJECT_DIR / "var" / "test-venvs" / "django6-py312"
# Django 6 and what the client needs (pyproject.toml's dependencies that taskhoster/ imports)
DJANGO_6_REQUIREMENTS = ["django>=6,<7", "pytest>=8", "websockets>=13", "httptools>=0.6"]
FRESH_FOR_SECONDS = 86400  # then the venv asks for the newest Django 6 again


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("django-tasks"), {"default": {}, "idle": {}}) as live:
        yield live


def run_cases(python: str, live, tmp_path: Path) -> str:
    env = client_env(live)
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the project's own: "settings"
    completed = subprocess.run(
        [python, "-m", "pytest", "-c", str(CASES / "pytest.ini"), "--rootdir", str(CASES), "-q",
         "--basetemp", str(tmp_path / "cases"), str(CASES / "cases.py")],
        cwd=CASES, env=env, capture_output=True, text=True, timeout=900)
    report = completed.stdout[-30000:] + completed.stderr[-5000:]
    assert completed.returncode == 0, report
    last_line = completed.stdout.strip().splitlines()[-1]
    assert " passed" in last_line and not any(word in last_line for word in ("skipped", "error", "failed")), report
    return last_line


def framework_of(python: str) -> str:
    return subprocess.run([python, "-c", "from taskhoster.django import framework; import django; "
                                         "print(framework.Task.__module__, django.__version__)"],
                          cwd=CASES, env=client_env(), capture_output=True, text=True, check=True).stdout.strip()


def test_the_backend_with_the_django_tasks_package(live, tmp_path):
    module, version = framework_of(sys.executable).split()
    assert module == "django_tasks.base" and version.startswith("5.")
    run_cases(sys.executable, live, tmp_path)


def test_the_backend_with_django_6_and_its_own_django_tasks(live, tmp_path):
    python = python_312()
    if python is None:
        pytest.skip("NOT RUN under Django 6: no working Python 3.12 found (under /root/.pyenv/versions, or "
                    "python3.12 on PATH); Django 6 needs it")
    venv_python = django_6_venv(python)
    module, version = framework_of(venv_python).split()
    assert module == "django.tasks.base" and version.startswith("6."), (module, version)
    run_cases(venv_python, live, tmp_path)


def python_312() -> str | None:
    """A Python 3.12 that runs: pyenv's first (its shims fail when no 3.12 is selected), then PATH's."""
    candidates = sorted(glob.glob("/root/.pyenv/versions/3.12*/bin/python3.12"), reverse=True)
    candidates += [found for found in [shutil.which("python3.12")] if found]
    for candidate in candidates:
        probe = subprocess.run([candidate, "-c", "import sys, venv; print(sys.version_info[:2] == (3, 12))"],
                               capture_output=True, text=True)
        if probe.stdout.strip() == "True":
            return candidate
    return None


def django_6_venv(python: str) -> str:
    """A venv of `python` with the newest Django 6; made once, brought up to date once a day.
    The client is not installed in it (its pins are the server's, Django 5.2): PYTHONPATH has it."""
    venv_python = DJANGO_6_VENV / "bin" / "python"
    marker = DJANGO_6_VENV / "installed"
    if marker.exists() and time.time() - marker.stat().st_mtime < FRESH_FOR_SECONDS:
        return str(venv_python)
    if not venv_python.exists():
        subprocess.run([python, "-m", "venv", str(DJANGO_6_VENV)], check=True)
    subprocess.run([str(venv_python), "-m", "pip", "install", "-q", "--upgrade", *DJANGO_6_REQUIREMENTS],
                   check=True, capture_output=True, timeout=600)
    marker.touch()
    return str(venv_python)
