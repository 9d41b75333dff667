"""The process-wide budget of request-body and frame bytes: uploads that would pass it are
answered 503 `busy` with Retry-After, a socket frame waits for room (its sender held back), and
every request and frame gives its share back whatever its outcome.

Uploads are driven by hand against the API's ASGI application, so a test decides when each part
of a body arrives and can hold some uploads half-way while others come in.
"""

import asyncio
import json

import pytest

from api_support import FedRequest, bearer, disk_snapshot, queues, tokens  # noqa: F401  (fixtures)
from queues import budget
from queues.api import requests as requests_module
from queues.api.app import application
from taskhoster_site.asgi import application as application_with_sockets

pytestmark = pytest.mark.django_db(transaction=True)

MAX_BODY = 1000  # so the budget is budget.BODIES_AT_ONCE bodies of 1,000 bytes
WAIT_SECONDS = 10.0  # generous: only ever waited out when a test is about to fail


def body_of(size: int) -> bytes:
    """A post of one item whose JSON is exactly `size` bytes."""
    shell = json.dumps({"payload": ""})
    return json.dumps({"payload": "x" * (size - len(shell))}).encode()


class Upload(FedRequest):
    """One post of `body` to the `jobs` queue; the test hands its parts over with `send()`."""

    def __init__(self, token: str, body: bytes, *, declare_length: bool = True):
        self.body, self.sent = body, 0
        headers = [(b"authorization", bearer(token)["Authorization"].encode()), (b"content-type", b"application/json")]
        if declare_length:
            headers.append((b"content-length", str(len(body)).encode()))
        scope = {"type": "http", "method": "POST", "path": "/api/queues/jobs/items", "headers": headers,
                 "query_string": b""}
        super().__init__(application, scope)

    async def send(self, size: int | None = None) -> None:
        """Hand over the next `size` bytes (all the rest by default), and wait until the
        application has taken them and asks for more, or has answered."""
        part = self.body[self.sent : None if size is None else self.sent + size]
        self.sent += len(part)
        reads = self.reads
        self.parts.put_nowait({"type": "http.request", "body": part, "more_body": self.sent < len(self.body)})
        await until(lambda: self.reads > reads or self.task.done())

    async def answer(self) -> tuple[int, dict, dict]:
        """Status, headers and JSON body of the answer, once given."""
        await asyncio.wait_for(asyncio.shield(self.task), WAIT_SECONDS)
        start, body = self.messages
        return start["status"], dict(start["headers"]), json.loads(body["body"])


