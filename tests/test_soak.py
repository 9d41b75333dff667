"""Many processes on one data directory, under load for a bounded time: three `serve` processes
and two standalone sweepers, with PostgreSQL and Redis; producers, socket workers and HTTP
workers spread over every server; one server SIGKILLed and started again midway, and a queue
setting changed midway.

What must hold: every acknowledged post ends exactly once (finished, one accepted result); no
item is held by two workers at once (as the server defines holding: from a claim until its
result or its lease's end); the setting reaches every process within a second; over a window in
which no process is killed, the counters summed over the servers equal what the clients saw;
and at the end the queue gauges of every server agree with each other and with the items.
"""

import itertools
import json
import subprocess
import sys
import threading
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from datetime import datetime

import httpx
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import WebSocketException
from websockets.sync.client import connect

from serverproc import MANAGE, PROJECT_DIR, Deployment, postgres_database, redis_database

QUEUE = "soak"
SERVERS = 3
SWEEPERS = 2
LOAD_SECONDS = 4.0  # each phase: before the kill, after it, and the counted window
DRAIN_TIMEOUT = 90.0
REQUEST_TIMEOUT = 10.0
SETTING_REACHES = 1.0 + 0.2  # a second, and the time of one database read
REDIS_DB = 9  # this module's own Redis database


def when(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


class Gate:
    """Posts and results pass one at a time through here, so the test can stop them, wait for
    those under way, and read the counters at a moment that splits no request."""

    def __init__(self):
        self._cond = threading.Condition()
        self._open = True
        self._busy = 0

    @contextmanager
    def passing(self):
        with self._cond:
            self._cond.wait_for(lambda: self._open)
            self._busy += 1
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    @contextmanager
    def closed(self):
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: self._busy == 0)
        try:
            yield
        finally:
            with self._cond:
                self._open = True
                self._cond.notify_all()


class Ledger:
    """What the clients saw: posts answered 201, results answered accepted, and every hold."""

    def __init__(self):
        self.lock = threading.Lock()
        self.posted: list[str] = []
        self.accepted: dict[str, int] = defaultdict(int)
        self.unsure: set[str] = set()  # a result whose answer was lost with its server
        self.holds: dict[str, list[tuple[float, float]]] = defaultdict(list)  # id -> (claimed, held until)
        self.errors: list[str] = []

    def hold(self, item: dict, ended: float) -> None:
        start, lease_end = when(item["claimedAt"]), when(item["leaseExpiresAt"])
        with self.lock:
            self.holds[item["id"]].append((start, min(ended, lease_end)))

    def accept(self, item_id: str, accepted: bool) -> None:
        with self.lock:
            self.accepted[item_id] += accepted


class Client(threading.Thread):
    """A client that goes round the servers: on a connection error it moves to the next one."""

    def __init__(self, name: str, urls: list[str], token: str, gate: Gate, ledger: Ledger, stop: threading.Event,
                 first: int):
        super().__init__(name=name, daemon=True)
        self.urls, self.token, self.gate, self.ledger, self.stop = urls, token, gate, ledger, stop
        self.turn = itertools.count(first)
        self.url = urls[first % len(urls)]
        self.claims: list[dict] = []  # every item claimed, as the claim answered it
        self.held: list[dict] = []  # claimed, no result handed in yet

    def next_server(self) -> None:
        self.url = self.urls[next(self.turn) % len(self.urls)]
        time.sleep(0.1)

    def run(self):
        while not self.stop.is_set():
            try:
                self.step()
            except (httpx.HTTPError, OSError, TimeoutError, WebSocketException):
                self.lost()
                self.next_server()
            except Exception as exc:  # noqa: BLE001  (reported by the test)
                self.ledger.errors.append(f"{self.name}: {exc!r}")
                self.next_server()

    def lost(self) -> None:
        """Its server is gone: what it held stays held until the lease ends, as the server says."""
        for item in self.held:
            self.ledger.hold(item, time.time())
        self.held = []


