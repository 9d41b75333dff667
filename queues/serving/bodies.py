"""Request bodies for Django's part of the site (admin, dashboard, login, /metrics). Django reads
a whole body into a temporary file before any of its own checks (allowed hosts, login, CSRF)
run, so anyone could fill the disk with one endless upload. Here a body is read first, within the
process's budget of body bytes (budget.py): over SITE_BODY_BYTES it is answered 413, and one that
stops coming for BODY_IDLE_SECONDS is answered 400, before Django sees the request; a body that
fits is handed to Django whole."""

import asyncio

from django.conf import settings

from ..budget import BODIES_AT_ONCE, BUSY_RETRY_SECONDS, receiving
from ..exceptions import Busy

SITE_BODY_BYTES = 1 << 20  # the site's forms are a few KiB
BODY_IDLE_SECONDS = 10  # as long as a request head may take

_TOO_LARGE = (413, f"The request body is over {SITE_BODY_BYTES} bytes.\n".encode())
_STOPPED = (400, f"The request body stopped coming for {BODY_IDLE_SECONDS} s.\n".encode())


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
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), BODY_IDLE_SECONDS)
                except TimeoutError:
                    return await _answer(send, *_STOPPED)
                if message["type"] == "http.disconnect":
                    return None  # nobody is left to answer
                chunk = message.get("body", b"")
                if held + len(chunk) > SITE_BODY_BYTES:
                    return await _answer(send, *_TOO_LARGE)
                try:
                    receiving.take(len(chunk), limit=BODIES_AT_ONCE * settings.TASKHOSTER_MAX_BODY_BYTES)
                except Busy as busy:
                    return await _answer(send, 503, f"{busy.message}; try again.\n".encode(),
                                         [(b"retry-after", str(BUSY_RETRY_SECONDS).encode())])
                held += len(chunk)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            return await self.application(scope, _replaying(b"".join(chunks), receive), send)
        finally:
            receiving.give_back(held)


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
