"""The Python client's side of scheduled items, retries and cancel, against a real `serve`:
Producer.post(delay=, run_at=), retry(), cancel(), result(follow_retries=), and the worker's
on_error="retry" with backoff, its last try, and a cancel reaching a running handler."""

import asyncio
import threading
from datetime import datetime, timedelta, timezone

import pytest

from client_support import live_server
import taskhoster.leases as leases_module
from taskhoster import ApiError, AsyncProducer, ItemFailed, Job, Producer, TaskhosterError, Worker
from taskhoster.jobs import HandlerFailed, error_result, retry_delay
from test_client_worker import wait_until, working

QUEUES = {
    "later": {},
    "later-many": {},
    "again": {},
    "stop": {},
    "three-tries": {"max_attempts": 3},
    "last-try-again": {"max_attempts": 2},
    "endless-tries": {},
    "cancel-async": {},
    "cancel-blocking": {},
}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("retries"), QUEUES) as live:
        yield live


@pytest.fixture
def producer(live):
    with Producer(live.url, live.token) as producer:
        yield producer


def moment(text: str) -> datetime:
    return datetime.fromisoformat(text)


# ---- scheduled posts ------------------------------------------------------------------------------


def test_a_post_with_a_delay_is_scheduled_and_handed_out_no_sooner_than_its_run_at(live, producer):
    started_at = []

    def handle(payload, job):
        started_at.append(datetime.now(timezone.utc))
        return payload

    item = producer.post("later", "soon", delay=0.6)
    assert item["status"] == "scheduled"
    assert moment(item["runAt"]) - moment(item["postedAt"]) == pytest.approx(timedelta(seconds=0.6),
                                                                              abs=timedelta(milliseconds=2))
    with working(Worker(live.url, live.token, queues=["later"]), handle):
        assert producer.result("later", item["id"], timeout=20) == "soon"
    assert started_at[0] >= moment(item["runAt"])


