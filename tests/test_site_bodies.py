"""Request bodies for Django's part of the site: Django reads a whole body into a temporary file
before its own checks run, so a body over the site's limit is answered 413, and one that stops
coming is answered 400, before Django sees the request, whoever sends it."""

import asyncio
import re

import pytest

from api_support import FedRequest
from queues import budget
from queues.serving import bodies
from taskhoster_site.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)
WAIT_SECONDS = 10.0  # only ever waited out when a test is about to fail


class Post(FedRequest):
    """An anonymous POST to the admin's login page; the test hands over its body's parts."""

    def __init__(self, *, declared: int | None = None, extra_headers: list = ()):
        headers = [(b"host", b"localhost"), (b"content-type", b"application/x-www-form-urlencoded"), *extra_headers]
        if declared is not None:
            headers.append((b"content-length", str(declared).encode()))
        scope = {"type": "http", "method": "POST", "path": "/admin/login/", "headers": headers, "query_string": b"",
                 "http_version": "1.1", "scheme": "http", "server": ("localhost", 8000), "client": ("127.0.0.1", 5)}
        super().__init__(application, scope)

    def send(self, body: bytes, *, more: bool) -> None:
        self.parts.put_nowait({"type": "http.request", "body": body, "more_body": more})

    async def status(self) -> int:
        await asyncio.wait_for(asyncio.shield(self.task), WAIT_SECONDS)
        return self.messages[0]["status"]


@pytest.fixture(autouse=True)
def budget_given_back():
    yield
    assert bodies.site_receiving.taken == 0 and budget.receiving.taken == 0


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


async def test_a_body_that_trickles_for_longer_than_a_form_takes_is_400(monkeypatch):
    monkeypatch.setattr(bodies, "BODY_SECONDS", 0.3)
    post = Post(declared=100)
    for _ in range(10):  # a byte now and then, each well within the idle limit
        if post.task.done():
            break
        post.send(b"x", more=True)
        await asyncio.sleep(0.05)
    assert await post.status() == 400


async def test_bodies_to_the_site_never_take_the_budget_of_the_api_and_the_sockets():
    """Whoever sends them has shown no token: they have a budget of their own."""
    posts = [Post() for _ in range(bodies.SITE_BODIES_AT_ONCE)]
    for post in posts:
        post.send(b"x" * (bodies.SITE_BODY_BYTES - 1), more=True)
    await asyncio.sleep(0.05)
    assert budget.receiving.taken == 0 and bodies.site_receiving.taken > 0
    late = Post()
    late.send(b"x" * 1000, more=True)
    assert await late.status() == 503  # the site's own budget is full
    for post in posts:
        post.task.cancel()
    await asyncio.gather(*(post.task for post in posts), return_exceptions=True)


async def test_a_body_within_the_limit_reaches_django_whole():
    """A login form with a wrong password is shown again with the user name it was sent: Django
    read the form, sent in two parts, whole."""
    page = await _get("/admin/login/")
    cookie = next(value for name, value in page["headers"] if name.lower() == b"set-cookie" and value.startswith(b"csrftoken="))
    csrf_cookie = cookie.split(b";")[0]
    token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page["body"]).group(1)
    post = Post(extra_headers=[(b"cookie", csrf_cookie), (b"referer", b"http://localhost/admin/login/")])
    post.send(b"csrfmiddlewaretoken=" + token + b"&username=ann-from-the-form&", more=True)
    post.send(b"password=wrong", more=False)
    assert await post.status() == 200
    assert b"ann-from-the-form" in b"".join(m.get("body", b"") for m in post.messages)


async def _get(path: str) -> dict:
    sent, messages = [], [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client stays: Django stops listening once it answers

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": [(b"host", b"localhost")], "query_string": b"",
             "http_version": "1.1", "scheme": "http", "server": ("localhost", 8000), "client": ("127.0.0.1", 5)}
    await asyncio.wait_for(application(scope, receive, send), WAIT_SECONDS)
    return {"headers": sent[0]["headers"], "body": b"".join(m.get("body", b"") for m in sent[1:])}
