"""What settings make outside the data directory: the secret key file (made once, whole, by the
first of several processes starting at once; a bad one refused in one line) and the owner-only
modes of `var/`, the key and a SQLite database, whatever the umask.

The processes here run `manage.py` (or import the settings) over a `var/` of the test's own,
named by TASKHOSTER_VAR_DIR, with no SECRET_KEY, DATABASE_URL or TASKHOSTER_DATA_DIR: the
defaults, as on a first start.
"""

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from serverproc import MANAGE, PROJECT_DIR, Deployment
from taskhoster_site import local_files

RACERS = 12
# Imports what is slow first, says it is ready, and reads the settings (making the key) only when
# told to, so that every racer makes or reads the key at about the same instant.
RACER = """
import sys
import django.conf, environ
print("ready", flush=True)
sys.stdin.readline()
from django.conf import settings
print(settings.SECRET_KEY, flush=True)
"""


def first_start_environ(var_dir: Path, **extra: str) -> dict[str, str]:
    env = Deployment(var_dir.parent / "deployment").environ()
    for name in ("SECRET_KEY", "DATABASE_URL", "TASKHOSTER_DATA_DIR"):
        env.pop(name)
    env.update(TASKHOSTER_VAR_DIR=str(var_dir), **extra)
    return env


def manage(var_dir: Path, *args: str, umask: int = -1, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(MANAGE), *args],
        cwd=PROJECT_DIR,
        env=first_start_environ(var_dir, **extra_env),
        capture_output=True,
        text=True,
        timeout=60,
        umask=umask,
    )


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_processes_racing_the_first_start_all_get_the_one_key_kept(tmp_path):
    var_dir = tmp_path / "var"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER],
            cwd=PROJECT_DIR,
            env=first_start_environ(var_dir),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(RACERS)
    ]
    for racer in racers:
        assert racer.stdout.readline() == "ready\n"
    for racer in racers:
        racer.stdin.write("go\n")
        racer.stdin.flush()
    finished = [racer.communicate(timeout=60) for racer in racers]

    assert [(racer.returncode, err) for racer, (_, err) in zip(racers, finished)] == [(0, "")] * RACERS
    keys = {out.strip() for out, _ in finished}
    kept = (var_dir / "secret_key").read_text()
    assert keys == {kept}
    assert len(kept) >= local_files.SECRET_KEY_MIN_CHARS
    assert [path.name for path in var_dir.iterdir() if "secret_key" in path.name] == ["secret_key"]  # no temp file left


def test_a_process_starting_while_another_writes_its_key_never_sees_it_half_made(tmp_path, monkeypatch):
    """The interleaving the race above can only hope to hit: a second process starts after the
    first has made its temporary file and written its key, before the key is in place. The
    second finds no key file, makes and places its own; the first then reads and keeps that one."""
    path = tmp_path / "secret_key"
    real_write = local_files._write_owner_only_file
    second_process_key = []

    def write_then_let_another_process_start(target: Path, text: str) -> None:
        assert not path.exists()  # nobody can read a key file being written
        real_write(target, text)
        if not second_process_key:
            second_process_key.append(None)  # the second process's own write does not nest
            second_process_key[0] = local_files.secret_key(path)

    monkeypatch.setattr(local_files, "_write_owner_only_file", write_then_let_another_process_start)
    first_process_key = local_files.secret_key(path)

    assert first_process_key == second_process_key[0] == path.read_text()
    assert len(first_process_key) >= local_files.SECRET_KEY_MIN_CHARS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret_key"]


def test_a_key_file_made_once_is_read_back_unchanged(tmp_path):
    path = tmp_path / "secret_key"
    made = local_files.secret_key(path)
    assert local_files.secret_key(path) == made
    assert mode(path) == 0o600


@pytest.mark.parametrize(
    "content",
    [b"", b"\n", b"not-a-key-we-made\n", b"\0" * 67, b"\xff\xfe" * 40],
    ids=["empty", "blank", "short", "zeros-after-a-crash", "not-text"],
)
def test_a_bad_key_file_is_refused_in_one_line_saying_what_to_do(tmp_path, content):
    var_dir = tmp_path / "var"
    var_dir.mkdir()
    key_file = var_dir / "secret_key"
    key_file.write_bytes(content)

    done = manage(var_dir, "check")

    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert str(key_file) in line
    assert "delete it" in line and "SECRET_KEY" in line
    assert key_file.read_bytes() == content  # told about, never silently replaced


def test_an_unreadable_key_path_is_refused_in_one_line(tmp_path):
    var_dir = tmp_path / "var"
    (var_dir / "secret_key").mkdir(parents=True)  # a directory where the key file should be

    done = manage(var_dir, "check")

    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert str(var_dir / "secret_key") in line and "SECRET_KEY" in line


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_a_first_start_makes_var_the_key_and_the_database_owner_only(tmp_path, umask):
    var_dir = tmp_path / "var"

    done = manage(var_dir, "migrate", "--no-input", "--verbosity", "0", umask=umask)

    assert (done.returncode, done.stderr) == (0, "")
    database = var_dir / "db.sqlite3"
    assert database.stat().st_size > 0  # SQLite took the empty file made for it as its database
    assert {path.name: mode(path) for path in [var_dir, var_dir / "secret_key", database]} == {
        "var": 0o700,
        "secret_key": 0o600,
        "db.sqlite3": 0o600,
    }


def test_var_is_owner_only_when_only_the_database_defaults_into_it(tmp_path):
    var_dir = tmp_path / "var"

    done = manage(var_dir, "migrate", "--no-input", "--verbosity", "0", umask=0o022, SECRET_KEY="k" * 50)

    assert (done.returncode, done.stderr) == (0, "")
    assert sorted(path.name for path in var_dir.iterdir()) == ["db.sqlite3"]
    assert (mode(var_dir), mode(var_dir / "db.sqlite3")) == (0o700, 0o600)


def test_a_database_that_exists_keeps_its_mode(tmp_path):
    """Only a database the server makes is made owner-only: one the operator made is theirs."""
    var_dir = tmp_path / "var"
    var_dir.mkdir(mode=0o700)
    database = var_dir / "db.sqlite3"
    database.touch(mode=0o640)
    database.chmod(0o640)

    done = manage(var_dir, "migrate", "--no-input", "--verbosity", "0", umask=0o022)

    assert (done.returncode, done.stderr) == (0, "")
    assert database.stat().st_size > 0
    assert mode(database) == 0o640
