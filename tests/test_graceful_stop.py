"""SIGTERM to a real `serve`: it stops taking connections, lets a request in flight end within
the grace period, re-queues what worker sockets hold (never ending an item for its attempts),
and exits 0; a second signal ends the grace at once."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from lock_holder import item_locks_held_elsewhere
from queues import serving
from queues.store import Store
from serverproc import MANAGE, PROJECT_DIR, Deployment

WAIT = 30.0  # for what must happen well within it


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class InFlight(threading.Thread):
    """A request that waits on the server (a long-polling read), answered in a thread."""

    def __init__(self, url: str, token: str):
        super().__init__(daemon=True)
        self.url, self.token = url, token
        self.answer: httpx.Response | Exception | None = None

    def run(self):
        try:
            self.answer = httpx.get(self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=WAIT * 2)
        except Exception as exc:  # the outcome the test looks at
            self.answer = exc


@pytest.fixture
def deployment(tmp_path) -> Deployment:
    deployment = Deployment(tmp_path, extra_env={"TASKHOSTER_STOP_GRACE_SECONDS": "60"})
    deployment.prepare(queues=["waiting"])
    deployment.create_queue("once", "--max-attempts", "1", "--lease-seconds", "300")
    deployment.scraper = deployment.create_token("scraper", "--metrics")
    return deployment


def post(server, token: str, queue: str) -> str:
    answer = httpx.post(f"{server.url}/api/queues/{queue}/items", json={"payload": 1},
                        headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 201
    return answer.json()["id"]


def in_flight(server, scraper: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {scraper}"}).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "taskhoster_http_requests_in_flight")


def long_poll(server, token: str, item_id: str, wait: float, scraper: str) -> InFlight:
    """A read waiting `wait` seconds, begun: the server is answering it (and the scrape)."""
    request = InFlight(f"{server.url}/api/queues/waiting/items/{item_id}?wait={wait}", token)
    request.start()
    wait_until(lambda: in_flight(server, scraper) >= 2, "the long poll never reached the server")
    return request


@pytest.mark.parametrize("server_name", ["uvicorn", "daphne"])
def test_sigterm_refuses_new_connections_lets_a_request_end_and_requeues_without_ending_an_item(deployment, server_name):
    token = deployment.token
    with deployment.server(server=server_name) as server:
        held_id = post(server, token, "once")
        waiting_id = post(server, token, "waiting")
        with connect(server.ws_url, additional_headers={"Authorization": f"Bearer {token}"}) as worker:
            worker.send(json.dumps({"op": "claim", "queue": "once"}))
            [claimed] = json.loads(worker.recv(timeout=WAIT))["items"]
            assert (claimed["id"], claimed["attempts"], claimed["maxAttempts"]) == (held_id, 1, 1)
            request = long_poll(server, token, waiting_id, wait=6, scraper=deployment.scraper)
            kept_alive = socket.create_connection(("127.0.0.1", server.port))
            kept_alive.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answered = b""
            while not answered.endswith(b"}"):  # the whole answer: its body is a JSON object
                received = kept_alive.recv(65536)
                assert received, "closed before its answer"
                answered += received
            assert answered.startswith(b"HTTP/1.1 200 ")  # and idle since

            server.process.send_signal(signal.SIGTERM)
            wait_until(lambda: refused(server.port), "the server still took connections after SIGTERM")
            kept_alive.settimeout(WAIT)
            assert kept_alive.recv(65536) == b""  # closed: no new request may start on it
            assert request.is_alive()  # closed at the stop, not once the server is gone
            assert server.process.poll() is None  # still serving the request in flight
            request.join(WAIT)
            assert isinstance(request.answer, httpx.Response), request.answer
            assert (request.answer.status_code, request.answer.json()["status"]) == (200, "pending")
            assert request.answer.headers["connection"] == "close"  # its connection takes no more
            assert server.process.wait(WAIT) == 0
    # the worker's item is pending again, its one attempt not spent on the stop
    item = Store(deployment.data_dir, fsync=False).read_item(queue="once", item_id=held_id)
    assert (item.status, item.attempts) == ("pending", 1)
    assert "Stopped." in server.output()


@pytest.mark.parametrize("server_name", ["uvicorn", "daphne"])
def test_a_second_signal_ends_the_grace_at_once(deployment, server_name):
    token = deployment.token
    with deployment.server(server=server_name) as server:
        waiting_id = post(server, token, "waiting")
        request = long_poll(server, token, waiting_id, wait=60, scraper=deployment.scraper)  # as long as the grace
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: refused(server.port), "the server still took connections after SIGTERM")
        assert server.process.poll() is None  # in its grace: the read may go on for a minute
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(WAIT) == 0  # well before the grace or the read would end
        request.join(WAIT)
        assert request.answer.status_code == 503  # cut, and told to try again
        assert request.answer.json()["error"] == "busy" and request.answer.headers["retry-after"] == "1"
    assert f"GET /api/queues/waiting/items/{waiting_id} 503 " in server.output()  # logged as answered


@pytest.mark.parametrize("server", ["uvicorn", "daphne"])
def test_a_second_signal_while_the_stop_gives_back_what_sockets_hold_still_ends_in_exit_0(tmp_path, server):
    """The socket's item cannot go back at once (another process holds its lock, as a slow disk
    or a busy sweeper would): the second SIGTERM comes while the stopped server waits for it."""
    deployment = Deployment(tmp_path, extra_env={"TASKHOSTER_STOP_GRACE_SECONDS": "0.5"})
    deployment.prepare(queues=[])
    deployment.create_queue("once", "--max-attempts", "1", "--lease-seconds", "300")
    with deployment.server(server=server) as server:
        held_id = post(server, deployment.token, "once")
        with connect(server.ws_url, additional_headers={"Authorization": f"Bearer {deployment.token}"}) as worker:
            worker.send(json.dumps({"op": "claim", "queue": "once"}))
            assert [item["id"] for item in json.loads(worker.recv(timeout=WAIT))["items"]] == [held_id]
            with item_locks_held_elsewhere(deployment.data_dir, "once") as let_go:
                server.process.send_signal(signal.SIGTERM)
                wait_until(lambda: refused(server.port), "the server still took connections after SIGTERM")
                time.sleep(2)  # past the grace: the stopped server waits for the item's lock
                server.process.send_signal(signal.SIGTERM)
                time.sleep(0.5)
                let_go()
                assert server.process.wait(WAIT) == 0
    item = Store(deployment.data_dir, fsync=False).read_item(queue="once", item_id=held_id)
    assert (item.status, item.attempts) == ("pending", 1)


@pytest.mark.parametrize("value", ["-1", "nan", "soon"])
def test_a_grace_below_zero_or_not_a_number_stops_the_start_with_what_to_set(tmp_path, value):
    env = Deployment(tmp_path).environ() | {"TASKHOSTER_STOP_GRACE_SECONDS": value}
    done = subprocess.run([sys.executable, str(MANAGE), "check"], cwd=PROJECT_DIR, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "TASKHOSTER_STOP_GRACE_SECONDS to 0 or more seconds" in done.stderr and value in done.stderr


@pytest.mark.parametrize("server", ["uvicorn", "daphne"])
def test_sigint_stops_a_serve_started_with_sigint_ignored(tmp_path, server):
    """As a background job of a script is started: serve still stops on Ctrl-C's signal."""
    deployment = Deployment(tmp_path)
    deployment.prepare(queues=[])
    process = subprocess.Popen(
        [sys.executable, str(MANAGE), "serve", "--host", "127.0.0.1", "--port", "0", "--server", server],
        cwd=PROJECT_DIR, env=deployment.environ(), stdout=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert "Taskhoster is serving" in process.stdout.readline()
        process.send_signal(signal.SIGINT)
        assert process.wait(WAIT) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


# serve as the command runs it, with a SIGTERM sent to itself just before the server starts (as a
# supervisor's stop right after a start would come while the server binds its port)
SIGNALLED_EARLY = """
import os, signal, sys
import django
django.setup()
from queues import serving
import queues.serving.{module} as server_module

serve_now = server_module.run

def run(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # before the server has its signal handlers
    return serve_now(*args, **kwargs)

server_module.run = run
serving.serve(host="127.0.0.1", port=0, ready=lambda port: print("ready", port, flush=True), server=sys.argv[1])
"""


@pytest.mark.parametrize("server", ["uvicorn", "daphne"])
def test_a_stop_signal_that_comes_before_the_server_has_its_handlers_stops_it_once_it_has(tmp_path, server):
    deployment = Deployment(tmp_path)
    deployment.prepare(queues=[])
    program = SIGNALLED_EARLY.format(module=serving.SERVERS[server])
    process = subprocess.Popen([sys.executable, "-c", program, server], cwd=PROJECT_DIR, env=deployment.environ(),
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().startswith("ready")
        assert process.wait(WAIT) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