class Producer(Client):
    def step(self):
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"},
                          timeout=REQUEST_TIMEOUT) as http:
            while not self.stop.is_set():
                with self.gate.passing():
                    answer = http.post(f"/api/queues/{QUEUE}/items", json={"payload": {"by": self.name}})
                    if answer.status_code == 201:
                        with self.ledger.lock:
                            self.ledger.posted.append(answer.json()["id"])
                if answer.status_code != 201:
                    self.ledger.errors.append(f"{self.name}: post answered {answer.status_code} {answer.text}")
                time.sleep(0.02)


class HttpWorker(Client):
    def step(self):
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"},
                          timeout=REQUEST_TIMEOUT) as http:
            while not self.stop.is_set():
                self.held = http.post(f"/api/queues/{QUEUE}/claim", json={"max": 5, "wait": 1}).json()["items"]
                self.claims += self.held
                while self.held:
                    item = self.held[0]
                    with self.gate.passing():
                        try:
                            answer = http.post(f"/api/queues/{QUEUE}/items/{item['id']}/result", json={"result": 1})
                        except httpx.HTTPError:
                            self.ledger.unsure.add(item["id"])
                            raise
                        self.ledger.accept(item["id"], answer.json()["accepted"])
                    self.ledger.hold(item, time.time())
                    self.held.pop(0)


class SocketWorker(Client):
    def step(self):
        ws_url = self.url.replace("http://", "ws://") + "/work"
        with connect(ws_url, additional_headers={"Authorization": f"Bearer {self.token}"},
                     open_timeout=REQUEST_TIMEOUT) as socket:
            while not self.stop.is_set():
                socket.send(json.dumps({"op": "claim", "queue": QUEUE, "max": 5, "wait": 1}))
                self.held = json.loads(socket.recv(timeout=REQUEST_TIMEOUT))["items"]
                self.claims += self.held
                if not self.held:
                    continue
                results = [{"queue": QUEUE, "id": item["id"], "result": 2} for item in self.held]
                with self.gate.passing():
                    try:
                        socket.send(json.dumps({"op": "results", "items": results}))
                        acks = json.loads(socket.recv(timeout=REQUEST_TIMEOUT))["items"]
                    except Exception:
                        self.ledger.unsure.update(item["id"] for item in self.held)
                        raise
                    for ack in acks:
                        self.ledger.accept(ack["id"], ack["accepted"])
                ended = time.time()
                for item in self.held:
                    self.ledger.hold(item, ended)
                self.held = []


def scrape(url: str, token: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=REQUEST_TIMEOUT).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def summed(scrapes: list[dict], name: str) -> float:
    return sum(figures.get((name, ()), 0.0) for figures in scrapes)


