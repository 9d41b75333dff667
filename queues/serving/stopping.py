"""What a request cut by a stop is answered: a server that stops cancels the requests still
running when its grace ends (or at once, on a second signal). One that has not begun its answer
gets 503 `busy` with Retry-After, which clients take as "try again", rather than the server's
bare 500. One whose client has gone (daphne cancels those too) gets nothing: nobody would read
it, and the access log says "no answer"."""

import asyncio
import json

from .limits import BUSY_RETRY_SECONDS

_STOPPING = json.dumps({"error": "busy", "message": "the server is stopping; try again"}).encode()


class AnswerWhenCut:
    def __init__(self, application):
        self.application = application

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.application(scope, receive, send)
        started = gone = False

        async def receiving():
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.application(scope, receiving, sending)
        except asyncio.CancelledError:
            if not started and not gone:
                await _answer_stopping(send)
            raise


async def _answer_stopping(send) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(_STOPPING)).encode()),
        (b"retry-after", str(BUSY_RETRY_SECONDS).encode()),
        (b"connection", b"close"),
    ]
    try:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": _STOPPING})
    except Exception:  # the connection is gone already: nobody to tell
        pass