def test_run_at_takes_a_datetime_with_a_time_zone_or_an_iso_string(producer):
    in_an_hour = datetime.now(timezone(timedelta(hours=5))) + timedelta(hours=1)
    by_datetime = producer.post("later", 1, run_at=in_an_hour)
    in_two_hours = (datetime.now(timezone.utc) + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%S")
    by_string = producer.post("later", 2, run_at=in_two_hours + "+00:00")
    by_timedelta = producer.post("later", 3, delay=timedelta(minutes=2))
    assert [item["status"] for item in (by_datetime, by_string, by_timedelta)] == ["scheduled"] * 3
    assert moment(by_datetime["runAt"]) == pytest.approx(in_an_hour, abs=timedelta(milliseconds=1))
    assert by_string["runAt"] == in_two_hours + ".000Z"
    assert moment(by_timedelta["runAt"]) - moment(by_timedelta["postedAt"]) == pytest.approx(
        timedelta(minutes=2), abs=timedelta(milliseconds=2))  # each shown to the millisecond
    for item in (by_datetime, by_string, by_timedelta):
        producer.cancel("later", item["id"])


@pytest.mark.parametrize(("options", "error"), [
    ({"run_at": datetime(2099, 1, 1)}, ValueError),  # no time zone: which instant is it?
    ({"delay": 5, "run_at": "2099-01-01T00:00:00Z"}, ValueError),
    ({"delay": "5"}, TypeError),
    ({"delay": True}, TypeError),
    ({"run_at": 1234567890}, TypeError),
    ({"delay": float("nan")}, ValueError),
])
def test_a_schedule_the_client_can_tell_is_wrong_fails_before_anything_is_sent(producer, options, error):
    before = producer.stats("later")["counts"]
    with pytest.raises(error):
        producer.post("later", "x", **options)
    with pytest.raises(error):
        producer.post_many("later", ["x", "y"], **options)
    assert producer.stats("later")["counts"] == before


def test_a_schedule_the_server_refuses_is_an_api_error_and_posts_nothing(producer):
    before = producer.stats("later")["counts"]
    for options in ({"delay": -1}, {"delay": 31 * 86400}, {"run_at": "2099-01-01T00:00:00"}):
        with pytest.raises(ApiError) as refused:
            producer.post("later", "x", **options)
        assert refused.value.status == 400 and refused.value.code == "invalid_request"
    assert producer.stats("later")["counts"] == before


def test_post_many_schedules_every_item(producer):
    items = producer.post_many("later-many", range(5), delay=3600)
    assert [item["status"] for item in items] == ["scheduled"] * 5
    assert producer.stats("later-many")["counts"]["scheduled"] == 5
    assert len({item["runAt"] for item in items}) == 1  # one batch, one moment


# ---- retry, cancel, and following retries ----------------------------------------------------------


def test_retry_posts_an_ended_item_again_once_and_refuses_one_that_has_not_ended(live, producer):
    item = producer.post("again", {"n": 1})
    with pytest.raises(ApiError) as refused:
        producer.retry("again", item["id"])
    assert refused.value.code == "not_ended" and refused.value.status == 409

    producer.cancel("again", item["id"])
    retried = producer.retry("again", item["id"])
    assert retried["retryOf"] == item["id"] and retried["status"] == "pending"
    assert producer.retry("again", item["id"])["id"] == retried["id"]  # asked again: the same new item
    assert producer.get("again", item["id"])["retriedAs"] == retried["id"]
    assert producer.get("again", retried["id"], payload=True)["payload"] == {"n": 1}


def test_cancel_ends_an_item_once_and_says_whether_it_did(producer):
    item = producer.post("stop", "x", delay=3600)
    first = producer.cancel("stop", item["id"])
    assert first["canceled"] is True
    assert (first["status"], first["error"]) == ("failed", "canceled")
    again = producer.cancel("stop", item["id"])
    assert again["canceled"] is False and again["status"] == "failed"
    with pytest.raises(ItemFailed) as failed:
        producer.result("stop", item["id"], timeout=5)
    assert failed.value.item["error"] == "canceled"


def test_result_follows_retries_when_asked(live, producer):
    first = producer.post("again", 21)
    producer.cancel("again", first["id"])
    second = producer.retry("again", first["id"])
    with working(Worker(live.url, live.token, queues=["again"]), lambda payload, job: payload * 2):
        assert producer.result("again", first["id"], timeout=20, follow_retries=True) == 42
    with pytest.raises(ItemFailed):
        producer.result("again", first["id"], timeout=5)  # not asked to: the first item failed
    assert producer.get("again", second["id"])["status"] == "finished"


def test_the_async_producer_schedules_retries_and_cancels_too(live):
    async def scenario():
        async with AsyncProducer(live.url, live.token) as producer:
            item = await producer.post("again", "a", delay=3600)
            many = await producer.post_many("again", ["b", "c"], run_at=datetime.now(timezone.utc) + timedelta(hours=1))
            canceled = await producer.cancel("again", item["id"])
            retried = await producer.retry("again", item["id"])
            for other in many:
                await producer.cancel("again", other["id"])
            await producer.cancel("again", retried["id"])
            with pytest.raises(ItemFailed):
                await producer.result("again", item["id"], timeout=5, follow_retries=True)
            return item, many, canceled, retried

    item, many, canceled, retried = asyncio.run(scenario())
    assert item["status"] == "scheduled" and [i["status"] for i in many] == ["scheduled"] * 2
    assert canceled["canceled"] is True and retried["retryOf"] == item["id"]


# ---- on_error="retry" ------------------------------------------------------------------------------


def test_retry_gives_a_failing_item_back_with_its_error_and_hands_the_error_in_on_the_last_try(live, producer):
    seen: list[tuple[int, int | None, bool, object]] = []

    def always_fails(payload, job):
        seen.append((job.attempts, job.max_attempts, job.is_last_try, job.last_error))
        raise RuntimeError(f"try {job.attempts} failed")

    item = producer.post("three-tries", "x")
    worker = Worker(live.url, live.token, queues=["three-tries"], on_error="retry", retry_base=0.05, retry_cap=0.2)
    with working(worker, always_fails):
        result = producer.result("three-tries", item["id"], timeout=30)

    assert [(attempts, limit, last) for attempts, limit, last, _ in seen] == [(1, 3, False), (2, 3, False), (3, 3, True)]
    assert seen[0][3] is None
    assert seen[1][3]["error"]["message"] == "try 1 failed"  # the release's error, as lastError
    assert seen[2][3]["error"]["message"] == "try 2 failed"
    assert result["error"]["type"] == "RuntimeError" and result["error"]["message"] == "try 3 failed"
    ended = producer.get("three-tries", item["id"])
    assert ended["status"] == "finished" and ended["attempts"] == 3
    assert ended["lastError"]["error"]["message"] == "try 2 failed"


def test_an_item_claimed_again_while_its_handler_runs_is_on_its_last_try_when_the_handler_fails(
        live, producer, monkeypatch):
    """The socket drops mid-handler, the server re-queues the item, and the worker's next claim
    brings it back (attempt 2 of 2) while the first run goes on: when that run fails, giving the
    item back would end it max_attempts, so its error is handed in as its result. The handler's
    job shows that latest claim too."""
    links = []
    real_hold = leases_module.Leases.hold

    def hold(self, job, link):
        links.append(link)
        real_hold(self, job, link)

    monkeypatch.setattr(leases_module.Leases, "hold", hold)

    async def fails_after_a_second_claim(payload, job):
        await links[0].socket.close()
        while len(links) < 2:
            await asyncio.sleep(0.01)
        raise RuntimeError(f"failed, claimed {job.attempts} time(s) by now")

    item = producer.post("last-try-again", "x")
    worker = Worker(live.url, live.token, queues=["last-try-again"], concurrency=2, on_error="retry",
                    retry_base=0.05, retry_cap=0.2)
    with working(worker, fails_after_a_second_claim):
        result = producer.result("last-try-again", item["id"], timeout=30)

    assert result["error"]["message"] == "failed, claimed 2 time(s) by now"  # the handler's job shows the latest claim
    ended = producer.get("last-try-again", item["id"])
    assert (ended["status"], ended["attempts"]) == ("finished", 2)


def test_retry_without_a_limit_goes_on_until_the_handler_succeeds(live, producer):
    async def fails_twice(payload, job):
        if job.attempts < 3:
            raise HandlerFailed({"type": "Flaky", "message": f"not yet ({job.attempts})"})
        return {"done on": job.attempts, "last error": job.last_error}

    item = producer.post("endless-tries", "x")
    worker = Worker(live.url, live.token, queues=["endless-tries"], on_error="retry", retry_base=0.05, retry_cap=0.1)
    with working(worker, fails_twice):
        result = producer.result("endless-tries", item["id"], timeout=30)
    assert result == {"done on": 3, "last error": {"error": {"type": "Flaky", "message": "not yet (2)"}}}


def test_retry_delays_grow_exponentially_up_to_the_cap_with_full_jitter(monkeypatch):
    import taskhoster.jobs as jobs

    monkeypatch.setattr(jobs.random, "uniform", lambda low, high: high)  # the top of each range
    assert [retry_delay(attempts, 1.0, 20.0) for attempts in range(1, 8)] == [1, 2, 4, 8, 16, 20, 20]
    assert retry_delay(10_000, 1.0, 600.0) == 600  # no overflow, however many tries
    monkeypatch.setattr(jobs.random, "uniform", lambda low, high: low)
    assert retry_delay(5, 1.0, 20.0) == 0  # full jitter: the range starts at 0
    monkeypatch.undo()

    delays = [retry_delay(4, 1.0, 600.0) for _ in range(2000)]
    assert all(0 <= delay <= 8 for delay in delays)
    assert min(delays) < 1 and max(delays) > 7  # spread over the whole range


@pytest.mark.parametrize("options", [{"retry_base": 0}, {"retry_base": 5, "retry_cap": 1},
                                     {"retry_cap": 86401}, {"on_error": "retry-forever"}])
def test_the_worker_refuses_retry_settings_that_make_no_sense(live, options):
    with pytest.raises(ValueError):
        Worker(live.url, live.token, queues=["endless-tries"], **options)


def test_an_error_result_keeps_a_huge_message_small():
    result = error_result(ValueError("x" * 100_000))
    assert len(result["error"]["message"]) == 4000


def test_a_job_reads_its_limit_and_last_error_from_the_claimed_item():
    job = Job.from_item({"id": "i", "queue": "q", "attempts": 2, "maxAttempts": 2, "lastError": {"why": 1}})
    assert (job.max_attempts, job.last_error, job.is_last_try) == (2, {"why": 1}, True)
    unlimited = Job.from_item({"id": "i", "queue": "q", "attempts": 99, "maxAttempts": None})
    assert not unlimited.is_last_try and not unlimited.canceled


# ---- cancel reaching a running handler ---------------------------------------------------------------


def test_a_cancel_cancels_an_async_handler_s_task_and_the_worker_goes_on(live, producer):
    started, cancelled = threading.Event(), threading.Event()

    async def slow(payload, job):
        if payload == "slow":
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return payload

    slow_item = producer.post("cancel-async", "slow")
    with working(Worker(live.url, live.token, queues=["cancel-async"], concurrency=1), slow):
        assert started.wait(20)
        assert producer.cancel("cancel-async", slow_item["id"])["canceled"] is True
        assert cancelled.wait(20)
        # its one slot is free again: the next item is worked
        next_item = producer.post("cancel-async", "next")
        assert producer.result("cancel-async", next_item["id"], timeout=20) == "next"
    ended = producer.get("cancel-async", slow_item["id"])
    assert (ended["status"], ended["error"]) == ("failed", "canceled")


def test_a_blocking_handler_sees_job_canceled_and_what_it_returns_is_dropped(live, producer):
    started, saw_cancel = threading.Event(), threading.Event()

    def careful(payload, job):
        started.set()
        if job.canceled.wait(30):  # a long step, cut short by a cancel
            saw_cancel.set()
        assert job.canceled  # and true from now on, for a plain `if job.canceled:`
        return "made after the cancel"

    item = producer.post("cancel-blocking", "x")
    with working(Worker(live.url, live.token, queues=["cancel-blocking"]), careful):
        assert started.wait(20)
        producer.cancel("cancel-blocking", item["id"])
        assert saw_cancel.wait(20)
        other = producer.post("cancel-blocking", "y")
        wait_until(lambda: producer.get("cancel-blocking", other["id"])["status"] != "pending",
                   what="the next item to be claimed")
        producer.cancel("cancel-blocking", other["id"])
    ended = producer.get("cancel-blocking", item["id"])
    assert (ended["status"], ended["error"]) == ("failed", "canceled")
    assert "result" not in ended
