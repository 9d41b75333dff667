"""/metrics: who may read it, and that its figures follow what the store does: counters for
every transition, the item histograms, the queue gauges (read from the shared data directory,
listed no more often than they allow) and the worker sockets connected."""

import asyncio
from contextlib import contextmanager

import pytest
from channels.testing import WebsocketCommunicator
from django.contrib.sessions.backends.db import SessionStore
from django.core.management import call_command
from django.db import OperationalError
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from api_support import api, bearer, disk_snapshot, queues, tokens  # noqa: F401  (fixtures)
from queues.metrics import gauges
from queues.metrics.families import REGISTRY
from queues.metrics.gauges import QueueFigures
from queues.metrics.transitions import TransitionCounter
from queues.models import ApiToken
from queues.runtime import get_registry, get_store
from queues.store import QueueConfig, Release, Store
from storekit import finish, post_batch, release
from taskhoster_site.asgi import application
from test_api_auth import EVERY_CALL, _ids, call

pytestmark = pytest.mark.django_db(transaction=True)

COUNTERS = [
    ("taskhoster_items_posted_total", {}),
    ("taskhoster_items_finished_total", {}),
    ("taskhoster_items_retried_total", {}),
    ("taskhoster_items_canceled_total", {}),
    *[("taskhoster_items_failed_total", {"reason": r}) for r in ("timeout", "max_attempts", "canceled")],
    *[("taskhoster_items_requeued_total", {"reason": r}) for r in ("lease", "socket", "release", "staff", "shutdown", "unsent")],
    ("taskhoster_item_wait_seconds_count", {}),
    ("taskhoster_item_run_seconds_count", {}),
]


@pytest.fixture(autouse=True)
def _fast(settings):
    settings.TASKHOSTER_FSYNC = False
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # test users only


@pytest.fixture(autouse=True)
def _fresh_figures():
    """The queue gauges of this test's data directory, not a count another test left."""
    gauges.queue_figures.__init__()


@contextmanager
def changes():
    """What the counters of this process gained while the block ran (those that gained)."""
    before = {(name, tuple(labels.items())): REGISTRY.get_sample_value(name, labels) or 0 for name, labels in COUNTERS}
    gained: dict[str, float] = {}
    yield gained
    for (name, labels), value in before.items():
        now = REGISTRY.get_sample_value(name, dict(labels)) or 0
        if now != value:
            key = name + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}" if labels else "")
            gained[key] = now - value


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# ---- who may read ----------------------------------------------------------------------------


def metrics_token(**rights) -> str:
    token = ApiToken(name="scraper", **{"can_produce": False, "can_work": False, "can_read_metrics": True, **rights})
    raw = token.set_new_value()
    token.full_clean()
    token.save()
    get_registry().invalidate()
    return raw


async def test_nobody_reads_metrics_anonymously(api, queues):
    answer = await api.get("/metrics")
    assert answer.status_code == 401
    assert answer.json()["error"] == "unauthorized"
    assert answer.headers["www-authenticate"] == "Bearer"
    assert "taskhoster_" not in answer.text


async def test_an_unknown_token_is_unauthorized_and_one_without_the_right_forbidden(api, queues, tokens):
    assert (await api.get("/metrics", headers=bearer("th_" + "x" * 32))).status_code == 401
    answer = await api.get("/metrics", headers=bearer(tokens["all"]))
    assert answer.status_code == 403
    assert answer.json()["error"] == "forbidden"


async def test_a_token_with_the_metrics_right_reads_the_text_format(api, queues):
    answer = await api.get("/metrics", headers=bearer(await asyncio.to_thread(metrics_token)))
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    names = {family.name for family in text_string_to_metric_families(answer.text)}
    assert {
        "taskhoster_queue_items", "taskhoster_queue_oldest_item_age_seconds", "taskhoster_workers_connected",
        "taskhoster_items_posted", "taskhoster_items_finished", "taskhoster_items_failed",
        "taskhoster_items_requeued", "taskhoster_items_retried", "taskhoster_items_canceled",
        "taskhoster_item_wait_seconds", "taskhoster_item_run_seconds", "taskhoster_http_request_duration_seconds",
    } <= names


@pytest.mark.parametrize(("method", "path", "body"), EVERY_CALL, ids=_ids(EVERY_CALL))
async def test_a_metrics_only_token_reads_nothing_else(api, queues, method, path, body):
    token = await asyncio.to_thread(metrics_token)
    before = disk_snapshot()
    answer = await call(api, method, path, body, bearer(token))
    assert answer.status_code == 403, answer.text
    assert answer.json()["error"] == "forbidden"
    assert disk_snapshot() == before


