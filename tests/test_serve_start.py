"""What a person starting the server is told: where everything is and how to get in, a busy port,
settings that would surprise them later, a host name outside ALLOWED_HOSTS; and that Django's
`runserver` runs the sweep too."""

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from queues.serving import MIGRATE_LOCK
from queues.serving.banner import banner, start_warnings
from queues.store import Store
from serverproc import MANAGE, PROJECT_DIR, Deployment


def test_the_banner_says_how_to_get_into_the_dashboard_and_where_the_api_is():
    text = banner(host="127.0.0.1", port=8000)

    assert "http://127.0.0.1:8000/ " in text and "python manage.py createsuperuser" in text
    assert "http://127.0.0.1:8000/api/schema" in text and "/api/ " not in text
    assert "ws://127.0.0.1:8000/work" in text
    assert "ALLOWED_HOSTS" not in text


def test_the_banner_for_every_address_shows_this_machines_name_and_the_allowed_hosts(settings):
    settings.ALLOWED_HOSTS = ["localhost", "127.0.0.1"]
    name = socket.gethostname()

    text = banner(host="0.0.0.0", port=8003)

    assert "0.0.0.0" not in text
    assert f"http://{name}:8003/" in text
    assert f"ALLOWED_HOSTS=localhost,127.0.0.1,{name}" in text


@pytest.mark.parametrize(("environ", "warned"), [
    ({"TASKHOSTER_DATA_DIR": "/srv/two"}, True),
    ({"TASKHOSTER_DATA_DIR": "/srv/two", "DATABASE_URL": "sqlite:////srv/two.sqlite3"}, False),
    ({"TASKHOSTER_DATA_DIR": "/srv/two", "TASKHOSTER_VAR_DIR": "/srv/two-var"}, False),
    ({}, False),
])
def test_a_data_directory_without_its_own_database_is_warned_about(environ, warned):
    warnings = start_warnings(environ)

    assert bool(warnings) == warned
    if warned:
        assert "moves only the item files" in warnings[0] and "DATABASE_URL" in warnings[0]


def test_a_busy_port_is_one_line_that_suggests_another(tmp_path):
    deployment = Deployment(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, str(MANAGE), "serve", "--port", str(port)], cwd=PROJECT_DIR,
                              env=deployment.environ(), capture_output=True, text=True, timeout=60)

    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}; is another server using port {port}? " \
           f"Choose another with --port {port + 1}" in done.stderr


@pytest.mark.django_db
def test_a_host_outside_allowed_hosts_is_logged_with_the_variable_to_set(client, settings, caplog):
    settings.ALLOWED_HOSTS = ["localhost"]
    with caplog.at_level(logging.ERROR, logger="django.security.DisallowedHost"):
        answer = client.get("/admin/login/", HTTP_HOST="box.example:8003")

    assert answer.status_code == 400
    assert b"ALLOWED_HOSTS" in answer.content
    assert "restart with ALLOWED_HOSTS=localhost,<that name>" in caplog.text


PREPARE = "import django; django.setup(); from queues.serving import prepare; prepare()"


def _preparing(deployment: Deployment) -> subprocess.Popen:
    """What `serve` does first (make the data directory, migrate), in a process of its own."""
    return subprocess.Popen([sys.executable, "-c", PREPARE], cwd=PROJECT_DIR, env=deployment.environ(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_servers_started_together_on_a_new_database_both_start(tmp_path):
    """Two at once on an installation whose database has no tables yet: one migrates, then the
    other finds it done (without taking turns, one failed most times: table already exists)."""
    deployment = Deployment(tmp_path)
    starting = [_preparing(deployment) for _ in range(2)]
    outputs = [process.communicate(timeout=120)[0] for process in starting]
    assert [process.returncode for process in starting] == [0, 0], outputs
    deployment.create_queue("jobs")  # the schema is whole


def test_a_server_migrates_only_while_it_holds_the_data_directory_s_migrate_lock(tmp_path):
    deployment = Deployment(tmp_path)
    deployment.data_dir.mkdir()
    lock = os.open(deployment.data_dir / MIGRATE_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.lockf(lock, fcntl.LOCK_EX)  # as another server migrating now
    starting = _preparing(deployment)
    try:
        def waits_for_the_lock() -> bool:
            """Whether it has the lock file open: it takes the lock right after."""
            opened = []
            for fd in Path(f"/proc/{starting.pid}/fd").iterdir():
                with contextlib.suppress(OSError):  # a descriptor closed meanwhile
                    opened.append(os.readlink(fd))
            return any(path.endswith(MIGRATE_LOCK) for path in opened)

        deadline = time.monotonic() + 60
        while not waits_for_the_lock():
            assert starting.poll() is None and time.monotonic() < deadline, "it never asked for the lock"
            time.sleep(0.05)
        assert starting.poll() is None
        with sqlite3.connect(tmp_path / "db.sqlite3") as database:  # nothing migrated meanwhile
            assert database.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone() == (0,)
    finally:
        os.close(lock)
    assert starting.wait(120) == 0, starting.communicate()[0]
    deployment.create_queue("jobs")


def _runserver(tmp_path, *queue_options: str, reload: bool = False) -> tuple[Deployment, subprocess.Popen, httpx.Client]:
    """`runserver --noreload` (or with its autoreloader, in a session of its own) over a new
    installation with the queue `short` (made with `queue_options`): the installation, the
    server, and an API client with a token."""
    deployment = Deployment(tmp_path)
    deployment.prepare(queues=[])
    deployment.create_queue("short", *queue_options)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(MANAGE), "runserver", *([] if reload else ["--noreload"]),
                               f"127.0.0.1:{port}"], cwd=PROJECT_DIR, env=deployment.environ(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=reload)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}",
                       headers={"Authorization": f"Bearer {deployment.token}"}, timeout=10)
    return deployment, server, api


