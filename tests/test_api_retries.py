"""Beyond the seed over HTTP: scheduled posts, release with a delay and an error, maxAttempts,
retry and cancel, and every bad input answered 400 with nothing stored."""

import time
from datetime import datetime, timedelta, timezone

import pytest
from asgiref.sync import sync_to_async

from api_support import api, bearer, disk_snapshot, queues, tokens  # noqa: F401  (fixtures)
from queues import ids
from queues.runtime import get_registry, get_store
from queues.services import save_queue

pytestmark = pytest.mark.django_db(transaction=True)
asave_queue = sync_to_async(save_queue)


async def call(api, token, method, path, body=None, status=200):
    answer = await api.request(method, f"/api/queues/jobs{path}", json=body, headers=bearer(token))
    assert answer.status_code == status, answer.text
    return answer.json()


async def claimed(api, token):
    (item,) = (await call(api, token, "POST", "/claim", {}))["items"]
    return item


def iso_in(seconds: float, offset_hours: int = 0) -> str:
    zone = timezone(timedelta(hours=offset_hours))
    return (datetime.now(timezone.utc) + timedelta(seconds=seconds)).astimezone(zone).isoformat()


# ---- scheduled posts -------------------------------------------------------------------------


async def test_a_post_with_a_delay_is_scheduled_and_shows_its_run_at(api, queues, tokens):
    before = time.time()
    item = await call(api, tokens["all"], "POST", "/items", {"payload": 1, "delay": 30}, status=201)
    assert item["status"] == "scheduled"
    run_at = datetime.fromisoformat(item["runAt"]).timestamp()
    assert before + 30 <= run_at + 0.001 <= time.time() + 30.002
    assert (await call(api, tokens["all"], "POST", "/claim", {}))["items"] == []  # never claimed early
    stats = await call(api, tokens["all"], "GET", "")
    assert stats["counts"]["scheduled"] == 1


async def test_a_run_at_with_any_offset_is_that_instant(api, queues, tokens):
    wanted = iso_in(60, offset_hours=5)
    item = await call(api, tokens["all"], "POST", "/items", {"payload": 1, "runAt": wanted}, status=201)
    assert abs(datetime.fromisoformat(item["runAt"]).timestamp() - datetime.fromisoformat(wanted).timestamp()) < 0.001
    assert item["runAt"].endswith("Z")


async def test_a_batch_may_schedule_each_item(api, queues, tokens):
    answer = await call(api, tokens["all"], "POST", "/items", {"items": [
        {"payload": 1}, {"payload": 2, "delay": 60}, {"payload": 3, "runAt": iso_in(-60)},
    ]}, status=201)
    assert [item["status"] for item in answer["items"]] == ["pending", "scheduled", "pending"]


@pytest.mark.parametrize("beside", [{"delay": 60}, {"runAt": "2026-12-01T10:00:00Z"}, {"key": "k1"}, {"payload": 1}],
                         ids=["delay", "runAt", "key", "payload"])
async def test_a_batch_with_an_item_field_beside_its_items_is_400_and_stores_nothing(api, queues, tokens, beside):
    """Taken for the whole batch, such a field would be silently dropped: refused instead."""
    before = disk_snapshot()
    answer = await api.post("/api/queues/jobs/items", json={"items": [{"payload": 0}], **beside}, headers=bearer(tokens["all"]))
    assert (answer.status_code, answer.json()["error"]) == (400, "invalid_request")
    assert disk_snapshot() == before


async def test_a_scheduled_item_comes_due_and_is_claimed(api, queues, tokens):
    item = await call(api, tokens["all"], "POST", "/items", {"payload": 1, "delay": 0.5}, status=201)
    await sync_to_async(time.sleep)(0.6)
    get_store().promote_due(config=get_registry().queue("jobs"))  # the promoter does this in a server
    assert (await claimed(api, tokens["worker"]))["id"] == item["id"]


BAD_SCHEDULES = [
    {"delay": -1}, {"delay": 30 * 86400 + 1}, {"delay": "5"}, {"delay": True}, {"delay": None},
    {"runAt": "2026-12-01T10:00:00"}, {"runAt": "tomorrow"}, {"runAt": 1796000000}, {"runAt": ""},
    {"delay": 5, "runAt": "2026-12-01T10:00:00Z"},
]


@pytest.mark.parametrize("bad", BAD_SCHEDULES + ["past the queue timeout"], ids=str)
async def test_a_bad_schedule_is_400_and_stores_nothing(api, queues, tokens, bad):
    await asave_queue("jobs", queue_seconds=3600)
    get_registry().invalidate()
    if bad == "past the queue timeout":
        bad = {"runAt": iso_in(3601)}
    before = disk_snapshot()
    for body in ({"payload": 1, **bad}, {"items": [{"payload": 0}, {"payload": 1, **bad}]}):
        answer = await api.post("/api/queues/jobs/items", json=body, headers=bearer(tokens["all"]))
        assert (answer.status_code, answer.json()["error"]) == (400, "invalid_request"), (body, answer.text)
    assert disk_snapshot() == before


# ---- release -----------------------------------------------------------------------------------


async def test_a_release_over_http_keeps_its_error_and_may_wait(api, queues, tokens):
    await call(api, tokens["all"], "POST", "/items", {"payload": 1}, status=201)
    item = await claimed(api, tokens["worker"])
    error = {"error": {"type": "Flaky", "message": "try later"}}
    back = await call(api, tokens["worker"], "POST", f"/items/{item['id']}/release", {"delay": 60, "error": error})
    assert (back["status"], back["lastError"]) == ("scheduled", error)
    read = await call(api, tokens["all"], "GET", f"/items/{item['id']}")
    assert (read["status"], read["lastError"], read["attempts"]) == ("scheduled", error, 1)
    assert "runAt" in read