async def test_a_metrics_only_token_opens_no_worker_socket(queues):
    token = await asyncio.to_thread(metrics_token)
    ws = WebsocketCommunicator(application, "/work", headers=[(b"authorization", f"Bearer {token}".encode())])
    assert (await ws.connect())[0]  # accepted, to say why it closes
    closed = await ws.receive_output(timeout=3)
    assert (closed["type"], closed["code"]) == ("websocket.close", 4401)


async def test_the_metrics_right_comes_on_top_of_others(api, queues):
    token = await asyncio.to_thread(metrics_token, can_produce=True)
    assert (await api.get("/metrics", headers=bearer(token))).status_code == 200
    assert (await api.post("/api/queues/jobs/items", json={"payload": 1}, headers=bearer(token))).status_code == 201


def test_staff_read_metrics_and_other_users_do_not(django_user_model, queues):
    staff = django_user_model.objects.create_user("operator", password="pw", is_staff=True)
    visitor = django_user_model.objects.create_user("visitor", password="pw")
    for user, status in ((staff, 200), (visitor, 403)):
        client = Client()
        client.force_login(user)
        assert client.get("/metrics").status_code == status


def test_a_session_the_database_cannot_read_is_storage_unavailable_not_a_server_error(django_user_model, queues,
                                                                                       monkeypatch):
    staff = django_user_model.objects.create_user("operator", password="pw", is_staff=True)
    client = Client()
    client.force_login(staff)

    def database_down(self):
        raise OperationalError("the database does not answer")

    async def database_down_async(self):
        database_down(self)

    monkeypatch.setattr(SessionStore, "_get_session_from_db", database_down)
    monkeypatch.setattr(SessionStore, "_aget_session_from_db", database_down_async)
    answer = client.get("/metrics")
    assert (answer.status_code, answer.json()["error"]) == (503, "storage_unavailable")


def test_createtoken_metrics_makes_a_token_with_only_that_right(queues, capsys):
    call_command("createtoken", "scraper", "--metrics")
    raw = capsys.readouterr().out.strip()
    token = ApiToken.objects.get(name="scraper")
    assert (token.can_produce, token.can_work, token.can_read_metrics) == (False, False, True)
    get_registry().invalidate()
    get_registry().refresh()
    grant = get_registry().authenticate(raw)
    assert grant.can_read_metrics and not grant.uses_queues
    call_command("createtoken", "both", "--metrics", "--work")
    both = ApiToken.objects.get(name="both")
    assert (both.can_produce, both.can_work, both.can_read_metrics) == (False, True, True)
    call_command("createtoken", "plain")
    plain = ApiToken.objects.get(name="plain")
    assert (plain.can_produce, plain.can_work, plain.can_read_metrics) == (True, True, False)


# ---- counters and histograms ---------------------------------------------------------------


@pytest.fixture
def counted(tmp_path, clock) -> Store:
    """A store that tells the counters, as the server's does."""
    return Store(tmp_path / "counted", fsync=False, clock=clock, observer=TransitionCounter())


def test_posts_claims_and_results_are_counted_once_each(counted, clock):
    config = QueueConfig(name="jobs")
    with changes() as gained:
        first, second, third = post_batch(counted, "jobs", [1, 2, 3])
        clock.advance(4)
        claimed = counted.claim_items(config=config, max_items=2)
        clock.advance(2)
        finish(counted, config, claimed[0].id, "ok")
        finish(counted, config, claimed[0].id, "again")  # refused: counts nothing
    assert gained == {
        "taskhoster_items_posted_total": 3,
        "taskhoster_item_wait_seconds_count": 2,
        "taskhoster_items_finished_total": 1,
        "taskhoster_item_run_seconds_count": 1,
    }


def test_the_item_histograms_measure_post_to_first_claim_and_claim_to_result(counted, clock):
    config = QueueConfig(name="jobs")
    wait_sum = REGISTRY.get_sample_value("taskhoster_item_wait_seconds_sum")
    run_sum = REGISTRY.get_sample_value("taskhoster_item_run_seconds_sum")
    (item,) = post_batch(counted, "jobs", [1])
    clock.advance(7)
    (claimed,) = counted.claim_items(config=config)
    clock.advance(3)
    finish(counted, config, claimed.id, "ok")
    # a post's id holds its millisecond: the wait is 7 s give or take that
    assert REGISTRY.get_sample_value("taskhoster_item_wait_seconds_sum") - wait_sum == pytest.approx(7, abs=0.002)
    assert REGISTRY.get_sample_value("taskhoster_item_run_seconds_sum") - run_sum == pytest.approx(3)


