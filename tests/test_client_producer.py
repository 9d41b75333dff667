"""The producer client: batching, long-polling for results, errors; against a stub server
where the request shape is the point, against a live server for the round trips. How the
connections behave (keep-alive, a server's close, TLS, framing) is tests/test_client_wire.py."""

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

import taskhoster.producer as producer_module
from client_support import client_env, live_server
from http_stub import Handler, Reply, Request, StubServer
from serverproc import PROJECT_DIR
from taskhoster import (
    ApiError,
    AsyncProducer,
    ConnectionFailed,
    ItemFailed,
    ItemNotFound,
    Producer,
    ResultTimeout,
    TaskhosterError,
    Unauthorized,
    UnknownQueue,
)

URL = "http://taskhoster.test"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    queues = {"jobs": {}, "later": {}, "many": {}, "ages": {"queue_seconds": 1}, "stats": {"lease_seconds": 7}}
    with live_server(tmp_path_factory.mktemp("producer"), queues) as live:
        yield live


def finish_pending(live, queue: str, result_of) -> None:
    """Play a worker over HTTP: claim what is pending and hand in `result_of(payload)`."""
    headers = {"Authorization": f"Bearer {live.token}"}
    claimed = httpx.post(f"{live.url}/api/queues/{queue}/claim", json={"max": 100}, headers=headers).json()
    for item in claimed["items"]:
        answer = httpx.post(f"{live.url}/api/queues/{queue}/items/{item['id']}/result",
                            json={"result": result_of(item["payload"])}, headers=headers)
        assert answer.json()["accepted"] is True


@contextmanager
def stub_producer(handler: Handler) -> Iterator[Producer]:
    with StubServer(handler) as stub, Producer(stub.url, "th_stub") as producer:
        yield producer


def posted_items(request: Request) -> Reply:
    """A stub server's answer to a batch post: each payload back as an item."""
    body = request.json()
    return Reply(201, {"items": [{"id": str(i), "payload": e["payload"]} for i, e in enumerate(body["items"])]})


def wait_of(request: Request) -> str | None:
    return parse_qs(urlsplit(request.target).query).get("wait", [None])[0]


