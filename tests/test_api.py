"""Each API call's success path, with the JSON shapes docs/api.md shows."""

import asyncio
import errno
import functools
import os
import shutil
import re
import threading
import time
from concurrent.futures import Future

import pytest
from asgiref.sync import sync_to_async
from django.db import OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper

from api_support import api, bearer, disk_snapshot, queues, tokens  # noqa: F401  (fixtures)
from queues import ids, runtime
from queues.api import handlers
from queues.runtime import get_registry, get_store, run
from queues.services import save_queue
from queues.store import NewItem, QueueConfig, Store, turn
from storekit import post_batch

pytestmark = pytest.mark.django_db(transaction=True)

ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
asave_queue = sync_to_async(save_queue)
ITEM_KEYS = {"id", "queue", "status", "attempts", "postedAt", "claimedAt", "leaseExpiresAt", "finishedAt"}


async def post(api, token, payload, queue="jobs"):
    answer = await api.post(f"/api/queues/{queue}/items", json={"payload": payload}, headers=bearer(token))
    assert answer.status_code == 201, answer.text
    return answer.json()


async def claim(api, token, **body):
    answer = await api.post("/api/queues/jobs/claim", json=body, headers=bearer(token))
    assert answer.status_code == 200, answer.text
    return answer.json()["items"]


async def test_post_one_item_answers_the_pending_item_and_stores_it(api, queues, tokens):
    answer = await api.post("/api/queues/jobs/items", json={"payload": {"n": 1}}, headers=bearer(tokens["all"]))

    assert answer.status_code == 201
    assert answer.headers["content-type"] == "application/json"
    item = answer.json()
    assert set(item) == ITEM_KEYS
    assert ids.is_valid_id(item["id"])
    assert (item["queue"], item["status"], item["attempts"]) == ("jobs", "pending", 0)
    assert ISO.fullmatch(item["postedAt"])
    assert item["claimedAt"] is item["leaseExpiresAt"] is item["finishedAt"] is None
    assert f"jobs/pending/{item['id']}.json" in disk_snapshot()


async def test_post_a_batch_answers_every_item_in_posting_order(api, queues, tokens):
    body = {"items": [{"payload": n} for n in range(5)]}
    answer = await api.post("/api/queues/jobs/items", json=body, headers=bearer(tokens["producer"]))

    assert answer.status_code == 201
    items = answer.json()["items"]
    assert [set(i) for i in items] == [ITEM_KEYS] * 5
    posted = [i["id"] for i in items]
    assert posted == sorted(posted) and len(set(posted)) == 5
    assert {f"jobs/pending/{i}.json" for i in posted} <= set(disk_snapshot())


async def test_read_item_shows_the_payload_only_when_asked(api, queues, tokens):
    item = await post(api, tokens["all"], {"photo": 7})

    plain = await api.get(f"/api/queues/jobs/items/{item['id']}", headers=bearer(tokens["producer"]))
    with_payload = await api.get(f"/api/queues/jobs/items/{item['id']}?payload=1", headers=bearer(tokens["all"]))

    assert plain.status_code == with_payload.status_code == 200
    assert plain.json() == item
    assert with_payload.json() == {**item, "payload": {"photo": 7}}


async def test_a_first_claim_finds_what_another_process_posted(api, queues, tokens):
    other = Store(get_store().data_dir, fsync=False)  # as another process: this one never saw them
    posted = post_batch(other, "jobs", [1, 2])

    claimed = await claim(api, tokens["worker"], max=5)

    assert [c["id"] for c in claimed] == [item.id for item in posted]


async def test_claim_hands_out_items_oldest_first_with_payloads_and_a_lease(api, queues, tokens):
    first = await post(api, tokens["all"], "a")
    second = await post(api, tokens["all"], "b")

    claimed = await claim(api, tokens["worker"], max=5)

    assert [c["id"] for c in claimed] == [first["id"], second["id"]]
    one = claimed[0]
    assert set(one) == ITEM_KEYS | {"payload", "maxAttempts"}
    assert (one["status"], one["attempts"], one["payload"]) == ("processing", 1, "a")
    assert ISO.fullmatch(one["claimedAt"]) and ISO.fullmatch(one["leaseExpiresAt"])
    lease = ids.parse_iso(one["leaseExpiresAt"]) - ids.parse_iso(one["claimedAt"])
    assert lease == pytest.approx(60, abs=0.01)  # the queue's default leaseSeconds
    assert await claim(api, tokens["worker"]) == []


