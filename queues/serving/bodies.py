"""Request bodies for Django's part of the site (admin, dashboard, login, /metrics). Django reads
a whole body into a temporary file before any of its own checks (allowed hosts, login, CSRF)
run, so anyone could fill the disk with one endless upload. Here a body is read first: over
SITE_BODY_BYTES it is answered 413, one that stops coming for BODY_IDLE_SECONDS, or is not whole
after BODY_SECONDS, 400, before Django sees the request; a body that fits is handed to Django
whole. These bodies have a budget of their own (budget.py), not the API's and the sockets':
whoever sends them has shown no token yet."""

import asyncio

from ..budget import BODY_IDLE_SECONDS, BUSY_RETRY_SECONDS, BodyBudget
from ..exceptions import Busy

SITE_BODY_BYTES = 1 << 20  # the site's forms are a few KiB
SITE_BODIES_AT_ONCE = 8  # of the largest size: past that, 503 busy
BODY_SECONDS = 30  # a trickle of a byte every few seconds is not a form
site_receiving = BodyBudget()

_TOO_LARGE = (413, f"The request body is over {SITE_BODY_BYTES} bytes.\n".encode())
_STOPPED = (400, f"The request body stopped coming for {BODY_IDLE_SECONDS} s, or took over {BODY_SECONDS} s.\n".encode())


class LimitedBodies:
    def __init__(self, application):
        self.application = application

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.application(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > SITE_BODY_BYTES:
            return await _answer(send, *_TOO_LARGE)
        chunks, held = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BODY_SECONDS
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), min(BODY_IDLE_SECONDS, deadline - loop.time()))
                except TimeoutError:
                    return await _answer(send, *_STOPPED)
                if message["type"] == "http.disconnect":
                    return None  # nobody is left to answer
                chunk = message.get("body", b"")
                if held + len(chunk) > SITE_BODY_BYTES:
                    return await _answer(send, *_TOO_LARGE)
                try:
                    site_receiving.take(len(chunk), limit=SITE_BODIES_AT_ONCE * SITE_BODY_BYTES)
                except Busy as busy:
                    return await _answer(send, 503, f"{busy.message}; try again.\n".encode(),
                                         [(b"retry-after", str(BUSY_RETRY_SECONDS).encode())])
                held += len(chunk)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            return await self.application(scope, _replaying(b"".join(chunks), receive), send)
        finally:
            site_receiving.give_back(held)


def _replaying(body: bytes, receive):
    """The body, read already, as the first message; then the connection's own (a disconnect)."""
    first = {"type": "http.request", "body": body, "more_body": False}

    async def replay():
        nonlocal first
        if first is not None:
            message, first = first, None
            return message
        return await receive()

    return replay


async def _answer(send, status: int, text: bytes, headers: list = ()) -> None:
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(text)).encode()),
               (b"connection", b"close"), *headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": text})