def test_a_second_claim_is_not_a_wait(counted, clock):
    config = QueueConfig(name="jobs")
    (item,) = post_batch(counted, "jobs", [1])
    (claimed,) = counted.claim_items(config=config)
    release(counted, config, claimed.id)
    with changes() as gained:
        counted.claim_items(config=config)
    assert gained == {}


def test_every_kind_of_requeue_is_counted_by_its_reason(counted, clock):
    config = QueueConfig(name="jobs", lease_seconds=10)
    post_batch(counted, "jobs", [1, 2, 3, 4])
    held = counted.claim_items(config=config, max_items=4)
    with changes() as gained:
        release(counted, config, held[0].id)
        release(counted, config, held[1].id, delay=30)  # to scheduled: given back all the same
        counted.release_items(releases=[Release(config, held[2].id, reason="socket")])
        clock.advance(11)
        counted.sweep_queue(config=config)  # the last one's lease lapsed
    assert gained == {
        "taskhoster_items_requeued_total{reason=release}": 2,
        "taskhoster_items_requeued_total{reason=socket}": 1,
        "taskhoster_items_requeued_total{reason=lease}": 1,
    }


def test_server_failures_are_counted_by_their_reason(counted, clock):
    config = QueueConfig(name="jobs", lease_seconds=10, queue_seconds=100, max_attempts=1)
    aged, limited, canceled, left = (item.id for item in post_batch(counted, "jobs", [1, 2, 3, 4]))
    with changes() as gained:
        counted.cancel_item(config=config, item_id=canceled)
        counted.cancel_item(config=config, item_id=canceled)  # ended already: nothing
        held = {item.id: item for item in counted.claim_items(config=config, max_items=3)}
        release(counted, config, limited, held[limited].claim_token)  # its one attempt: it ends
        clock.advance(101)
        counted.sweep_queue(config=config)  # the others aged out
    assert gained == {
        "taskhoster_items_canceled_total": 1,
        "taskhoster_items_failed_total{reason=canceled}": 1,
        "taskhoster_items_failed_total{reason=max_attempts}": 1,
        "taskhoster_items_failed_total{reason=timeout}": 2,
        "taskhoster_item_wait_seconds_count": 3,
    }


def test_a_stopping_server_gives_items_back_as_shutdown_without_ending_them(counted):
    config = QueueConfig(name="jobs", max_attempts=1)
    post_batch(counted, "jobs", [1])
    (held,) = counted.claim_items(config=config)
    with changes() as gained:
        (back,) = counted.release_items(releases=[Release(config, held.id, held.claim_token, reason="shutdown")])
    assert back.status == "pending"
    assert gained == {"taskhoster_items_requeued_total{reason=shutdown}": 1}


def test_a_retry_counts_as_retried_not_as_posted(counted):
    config = QueueConfig(name="jobs")
    (item,) = post_batch(counted, "jobs", [1])
    (held,) = counted.claim_items(config=config)
    finish(counted, config, held.id, "ok")
    with changes() as gained:
        counted.retry_item(config=config, item_id=item.id)
        counted.retry_item(config=config, item_id=item.id)  # the same new item: nothing new
    assert gained == {"taskhoster_items_retried_total": 1}


