"""A database that cannot be reached at start: every command says so in one line on stderr that
names DATABASE_URL, and exits 1, instead of a traceback. The data directory: serve makes it at
its start, or says in one line why it cannot."""

import subprocess
import sys

import pytest

from serverproc import MANAGE, PROJECT_DIR, Deployment

PASSWORD = "password-in-the-url"
UNREACHABLE = f"postgres://nobody:{PASSWORD}@127.0.0.1:1/none"  # nothing listens on port 1
COMMANDS = [
    pytest.param(["serve", "--host", "127.0.0.1", "--port", "0"], id="serve"),  # fails in its migrate
    pytest.param(["createqueue", "jobs"], id="createqueue"),
    pytest.param(["sweep", "--once"], id="sweep-once"),
    pytest.param(["sweep"], id="sweep-loop"),  # the loop rides out an outage later, not one at start
]


def manage(deployment: Deployment, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(MANAGE), *args],
        cwd=PROJECT_DIR,
        env=deployment.environ(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_one_line_naming_database_url(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert "DATABASE_URL" in line
    return line


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unreachable_postgres_database_is_told_in_one_line(tmp_path, command):
    done = manage(Deployment(tmp_path, database_url=UNREACHABLE), *command)

    line = assert_one_line_naming_database_url(done)
    assert "127.0.0.1:1" in line and "Connection refused" in line  # where, and what failed
    assert PASSWORD not in line
    assert done.stdout == ""


def test_a_sqlite_file_that_cannot_be_opened_is_told_in_one_line(tmp_path):
    missing = tmp_path / "no-such-directory" / "db.sqlite3"

    done = manage(Deployment(tmp_path, database_url=f"sqlite:///{missing}"), "createqueue", "jobs")

    line = assert_one_line_naming_database_url(done)
    assert str(missing) in line and "unable to open database file" in line


def test_traceback_still_shows_the_traceback_when_asked(tmp_path):
    done = manage(Deployment(tmp_path, database_url=UNREACHABLE), "sweep", "--once", "--traceback")

    assert done.returncode != 0
    assert "Traceback" in done.stderr and "OperationalError" in done.stderr



def test_serve_makes_the_data_directory_before_it_serves_with_no_queue_yet(tmp_path):
    deployment = Deployment(tmp_path)
    deployment.prepare(queues=[])
    assert not deployment.data_dir.exists()
    server = subprocess.Popen([sys.executable, str(MANAGE), "serve", "--host", "127.0.0.1", "--port", "0"],
                              cwd=PROJECT_DIR, env=deployment.environ(), stdout=subprocess.PIPE, text=True)
    try:
        assert "Taskhoster is serving" in server.stdout.readline()  # no request has come yet
        assert deployment.data_dir.is_dir()
    finally:
        server.terminate()
        server.communicate(timeout=30)


def test_a_data_directory_that_cannot_be_made_is_told_in_one_line(tmp_path):
    deployment = Deployment(tmp_path)
    deployment.prepare(queues=[])
    deployment.data_dir.write_text("a file where the data directory should be")

    done = manage(deployment, "serve", "--host", "127.0.0.1", "--port", "0")

    assert (done.returncode, done.stdout) == (1, "")
    [line] = done.stderr.splitlines()
    assert str(deployment.data_dir) in line and "TASKHOSTER_DATA_DIR" in line