class FakeTime:
    """Stands in for the `time` module in the producer: the stub server moves it by each wait."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


# ---- stub server: what goes on the wire ---------------------------------------------------------


def test_post_many_sends_batches_of_at_most_1000_in_the_given_order():
    sizes = []

    def handler(request):
        sizes.append(len(request.json()["items"]))
        return posted_items(request)

    with stub_producer(handler) as producer:
        items = producer.post_many("jobs", range(2500))

    assert sizes == [1000, 1000, 500]
    assert [item["payload"] for item in items] == list(range(2500))


def test_post_many_splits_big_payloads_so_no_body_grows_past_the_batch_size():
    bodies = []

    def handler(request):
        bodies.append(len(request.body))
        return posted_items(request)

    big = "x" * (3 << 20)
    with stub_producer(handler) as producer:
        items = producer.post_many("jobs", [big, big, big])

    assert len(items) == 3
    assert len(bodies) == 2 and max(bodies) <= producer_module.MAX_BATCH_BYTES + 100


@pytest.mark.parametrize("bad", [float("nan"), object(), {"x": float("inf")}])
def test_a_payload_that_is_not_json_fails_before_anything_is_sent(bad):
    requests = []
    with stub_producer(lambda request: requests.append(request) or posted_items(request)) as producer:
        with pytest.raises((TypeError, ValueError)):
            producer.post_many("jobs", [1, 2, bad])
        with pytest.raises((TypeError, ValueError)):
            producer.post("jobs", bad)
    assert requests == []


def test_a_failed_batch_says_which_items_of_earlier_batches_went_in():
    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) == 2:
            return Reply(503, {"error": "storage_unavailable", "message": "disk full"})
        return posted_items(request)

    with stub_producer(handler) as producer:
        with pytest.raises(TaskhosterError) as raised:
            producer.post_many("jobs", range(1500))

    assert raised.value.code == "storage_unavailable" and raised.value.status == 503
    assert [item["payload"] for item in raised.value.posted] == list(range(1000))


def test_result_long_polls_in_steps_of_at_most_60_seconds_until_the_timeout(monkeypatch):
    clock, waits = FakeTime(), []
    monkeypatch.setattr(producer_module, "time", clock)

    def handler(request):
        wait = float(wait_of(request) or 0)
        waits.append(wait)
        clock.now += wait
        return Reply(200, {"id": "a", "status": "pending"})

    with stub_producer(handler) as producer:
        with pytest.raises(ResultTimeout) as raised:
            producer.result("jobs", "a", timeout=150)

    assert waits == [60, 60, 30]
    assert raised.value.item["status"] == "pending"
    assert isinstance(raised.value, TimeoutError)


def test_result_without_a_timeout_polls_until_the_item_ends(monkeypatch):
    clock, answers = FakeTime(), iter(["pending", "processing", "processing", "finished"])
    monkeypatch.setattr(producer_module, "time", clock)
    waits = []

    def handler(request):
        waits.append(wait_of(request))
        status = next(answers)
        return Reply(200, {"id": "a", "status": status, "result": {"ok": True} if status == "finished" else None})

    with stub_producer(handler) as producer:
        assert producer.result("jobs", "a") == {"ok": True}
    assert waits == ["60"] * 4


@pytest.mark.parametrize("timeout", [-1, float("nan")])
def test_a_timeout_that_is_not_seconds_is_refused_before_any_request(timeout):
    requests = []
    with stub_producer(lambda request: requests.append(request)) as producer:
        with pytest.raises(ValueError, match="timeout must be"):
            producer.result("jobs", "a", timeout=timeout)
    assert requests == []


def raw_answer(status: int, reason: str, page: bytes = b"<html>oops</html>", *, head: bytes = b"") -> Reply:
    return Reply(raw=b"HTTP/1.1 %d %s\r\nContent-Type: text/html\r\n%sContent-Length: %d\r\n\r\n%s"
                 % (status, reason.encode(), head, len(page), page))


def test_an_answer_that_is_not_the_api_s_json_is_a_clear_error():
    with stub_producer(lambda request: raw_answer(500, "Internal Server Error")) as producer:
        with pytest.raises(TaskhosterError, match="unexpected_answer: HTTP 500"):
            producer.stats()


@pytest.mark.parametrize("status", [502, 503, 504])
def test_a_proxy_that_lost_the_server_is_a_failed_connection_that_may_have_carried_out_a_post(status):
    """nginx answers so while the server restarts, or when it went away mid-request: not the
    server's own (JSON) answer, so nothing says whether a post it forwarded was carried out."""
    with stub_producer(lambda request: raw_answer(status, "Bad Gateway")) as producer:
        with pytest.raises(ConnectionFailed, match=f"HTTP {status}") as posting:
            producer.post("jobs", 1)
        with pytest.raises(ConnectionFailed, match=f"HTTP {status}") as reading:
            producer.stats()
    assert posting.value.maybe_done and "may have been carried out" in str(posting.value)
    assert not reading.value.maybe_done


def test_post_retries_sends_a_post_a_proxy_lost_again_under_its_key():
    posts = []

    def handler(request):
        posts.append(request.json())
        return raw_answer(502, "Bad Gateway") if len(posts) == 1 else Reply(201, {"id": "1", **request.json()})

    with StubServer(handler) as stub, Producer(stub.url, "th_stub", post_retries=1) as producer:
        assert producer.post("jobs", 1)["id"] == "1"
    assert len(posts) == 2 and posts[0] == posts[1] and posts[0]["key"]


