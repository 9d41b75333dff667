"""A request cut by a stop (the grace is over, a second signal came, or daphne cancels at once)
after its change began is answered with what the change did, not 503 `busy` ("try again"): the
change runs on to its end anyway, and a post sent again on a 503 would make a second item. One
cut before its change began is still answered `busy`, and nothing is done."""

import asyncio
import json
import threading

import pytest

from api_support import FedRequest, bearer, queues, tokens  # noqa: F401  (fixtures)
from queues import runtime
from queues.api import handlers
from queues.runtime import get_store
from queues.store import files
from taskhoster_site.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)

WAIT_SECONDS = 10.0  # generous: only ever waited out when a test is about to fail
BATCH = runtime.ITEMS_ON_LOOP + 1  # a batch this big is written in a store thread


def post_request(token: str, body: bytes, *, send_body: bool = True) -> FedRequest:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in bearer(token).items())]
    scope = {"type": "http", "method": "POST", "path": "/api/queues/jobs/items", "headers": headers,
             "query_string": b"", "http_version": "1.1", "scheme": "http"}
    request = FedRequest(application, scope)
    if send_body:
        request.parts.put_nowait({"type": "http.request", "body": body, "more_body": False})
    return request


def answer_of(request: FedRequest) -> tuple[int, dict]:
    start, body = request.messages
    return start["status"], json.loads(body["body"])


def pending_files() -> list[str]:
    directory = get_store().data_dir / "jobs" / "pending"
    return sorted(path.name for path in directory.iterdir()) if directory.is_dir() else []


@pytest.fixture
def slow_disk(monkeypatch):
    """The store's first file of a post waits until the test lets it go on; `began` is set once a
    post's change is under way."""
    began, go_on = threading.Event(), threading.Event()

    def waiting(call: str, path: str) -> None:
        if call == "create" and "/jobs/" in path:
            began.set()
            go_on.wait(WAIT_SECONDS)

    monkeypatch.setattr(files, "fault", waiting)
    yield began, go_on
    go_on.set()


@pytest.mark.parametrize("cuts", [1, 3], ids=["cut once", "cut again while it ends"])
async def test_a_post_cut_after_its_change_began_is_answered_with_the_items_it_made(queues, tokens, slow_disk, cuts):
    began, go_on = slow_disk
    body = json.dumps({"items": [{"payload": n} for n in range(BATCH)]}).encode()
    request = post_request(tokens["all"], body)
    assert await asyncio.to_thread(began.wait, WAIT_SECONDS)
    for _ in range(cuts):
        request.task.cancel()  # as a server that stops does
        await asyncio.sleep(0.05)
    go_on.set()
    await asyncio.wait_for(asyncio.gather(request.task, return_exceptions=True), WAIT_SECONDS)

    status, answer = answer_of(request)
    assert status == 201, answer
    assert [item["status"] for item in answer["items"]] == ["pending"] * BATCH
    assert pending_files() == sorted(f"{item['id']}.json" for item in answer["items"])


async def test_a_post_cut_before_its_change_began_is_busy_and_does_nothing(queues, tokens):
    request = post_request(tokens["all"], json.dumps({"payload": 1}).encode(), send_body=False)
    for _ in range(int(WAIT_SECONDS / 0.01)):
        if request.reads:  # waiting for its body
            break
        await asyncio.sleep(0.01)
    request.task.cancel()
    await asyncio.gather(request.task, return_exceptions=True)

    status, answer = answer_of(request)
    assert (status, answer["error"]) == (503, "busy")
    assert pending_files() == []


async def test_a_post_whose_change_has_not_begun_when_the_wait_runs_out_is_busy_and_never_runs(
        queues, tokens, monkeypatch):
    """Both store threads taken (a stalled disk, say): the cut post's batch waits for one past
    TRANSITIONS_END_SECONDS, then is answered busy, and must then never run."""
    monkeypatch.setattr(handlers, "TRANSITIONS_END_SECONDS", 0.2)
    free = threading.Event()

    def post_items(items):
        free.wait(WAIT_SECONDS)

    busy = asyncio.gather(*(runtime.run(post_items, items=[None] * BATCH) for _ in range(runtime.STORE_THREADS)))
    body = json.dumps({"items": [{"payload": n} for n in range(BATCH)]}).encode()
    request = post_request(tokens["all"], body)
    await asyncio.sleep(0.1)  # its batch waits for a store thread
    request.task.cancel()
    await asyncio.wait_for(asyncio.gather(request.task, return_exceptions=True), WAIT_SECONDS)
    free.set()
    await busy
    await asyncio.sleep(0.1)  # a store thread is free for anything still queued

    status, answer = answer_of(request)
    assert (status, answer["error"]) == (503, "busy")
    assert pending_files() == []