def test_runserver_runs_the_sweep(tmp_path):
    """An item of a queue with a one-second life fails `timeout` under runserver too."""
    _, server, api = _runserver(tmp_path, "--queue-seconds", "1")
    try:
        item = _post_when_up(api)
        status = item["status"]
        deadline = time.monotonic() + 30
        while status == "pending" and time.monotonic() < deadline:
            time.sleep(0.2)
            status = api.get(f"/api/queues/short/items/{item['id']}").json()["status"]
        assert status == "failed"
        assert api.get(f"/api/queues/short/items/{item['id']}").json()["error"] == "timeout"
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=30)
    assert "sweep runs beside this development server" in output


def test_runserver_that_stops_gives_what_sockets_hold_back_without_counting_the_try(tmp_path):
    deployment, server, api = _runserver(tmp_path, "--max-attempts", "1")
    try:
        with _holding_an_item(deployment, api) as item:
            server.terminate()
            assert server.wait(30) == 0  # not a crash at exit (it was SIGSEGV)
    finally:
        if server.poll() is None:
            server.kill()
    back = Store(deployment.data_dir, fsync=False).read_item(queue="short", item_id=item["id"])
    assert (back.status, back.attempts) == ("pending", 1)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("to_group", [True, False], ids=["to-the-group", "to-the-parent-alone"])
def test_runserver_under_its_autoreloader_gives_what_sockets_hold_back_at_a_stop(tmp_path, stop, to_group):
    """The server runs in a thread of the reloader's child, without signal handlers. A signal
    reaches every process of the group (as Ctrl-C in a terminal), or the parent alone (a plain
    `kill`, a process manager), which passes it on to its child."""
    deployment, server, api = _runserver(tmp_path, "--max-attempts", "1", reload=True)
    try:
        with _holding_an_item(deployment, api) as item:
            (os.killpg if to_group else os.kill)(server.pid, stop)
            server.wait(30)
            store = Store(deployment.data_dir, fsync=False)
            deadline = time.monotonic() + 30  # the reloader's child may end after its parent
            while (back := store.read_item(queue="short", item_id=item["id"])).status == "processing":
                assert time.monotonic() < deadline, "the item was not given back"
                time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.communicate()
    assert (back.status, back.attempts) == ("pending", 1)


@contextlib.contextmanager
def _holding_an_item(deployment: Deployment, api: httpx.Client):
    """An item posted, and held by a worker socket for the block."""
    item = _post_when_up(api)
    work_url = f"ws://{api.base_url.host}:{api.base_url.port}/work"
    with connect(work_url, additional_headers={"Authorization": f"Bearer {deployment.token}"}) as worker:
        worker.send(json.dumps({"op": "claim", "queue": "short"}))
        assert [held["id"] for held in json.loads(worker.recv(timeout=30))["items"]] == [item["id"]]
        yield item


def _post_when_up(api: httpx.Client) -> dict:
    deadline = time.monotonic() + 60
    while True:
        try:
            answer = api.post("/api/queues/short/items", json={"payload": 1})
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        assert answer.status_code == 201, answer.text
        return answer.json()
