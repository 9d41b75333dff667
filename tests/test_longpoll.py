"""Waiting calls: a read with `wait` answers as soon as the item turns terminal, a claim with
`wait` as soon as an item comes; neither busy-loops the disk, and a claim whose client left hands
its items back."""

import asyncio
import json
import time

import pytest

from api_support import api, bearer, queues, tokens  # noqa: F401  (fixtures)
from queues.api import application, handlers
from queues.events import hub
from queues.models import ApiToken
from queues.runtime import get_registry, get_store
from queues.services import save_queue
from storekit import finish

pytestmark = pytest.mark.django_db(transaction=True)


async def post(api, token) -> str:
    answer = await api.post("/api/queues/jobs/items", json={"payload": "x"}, headers=bearer(token))
    return answer.json()["id"]


def request_that_leaves(token: str, method: str, path: str, *, query: bytes = b"", body: bytes = b""):
    """A request straight to the ASGI app whose client goes away once `left` is set: the task
    answering it, `left`, and the messages it was sent."""
    left, sent = asyncio.Event(), []
    requests = iter([{"type": "http.request", "body": body, "more_body": False}])

    async def receive():
        try:
            return next(requests)
        except StopIteration:
            await left.wait()
            return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "query_string": query,
             "headers": [(b"authorization", f"Bearer {token}".encode())]}
    return asyncio.create_task(application(scope, receive, send)), left, sent


async def hand_in(api, token, item_id, result):
    return await api.post(f"/api/queues/jobs/items/{item_id}/result", json={"result": result}, headers=bearer(token))


async def wait_until_waiting(task: asyncio.Task, seconds: float = 0.3) -> None:
    await asyncio.sleep(seconds)
    assert not task.done(), "the call answered before anything happened"


@pytest.fixture
def rare_rereads(monkeypatch):
    """Re-reads far apart, so only the in-process wake-up can answer within a second."""
    monkeypatch.setattr(handlers, "RECHECK_SECONDS", 30.0)


async def test_a_waiting_read_answers_within_a_second_of_the_result(api, queues, tokens, rare_rereads):
    item_id = await post(api, tokens["all"])
    reading = asyncio.create_task(api.get(f"/api/queues/jobs/items/{item_id}?wait=10", headers=bearer(tokens["all"])))
    await wait_until_waiting(reading)

    handed_in = time.monotonic()
    await hand_in(api, tokens["all"], item_id, {"done": 1})
    answer = await reading

    assert time.monotonic() - handed_in < 1.0
    assert answer.status_code == 200
    assert (answer.json()["status"], answer.json()["result"]) == ("finished", {"done": 1})


async def test_a_result_that_lands_while_the_read_looks_at_the_disk_still_wakes_it(
    api, queues, tokens, rare_rereads, monkeypatch
):
    item_id = await post(api, tokens["all"])
    store = get_store()
    real_read = store.read_item
    handed_in = []

    def read_then_result(**kwargs):  # the result comes after the read, before the wait
        item = real_read(**kwargs)
        if not handed_in:
            handed_in.append(finish(store, get_registry().queue("jobs"), item_id, 2))
            hub.items_terminal("jobs", [item_id])
        return item

    monkeypatch.setattr(store, "read_item", read_then_result)
    answer = await asyncio.wait_for(
        api.get(f"/api/queues/jobs/items/{item_id}?wait=20", headers=bearer(tokens["all"])), timeout=5
    )
    assert (answer.json()["status"], answer.json()["result"]) == ("finished", 2)


async def test_a_waiting_read_sees_a_result_from_another_process_by_re_reading(api, queues, tokens):
    item_id = await post(api, tokens["all"])
    reading = asyncio.create_task(api.get(f"/api/queues/jobs/items/{item_id}?wait=10", headers=bearer(tokens["all"])))
    await wait_until_waiting(reading)

    handed_in = time.monotonic()
    config = get_registry().queue("jobs")
    finish(get_store(), config, item_id, 2)  # no wake-up: as another process would
    answer = await reading

    assert time.monotonic() - handed_in < 3.0  # the re-read comes once a second, long before wait=10 ends
    assert answer.json()["status"] == "finished"


async def test_a_waiting_read_answers_the_pending_item_when_the_wait_ends(api, queues, tokens, monkeypatch):
    item_id = await post(api, tokens["all"])
    store = get_store()
    reads = []
    real_read = store.read_item

    def counted_read(**kwargs):
        reads.append(time.monotonic())
        return real_read(**kwargs)

    monkeypatch.setattr(store, "read_item", counted_read)

    started = time.monotonic()
    answer = await api.get(f"/api/queues/jobs/items/{item_id}?wait=1.5", headers=bearer(tokens["all"]))

    assert time.monotonic() - started >= 1.5
    assert (answer.status_code, answer.json()["status"]) == (200, "pending")
    assert 2 <= len(reads) <= 4  # one read, then about one a second: no busy loop


async def test_a_waiting_read_of_a_terminal_item_answers_at_once(api, queues, tokens):
    item_id = await post(api, tokens["all"])
    await hand_in(api, tokens["all"], item_id, 1)

    started = time.monotonic()
    answer = await api.get(f"/api/queues/jobs/items/{item_id}?wait=30", headers=bearer(tokens["all"]))

    assert time.monotonic() - started < 1.0
    assert answer.json()["status"] == "finished"


