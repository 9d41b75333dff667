"""End to end: real `manage.py serve` processes, with workers and producers in processes of their
own, on the default embedded settings (SQLite, in-memory channel layer) and on PostgreSQL + Redis.

Every test runs on serve's default HTTP server; those marked ON_EVERY_SERVER (what a server choice
could break: handshakes, frame limits, a dropped socket, a wake-up, printing and stopping) run on
each server `serve --server` offers.
"""

import json
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from queues.serving import DEFAULT_SERVER, SERVERS
from queues.serving.limits import FRAME_SLACK_BYTES
from serverproc import Deployment, ServerProcess, postgres_database, redis_database

REDIS_DB = 5  # this module's own Redis database
WAKE_SECONDS = 1.0  # a dropped socket re-queues, and a post wakes a waiting claim, within this
LOG_TIMEOUT = 15.0
MAX_BODY_BYTES = 64 * 1024  # the sites' frame limit, small so that frames over it are cheap

ON_EVERY_SERVER = pytest.mark.parametrize("server_name", list(SERVERS), indirect=True)
ON_DEFAULT_SERVER = pytest.mark.parametrize("server_name", [DEFAULT_SERVER], indirect=True)  # shares its site

# A worker that claims `count` items, says which, and then hangs on to them.
HOLDER = """
import json, sys, time
from websockets.sync.client import connect
url, token, queue, count = sys.argv[1:]
socket = connect(url, additional_headers={"Authorization": "Bearer " + token})
socket.send(json.dumps({"op": "claim", "queue": queue, "max": int(count)}))
print(json.dumps({"held": [item["id"] for item in json.loads(socket.recv())["items"]]}), flush=True)
time.sleep(600)
"""

# A worker whose claim waits; it says when the server has taken the claim in, and when and what
# it was answered.
WAITER = """
import json, sys, time
from websockets.sync.client import connect
url, token, queue = sys.argv[1:]
socket = connect(url, additional_headers={"Authorization": "Bearer " + token})
socket.send(json.dumps({"op": "claim", "queue": queue, "wait": 60, "ref": "claim"}))
socket.send(json.dumps({"op": "sync", "ref": "sync"}))  # frames are handled in order
assert json.loads(socket.recv())["ref"] == "sync"
print(json.dumps({"waiting": True}), flush=True)
answer = json.loads(socket.recv())
print(json.dumps({"answered": time.time(), "ids": [item["id"] for item in answer["items"]]}), flush=True)
"""

# A worker that claims and finishes items for ever, reconnecting whenever the server goes away.
WORKER = """
import json, sys, time
from websockets.exceptions import WebSocketException
from websockets.sync.client import connect
url, token, queue = sys.argv[1:]
while True:
    try:
        with connect(url, additional_headers={"Authorization": "Bearer " + token}, open_timeout=2) as socket:
            while True:
                socket.send(json.dumps({"op": "claim", "queue": queue, "max": 5, "wait": 1}))
                for item in json.loads(socket.recv())["items"]:
                    print(json.dumps({"claimed": item["id"]}), flush=True)
                    result = {"done": item["payload"]}
                    socket.send(json.dumps({"op": "result", "queue": queue, "id": item["id"], "result": result}))
                    if json.loads(socket.recv())["accepted"]:
                        print(json.dumps({"accepted": item["id"], "result": result}), flush=True)
    except (OSError, WebSocketException):
        time.sleep(0.05)
"""

# A worker that claims one item (waiting for it), says which, and then says every frame it gets.
LISTENER = """
import json, sys
from websockets.sync.client import connect
url, token, queue = sys.argv[1:]
socket = connect(url, additional_headers={"Authorization": "Bearer " + token})
socket.send(json.dumps({"op": "claim", "queue": queue, "max": 1, "wait": 30}))
print(json.dumps({"held": [item["id"] for item in json.loads(socket.recv())["items"]]}), flush=True)
while True:
    print(json.dumps({"frame": json.loads(socket.recv())}), flush=True)
"""

# A producer that posts items for ever, saying which ones were answered 201.
PRODUCER = """
import json, sys, time
import httpx
url, token, queue = sys.argv[1:]
client = httpx.Client(base_url=url, headers={"Authorization": "Bearer " + token}, timeout=5)
n = 0
while True:
    n += 1
    try:
        response = client.post(f"/api/queues/{queue}/items", json={"payload": n})
    except httpx.HTTPError:
        time.sleep(0.05)
        continue
    if response.status_code == 201:
        print(json.dumps({"posted": response.json()["id"]}), flush=True)
    time.sleep(0.003)
"""