async def test_a_claim_request_cancelled_midway_gives_its_items_back(api, queues, tokens, monkeypatch):
    """A big claim goes on in a store thread after its first items; a cancellation of the
    request meanwhile leaves no item claimed for nobody: they are given back, pending again."""
    posted = post_batch(get_store(), "jobs", list(range(20)))
    in_thread, go_on = threading.Event(), threading.Event()
    claim_items = Store.claim_items

    @functools.wraps(claim_items)
    def claim_waiting_in_the_thread(store, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            in_thread.set()
            go_on.wait(30)
        return claim_items(store, **kwargs)

    monkeypatch.setattr(Store, "claim_items", claim_waiting_in_the_thread)
    request = asyncio.ensure_future(
        api.post("/api/queues/jobs/claim", json={"max": 20}, headers=bearer(tokens["worker"]))
    )
    for _ in range(3000):  # until the claim's rest runs in a store thread
        if in_thread.is_set():
            break
        await asyncio.sleep(0.01)
    assert in_thread.is_set(), "the claim never went on in a store thread"
    request.cancel()
    go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await request
    for _ in range(3000):  # the give-back runs on this loop once the claim ends: let it
        if get_store().count_items(queue="jobs").pending == 20:
            break
        await asyncio.sleep(0.01)

    assert get_store().count_items(queue="jobs").pending == 20
    again = await claim(api, tokens["worker"], max=20)
    assert sorted(c["id"] for c in again) == sorted(item.id for item in posted)


async def test_claim_takes_an_empty_body_as_the_defaults(api, queues, tokens):
    await post(api, tokens["all"], 1)
    await post(api, tokens["all"], 2)

    answer = await api.post("/api/queues/jobs/claim", headers=bearer(tokens["worker"]))

    assert answer.status_code == 200
    assert len(answer.json()["items"]) == 1


async def test_claim_takes_a_max_written_as_a_whole_float(api, queues, tokens):
    for n in range(3):
        await post(api, tokens["all"], n)

    answer = await api.post("/api/queues/jobs/claim", content=b'{"max": 2.0}', headers=bearer(tokens["worker"]))

    assert answer.status_code == 200
    assert len(answer.json()["items"]) == 2


async def test_claim_on_a_paused_queue_hands_out_nothing(api, queues, tokens):
    await post(api, tokens["all"], 1)
    await asave_queue("jobs", paused=True)
    get_registry().invalidate()

    assert await claim(api, tokens["worker"]) == []


async def test_first_result_wins_and_a_later_one_is_refused(api, queues, tokens):
    item = await post(api, tokens["all"], "x")
    await claim(api, tokens["worker"])
    url = f"/api/queues/jobs/items/{item['id']}/result"

    first = await api.post(url, json={"result": {"ok": True}}, headers=bearer(tokens["worker"]))
    second = await api.post(url, json={"result": "late"}, headers=bearer(tokens["worker"]))

    assert first.status_code == second.status_code == 200
    assert first.json() == {"id": item["id"], "accepted": True, "status": "finished"}
    assert second.json() == {"id": item["id"], "accepted": False, "status": "finished"}
    done = (await api.get(f"/api/queues/jobs/items/{item['id']}", headers=bearer(tokens["all"]))).json()
    assert (done["status"], done["result"]) == ("finished", {"ok": True})
    assert ISO.fullmatch(done["finishedAt"]) and done["leaseExpiresAt"] is None


async def test_a_result_for_a_pending_item_is_accepted(api, queues, tokens):
    item = await post(api, tokens["all"], "x")

    answer = await api.post(
        f"/api/queues/jobs/items/{item['id']}/result", json={"result": None}, headers=bearer(tokens["worker"])
    )

    assert answer.json() == {"id": item["id"], "accepted": True, "status": "finished"}


async def test_a_result_for_an_aged_item_fails_it_with_timeout(api, queues, tokens):
    await asave_queue("short", queue_seconds=1)
    get_registry().invalidate()
    earlier = Store(get_store().data_dir, fsync=False, clock=lambda: time.time() - 5)
    old_id = post_batch(earlier, "short", [1])[0].id  # posted five seconds ago

    answer = await api.post(
        f"/api/queues/short/items/{old_id}/result", json={"result": 1}, headers=bearer(tokens["worker"])
    )

    assert answer.json() == {"id": old_id, "accepted": False, "status": "failed"}
    failed = (await api.get(f"/api/queues/short/items/{old_id}", headers=bearer(tokens["all"]))).json()
    assert (failed["status"], failed["error"]) == ("failed", "timeout")
    assert "result" not in failed


async def test_extend_sets_the_lease_from_now(api, queues, tokens):
    item = await post(api, tokens["all"], "x")
    await claim(api, tokens["worker"])

    before = time.time()
    answer = await api.post(
        f"/api/queues/jobs/items/{item['id']}/extend", json={"seconds": 600}, headers=bearer(tokens["worker"])
    )

    assert answer.status_code == 200
    extended = answer.json()
    assert set(extended) == ITEM_KEYS and extended["status"] == "processing"
    assert before + 600 - 0.01 <= ids.parse_iso(extended["leaseExpiresAt"]) <= time.time() + 600 + 0.01


async def test_queue_stats_show_settings_and_counts(api, queues, tokens):
    for n in range(3):
        await post(api, tokens["all"], n)
    claimed = await claim(api, tokens["worker"])
    await api.post(
        f"/api/queues/jobs/items/{claimed[0]['id']}/result", json={"result": 1}, headers=bearer(tokens["worker"])
    )
    await claim(api, tokens["worker"])

    answer = await api.get("/api/queues/jobs", headers=bearer(tokens["producer"]))

    assert answer.status_code == 200
    stats = answer.json()
    age = stats.pop("oldestPendingAgeSeconds")
    assert stats == {
        "name": "jobs",
        "leaseSeconds": 60,
        "queueSeconds": 86400,
        "retainSeconds": 3600,
        "retainFrom": "finished",
        "paused": False,
        "maxAttempts": None,
        "counts": {"scheduled": 0, "pending": 1, "processing": 1, "finished": 1, "failed": 0},
    }
    assert 0 <= age < 60


async def test_queue_stats_of_an_empty_queue_have_no_oldest_age(api, queues, tokens):
    stats = (await api.get("/api/queues/other", headers=bearer(tokens["all"]))).json()

    assert stats["counts"] == {"scheduled": 0, "pending": 0, "processing": 0, "finished": 0, "failed": 0}
    assert stats["oldestPendingAgeSeconds"] is None


async def test_queue_list_shows_only_the_queues_the_token_may_see(api, queues, tokens):
    every = await api.get("/api/queues", headers=bearer(tokens["producer"]))
    scoped = await api.get("/api/queues", headers=bearer(tokens["other_only"]))

    assert every.status_code == scoped.status_code == 200
    assert [q["name"] for q in every.json()["queues"]] == ["jobs", "other"]
    assert [q["name"] for q in scoped.json()["queues"]] == ["other"]
    assert set(scoped.json()["queues"][0]) == {
        "name", "leaseSeconds", "queueSeconds", "retainSeconds", "retainFrom", "paused", "maxAttempts", "counts",
        "oldestPendingAgeSeconds",
    }


async def test_first_terminal_answer_counts_as_the_fetch_for_retention(api, queues, tokens):
    await asave_queue("jobs", retain_from="fetched", retain_seconds=0)
    get_registry().invalidate()
    config = QueueConfig(name="jobs", retain_seconds=0, retain_from="fetched")
    item = await post(api, tokens["all"], "x")
    await api.post(f"/api/queues/jobs/items/{item['id']}/result", json={"result": 1}, headers=bearer(tokens["all"]))
    store = get_store()

    assert store.sweep_queue(config=config).deleted == []  # never fetched: kept
    shown = await api.get(f"/api/queues/jobs/items/{item['id']}", headers=bearer(tokens["all"]))

    assert shown.json()["status"] == "finished"
    assert store.sweep_queue(config=config).deleted == [item["id"]]


async def test_health_is_ok_when_database_and_data_directory_work(api, transactional_db):
    answer = await api.get("/healthz")

    assert (answer.status_code, answer.json()) == (200, {"ok": True})


async def test_health_is_503_when_the_data_directory_cannot_be_written(api, transactional_db, settings, tmp_path):
    (tmp_path / "a-file").write_text("")
    settings.TASKHOSTER_DATA_DIR = tmp_path / "a-file" / "data"
    get_store.cache_clear()

    answer = await api.get("/healthz")

    assert answer.status_code == 503
    assert answer.json() == {"error": "storage_unavailable", "message": "the data directory does not take a write",
                             "ok": False, "database": True, "dataDirectory": False, "storeThread": True}


async def test_health_is_503_when_the_database_does_not_answer(api, transactional_db, monkeypatch):
    def refuse(self):
        raise OperationalError("the database is down")

    monkeypatch.setattr(BaseDatabaseWrapper, "ensure_connection", refuse)

    answer = await api.get("/healthz")

    assert answer.status_code == 503
    assert answer.json() == {"error": "storage_unavailable", "message": "the database does not answer",
                             "ok": False, "database": False, "dataDirectory": True, "storeThread": True}


MESSAGES = {"storeThread": "the store's threads do not take a call",
            "dataDirectory": "the data directory does not take a write"}


@pytest.mark.parametrize("stuck", ["storeThread", "dataDirectory"])
async def test_health_is_503_while_a_check_hangs(api, transactional_db, monkeypatch, stuck):
    """Big batches wait for a store thread, and the directory check for the disk: when either
    hangs (disk calls that never return), /healthz says so within its timeout, rather than
    answer 200 while batches hang, or hang itself."""
    monkeypatch.setattr(handlers, "HEALTH_TIMEOUT_SECONDS", 1.0)
    release = threading.Event()
    held = None
    if stuck == "storeThread":  # every one of the process's store threads is taken

        def post_items(items):
            release.wait()  # as a flush that never returns

        batch = [None] * (runtime.ITEMS_ON_LOOP + 1)
        held = asyncio.gather(*(run(post_items, items=batch) for _ in range(runtime.STORE_THREADS)))
    else:
        check_health = Store.check_health

        @functools.wraps(check_health)  # its name, so it runs where the real one does
        def hanging_check_health(store):
            return release.wait() and check_health(store)

        monkeypatch.setattr(Store, "check_health", hanging_check_health)
    try:
        answer = await asyncio.wait_for(api.get("/healthz"), 30)  # not forever: a hang fails the test

        assert answer.status_code == 503
        assert answer.json() == {"ok": False, "database": True, "dataDirectory": True, "storeThread": True, stuck: False,
                                 "error": "storage_unavailable", "message": MESSAGES[stuck]}
    finally:
        release.set()
        if held is not None:
            await held

    answer = await api.get("/healthz")

    assert (answer.status_code, answer.json()) == (200, {"ok": True})


async def test_a_payload_nested_to_the_limit_is_taken(api, queues, tokens):
    value = "deep"
    for _ in range(127):  # the body {"payload": ...} adds the 128th level
        value = [value]

    item = await post(api, tokens["all"], value)

    claimed = await claim(api, tokens["worker"])
    assert claimed[0]["id"] == item["id"] and claimed[0]["payload"] == value


@pytest.mark.parametrize("count", [2, runtime.ITEMS_ON_LOOP + 1])  # on the loop, in a store thread
async def test_a_post_begun_is_finished_even_if_its_caller_is_cancelled(queues, monkeypatch, count):
    """A transition runs to its end: a caller cancelled meanwhile (its client went away) leaves
    no half-done batch."""
    store = get_store()
    gate = Future()
    real_post = store.post_items

    @functools.wraps(real_post)  # its name, so it runs where the real one does
    def slow_post(**kwargs):
        turn.wait_for(gate)  # the caller is cancelled while this waits (as for a lock)
        return real_post(**kwargs)

    monkeypatch.setattr(store, "post_items", slow_post)
    items = [NewItem(n) for n in range(count)]
    posting = asyncio.ensure_future(run(store.post_items, config=QueueConfig(name="jobs"), items=items))
    await asyncio.sleep(0.2)
    assert not posting.done()
    posting.cancel()
    gate.set_result(None)
    queue_dir = store.data_dir / "jobs"
    for _ in range(200):
        if len(os.listdir(queue_dir / "pending")) == count:
            break
        await asyncio.sleep(0.025)
    assert len(os.listdir(queue_dir / "pending")) == count
    assert os.listdir(queue_dir / "tmp") == []
    with pytest.raises(asyncio.CancelledError):
        await posting


@pytest.mark.parametrize("removed", ["jobs/pending", "jobs/tmp", "jobs/done", "jobs", "."])
async def test_a_state_directory_removed_while_serving_is_made_again_and_posts_go_on(api, queues, tokens, removed):
    first = await post(api, tokens["all"], "before")
    claimed = await claim(api, tokens["worker"])  # in processing/, out of the way
    shutil.rmtree(get_store().data_dir / removed)
    if removed in ("jobs", "."):  # the item a worker held went with it: nothing left to hand in
        first, claimed = None, []

    second = await post(api, tokens["all"], "after")
    claimed += await claim(api, tokens["worker"], max=5)
    for item in claimed:
        answer = await api.post(f"/api/queues/jobs/items/{item['id']}/result", json={"result": 1}, headers=bearer(tokens["all"]))
        assert answer.json()["accepted"]

    assert {item["id"] for item in claimed} == {item["id"] for item in (first, second) if item}
    assert (await api.get("/healthz")).status_code == 200


async def test_health_is_503_when_the_data_directory_cannot_take_a_real_write(api, transactional_db, faults):
    faults.fail(calls={"write"}, where="/.healthz-", error=errno.ENOSPC)

    answer = await api.get("/healthz")

    assert answer.status_code == 503
    assert answer.json()["dataDirectory"] is False


async def test_health_and_posts_are_503_below_the_free_space_reserve(api, queues, tokens, settings):
    settings.TASKHOSTER_MIN_FREE_BYTES = 1 << 62  # more than any disk has free
    get_store.cache_clear()

    health = await api.get("/healthz")
    posted = await api.post("/api/queues/jobs/items", json={"payload": 1}, headers=bearer(tokens["all"]))

    assert health.status_code == 503 and "nearly full" in health.json()["message"]
    assert (posted.status_code, posted.json()["error"]) == (503, "storage_unavailable")
    assert "TASKHOSTER_MIN_FREE_BYTES" in posted.json()["message"]
