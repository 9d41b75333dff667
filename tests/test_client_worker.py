"""The worker client against a real `serve` process: handlers, slots, leases, errors, stopping,
and the end-to-end runs (two worker processes, a killed worker, a restarted server)."""

import asyncio
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
from websockets.asyncio.server import serve as serve_websocket

import taskhoster.claims as claims_module
import taskhoster.leases as leases_module
import taskhoster.outbox as outbox_module
import taskhoster.run as run_module
import taskhoster.shutdown as shutdown_module
from client_support import client_env, live_server
from serverproc import PROJECT_DIR
from taskhoster import ConnectionFailed, Job, Producer, TaskhosterError, Unauthorized, UnknownQueue, Worker
from taskhoster.claims import split_slots
from taskhoster.connection import backoff_delay
from taskhoster.errors import api_error
from taskhoster.link import Link

QUEUES = {
    "basic": {},
    "errors": {},
    "broken": {},
    "retry": {},
    "release-busy": {},  # 60 s leases: a release dropped by its worker holds the item past the test
    "release-full": {},
    "claimed-again": {},  # 60 s leases: an item dropped by its worker stays out past the test
    "claimed-again-lost": {},
    "claimed-again-stop": {},
    "slots": {},
    "batch": {},
    "unstored-one": {},
    "unstored-many": {},
    "unstored-acks": {},
    "unstored-busy": {},
    "unstored-shed": {},
    "unstored-stop": {},
    "unstored-drop": {},
    "unstored-rest": {},
    "too-large": {},
    "refused": {},
    "batched-claims": {},
    "idle": {},
    "either-a": {},
    "either-b": {},
    "graceful": {},
    "outlast": {},
    "stop-claim-runs": {},
    "stop-claim-back": {"lease_seconds": 300},  # only a release puts its item back while the worker runs
    "early-stop": {},
    "heartbeat": {"lease_seconds": 2},
    "heartbeat-busy": {"lease_seconds": 2},
    "many": {},
    "killed": {},
    "signals": {},
    "talks": {},
}