class Client:
    """A client script running in its own process; its output lines are JSON records."""

    def __init__(self, directory: Path, name: str, script: str, *args: str):
        self.log_path = directory / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", script, *args], stdout=log, stderr=subprocess.STDOUT
            )

    def records(self) -> list[dict]:
        """Every complete line written so far (a process killed mid-line leaves half a line)."""
        text = self.log_path.read_text(errors="replace")
        lines = text.split("\n")[:-1]
        return [json.loads(line) for line in lines if line.startswith("{")]

    def values(self, key: str) -> list:
        return [record[key] for record in self.records() if key in record]

    def wait_for(self, key: str, count: int = 1, timeout: float = LOG_TIMEOUT) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.values(key)
            if len(found) >= count:
                return found
            if self.process.poll() is not None:
                break
            time.sleep(0.01)
        raise AssertionError(f"no {count} x {key!r} from the client; its output:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@contextmanager
def clients(directory: Path):
    """Start clients with `start(name, script, *args)`; every one is killed at the end."""
    started: list[Client] = []

    def start(name: str, script: str, *args: str) -> Client:
        client = Client(directory, name, script, *args)
        started.append(client)
        return client

    try:
        yield start
    finally:
        for client in started:
            client.kill()


@dataclass
class Site:
    deployment: Deployment
    server: ServerProcess
    server_name: str
    token: str

    def api(self, server: ServerProcess | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=(server or self.server).url, headers={"Authorization": f"Bearer {self.token}"}, timeout=10
        )


@contextmanager
def backing_services(variant: str):
    """(database URL, Redis URL) of a variant: the embedded defaults, or PostgreSQL + Redis."""
    if variant == "embedded":
        yield None, None
        return
    with postgres_database() as database_url:
        yield database_url, redis_database(REDIS_DB)


def set_up(deployment: Deployment, queues: dict[str, tuple[str, ...]]) -> str:
    """Schema, queues (with their createqueue options) and one token for everything."""
    deployment.migrate()
    for name, options in queues.items():
        deployment.create_queue(name, *options)
    return deployment.create_token("e2e")


@pytest.fixture(scope="module", params=["embedded", "postgres"])
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server_name(request) -> str:
    """The HTTP server `serve --server` runs (ON_EVERY_SERVER or ON_DEFAULT_SERVER chooses)."""
    return request.param


@pytest.fixture(scope="module")
def site(variant, server_name, tmp_path_factory):
    with backing_services(variant) as (database_url, redis_url):
        deployment = Deployment(
            tmp_path_factory.mktemp(f"{variant}-{server_name}"),
            database_url=database_url,
            redis_url=redis_url,
            extra_env={"TASKHOSTER_MAX_BODY_BYTES": str(MAX_BODY_BYTES)},
        )
        token = set_up(
            deployment,
            {
                "held": ("--lease-seconds", "300"), "stopped": ("--lease-seconds", "300"),
                "woken": (), "load": ("--lease-seconds", "2"), "idle": (),
            },
        )
        with deployment.server(server=server_name) as server:
            yield Site(deployment, server, server_name, token)


@ON_EVERY_SERVER
def test_worker_handshakes_are_accepted_or_refused_by_the_socket_rules(site):
    url, bearer = site.server.ws_url, {"Authorization": f"Bearer {site.token}"}
    claim = json.dumps({"op": "claim", "queue": "idle", "ref": 1})
    # a worker sends no Origin; a page of one of our own hosts may, with the token in the URL
    for target, headers in [(url, bearer), (f"{url}?token={site.token}", {"Origin": "http://localhost:8000"})]:
        with connect(target, additional_headers=headers) as socket:
            socket.send(claim)
            assert json.loads(socket.recv()) == {"op": "items", "ref": 1, "items": []}

    with connect(url, additional_headers={"Authorization": "Bearer th_not-a-token"}) as socket:
        with pytest.raises(ConnectionClosed) as closed:
            socket.recv()
    assert closed.value.rcvd.code == 4401

    foreign_origin, unknown_path = {**bearer, "Origin": "https://elsewhere.example"}, url.replace("/work", "/elsewhere")
    for target, headers in [(url, foreign_origin), (unknown_path, bearer)]:
        with pytest.raises(InvalidStatus) as refused:
            connect(target, additional_headers=headers)
        assert refused.value.response.status_code == 403


@ON_EVERY_SERVER
def test_a_frame_over_the_limit_is_refused_and_one_far_over_it_closes_the_socket(site):
    bearer = {"Authorization": f"Bearer {site.token}"}
    with connect(site.server.ws_url, additional_headers=bearer, max_size=None) as socket:
        for over in (1, 3 * MAX_BODY_BYTES):  # however small the limit, a frame over it is answered
            socket.send(json.dumps({"op": "claim", "queue": "idle", "pad": "x" * (MAX_BODY_BYTES + over)}))
            assert json.loads(socket.recv())["code"] == "payload_too_large"
            socket.send(json.dumps({"op": "claim", "queue": "idle", "ref": 2}))  # still open
            assert json.loads(socket.recv()) == {"op": "items", "ref": 2, "items": []}

        # not buffered: the server closes the socket (uvicorn says 1009, message too big; daphne
        # drops the connection), which may cut the sending short
        with pytest.raises((ConnectionClosed, ConnectionResetError, BrokenPipeError)) as closed:
            socket.send("x" * (MAX_BODY_BYTES + FRAME_SLACK_BYTES + 1))
            socket.recv()
    if isinstance(closed.value, ConnectionClosed) and closed.value.rcvd is not None:
        assert closed.value.rcvd.code == 1009


@ON_EVERY_SERVER
def test_items_of_a_killed_worker_are_pending_again_at_once(site, tmp_path):
    with site.api() as api, clients(tmp_path) as start:
        posted = [api.post("/api/queues/held/items", json={"payload": n}).json()["id"] for n in range(3)]
        holder = start("holder", HOLDER, site.server.ws_url, site.token, "held", "3")
        assert sorted(holder.wait_for("held")[0]) == sorted(posted)
        assert {api.get(f"/api/queues/held/items/{i}").json()["status"] for i in posted} == {"processing"}
        holder.kill()  # SIGKILL: the lease (300 s) is far away
        deadline = time.monotonic() + WAKE_SECONDS
        while time.monotonic() < deadline:
            statuses = {api.get(f"/api/queues/held/items/{i}").json()["status"] for i in posted}
            if statuses == {"pending"}:
                break
        assert statuses == {"pending"}


@ON_EVERY_SERVER
def test_a_waiting_claim_is_woken_by_a_post_over_http(site, tmp_path):
    with site.api() as api, clients(tmp_path) as start:
        waiter = start("waiter", WAITER, site.server.ws_url, site.token, "woken")
        waiter.wait_for("waiting")
        posted_at = time.time()
        item_id = api.post("/api/queues/woken/items", json={"payload": "wake up"}).json()["id"]
        [answered] = waiter.wait_for("answered")
        assert waiter.values("ids") == [[item_id]]
        assert answered - posted_at < WAKE_SECONDS


def test_two_servers_wake_each_other_and_hand_each_item_out_once(variant, tmp_path):
    with ExitStack() as stack:
        database_url, _ = stack.enter_context(backing_services(variant))
        deployment = Deployment(tmp_path / "shared", database_url=database_url, redis_url=redis_database(REDIS_DB + 1))
        token = set_up(deployment, {"shared": ()})
        first = stack.enter_context(deployment.server())
        second = stack.enter_context(deployment.server())
        site = Site(deployment, first, DEFAULT_SERVER, token)
        start = stack.enter_context(clients(tmp_path))
        api_first, api_second = stack.enter_context(site.api(first)), stack.enter_context(site.api(second))

        waiter = start("waiter", WAITER, first.ws_url, token, "shared")
        waiter.wait_for("waiting")
        posted_at = time.time()
        item_id = api_second.post("/api/queues/shared/items", json={"payload": 0}).json()["id"]
        [answered] = waiter.wait_for("answered")
        assert waiter.values("ids") == [[item_id]]
        assert answered - posted_at < WAKE_SECONDS

        workers = [start(f"worker{n}", WORKER, server.ws_url, token, "shared") for n, server in enumerate([first, second] * 2)]
        batch = [{"payload": n} for n in range(1, 301)]
        posted = [item["id"] for item in api_first.post("/api/queues/shared/items", json={"items": batch[:150]}).json()["items"]]
        posted += [item["id"] for item in api_second.post("/api/queues/shared/items", json={"items": batch[150:]}).json()["items"]]
        posted.append(item_id)  # the waiter went away holding it: re-queued, so a worker gets it
        deadline = time.monotonic() + LOG_TIMEOUT
        while sum(len(w.values("accepted")) for w in workers) < len(posted) and time.monotonic() < deadline:
            time.sleep(0.05)
        claimed = [item for w in workers for item in w.values("claimed")]
        assert sorted(claimed) == sorted(posted)  # every item handed out, none twice
        assert sum(1 for w in workers if w.values("claimed")) > 1
        for api in (api_first, api_second):
            counts = api.get("/api/queues/shared").json()["counts"]
            assert counts == {"scheduled": 0, "pending": 0, "processing": 0, "finished": len(posted), "failed": 0}


def test_scheduled_items_and_cancels_reach_workers_of_another_server_process(variant, tmp_path):
    """Two servers: an item scheduled through one comes due and is handed to a worker of the
    other; canceled through the first, the other's socket that holds it is told."""
    with ExitStack() as stack:
        database_url, _ = stack.enter_context(backing_services(variant))
        deployment = Deployment(tmp_path / "shared", database_url=database_url, redis_url=redis_database(REDIS_DB + 2))
        token = set_up(deployment, {"later": ("--lease-seconds", "300")})
        first = stack.enter_context(deployment.server())
        second = stack.enter_context(deployment.server())
        start = stack.enter_context(clients(tmp_path))
        api_first = stack.enter_context(Site(deployment, first, DEFAULT_SERVER, token).api())

        listener = start("listener", LISTENER, second.ws_url, token, "later")
        item = api_first.post("/api/queues/later/items", json={"payload": 1, "delay": 0.5}).json()
        assert item["status"] == "scheduled"
        [held] = listener.wait_for("held")
        assert held == [item["id"]]
        claimed = api_first.get(f"/api/queues/later/items/{item['id']}").json()
        assert claimed["status"] == "processing" and claimed["attempts"] == 1

        canceled = api_first.post(f"/api/queues/later/items/{item['id']}/cancel", json={}).json()
        assert canceled["canceled"] is True
        [frame] = listener.wait_for("frame")
        assert frame == {"op": "canceled", "queue": "later", "id": item["id"]}


@ON_DEFAULT_SERVER
def test_nothing_acknowledged_is_lost_when_the_server_is_killed_under_load(site, tmp_path):
    server = site.server
    with clients(tmp_path) as start:
        producer = start("producer", PRODUCER, server.url, site.token, "load")
        workers = [start(f"worker{n}", WORKER, server.ws_url, site.token, "load") for n in range(2)]

        def acknowledged() -> tuple[int, int]:
            return len(producer.values("posted")), sum(len(w.values("accepted")) for w in workers)

        def wait_for_more(posts: int, results: int) -> None:
            deadline = time.monotonic() + LOG_TIMEOUT
            while time.monotonic() < deadline:
                if all(now >= before + 20 for now, before in zip(acknowledged(), (posts, results))):
                    return
                time.sleep(0.05)
            raise AssertionError(f"the load stalled at {acknowledged()}; server output:\n{server.output()[-3000:]}")

        wait_for_more(0, 0)
        server.kill()
        before_restart = acknowledged()
        server.start()
        wait_for_more(*before_restart)
        for client in (producer, *workers):
            client.kill()

    with site.api() as api:
        for item_id in producer.values("posted"):
            assert api.get(f"/api/queues/load/items/{item_id}").status_code == 200
        for worker in workers:
            for record in worker.records():
                if "accepted" in record:
                    item = api.get(f"/api/queues/load/items/{record['accepted']}").json()
                    assert (item["status"], item["result"]) == ("finished", record["result"])


@ON_EVERY_SERVER
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_serve_prints_where_it_serves_and_stops_cleanly(site, stop_signal, tmp_path):
    server = site.deployment.server(server=site.server_name)
    with server, clients(tmp_path) as start:
        output = server.output()
        for url in ("http://127.0.0.1:{}/", "/admin/", "/api/", "ws://127.0.0.1:{}/work"):
            assert url.format(server.port, server.port) in output
        assert "manage.py createtoken" in output
        start("waiter", WAITER, server.ws_url, site.token, "idle").wait_for("waiting")  # open sockets do not hold it up
        with site.api() as api:
            posted = [api.post("/api/queues/stopped/items", json={"payload": n}).json()["id"] for n in range(2)]
        holder = start("holder", HOLDER, server.ws_url, site.token, "stopped", "100")
        assert set(posted) <= set(holder.wait_for("held")[0])  # with what an earlier stop put back
        assert server.stop(stop_signal) == 0
        assert server.output().rstrip().endswith("Stopped.")
    with site.api() as api:  # what the stopped server's sockets held is pending again (G8)
        assert {api.get(f"/api/queues/stopped/items/{i}").json()["status"] for i in posted} == {"pending"}
