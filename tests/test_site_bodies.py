"""Request bodies for Django's part of the site: Django reads a whole body into a temporary file
before its own checks run, so a body over the site's limit is answered 413, and one that stops
coming is answered 400, before Django sees the request, whoever sends it."""

import asyncio

import pytest

from queues import budget
from queues.serving import bodies
from taskhoster_site.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)
WAIT_SECONDS = 10.0  # only ever waited out when a test is about to fail


class Post:
    """An anonymous POST to the admin's login page; the test hands over its body's parts."""

    def __init__(self, *, declared: int | None = None):
        headers = [(b"host", b"localhost"), (b"content-type", b"application/x-www-form-urlencoded")]
        if declared is not None:
            headers.append((b"content-length", str(declared).encode()))
        scope = {"type": "http", "method": "POST", "path": "/admin/login/", "headers": headers, "query_string": b"",
                 "http_version": "1.1", "scheme": "http", "server": ("localhost", 8000), "client": ("127.0.0.1", 5)}
        self.parts: asyncio.Queue = asyncio.Queue()
        self.reads = 0
        self.messages: list[dict] = []
        self.task = asyncio.ensure_future(application(scope, self._receive, self._send))

    async def _receive(self) -> dict:
        self.reads += 1
        return await self.parts.get()

    async def _send(self, message: dict) -> None:
        self.messages.append(message)

    def send(self, body: bytes, *, more: bool) -> None:
        self.parts.put_nowait({"type": "http.request", "body": body, "more_body": more})

    async def status(self) -> int:
        await asyncio.wait_for(asyncio.shield(self.task), WAIT_SECONDS)
        return self.messages[0]["status"]


@pytest.fixture(autouse=True)
def budget_given_back():
    yield
    assert budget.receiving.taken == 0


async def test_a_body_declared_over_the_limit_is_413_before_it_is_read():
    post = Post(declared=bodies.SITE_BODY_BYTES + 1)
    assert await post.status() == 413
    assert post.reads == 0


async def test_a_streamed_body_is_413_as_soon_as_it_passes_the_limit():
    post = Post()
    chunk = b"x" * (bodies.SITE_BODY_BYTES // 4)
    for _ in range(4):
        post.send(chunk, more=True)
    post.send(b"x", more=True)  # one byte over: the rest is never read
    assert await post.status() == 413


async def test_a_body_that_stops_coming_is_400(monkeypatch):
    monkeypatch.setattr(bodies, "BODY_IDLE_SECONDS", 0.1)
    post = Post(declared=100)
    post.send(b"x" * 10, more=True)
    assert await post.status() == 400


async def test_a_body_within_the_limit_reaches_django_whole():
    post = Post()
    post.send(b"username=ann&", more=True)
    post.send(b"password=wrong", more=False)
    assert await post.status() == 403  # Django's own answer: its CSRF check, the form read whole
