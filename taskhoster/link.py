"""One open /work socket: every request gets a fresh `ref`, and each answer goes back to the
request that carries its ref the moment the socket reads it, so any number of requests (waiting
claims among them) can be out at once."""

import asyncio
import itertools
import json
import logging

from .errors import api_error
from .websocket import SocketClosed, WebSocket

log = logging.getLogger("taskhoster.worker")

# A server that takes longer than this to answer a frame (beyond a claim's own wait) is treated as
# gone: the socket is closed, so the worker connects afresh instead of waiting forever.
ANSWER_SECONDS = 30.0


class LinkClosed(Exception):
    """The socket closed before the answer came."""


class Link:
    def __init__(self, socket: WebSocket):
        self.socket = socket
        self._loop = asyncio.get_running_loop()  # once: in Python 3.11 each call costs a getpid()
        self._refs = itertools.count(1)
        self._waiting: dict[str, asyncio.Future] = {}
        self._closed = False
        self.answered = False  # the server has answered a frame over this socket
        socket.on_message = self._receive

    @property
    def closed(self) -> bool:
        """The socket has closed: no request over it can be answered any more."""
        return self._closed

    async def request(self, frame: dict | str, *, timeout: float = ANSWER_SECONDS) -> dict:
        """Send the frame (a dict, or its JSON text when parts of it were encoded before) and
        return the server's answer to it. An error frame raises ApiError (`status` None); a socket
        that closes first, or no answer within `timeout` seconds, raises LinkClosed."""
        if self._closed:
            raise LinkClosed()
        ref = str(next(self._refs))
        if isinstance(frame, str):
            text = f'{frame[:-1]},"ref":"{ref}"}}'
        else:
            text = json.dumps({**frame, "ref": ref}, separators=(",", ":"))
        answer = self._waiting[ref] = self._loop.create_future()
        # a timer that ends the wait: asyncio.wait_for would add a future and two callbacks to each
        timer = self._loop.call_later(timeout, _give_up, answer)
        try:
            self.socket.send(text)
            reply = await answer
        except SocketClosed as exc:
            raise LinkClosed() from exc
        except TimeoutError as exc:
            op = text.partition('"op":"')[2].partition('"')[0]
            log.warning("no answer to %r in %g s; closing the socket to connect again", op, timeout)
            await self.socket.close()
            raise LinkClosed() from exc
        finally:
            timer.cancel()
            self._waiting.pop(ref, None)
        if reply is None:
            raise LinkClosed()
        if reply.get("op") == "error":
            raise api_error(str(reply.get("code")), str(reply.get("message", "")))
        return reply

    def _receive(self, message: str) -> None:
        """An answer (or any frame) from the server: to the request that waits for its ref."""
        try:
            reply = json.loads(message)
        except ValueError:
            return
        if not isinstance(reply, dict):
            return
        self.answered = True
        waiter = self._waiting.get(str(reply.get("ref")))
        if waiter is not None and not waiter.done():
            waiter.set_result(reply)

    async def serve_until_closed(self) -> None:
        """Wait until the socket closes; then wake every request still waiting with None (which
        it raises as LinkClosed: a future's exception that nobody retrieves, its request being
        cancelled meanwhile, would be logged)."""
        try:
            await self.socket.wait_closed()
        finally:
            self._closed = True
            for waiter in self._waiting.values():
                if not waiter.done():
                    waiter.set_result(None)


def _give_up(answer: asyncio.Future) -> None:
    if not answer.done():
        answer.set_exception(TimeoutError())