async def test_a_waiting_claim_answers_within_a_second_of_a_post(api, queues, tokens, rare_rereads):
    claiming = asyncio.create_task(
        api.post("/api/queues/jobs/claim", json={"max": 3, "wait": 10}, headers=bearer(tokens["all"]))
    )
    await wait_until_waiting(claiming)

    posted_at = time.monotonic()
    item_id = await post(api, tokens["all"])
    answer = await claiming

    assert time.monotonic() - posted_at < 1.0
    assert [i["id"] for i in answer.json()["items"]] == [item_id]


async def test_a_post_that_lands_while_the_claim_looks_at_the_disk_still_wakes_it(
    api, queues, tokens, rare_rereads, post_lands_mid_claim
):
    answer = await asyncio.wait_for(
        api.post("/api/queues/jobs/claim", json={"wait": 20}, headers=bearer(tokens["all"])), timeout=5
    )
    assert [i["id"] for i in answer.json()["items"]] == post_lands_mid_claim


async def test_a_waiting_claim_answers_no_items_when_the_wait_ends(api, queues, tokens):
    started = time.monotonic()
    answer = await api.post("/api/queues/jobs/claim", json={"wait": 1.2}, headers=bearer(tokens["all"]))

    assert time.monotonic() - started >= 1.2
    assert (answer.status_code, answer.json()) == (200, {"items": []})


async def test_a_claim_whose_client_left_stops_waiting_and_claims_nothing(api, queues, tokens):
    """The client goes away while its claim waits: the claim stops waiting there and then (its
    place among the waiters goes, so the next wake-up is for a claim still waiting), and an item
    posted then is left for the next claimant, no try spent on it."""
    await asyncio.to_thread(save_queue, "jobs", max_attempts=1)
    get_registry().invalidate()
    claiming, left, sent = request_that_leaves(tokens["all"], "POST", "/api/queues/jobs/claim",
                                               body=json.dumps({"wait": 60}).encode())
    while not hub._claim_waiters.get("jobs"):  # waiting for an item
        await asyncio.sleep(0.01)
    left.set()
    await asyncio.sleep(0.05)  # the server notices the client left
    assert not hub._claim_waiters.get("jobs")
    item_id = await post(api, tokens["all"])  # woke the claim of a client that was gone, before
    await asyncio.wait_for(claiming, 10)

    assert json.loads(sent[-1]["body"]) == {"items": []}
    item = get_store().read_item(queue="jobs", item_id=item_id)
    assert (item.status, item.attempts) == ("pending", 0)  # never claimed


async def test_a_waiting_claim_stops_once_its_token_is_revoked(api, queues, tokens):
    claiming = asyncio.create_task(api.post("/api/queues/jobs/claim", json={"wait": 10}, headers=bearer(tokens["all"])))
    await asyncio.sleep(0.2)  # waiting for an item
    await ApiToken.objects.filter(name="all").adelete()
    get_registry().invalidate()  # as the admin's own process does; the others within a second
    item_id = await post(api, tokens["producer"])  # wakes the claim
    answer = await asyncio.wait_for(claiming, 10)
    assert (answer.status_code, answer.json()["error"]) == (401, "unauthorized")
    item = get_store().read_item(queue="jobs", item_id=item_id)
    assert (item.status, item.attempts) == ("pending", 0)


async def test_a_read_whose_client_left_stops_waiting_there_and_then(api, queues, tokens):
    item_id = await post(api, tokens["all"])
    reading, left, _ = request_that_leaves(tokens["all"], "GET", f"/api/queues/jobs/items/{item_id}", query=b"wait=60")
    while not hub._item_waiters.get(("jobs", item_id)):  # waiting for the item to end
        await asyncio.sleep(0.01)
    left.set()
    await asyncio.sleep(0.05)  # the server notices the client left
    assert not hub._item_waiters.get(("jobs", item_id))
    await asyncio.wait_for(reading, 10)


async def test_a_reader_who_left_a_waiting_read_never_counts_as_the_fetch(api, queues, tokens):
    """Under retainFrom fetched, the fetch starts the clock of the item's deletion: a read whose
    client left before the item ended must not start it, or the result could go unseen."""
    await asyncio.to_thread(save_queue, "jobs", retain_from="fetched", retain_seconds=0)
    get_registry().invalidate()
    item_id = await post(api, tokens["all"])
    reading, left, _ = request_that_leaves(tokens["all"], "GET", f"/api/queues/jobs/items/{item_id}", query=b"wait=10")
    await asyncio.sleep(0.2)  # waiting for the item to end
    left.set()
    await asyncio.sleep(0.05)
    store = get_store()
    config = get_registry().queue("jobs")
    [claimed] = await asyncio.to_thread(store.claim_items, config=config)
    assert (await asyncio.to_thread(finish, store, config, claimed.id, "seen by no one")).accepted
    await asyncio.wait_for(reading, 10)

    assert (await asyncio.to_thread(store.sweep_queue, config=config)).deleted == []
    assert store.read_item(queue="jobs", item_id=item_id).result == "seen by no one"