async def test_what_the_api_does_shows_in_the_scraped_counters(api, queues, tokens):
    scraper = await asyncio.to_thread(metrics_token)
    before = scrape((await api.get("/metrics", headers=bearer(scraper))).text)
    producer, worker = bearer(tokens["producer"]), bearer(tokens["worker"])
    for n in range(3):
        assert (await api.post("/api/queues/jobs/items", json={"payload": n}, headers=producer)).status_code == 201
    claimed = (await api.post("/api/queues/jobs/claim", json={"max": 2}, headers=worker)).json()["items"]
    for item in claimed:
        await api.post(f"/api/queues/jobs/items/{item['id']}/result", json={"result": 1}, headers=worker)
    after = scrape((await api.get("/metrics", headers=bearer(scraper))).text)

    def gained(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert gained("taskhoster_items_posted_total") == 3
    assert gained("taskhoster_items_finished_total") == 2
    posts = gained("taskhoster_http_request_duration_seconds_count",
                   method="POST", route="/api/queues/{queue}/items", status="201")
    assert posts == 3


# ---- queue gauges and workers ------------------------------------------------------------


async def test_the_queue_gauges_count_items_by_state_and_age_the_oldest_pending(api, queues, tokens):
    scraper = await asyncio.to_thread(metrics_token)
    store = get_store()
    config = QueueConfig(name="jobs")
    oldest, *_ = post_batch(store, "jobs", [1, 2, 3, 4])
    held = store.claim_items(config=config, max_items=2)
    finish(store, config, held[1].id, "ok")
    figures = scrape((await api.get("/metrics", headers=bearer(scraper))).text)
    jobs = {state: figures[("taskhoster_queue_items", (("queue", "jobs"), ("state", state)))]
            for state in ("scheduled", "pending", "processing", "finished", "failed")}
    assert jobs == {"scheduled": 0, "pending": 2, "processing": 1, "finished": 1, "failed": 0}
    assert figures[("taskhoster_queue_items", (("queue", "other"), ("state", "pending")))] == 0
    age = figures[("taskhoster_queue_oldest_item_age_seconds", (("queue", "jobs"),))]
    assert age >= 0 and figures[("taskhoster_queue_oldest_item_age_seconds", (("queue", "other"),))] == 0


class StepClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


async def test_the_queue_gauges_list_the_disk_no_more_often_than_their_age_allows(queues, monkeypatch):
    listings = []
    real = gauges.count_queues

    def counting(names):
        listings.append(names)
        return real(names)

    monkeypatch.setattr(gauges, "count_queues", counting)
    clock = StepClock()
    figures = QueueFigures(min_age=1.0, clock=clock)
    await asyncio.gather(*(figures.refresh(["jobs"]) for _ in range(5)))  # scrapes at once share a listing
    await figures.refresh(["jobs"])
    assert len(listings) == 1
    post_batch(get_store(), "jobs", [1])  # as another process would
    clock.now += 1.5
    await figures.refresh(["jobs"])
    assert len(listings) == 2 and figures.counts["jobs"].pending == 1
    await figures.refresh(["jobs", "other"])  # a queue made meanwhile is counted at once
    assert len(listings) == 3


async def test_a_slow_listing_is_taken_again_only_after_many_times_its_cost(queues, monkeypatch):
    clock = StepClock()

    def slow(names):
        clock.now += 2.0  # a listing of a huge queue
        return {}

    monkeypatch.setattr(gauges, "count_queues", slow)
    figures = QueueFigures(min_age=1.0, cost_share=0.05, clock=clock)
    await figures.refresh(["jobs"])
    assert figures.max_age() == pytest.approx(40.0)
    taken = clock.now
    clock.now += 39
    await figures.refresh(["jobs"])
    assert clock.now == taken + 39  # not listed again
    clock.now += 2
    await figures.refresh(["jobs"])
    assert clock.now == taken + 43


async def test_two_processes_give_the_same_queue_figures(api, queues, tokens):
    """Another server process is another registry and count over the same data directory."""
    scraper = await asyncio.to_thread(metrics_token)
    post_batch(Store(get_store().data_dir, fsync=False), "jobs", [1, 2])  # posted by another process
    here = scrape((await api.get("/metrics", headers=bearer(scraper))).text)
    elsewhere = QueueFigures()
    await elsewhere.refresh(["jobs", "other"])
    assert elsewhere.counts == gauges.queue_figures.counts
    assert here[("taskhoster_queue_items", (("queue", "jobs"), ("state", "pending")))] == 2


async def test_workers_connected_counts_the_sockets_that_claim_from_a_queue(api, queues, tokens):
    scraper = await asyncio.to_thread(metrics_token)

    async def connected() -> dict:
        figures = scrape((await api.get("/metrics", headers=bearer(scraper))).text)
        return {q: figures[("taskhoster_workers_connected", (("queue", q),))] for q in ("jobs", "other")}

    sockets = []
    for queue in ("jobs", "jobs", "other"):
        ws = WebsocketCommunicator(application, "/work", headers=[(b"authorization", f"Bearer {tokens['all']}".encode())])
        assert (await ws.connect())[0]
        await ws.send_json_to({"op": "claim", "queue": queue})
        assert (await ws.receive_json_from(timeout=3))["op"] == "items"
        sockets.append(ws)
    assert await connected() == {"jobs": 2, "other": 1}
    await sockets[0].disconnect()
    await sockets[2].disconnect()
    assert await connected() == {"jobs": 1, "other": 0}
    await sockets[1].disconnect()