def test_a_busy_server_s_retry_after_comes_with_its_error_and_paces_post_retries():
    busy = raw_answer(503, "Service Unavailable", b'{"error": "busy", "message": "try again"}',
                      head=b"Retry-After: 3\r\n")
    with stub_producer(lambda request: busy) as producer:
        with pytest.raises(ApiError) as raised:
            producer.post("jobs", 1)
    assert (raised.value.code, raised.value.retry_after) == ("busy", 3.0)
    assert 3.0 <= producer_module._PostTries(2, [None]).pause_after(raised.value) <= producer_module.LONGEST_RETRY_PAUSE
    raised.value.retry_after = 3600.0  # within reason
    assert producer_module._PostTries(2, [None]).pause_after(raised.value) == producer_module.LONGEST_RETRY_PAUSE


def restarting_server(*outage: Reply | None):
    """A stub of a server that answers one read (the item processing), then goes through
    `outage` (None: the connection closed unanswered), then has the item finished."""
    reads = []

    def handler(request):
        reads.append(request.target)
        if len(reads) == 1:
            return Reply(200, {"id": "1", "status": "processing"})
        if len(reads) - 2 < len(outage):
            return outage[len(reads) - 2]
        return Reply(200, {"id": "1", "status": "finished", "result": "done"})

    return handler, reads


OUTAGE = (None, Reply(503, {"error": "busy", "message": "the server is stopping; try again"}), None)


def test_result_waits_through_a_server_restart_once_the_server_answered():
    handler, reads = restarting_server(*OUTAGE)
    with stub_producer(handler) as producer:
        assert producer.result("jobs", "1", timeout=30) == "done"
    assert len(reads) == 2 + len(OUTAGE)


async def test_async_result_waits_through_a_server_restart_once_the_server_answered():
    handler, reads = restarting_server(*OUTAGE)
    with StubServer(handler) as stub:
        async with AsyncProducer(stub.url, "th_stub") as producer:
            assert await producer.result("jobs", "1", timeout=30) == "done"
    assert len(reads) == 2 + len(OUTAGE)


def test_result_follows_a_retry_through_a_restart_during_the_retry_s_first_read():
    reads = []

    def handler(request):
        reads.append(request.target)
        if "/items/1" in request.target:
            return Reply(200, {"id": "1", "status": "failed", "error": "max_attempts", "retriedAs": "2"})
        if len(reads) in (2, 3):
            return None  # the retry's first read, sent twice (a GET is): the server is restarting
        return Reply(200, {"id": "2", "status": "finished", "result": "done"})

    with stub_producer(handler) as producer:
        assert producer.result("jobs", "1", timeout=30, follow_retries=True) == "done"
    assert len(reads) == 4


def test_result_raises_when_the_server_never_answered_or_the_outage_outlasts_the_timeout():
    with stub_producer(lambda request: None) as producer:
        with pytest.raises(ConnectionFailed):
            producer.result("jobs", "1")  # no limit, but nothing says the server is there
    handler, _ = restarting_server(*[None] * 1000)
    with stub_producer(handler) as producer:
        with pytest.raises(ConnectionFailed):
            producer.result("jobs", "1", timeout=0.5)


def test_url_and_token_come_from_the_environment(monkeypatch):
    seen = []

    def handler(request):
        seen.append((request.target, request.headers["host"], request.headers["authorization"]))
        return Reply(200, {"queues": []})

    with StubServer(handler) as stub:
        monkeypatch.setenv("TASKHOSTER_URL", stub.url + "/")
        monkeypatch.setenv("TASKHOSTER_TOKEN", "th_from_env")
        with Producer() as producer:
            assert producer.stats() == []
    assert seen == [("/api/queues", f"127.0.0.1:{stub.port}", "Bearer th_from_env")]


@pytest.mark.parametrize(
    ("url", "token", "message"),
    [(URL, None, "no token"), ("127.0.0.1:8000", "th_x", "must look like http")],
)
def test_a_missing_or_malformed_server_setting_is_a_clear_error(monkeypatch, url, token, message):
    monkeypatch.delenv("TASKHOSTER_URL", raising=False)
    monkeypatch.delenv("TASKHOSTER_TOKEN", raising=False)
    with pytest.raises(TaskhosterError, match=message):
        Producer(url, token)