async def test_a_release_without_a_body_puts_the_item_back_now(api, queues, tokens):
    await call(api, tokens["all"], "POST", "/items", {"payload": 1}, status=201)
    item = await claimed(api, tokens["worker"])
    answer = await api.post(f"/api/queues/jobs/items/{item['id']}/release", headers=bearer(tokens["worker"]))
    assert (answer.status_code, answer.json()["status"]) == (200, "pending")
    again = await claimed(api, tokens["worker"])
    assert (again["id"], again["attempts"], "lastError" in again) == (item["id"], 2, False)


@pytest.mark.parametrize("body", [{"delay": -1}, {"delay": 86401}, {"delay": "1"}, {"extra": 1}, [], "x"], ids=str)
async def test_a_bad_release_is_400_and_changes_nothing(api, queues, tokens, body):
    await call(api, tokens["all"], "POST", "/items", {"payload": 1}, status=201)
    item = await claimed(api, tokens["worker"])
    answer = await api.post(f"/api/queues/jobs/items/{item['id']}/release", json=body, headers=bearer(tokens["worker"]))
    assert answer.status_code == 400
    assert (await call(api, tokens["all"], "GET", f"/items/{item['id']}"))["status"] == "processing"


async def test_a_release_of_an_item_not_processing_is_not_held_and_an_unknown_one_not_found(api, queues, tokens):
    item = await call(api, tokens["all"], "POST", "/items", {"payload": 1}, status=201)
    answer = await call(api, tokens["worker"], "POST", f"/items/{item['id']}/release", {}, status=409)
    assert answer["error"] == "not_held"
    absent = ids.IdMaker().new_ids(1, time.time())[0]
    assert (await call(api, tokens["worker"], "POST", f"/items/{absent}/release", {}, status=404))["error"] == "not_found"
    await call(api, tokens["producer"], "POST", f"/items/{item['id']}/release", {}, status=403)


# ---- maxAttempts ---------------------------------------------------------------------------------


async def test_claims_report_max_attempts_and_the_last_try_ends_the_item(api, queues, tokens):
    await asave_queue("jobs", max_attempts=2)
    get_registry().invalidate()
    assert (await call(api, tokens["all"], "GET", ""))["maxAttempts"] == 2
    await call(api, tokens["all"], "POST", "/items", {"payload": 1}, status=201)
    for attempt in (1, 2):
        item = await claimed(api, tokens["worker"])
        assert (item["attempts"], item["maxAttempts"]) == (attempt, 2)
        back = await call(api, tokens["worker"], "POST", f"/items/{item['id']}/release", {"error": f"no {attempt}"})
    assert (back["status"], back["error"], back["lastError"]) == ("failed", "max_attempts", "no 2")
    assert (await call(api, tokens["all"], "GET", ""))["counts"]["failed"] == 1


# ---- retry ---------------------------------------------------------------------------------------


async def test_a_retry_answers_the_new_item_and_the_same_one_asked_again(api, queues, tokens):
    old = await call(api, tokens["all"], "POST", "/items", {"payload": {"n": 7}}, status=201)
    item = await claimed(api, tokens["worker"])
    await call(api, tokens["worker"], "POST", f"/items/{item['id']}/result", {"result": "r"})
    new = await call(api, tokens["producer"], "POST", f"/items/{old['id']}/retry", {}, status=201)
    assert (new["status"], new["retryOf"]) == ("pending", old["id"])
    again = await call(api, tokens["producer"], "POST", f"/items/{old['id']}/retry", {}, status=200)
    assert again["id"] == new["id"]
    shown = await call(api, tokens["all"], "GET", f"/items/{old['id']}")
    assert (shown["retriedAs"], shown["result"]) == (new["id"], "r")
    assert (await claimed(api, tokens["worker"]))["payload"] == {"n": 7}


async def test_a_retry_of_an_item_that_has_not_ended_is_409(api, queues, tokens):
    item = await call(api, tokens["all"], "POST", "/items", {"payload": 1}, status=201)
    before = disk_snapshot()
    answer = await call(api, tokens["producer"], "POST", f"/items/{item['id']}/retry", {}, status=409)
    assert answer["error"] == "not_ended"
    assert disk_snapshot() == before
    await call(api, tokens["worker"], "POST", f"/items/{item['id']}/retry", {}, status=403)


# ---- cancel --------------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["scheduled", "pending", "processing"])
async def test_a_cancel_ends_the_item_and_refuses_later_results(api, queues, tokens, state):
    body = {"payload": 1, "delay": 60} if state == "scheduled" else {"payload": 1}
    item = await call(api, tokens["all"], "POST", "/items", body, status=201)
    if state == "processing":
        await claimed(api, tokens["worker"])
    answer = await call(api, tokens["producer"], "POST", f"/items/{item['id']}/cancel", {})
    assert (answer["status"], answer["error"], answer["canceled"]) == ("failed", "canceled", True)
    late = await call(api, tokens["worker"], "POST", f"/items/{item['id']}/result", {"result": 1})
    assert (late["accepted"], late["status"]) == (False, "failed")
    again = await call(api, tokens["producer"], "POST", f"/items/{item['id']}/cancel", {})
    assert (again["canceled"], again["error"]) == (False, "canceled")


async def test_a_cancel_of_an_unknown_item_is_404(api, queues, tokens):
    absent = ids.IdMaker().new_ids(1, time.time())[0]
    assert (await call(api, tokens["producer"], "POST", f"/items/{absent}/cancel", {}, status=404))["error"] == "not_found"
    assert (await call(api, tokens["producer"], "POST", f"/items/{absent}/retry", {}, status=404))["error"] == "not_found"