def test_three_servers_two_sweepers_a_kill_and_a_setting_change(tmp_path):
    with ExitStack() as stack:
        database_url = stack.enter_context(postgres_database())
        deployment = Deployment(tmp_path / "soak", database_url=database_url, redis_url=redis_database(REDIS_DB))
        deployment.migrate()
        deployment.create_queue(QUEUE, "--lease-seconds", "2")
        token = deployment.create_token("load")
        scraper = deployment.create_token("prometheus", "--metrics")
        servers = [stack.enter_context(deployment.server()) for _ in range(SERVERS)]
        sweepers = [
            subprocess.Popen([sys.executable, str(MANAGE), "sweep"], cwd=PROJECT_DIR, env=deployment.environ(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(SWEEPERS)
        ]
        stack.callback(lambda: [(s.terminate(), s.wait(30)) for s in sweepers])
        urls = [server.url for server in servers]

        gate, ledger = Gate(), Ledger()
        stop_posting, stop_working = threading.Event(), threading.Event()
        clients = [
            kind(f"{kind.__name__}{n}", urls, token, gate, ledger, stop_posting if kind is Producer else stop_working, n)
            for kind in (Producer, SocketWorker, HttpWorker) for n in range(SERVERS)
        ]
        for client in clients:
            client.start()
        stack.callback(lambda: (stop_posting.set(), stop_working.set(), [c.join(REQUEST_TIMEOUT * 2) for c in clients]))

        # a setting changed midway reaches every process within a second
        time.sleep(LOAD_SECONDS / 2)
        deployment.create_queue(QUEUE, "--lease-seconds", "3")
        changed_at = time.time()
        time.sleep(SETTING_REACHES)
        for url in urls:
            seen = httpx.get(f"{url}/api/queues/{QUEUE}", headers={"Authorization": f"Bearer {token}"}).json()
            assert seen["leaseSeconds"] == 3, url

        # one server killed under load, and started again on its port
        time.sleep(LOAD_SECONDS / 2)
        servers[0].kill()
        time.sleep(LOAD_SECONDS / 2)
        servers[0].start()
        time.sleep(LOAD_SECONDS / 2)

        # a window in which no process is killed: the counters gained are what the clients saw
        with gate.closed():
            before = [scrape(url, scraper) for url in urls]
            posted_before, accepted_before = len(ledger.posted), sum(ledger.accepted.values())
        time.sleep(LOAD_SECONDS)
        with gate.closed():
            after = [scrape(url, scraper) for url in urls]
            posted_window = len(ledger.posted) - posted_before
            accepted_window = sum(ledger.accepted.values()) - accepted_before
        assert posted_window > 0 and accepted_window > 0
        gained = {name: summed(after, name) - summed(before, name)
                  for name in ("taskhoster_items_posted_total", "taskhoster_items_finished_total")}
        assert gained == {"taskhoster_items_posted_total": posted_window,
                          "taskhoster_items_finished_total": accepted_window}

        # stop posting, let the workers drain the queue
        stop_posting.set()
        deadline = time.monotonic() + DRAIN_TIMEOUT
        with httpx.Client(base_url=urls[1], headers={"Authorization": f"Bearer {token}"}) as api:
            while True:
                counts = api.get(f"/api/queues/{QUEUE}").json()["counts"]
                if counts["pending"] == counts["processing"] == counts["scheduled"] == 0:
                    break
                assert time.monotonic() < deadline, f"the queue did not drain: {counts}"
                time.sleep(0.2)
            stop_working.set()
            for client in clients:
                client.join(REQUEST_TIMEOUT * 2)
            assert not ledger.errors, ledger.errors[:5]

            # every acknowledged post ended exactly once
            for item_id in ledger.posted:
                item = api.get(f"/api/queues/{QUEUE}/items/{item_id}").json()
                assert item["status"] == "finished", item
                accepted = ledger.accepted.get(item_id, 0)
                assert accepted == 1 or (accepted == 0 and item_id in ledger.unsure), (item_id, accepted)
            assert len(set(ledger.posted)) == len(ledger.posted)
            final = counts

        # no item was held by two workers at once
        for item_id, holds in ledger.holds.items():
            ordered = sorted(holds)
            for (_, held_until), (next_claim, _) in zip(ordered, ordered[1:]):
                assert held_until <= next_claim + 0.002, (item_id, ordered)  # the ids' millisecond

        # claims made after the change got its lease
        claims = [item for client in clients for item in client.claims]
        late = [c for c in claims if when(c["claimedAt"]) > changed_at + SETTING_REACHES]
        assert late and all(
            abs(when(c["leaseExpiresAt"]) - when(c["claimedAt"]) - 3) < 0.002 for c in late
        )

        # the queue gauges agree on every server, and with the items
        time.sleep(1.1)  # older than a count is kept, so every server counts afresh
        gauges = [scrape(url, scraper) for url in urls]
        states = ("scheduled", "pending", "processing", "finished", "failed")
        per_server = [
            {state: figures[("taskhoster_queue_items", (("queue", QUEUE), ("state", state)))] for state in states}
            for figures in gauges
        ]
        assert per_server[0] == per_server[1] == per_server[2]
        assert per_server[0] == {state: final[state] for state in states}
        assert per_server[0]["finished"] >= len(ledger.posted) and per_server[0]["pending"] == 0