def test_without_a_url_the_producer_goes_to_the_servers_default_address(monkeypatch):
    monkeypatch.delenv("TASKHOSTER_URL", raising=False)
    with Producer(token="th_x") as producer:
        assert producer.url == "http://127.0.0.1:8000"


def test_an_unreachable_server_raises_connection_failed():
    with Producer("http://127.0.0.1:9", "th_x", timeout=5) as producer:
        with pytest.raises(ConnectionFailed, match="cannot reach http://127.0.0.1:9"):
            producer.post("jobs", 1)


def test_importing_the_client_loads_no_django():
    code = "import sys, taskhoster, taskhoster.cli; print('django' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_DIR, env=client_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# ---- live server ------------------------------------------------------------------------------


def test_post_get_and_result_round_trip(live):
    with Producer(live.url, live.token) as producer:
        item = producer.post("jobs", {"n": 21})
        assert item["status"] == "pending" and item["queue"] == "jobs"
        read = producer.get("jobs", item["id"])
        assert read["status"] == "pending" and "payload" not in read
        assert producer.get("jobs", item["id"], payload=True)["payload"] == {"n": 21}

        finish_pending(live, "jobs", lambda payload: {"doubled": payload["n"] * 2})

        assert producer.result("jobs", item["id"], timeout=10) == {"doubled": 42}
        assert producer.get("jobs", item["id"])["status"] == "finished"


def test_result_waits_for_a_result_handed_in_meanwhile(live):
    with Producer(live.url, live.token) as producer:
        item = producer.post("later", "later")
        finisher = threading.Timer(0.3, finish_pending, (live, "later", str.upper))
        finisher.start()
        try:
            assert producer.result("later", item["id"], timeout=20) == "LATER"
        finally:
            finisher.join()


def test_result_runs_out_with_result_timeout_while_nobody_works(live):
    with Producer(live.url, live.token) as producer:
        item = producer.post("stats", "nobody works this queue")
        with pytest.raises(ResultTimeout) as raised:
            producer.result("stats", item["id"], timeout=0.5)
    assert raised.value.item["status"] == "pending"


def test_result_of_an_item_the_server_failed_raises_item_failed(live):
    with Producer(live.url, live.token) as producer:
        item = producer.post("ages", "too old soon")
        with pytest.raises(ItemFailed) as raised:
            producer.result("ages", item["id"], timeout=15)
    assert raised.value.error == "timeout"
    assert raised.value.item["status"] == "failed"


def test_server_errors_become_typed_exceptions(live):
    with Producer(live.url, live.token) as producer:
        with pytest.raises(UnknownQueue) as raised:
            producer.post("no-such-queue", 1)
        assert raised.value.status == 404 and raised.value.code == "unknown_queue"
        with pytest.raises(ItemNotFound):
            producer.get("jobs", "01a00000-0000-7000-8000-000000000000")
    with Producer(live.url, "th_" + "x" * 32) as stranger:
        with pytest.raises(Unauthorized) as raised:
            stranger.stats()
        assert raised.value.status == 401


def test_stats_shows_one_queue_or_every_queue(live):
    with Producer(live.url, live.token) as producer:
        one = producer.stats("stats")
        every = producer.stats()
    assert one["name"] == "stats" and one["leaseSeconds"] == 7
    assert set(one["counts"]) == {"scheduled", "pending", "processing", "finished", "failed"}
    assert {"jobs", "ages", "stats"} <= {queue["name"] for queue in every}


async def test_async_producer_posts_many_and_gathers_results(live):
    async with AsyncProducer(live.url, live.token) as producer:
        items = await producer.post_many("many", [{"n": n} for n in range(5)])
        waiting = asyncio.gather(*(producer.result("many", item["id"], timeout=20) for item in items))
        await asyncio.sleep(0.2)  # the reads are waiting on the server now
        await asyncio.to_thread(finish_pending, live, "many", lambda payload: payload["n"] ** 2)
        assert await waiting == [0, 1, 4, 9, 16]
        assert (await producer.stats("many"))["counts"]["finished"] == 5
        with pytest.raises(UnknownQueue):
            await producer.post("no-such-queue", 1)