async def until(condition) -> None:
    for _ in range(int(WAIT_SECONDS / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the application never got there")


async def started(token: str, size: int, first_part: int = 0, **options) -> Upload:
    """An upload whose request the application has taken in, with `first_part` bytes sent."""
    upload = Upload(token, body_of(size), **options)
    await until(lambda: upload.reads or upload.task.done())
    if first_part:
        await upload.send(first_part)
    return upload


async def held_uploads(token: str, count: int) -> list[Upload]:
    """`count` uploads of the largest body, each with all of it but its last byte received."""
    return [await started(token, MAX_BODY, MAX_BODY - 1) for _ in range(count)]


async def posted(upload: Upload) -> dict:
    await upload.send()
    status, _, item = await upload.answer()
    assert status == 201, item
    return item


def assert_busy(status: int, headers: dict, body: dict) -> None:
    assert status == 503
    assert headers[b"retry-after"] == b"1"
    assert body["error"] == "busy" and body["message"]


@pytest.fixture(autouse=True)
def small_budget(settings):
    """Bodies of at most MAX_BODY bytes; afterwards, every byte of the budget has been given back."""
    settings.TASKHOSTER_MAX_BODY_BYTES = MAX_BODY
    yield
    assert budget.receiving.taken == 0


async def test_an_upload_past_the_budget_is_busy_as_soon_as_its_first_bytes_come(queues, tokens):
    held = await held_uploads(tokens["all"], budget.BODIES_AT_ONCE)  # nearly the whole budget
    before = disk_snapshot()

    late = await started(tokens["all"], MAX_BODY, first_part=MAX_BODY // 10)

    assert_busy(*await late.answer())
    assert disk_snapshot() == before  # nothing stored
    await asyncio.gather(*(posted(upload) for upload in held))


async def test_a_body_declared_but_not_sent_holds_none_of_the_budget(queues, tokens):
    """Uploads that declare the largest body and send nothing do not keep others out."""
    declared = [await started(tokens["all"], MAX_BODY) for _ in range(budget.BODIES_AT_ONCE)]
    await posted(await started(tokens["all"], MAX_BODY))
    await asyncio.gather(*(posted(upload) for upload in declared))


async def test_a_body_that_stops_coming_is_refused_and_gives_its_share_back(queues, tokens, monkeypatch):
    monkeypatch.setattr(requests_module, "BODY_IDLE_SECONDS", 0.2)
    first, *others = await held_uploads(tokens["all"], budget.BODIES_AT_ONCE)  # then no more bytes
    before = disk_snapshot()
    for stalled in (first, *others):
        status, _, body = await stalled.answer()
        assert (status, body["error"]) == (400, "invalid_request") and "stopped coming" in body["message"]
    assert disk_snapshot() == before
    await posted(await started(tokens["all"], MAX_BODY))


async def test_the_budget_is_free_again_once_an_upload_is_answered(queues, tokens):
    first, *others = await held_uploads(tokens["all"], budget.BODIES_AT_ONCE)
    assert_busy(*await (await started(tokens["all"], MAX_BODY, first_part=MAX_BODY // 10)).answer())

    await posted(first)

    await posted(await started(tokens["all"], MAX_BODY))
    await asyncio.gather(*(posted(upload) for upload in others))


async def test_a_streamed_upload_is_busy_as_soon_as_it_passes_the_budget(queues, tokens):
    held = await held_uploads(tokens["all"], budget.BODIES_AT_ONCE - 1)  # room for one body
    streamed = await started(tokens["all"], 2 * MAX_BODY // 3, declare_length=False)
    await streamed.send(MAX_BODY // 3)
    assert not streamed.task.done()  # a third of the room: it fits
    other = await started(tokens["all"], MAX_BODY, first_part=MAX_BODY // 2)  # half the room
    before = disk_snapshot()

    await streamed.send(MAX_BODY // 3)  # two thirds in all: no longer fits

    assert_busy(*await streamed.answer())
    assert disk_snapshot() == before
    await asyncio.gather(*(posted(upload) for upload in [other, *held]))


async def end_with_disconnect(upload: Upload) -> None:
    upload.parts.put_nowait({"type": "http.disconnect"})
    await asyncio.wait_for(upload.task, WAIT_SECONDS)
    assert upload.messages == []  # nobody left to answer


async def end_with_cancel(upload: Upload) -> None:
    upload.task.cancel()  # as a server that stops does
    with pytest.raises(asyncio.CancelledError):
        await upload.task


async def end_with_error(upload: Upload) -> None:
    upload.body = upload.body[: upload.sent] + b"!" * (len(upload.body) - upload.sent)  # no longer JSON
    await upload.send()
    status, _, body = await upload.answer()
    assert (status, body["error"]) == (400, "invalid_json")


@pytest.mark.parametrize("end", [end_with_disconnect, end_with_cancel, end_with_error])
async def test_an_upload_gives_its_share_back_however_it_ends(queues, tokens, end):
    first, *others = await held_uploads(tokens["all"], budget.BODIES_AT_ONCE)

    await end(first)
    replacement = await started(tokens["all"], MAX_BODY)

    await posted(replacement)
    await asyncio.gather(*(posted(upload) for upload in others))


# ---- socket frames share the budget --------------------------------------------------------------


async def test_a_socket_frame_waits_for_room_in_the_budget_and_is_then_answered(queues, tokens):
    from channels.testing import WebsocketCommunicator

    limit = budget.BODIES_AT_ONCE * MAX_BODY
    ws = WebsocketCommunicator(application_with_sockets, "/work", headers=[(b"authorization", f"Bearer {tokens['all']}".encode())])
    assert (await ws.connect())[0]
    budget.receiving.taken = limit - 10  # as if uploads held nearly all of it
    try:
        await ws.send_json_to({"op": "claim", "queue": "jobs", "ref": "r1"})
        assert await ws.receive_nothing(timeout=0.3)  # held back: not parsed, not answered
        budget.receiving.taken -= limit - 10  # the uploads end
        answer = await ws.receive_json_from(timeout=10)
        assert (answer["op"], answer["ref"]) == ("items", "r1")
    finally:
        budget.receiving.taken = max(0, budget.receiving.taken)
        await ws.disconnect()