# A worker process for the end-to-end tests: each handler call is logged, then sleeps.
WORKER_PROGRAM = """
import sys, time
from taskhoster import Worker

queue, name, concurrency, seconds, log_path = sys.argv[1:]

def handle(payload, job):
    with open(log_path, "a") as log:
        log.write(f"start {job.id} {job.attempts}\\n")
    time.sleep(float(seconds))
    return {"worker": name, "payload": payload, "attempts": job.attempts}

Worker(queues=[queue], concurrency=int(concurrency)).run(handle)
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("worker"), QUEUES) as live:
        yield live


@pytest.fixture
def producer(live):
    with Producer(live.url, live.token) as producer:
        yield producer


def wait_until(condition, timeout: float = 20.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def frame_of(frame: dict | str) -> dict:
    """A frame the worker hands Link.ask, as a dict (result frames come as JSON text)."""
    return json.loads(frame) if isinstance(frame, str) else frame


def answer_later(answered, reply: dict) -> None:
    """Hand `answered` a made-up answer as the socket would: from the loop, not within ask()."""
    asyncio.get_running_loop().call_soon(answered, reply)


@contextmanager
def working(worker: Worker, handler):
    """Run the worker on an event loop in a thread of its own; stop it at the end and re-raise
    anything it raised."""
    failure = []

    def run():
        try:
            asyncio.run(worker.run_async(handler))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        worker.stop()
        thread.join(30)
    assert not thread.is_alive(), "the worker did not stop"
    if failure:
        raise failure[0]


def start_worker_process(live, queue: str, name: str, log_path, *, concurrency: int = 1, seconds: float = 0):
    log_path.touch()
    return subprocess.Popen(
        [sys.executable, "-c", WORKER_PROGRAM, queue, name, str(concurrency), str(seconds), str(log_path)],
        cwd=PROJECT_DIR,
        env=client_env(live),
        stderr=subprocess.PIPE,
        text=True,
    )


def started(log_path) -> list[tuple[str, int]]:
    return [(line.split()[1], int(line.split()[2])) for line in log_path.read_text().splitlines()]


# ---- handlers and results -------------------------------------------------------------------------


@pytest.mark.parametrize("handler", [lambda payload: payload, lambda: None, lambda payload, job, extra: None],
                         ids=["one argument", "none", "three required"])
def test_a_handler_that_cannot_take_payload_and_job_is_refused_before_anything_is_claimed(handler):
    worker = Worker("http://127.0.0.1:9", "th_x", queues=["basic"])  # nothing listens: nothing is reached

    with pytest.raises(TypeError, match=r"must take two arguments, \(payload, job\)"):
        worker.run(handler)


def test_a_worker_in_a_program_without_logging_set_up_says_what_it_works_on_stderr(live, tmp_path):
    worker = start_worker_process(live, "talks", "quiet", tmp_path / "log")
    try:
        line = worker.stderr.readline()
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=30)
    assert "taskhoster: working talks at" in line


def test_a_plain_handler_gets_the_payload_and_the_job_and_its_return_is_the_result(live, producer):
    seen_threads = set()

    def handle(payload, job):
        seen_threads.add(threading.current_thread().name)
        return {"sum": sum(payload), "id": job.id, "queue": job.queue, "attempts": job.attempts}

    item = producer.post("basic", [1, 2, 3])
    with working(Worker(live.url, live.token, queues=["basic"]), handle):
        result = producer.result("basic", item["id"], timeout=20)
    assert result == {"sum": 6, "id": item["id"], "queue": "basic", "attempts": 1}
    assert seen_threads == {"taskhoster-handler"}  # not the event loop's thread


def test_an_async_handler_is_awaited_on_the_worker_s_loop(live, producer):
    async def handle(payload, job):
        await asyncio.sleep(0.01)
        return {"upper": payload.upper(), "on_loop": asyncio.get_running_loop() is not None}

    item = producer.post("basic", "hello")
    with working(Worker(live.url, live.token, queues=["basic"], concurrency=2), handle):
        assert producer.result("basic", item["id"], timeout=20) == {"upper": "HELLO", "on_loop": True}


def test_a_raising_handler_gives_an_error_result_and_the_worker_goes_on(live, producer):
    def check_positive(payload, job):
        if payload < 0:
            raise ValueError(f"{payload} is negative")
        return payload

    items = producer.post_many("errors", [-1, 5, {"not": "a number"}])
    with working(Worker(live.url, live.token, queues=["errors"]), check_positive):
        results = [producer.result("errors", item["id"], timeout=20) for item in items]

    negative, five, dict_payload = results
    assert five == 5
    assert negative["error"]["type"] == "ValueError"
    assert negative["error"]["message"] == "-1 is negative"
    assert "check_positive" in negative["error"]["traceback"]
    assert negative["error"]["traceback"].rstrip().endswith("ValueError: -1 is negative")
    assert dict_payload["error"]["type"] == "TypeError"


def test_a_handler_error_whose_message_cannot_be_made_is_an_error_result_too(live, producer):
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no message")

    def handle(payload, job):
        if payload == "bad":
            raise Unprintable()
        return payload

    items = producer.post_many("errors", ["bad", "good"])
    with working(Worker(live.url, live.token, queues=["errors"]), handle):
        bad, good = [producer.result("errors", item["id"], timeout=20) for item in items]
    assert (bad["error"]["type"], good) == ("Unprintable", "good")
    assert "RuntimeError" in bad["error"]["message"]


def test_an_async_handler_whose_own_await_was_cancelled_gives_an_error_result(live, producer):
    """Something the handler awaited was cancelled elsewhere in the program: its CancelledError is
    the handler's failure, not the worker's stop, and the item must not wait for its lease."""
    async def handle(payload, job):
        if payload == "cancelled":
            elsewhere = asyncio.get_running_loop().create_future()
            elsewhere.cancel()
            await elsewhere
        return payload

    items = producer.post_many("errors", ["cancelled", "fine"])
    with working(Worker(live.url, live.token, queues=["errors"]), handle):
        cancelled, fine = [producer.result("errors", item["id"], timeout=20) for item in items]
    assert (cancelled["error"]["type"], fine) == ("CancelledError", "fine")


def test_a_result_that_is_not_json_becomes_an_error_result(live, producer):
    item = producer.post("errors", "x")
    with working(Worker(live.url, live.token, queues=["errors"]), lambda payload, job: {1, 2}):
        result = producer.result("errors", item["id"], timeout=20)
    assert result["error"]["type"] == "TypeError"
    assert "not JSON serializable" in result["error"]["message"]


def test_on_error_release_puts_the_item_back_for_another_try(live, producer):
    def flaky(payload, job):
        if job.attempts == 1:
            raise ConnectionError("the first try always fails")
        return {"done on attempt": job.attempts}

    item = producer.post("retry", "x")
    with working(Worker(live.url, live.token, queues=["retry"], on_error="release"), flaky):
        assert producer.result("retry", item["id"], timeout=20) == {"done on attempt": 2}
    assert producer.get("retry", item["id"])["attempts"] == 2


@pytest.mark.parametrize(("queue", "code"), [("release-busy", "busy"), ("release-full", "storage_unavailable")])
def test_a_release_the_server_could_not_make_for_now_goes_again(live, producer, monkeypatch, queue, code):
    """on_error="retry": the failed try goes back for its backoff, not for its lease (60 s), though
    the server answers its release `busy` or `storage_unavailable` twice; each try's delay is
    shortened by the wait, so the item is due when it was to be."""
    monkeypatch.setattr(leases_module, "RELEASE_RETRY_SECONDS", 0.2)
    refused = []
    request = Link.request

    async def refusing_at_first(self, frame, **options):
        if isinstance(frame, dict) and frame.get("op") == "release" and len(refused) < 2:
            refused.append(frame.get("delay", 0.0))  # none once the wait has used it up
            raise api_error(code, "not now")
        return await request(self, frame, **options)

    monkeypatch.setattr(Link, "request", refusing_at_first)

    def flaky(payload, job):
        if job.attempts == 1:
            raise ConnectionError("the first try always fails")
        return {"done on attempt": job.attempts, "lastError": job.last_error["error"]["type"]}

    item = producer.post(queue, "x")
    with working(Worker(live.url, live.token, queues=[queue], on_error="retry", retry_base=2), flaky):
        assert producer.result(queue, item["id"], timeout=20) == {"done on attempt": 2, "lastError": "ConnectionError"}
    assert len(refused) == 2 and (refused[1] <= refused[0] - 0.2 or refused[1] == 0.0)


@pytest.mark.parametrize("kind", ["plain", "async"])
def test_an_item_handed_out_again_before_its_release_is_answered_gets_its_next_try(live, producer, monkeypatch,
                                                                                   kind):
    """A failed run's item goes back, and the worker's own waiting claim (a free slot) may bring
    it again before the server has answered the release: that claim is its next try."""
    real_release = leases_module._ask_release

    async def release_answered_late(link, job, **options):
        await real_release(link, job, **options)
        await asyncio.sleep(0.3)  # by now the claim that brings it back has come

    monkeypatch.setattr(leases_module, "_ask_release", release_answered_late)

    def flaky(payload, job):
        if job.attempts == 1:
            raise ConnectionError("the first try fails")
        return {"done on attempt": job.attempts}

    async def async_flaky(payload, job):
        return flaky(payload, job)

    item = producer.post("claimed-again", kind)
    worker = Worker(live.url, live.token, queues=["claimed-again"], concurrency=2, on_error="release")
    with working(worker, flaky if kind == "plain" else async_flaky):
        assert producer.result("claimed-again", item["id"], timeout=20) == {"done on attempt": 2}
    assert producer.get("claimed-again", item["id"])["attempts"] == 2


def test_an_item_handed_out_again_over_a_socket_lost_before_the_release_is_answered_is_not_run_there(
        live, producer, monkeypatch):
    """The server put that claim's item back when the socket closed: the next try is the one a
    claim over the next socket brings."""
    real_release = leases_module._ask_release

    async def release_then_lose_the_socket(link, job, **options):
        await real_release(link, job, **options)
        await asyncio.sleep(0.3)  # the claim that brings it back comes first
        await link.socket.close()
        while not link.closed:  # answered once the link knows, before a new socket brings it back
            await asyncio.sleep(0.005)

    monkeypatch.setattr(leases_module, "_ask_release", release_then_lose_the_socket)
    attempts = []

    def flaky(payload, job):
        attempts.append(job.attempts)
        if job.attempts == 1:
            raise ConnectionError("the first try fails")
        return {"done on attempt": job.attempts}

    item = producer.post("claimed-again-lost", "x")
    worker = Worker(live.url, live.token, queues=["claimed-again-lost"], concurrency=2, on_error="release")
    with working(worker, flaky):
        assert producer.result("claimed-again-lost", item["id"], timeout=20) == {"done on attempt": 3}
    assert attempts == [1, 3]


def test_an_item_handed_out_again_before_its_release_is_answered_is_given_back_when_the_worker_stops(
        live, producer, monkeypatch):
    released, stop_asked = threading.Event(), threading.Event()
    real_release = leases_module._ask_release

    async def release_answered_late(link, job, **options):
        await real_release(link, job, **options)
        await asyncio.sleep(0.3)  # the claim that brings it back comes first
        released.set()  # then the stop, which reaches the loop before this answer goes on
        assert await asyncio.to_thread(stop_asked.wait, 20)

    monkeypatch.setattr(leases_module, "_ask_release", release_answered_late)
    attempts = []

    def fails(payload, job):
        attempts.append(job.attempts)
        raise ConnectionError("fails")

    item = producer.post("claimed-again-stop", "x")
    worker = Worker(live.url, live.token, queues=["claimed-again-stop"], concurrency=2, on_error="release")
    with working(worker, fails):
        assert released.wait(20)
        worker.stop()
        stop_asked.set()
    # the stop gives back the try claim 2 brought rather than start it; the claim still out may
    # bring the item back once more (claim 3), which runs within the grace like any item it brings
    assert attempts in ([1], [1, 3])
    # given back by the worker, or by the server when the socket closed (if the stop came first)
    wait_until(lambda: producer.get("claimed-again-stop", item["id"])["status"] == "pending", what="the item back")


def test_the_worker_claims_only_as_many_items_as_it_has_free_slots(live, producer):
    gate, running, most = threading.Event(), [], []
    lock = threading.Lock()

    def handle(payload, job):
        with lock:
            running.append(job.id)
            most.append(len(running))
        gate.wait(20)
        with lock:
            running.remove(job.id)
        return payload

    items = producer.post_many("slots", range(7))
    with working(Worker(live.url, live.token, queues=["slots"], concurrency=3), handle):
        wait_until(lambda: len(running) == 3, what="three handlers to run")
        counts = producer.stats("slots")["counts"]
        assert counts["processing"] == 3 and counts["pending"] == 4
        gate.set()
        assert [producer.result("slots", item["id"], timeout=20) for item in items] == list(range(7))
    assert max(most) == 3


def test_results_that_finish_together_go_in_one_results_frame(live, producer, monkeypatch):
    frames = []
    ask = Link.ask

    def recording(self, frame, answered, **options):
        shown = frame_of(frame)
        frames.append((shown["op"], len(shown.get("items", [])) if shown["op"] == "results" else 1))
        return ask(self, frame, answered, **options)

    monkeypatch.setattr(Link, "ask", recording)
    gate = {}

    async def handle(payload, job):
        # the tenth handler opens the gate for all ten at once
        event = gate.setdefault("event", asyncio.Event())
        gate["started"] = gate.get("started", 0) + 1
        if gate["started"] == 10:
            event.set()
        await event.wait()
        return payload

    items = producer.post_many("batch", range(10))
    with working(Worker(live.url, live.token, queues=["batch"], concurrency=10), handle):
        assert [producer.result("batch", item["id"], timeout=20) for item in items] == list(range(10))
    handed_in = [frame for frame in frames if frame[0] in ("result", "results")]
    assert handed_in == [("results", 10)]


DISK_FULL = {"op": "error", "code": "storage_unavailable",
             "message": "the data directory cannot be written: No space left on device"}


def disk_full_for_two_hand_ins(monkeypatch, refusal: str = "error frame",
                               code: str = "storage_unavailable") -> list[tuple[str, list[str]]]:
    """The first two result or results frames the worker sends are refused as a server with a
    full disk refuses them (not sent on: an error frame, or with `refusal="acks"` an ack per item
    with error `storage_unavailable`); later ones go to the server. Every hand-in: (op, ids)."""
    sent = []
    ask = Link.ask

    def refusing(self, frame, answered, **options):
        shown = frame_of(frame)
        if shown["op"] not in ("result", "results"):
            return ask(self, frame, answered, **options)
        ids = [entry["id"] for entry in shown.get("items", [shown])]
        sent.append((shown["op"], sorted(ids)))
        if len(sent) > 2:
            return ask(self, frame, answered, **options)
        if refusal == "acks":
            answer_later(answered, {"op": "acks", "items": [{"id": i, "accepted": False, "error": code} for i in ids]})
        else:
            answer_later(answered, {**DISK_FULL, "code": code})

    monkeypatch.setattr(Link, "ask", refusing)
    return sent


@pytest.mark.parametrize(
    ("queue", "count", "refusal", "code"),
    [("unstored-one", 1, "error frame", "storage_unavailable"), ("unstored-many", 3, "error frame", "storage_unavailable"),
     ("unstored-acks", 3, "acks", "storage_unavailable"), ("unstored-busy", 1, "error frame", "busy"),
     ("unstored-shed", 3, "error frame", "busy")],
)
def test_results_the_server_could_not_store_go_in_again_after_a_pause(live, producer, monkeypatch, queue, count,
                                                                      refusal, code):
    """A full disk or load shed are passing troubles: the results stay with the worker and go in
    again (not dropped, which would leave the items to be done again once their leases lapse)."""
    monkeypatch.setattr(outbox_module, "RESULT_RETRY_SECONDS", 0.05)
    sent = disk_full_for_two_hand_ins(monkeypatch, refusal, code)
    gate = {}

    async def handle(payload, job):
        # the last handler opens the gate for all at once: their results go in one frame
        event = gate.setdefault("event", asyncio.Event())
        gate["started"] = gate.get("started", 0) + 1
        if gate["started"] == count:
            event.set()
        await event.wait()
        return payload

    items = producer.post_many(queue, range(count))
    with working(Worker(live.url, live.token, queues=[queue], concurrency=count), handle):
        assert [producer.result(queue, item["id"], timeout=20) for item in items] == list(range(count))
    assert [producer.get(queue, item["id"])["attempts"] for item in items] == [1] * count
    ids = sorted(item["id"] for item in items)
    assert sent == [("result" if count == 1 else "results", ids)] * 3  # refused twice, then accepted


def test_a_result_the_server_could_not_store_rests_while_later_results_go_in(live, producer, monkeypatch):
    """The refused result waits RESULT_RETRY_SECONDS before it goes in again (not at once and
    again and again); a result that finishes meanwhile does not wait for it."""
    hand_ins = []  # (when, ids)
    ask = Link.ask

    def refusing_the_first(self, frame, answered, **options):
        shown = frame_of(frame)
        if shown["op"] not in ("result", "results"):
            return ask(self, frame, answered, **options)
        hand_ins.append((time.monotonic(), [entry["id"] for entry in shown.get("items", [shown])]))
        if len(hand_ins) == 1:
            return answer_later(answered, DISK_FULL)
        return ask(self, frame, answered, **options)

    monkeypatch.setattr(Link, "ask", refusing_the_first)
    later = threading.Event()

    def handle(payload, job):
        if payload == "later":
            later.wait(20)
        return payload

    first, second = producer.post_many("unstored-rest", ["first", "later"])
    with working(Worker(live.url, live.token, queues=["unstored-rest"], concurrency=2), handle):
        wait_until(lambda: hand_ins, what="the first hand-in")
        later.set()
        assert producer.result("unstored-rest", second["id"], timeout=20) == "later"
        assert producer.result("unstored-rest", first["id"], timeout=20) == "first"
    (refused_at, refused), *rest = hand_ins
    assert refused == [first["id"]]
    later_at = next(when for when, ids in rest if second["id"] in ids)
    again_at = next(when for when, ids in rest if first["id"] in ids)
    assert later_at - refused_at < outbox_module.RESULT_RETRY_SECONDS
    assert again_at - refused_at >= outbox_module.RESULT_RETRY_SECONDS - 0.05
    assert [producer.get("unstored-rest", item["id"])["attempts"] for item in (first, second)] == [1, 1]


@pytest.mark.parametrize("big", [1 << 20, 17 << 20, 33 << 20],
                         ids=["over the payload limit", "over the frame limit", "too big to be read"])
@pytest.mark.parametrize("payloads", [["big"], ["big", "small"]], ids=["alone", "in a results frame"])
def test_a_result_too_large_for_the_server_ends_the_item_with_an_error_saying_why(live, producer, payloads, big):
    """Over the payload limit, the server refuses it; over the frame limit (16 MiB by default) it
    refuses the frame unread, answering its ref; over twice that, it closes the socket unread
    (1009). The result must not go in again and again."""
    gate, handled = {}, []

    async def handle(payload, job):
        handled.append(payload)
        # the last handler opens the gate for all at once: their results go in one frame
        event = gate.setdefault("event", asyncio.Event())
        gate["started"] = gate.get("started", 0) + 1
        if gate["started"] == len(payloads):
            event.set()
        await event.wait()
        return "x" * big if payload == "big" else payload

    items = producer.post_many("too-large", payloads)
    with working(Worker(live.url, live.token, queues=["too-large"], concurrency=len(payloads)), handle):
        results = [producer.result("too-large", item["id"], timeout=20) for item in items]
    assert results[0]["error"]["type"] == "PayloadTooLarge"
    assert results[1:] == payloads[1:]
    assert sorted(handled) == sorted(payloads)  # each run once
    # the socket closed unread gave its items back (G8), and the worker's next claim may take them
    # again before its results go in: a try each, the handler not run again
    most = 2 if big == 33 << 20 else 1
    assert all(1 <= producer.get("too-large", item["id"])["attempts"] <= most for item in items)


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


RAISES = object()  # the handler raises an error whose message the server refuses


@pytest.mark.parametrize("refused", ["\ud800", nested(200), RAISES],
                         ids=["a lone surrogate", "nested too deep", "an error result with a lone surrogate"])
def test_a_result_the_server_refuses_as_json_ends_the_item_with_an_error_saying_why(live, producer, refused):
    """Python's JSON, not the server's: the item must end, not wait out its lease and run again."""
    handled = []

    async def handle(payload, job):
        handled.append(payload)
        if refused is RAISES:
            raise ValueError("bytes read with surrogateescape: \udcff")
        return refused

    item = producer.post("refused", "x")
    with working(Worker(live.url, live.token, queues=["refused"]), handle):
        result = producer.result("refused", item["id"], timeout=20)
    assert result["error"]["type"] == "InvalidResult" and result["error"]["message"]
    assert handled == ["x"] and producer.get("refused", item["id"])["attempts"] == 1


def test_a_refused_result_in_a_results_frame_ends_its_item_and_the_others_go_in(live, producer):
    """Two results go in one frame; the server refuses the frame for one (a lone surrogate): each
    then goes in alone, the good one accepted, the bad one replaced by an error result."""
    gate = {"event": asyncio.Event(), "started": 0}

    async def handle(payload, job):
        gate["started"] += 1
        if gate["started"] == 2:
            gate["event"].set()
        await gate["event"].wait()  # both finish at once: their results go in one frame
        return "\ud800" if payload == "bad" else payload

    items = producer.post_many("refused", ["bad", "good"])
    with working(Worker(live.url, live.token, queues=["refused"], concurrency=2), handle):
        results = [producer.result("refused", item["id"], timeout=20) for item in items]
    assert results[0]["error"]["type"] == "InvalidResult" and results[1] == "good"


def recording_claims(monkeypatch) -> list[tuple[int, int, int]]:
    """Every claim the worker sends, once answered: (max, wait, how many items came)."""
    claims = []
    ask = Link.ask

    def recording(self, frame, answered, **options):
        shown = frame_of(frame)
        if shown["op"] != "claim":
            return ask(self, frame, answered, **options)

        def noting(reply):
            if reply is not None and reply.get("op") == "items":
                claims.append((shown["max"], shown["wait"], len(reply["items"])))
            answered(reply)

        return ask(self, frame, noting, **options)

    monkeypatch.setattr(Link, "ask", recording)
    return claims


def test_slots_that_free_up_together_are_claimed_together(live, producer, monkeypatch):
    claims = recording_claims(monkeypatch)
    frames = []
    ask = Link.ask  # the recording one: handed-in results are counted on top

    def counting(self, frame, answered, **options):
        shown = frame_of(frame)
        if shown["op"] in ("result", "results"):
            frames.append(len(shown.get("items", [shown])))
        return ask(self, frame, answered, **options)

    monkeypatch.setattr(Link, "ask", counting)

    async def handle(payload, job):
        return payload

    items = producer.post_many("batched-claims", range(50))
    with working(Worker(live.url, live.token, queues=["batched-claims"], concurrency=10), handle):
        assert [producer.result("batched-claims", item["id"], timeout=20) for item in items] == list(range(50))
    # ten handlers that finish in one turn free ten slots: one claim for all ten, never a claim
    # for one slot followed by one for nine
    assert claims and all(slots == 10 for slots, _, _ in claims)
    assert sum(came for _, _, came in claims) == 50
    # each batch's results go in together (a frame may carry several batches, never part of one)
    assert sum(frames) == 50 and all(count % 10 == 0 for count in frames)


def test_an_idle_worker_s_waiting_claim_brings_each_item_without_empty_claims(live, producer, monkeypatch):
    claims = recording_claims(monkeypatch)

    async def handle(payload, job):
        return payload * 2

    with working(Worker(live.url, live.token, queues=["idle"], concurrency=4), handle):
        first = producer.post("idle", 0)
        assert producer.result("idle", first["id"], timeout=20) == 0
        claims.clear()  # from here on the worker is warm: its socket has answered
        for number in range(1, 6):
            item = producer.post("idle", number)
            assert producer.result("idle", item["id"], timeout=20) == number * 2
    # one waiting claim per item, each answered by the post: no claim that came back empty (the
    # claim still waiting when the worker stopped was never answered)
    assert [came for _, _, came in claims] == [1] * 5
    assert all(wait > 0 for _, wait, _ in claims)


def test_an_idle_worker_on_two_queues_takes_an_item_from_either_at_once(live, producer):
    """With both queues empty, a waiting claim is out on each: an item posted to either is
    worked long before a claim on the other would end (CLAIM_WAIT_SECONDS)."""
    async def handle(payload, job):
        return payload

    with working(Worker(live.url, live.token, queues=["either-a", "either-b"], concurrency=2), handle):
        warm = producer.post("either-a", "warm")
        assert producer.result("either-a", warm["id"], timeout=20) == "warm"
        for queue in ("either-b", "either-a", "either-b"):
            time.sleep(0.2)  # both queues known empty: the waiting claims are out
            item = producer.post(queue, queue)
            assert producer.result(queue, item["id"], timeout=claims_module.CLAIM_WAIT_SECONDS / 4) == queue


# ---- stopping ------------------------------------------------------------------------------------


def test_stop_lets_a_running_handler_finish_and_hands_its_result_in(live, producer):
    began = threading.Event()

    def handle(payload, job):
        began.set()
        time.sleep(0.5)
        return "finished in time"

    item = producer.post("graceful", 1)
    worker = Worker(live.url, live.token, queues=["graceful"], grace=10)
    with working(worker, handle):
        assert began.wait(20)
        worker.stop()
    finished = producer.get("graceful", item["id"])
    assert finished["status"] == "finished" and finished["result"] == "finished in time"


def test_stop_releases_the_items_whose_handlers_outlast_the_grace_period(live, producer):
    began = threading.Event()

    async def handle(payload, job):
        began.set()
        await asyncio.sleep(60)

    item = producer.post("outlast", 1)
    worker = Worker(live.url, live.token, queues=["outlast"], grace=0.2)
    with working(worker, handle) as thread:
        assert began.wait(20)
        stopped_at = time.monotonic()
        worker.stop()
        thread.join(10)
        assert time.monotonic() - stopped_at < 10
    released = producer.get("outlast", item["id"])
    assert released["status"] == "pending" and released["attempts"] == 1


def test_a_stopping_worker_keeps_handing_in_a_result_the_server_could_not_store(live, producer, monkeypatch):
    monkeypatch.setattr(outbox_module, "RESULT_RETRY_SECONDS", 0.05)
    sent = disk_full_for_two_hand_ins(monkeypatch)
    item = producer.post("unstored-stop", "late")
    worker = Worker(live.url, live.token, queues=["unstored-stop"])
    with working(worker, lambda payload, job: payload):
        wait_until(lambda: sent, what="the first hand-in")
        worker.stop()  # while the server cannot store the result: the drain goes on trying
    finished = producer.get("unstored-stop", item["id"])
    assert (finished["status"], finished.get("result"), finished["attempts"]) == ("finished", "late", 1)
    assert sent == [("result", [item["id"]])] * 3


def test_a_stop_that_ends_with_results_the_server_never_took_says_so(live, producer, monkeypatch, caplog):
    monkeypatch.setattr(outbox_module, "RESULT_RETRY_SECONDS", 0.05)
    monkeypatch.setattr(shutdown_module, "DRAIN_SECONDS", 0.3)
    ask = Link.ask

    def refusing_results(self, frame, answered, **options):
        if frame_of(frame)["op"] in ("result", "results"):
            return answer_later(answered, DISK_FULL)
        return ask(self, frame, answered, **options)

    monkeypatch.setattr(Link, "ask", refusing_results)
    handled = threading.Event()
    item = producer.post("unstored-drop", 1)
    worker = Worker(live.url, live.token, queues=["unstored-drop"])
    with working(worker, lambda payload, job: handled.set()):
        assert handled.wait(20)
        worker.stop()
    assert "stopping with 1 results the server has not taken: their items go back" in caplog.text
    wait_until(lambda: producer.get("unstored-drop", item["id"])["status"] == "pending", what="the item back")


@pytest.mark.parametrize("stop_waits", [True, False], ids=["while the stop waits for a handler", "after"])
def test_a_claim_that_was_waiting_when_the_stop_came_runs_its_items_while_the_stop_waits_else_gives_them_back(
        live, producer, monkeypatch, caplog, stop_waits):
    """Its items run beside the handler the stop waits for: giving one back would spend a try
    (and end an item on its last). Once the stop no longer waits for handlers they go back."""
    caplog.set_level(logging.INFO, logger="taskhoster.worker")
    waits = []  # the wait of every claim sent
    ask = Link.ask

    def recording(self, frame, answered, **options):
        shown = frame_of(frame)
        if shown["op"] == "claim":
            waits.append(shown["wait"])
        return ask(self, frame, answered, **options)

    monkeypatch.setattr(Link, "ask", recording)
    if not stop_waits:  # as if the claim's answer came once the stop was over waiting
        monkeypatch.setattr(run_module.Run, "letting_handlers_finish", property(lambda run: False))
    gate, calls = threading.Event(), []

    def handle(payload, job):
        calls.append(payload)
        if payload == "running":
            gate.wait(60)
        return payload

    queue = f"stop-claim-{'runs' if stop_waits else 'back'}"
    running = producer.post(queue, "running")
    worker = Worker(live.url, live.token, queues=[queue], concurrency=2, grace=20)
    with working(worker, handle):
        wait_until(lambda: calls and any(waits), what="a waiting claim beside the running handler")
        worker.stop()  # the stop waits for the running handler; the claim is still out
        wait_until(lambda: any(r.getMessage().startswith("stopping:") for r in caplog.records), what="the stop")
        late = producer.post(queue, "late")  # the waiting claim brings it
        ended = "finished" if stop_waits else "pending"
        wait_until(lambda: producer.get(queue, late["id"])["status"] == ended, timeout=10,
                   what=f"the late item {ended} while the worker is still stopping")
        gate.set()
    assert calls == (["running", "late"] if stop_waits else ["running"])
    assert producer.get(queue, running["id"])["status"] == "finished"
    assert producer.get(queue, late["id"])["attempts"] == 1


def test_a_stop_before_the_run_starts_stops_it_at_once(live, producer):
    item = producer.post("early-stop", "untouched")
    worker = Worker(live.url, live.token, queues=["early-stop"])
    worker.stop()
    asyncio.run(asyncio.wait_for(worker.run_async(lambda payload, job: payload), 10))
    untouched = producer.get("early-stop", item["id"])
    assert (untouched["status"], untouched["attempts"]) == ("pending", 0)


# ---- what cannot work ----------------------------------------------------------------------------


def test_a_bad_token_is_an_unauthorized_error_not_a_retry_loop(live):
    worker = Worker(live.url, "th_" + "x" * 32, queues=["basic"])
    with pytest.raises(Unauthorized):
        asyncio.run(asyncio.wait_for(worker.run_async(lambda payload, job: None), 20))


def test_an_unknown_queue_stops_the_worker_with_unknown_queue(live):
    worker = Worker(live.url, live.token, queues=["no-such-queue"])
    with pytest.raises(UnknownQueue):
        asyncio.run(asyncio.wait_for(worker.run_async(lambda payload, job: None), 20))


def test_an_unreachable_server_at_the_start_is_connection_failed():
    worker = Worker("http://127.0.0.1:9", "th_x", queues=["basic"])
    with pytest.raises(ConnectionFailed, match="cannot reach ws://127.0.0.1:9/work"):
        asyncio.run(asyncio.wait_for(worker.run_async(lambda payload, job: None), 20))


def test_an_unexpected_error_inside_the_worker_stops_it_rather_than_leave_it_stuck(live, producer, monkeypatch):
    def broken(cls, item):
        raise RuntimeError("a bug in the worker")

    monkeypatch.setattr(Job, "from_item", classmethod(broken))
    producer.post("broken", "x")
    worker = Worker(live.url, live.token, queues=["broken"])
    with pytest.raises(RuntimeError, match="a bug in the worker"):
        asyncio.run(asyncio.wait_for(worker.run_async(lambda payload, job: None), 20))


@pytest.mark.parametrize(
    "options",
    [{"queues": "basic"}, {"queues": []}, {"queues": ["a"], "concurrency": 0}, {"queues": ["a"], "on_error": "ignore"},
     {"queues": ["a"], "grace": -1}],
)
def test_bad_worker_options_are_refused_at_once_as_python_refuses_bad_arguments(options):
    with pytest.raises((ValueError, TypeError)):
        Worker("http://127.0.0.1:8000", "th_x", **options)


# ---- the parts that need no server ----------------------------------------------------------------


def test_reconnect_delays_grow_to_a_cap_with_jitter():
    for failures, step in [(1, 0.25), (2, 0.5), (3, 1.0), (10, 30.0), (60, 30.0)]:
        delays = {backoff_delay(failures) for _ in range(50)}
        assert all(step / 2 <= delay <= step for delay in delays)
        assert len(delays) > 1


@pytest.mark.parametrize(("free", "queues", "slots"), [(5, 1, [5]), (5, 3, [3, 1, 1]), (2, 3, [1, 1]), (0, 2, [])])
def test_waiting_claims_never_ask_for_more_than_the_free_slots(free, queues, slots):
    assert split_slots(free, queues) == slots


async def test_a_server_that_stops_answering_is_left_for_a_fresh_socket(monkeypatch):
    monkeypatch.setattr(claims_module, "ANSWER_SECONDS", 0.2)
    sockets = []

    async def silent(socket):
        sockets.append(socket)
        async for _ in socket:  # reads every frame, answers none
            pass

    async with serve_websocket(silent, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        worker = Worker(f"http://127.0.0.1:{port}", "th_x", queues=["jobs"])
        run = asyncio.create_task(worker.run_async(lambda payload, job: None))
        deadline = time.monotonic() + 10
        while len(sockets) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        worker.stop()
        await asyncio.wait_for(run, 10)
    assert len(sockets) >= 2


# ---- end to end ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("queue", "refusals"), [("heartbeat", 0), ("heartbeat-busy", 2)],
                         ids=["renewed", "renewed after two busy answers"])
def test_a_slow_handler_keeps_its_lease_by_heartbeat_and_finishes_once(live, producer, monkeypatch, queue, refusals):
    """leaseSeconds 2, a handler of ~5 s: without renewals the sweep would re-queue the item and
    the second worker, waiting on the same queue, would get it. Renewals the server answers
    `busy` are tried again within the lease, not given up."""
    refused = []
    request = Link.request

    async def busy_at_first(self, frame, **options):
        if isinstance(frame, dict) and frame.get("op") == "extend" and len(refused) < refusals:
            refused.append(frame["id"])
            raise api_error("busy", "the server sheds load for a moment")
        return await request(self, frame, **options)

    monkeypatch.setattr(Link, "request", busy_at_first)
    calls, rival_calls = [], []

    def slow(payload, job):
        calls.append(job.attempts)
        time.sleep(5)
        return "slow but sure"

    item = producer.post(queue, "x")
    with working(Worker(live.url, live.token, queues=[queue]), slow):
        wait_until(lambda: calls, what="the slow handler to start")
        with working(Worker(live.url, live.token, queues=[queue]), lambda p, job: rival_calls.append(job.id)):
            assert producer.result(queue, item["id"], timeout=30) == "slow but sure"
    assert (refused, calls, rival_calls) == ([item["id"]] * refusals, [1], [])
    assert producer.get(queue, item["id"])["attempts"] == 1


def test_a_producer_and_two_worker_processes_work_500_items(live, producer, tmp_path):
    workers = [start_worker_process(live, "many", name, tmp_path / f"{name}.log", concurrency=4, seconds=0.02)
               for name in ("one", "two")]
    try:
        items = producer.post_many("many", range(500))
        results = [producer.result("many", item["id"], timeout=60) for item in items]
    finally:
        for process in workers:
            process.send_signal(signal.SIGTERM)
        exits = [process.wait(30) for process in workers]

    assert exits == [0, 0]
    assert [result["payload"] for result in results] == list(range(500))
    assert all(result["attempts"] == 1 for result in results)
    by_worker = {name: sum(result["worker"] == name for result in results) for name in ("one", "two")}
    assert by_worker["one"] > 0 and by_worker["two"] > 0
    assert producer.stats("many")["counts"]["finished"] == 500


def test_a_worker_killed_mid_handler_loses_nothing(live, producer, tmp_path):
    stuck_log, rescuer_log = tmp_path / "stuck.log", tmp_path / "rescuer.log"
    stuck = start_worker_process(live, "killed", "stuck", stuck_log, concurrency=3, seconds=300)
    rescuer = None
    try:
        items = producer.post_many("killed", ["a", "b", "c"])
        wait_until(lambda: len(started(stuck_log)) == 3, what="the stuck worker to take all three")
        rescuer = start_worker_process(live, "killed", "rescuer", rescuer_log, concurrency=3)
        stuck.kill()
        results = [producer.result("killed", item["id"], timeout=30) for item in items]
    finally:
        stuck.kill()
        stuck.wait()
        if rescuer is not None:
            rescuer.send_signal(signal.SIGTERM)
            assert rescuer.wait(30) == 0

    assert [(r["worker"], r["payload"], r["attempts"]) for r in results] == [
        ("rescuer", "a", 2), ("rescuer", "b", 2), ("rescuer", "c", 2)]
    assert sorted(item_id for item_id, _ in started(rescuer_log)) == sorted(item["id"] for item in items)


def test_a_second_signal_skips_the_grace_period_and_releases_the_item(live, producer, tmp_path):
    log_path = tmp_path / "patient.log"
    worker = start_worker_process(live, "signals", "patient", log_path, seconds=300)  # grace: 30 s
    try:
        item = producer.post("signals", "long job")
        wait_until(lambda: started(log_path), what="the handler to start")
        worker.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            worker.wait(0.5)  # the first (Ctrl-C) asks to stop, and waits for the handler
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(10) == 0
    finally:
        worker.kill()
        worker.wait()
    released = producer.get("signals", item["id"])
    assert released["status"] == "pending" and released["attempts"] == 1


def test_the_worker_reconnects_after_a_server_restart_and_every_item_finishes_once(tmp_path, caplog):
    """The server is killed under a running worker and started again. A handler that was running
    then finishes while the server is away: its result goes in after the reconnect."""
    caplog.set_level(logging.WARNING, logger="taskhoster.worker")
    gate, gated_calls = threading.Event(), []

    def handle(payload, job):
        if payload == "gated":
            gated_calls.append(job.attempts)
            gate.wait(30)
            return "gated done"
        time.sleep(0.02)
        return payload * 2

    with live_server(tmp_path, {"restart": {"lease_seconds": 3}}) as live, Producer(live.url, live.token) as producer:
        gated = producer.post("restart", "gated")
        with working(Worker(live.url, live.token, queues=["restart"], concurrency=2), handle) as thread:
            wait_until(lambda: gated_calls, what="the gated handler to start")
            items = producer.post_many("restart", range(40))
            wait_until(lambda: producer.stats("restart")["counts"]["finished"] >= 10, what="ten results")

            live.server.kill()
            live.server.start()
            gate.set()

            results = [producer.result("restart", item["id"], timeout=30) for item in items]
            assert producer.result("restart", gated["id"], timeout=30) == "gated done"
            assert thread.is_alive()

        assert results == [n * 2 for n in range(40)]
        assert gated_calls == [1]  # the handler ran once: a re-claim of its item did not start it again
        counts = producer.stats("restart")["counts"]
        assert counts == {"scheduled": 0, "pending": 0, "processing": 0, "finished": 41, "failed": 0}
    assert any("connected again" in record.getMessage() for record in caplog.records)


def test_a_hand_in_that_fails_for_good_stops_the_worker_and_is_not_sent_again(live, producer, monkeypatch):
    sent = []
    ask = Link.ask

    def broken_hand_in(self, frame, answered, **options):
        shown = frame_of(frame)
        if shown["op"] in ("result", "results"):
            sent.append(shown["op"])
            raise RuntimeError("a bug in handing in")
        return ask(self, frame, answered, **options)

    monkeypatch.setattr(Link, "ask", broken_hand_in)
    producer.post("basic", "once")
    with pytest.raises(RuntimeError, match="a bug in handing in"):
        with working(Worker(live.url, live.token, queues=["basic"]), lambda payload, job: payload):
            deadline = time.monotonic() + 10
            while not sent and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.5)  # time enough to send it again many times, were it sent again
    assert sent == ["result"]
