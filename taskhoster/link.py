"""One open /work socket: every request gets a fresh `ref`, and each answer goes back to the
request that carries its ref the moment the socket reads it, so any number of requests (waiting
claims among them) can be out at once."""

import asyncio
import itertools
import json
import logging
from collections.abc import Callable
from functools import partial

from .errors import api_error
from .websocket import SocketClosed, WebSocket

log = logging.getLogger("taskhoster.worker")

# A server that takes longer than this to answer a frame (beyond a claim's own wait) is treated as
# gone: the socket is closed, so the worker connects afresh instead of waiting forever.
ANSWER_SECONDS = 30.0


class LinkClosed(Exception):
    """The socket closed before the answer came."""


# What `Link.ask` calls with the answer: the server's frame, or None if none will come.
Answered = Callable[[dict | None], None]


def answer_of(reply: dict | None) -> dict:
    """The answer `Link.ask` handed over, as `request` returns it: an error frame raises ApiError
    (`status` None), no answer (the socket closed, or no answer in time) raises LinkClosed."""
    if reply is None:
        raise LinkClosed()
    if reply.get("op") == "error":
        raise api_error(str(reply.get("code")), str(reply.get("message", "")))
    return reply


class Link:
    def __init__(self, socket: WebSocket):
        self.socket = socket
        self._loop = asyncio.get_running_loop()  # once: in Python 3.11 each call costs a getpid()
        self._refs = itertools.count(1)
        self._waiting: dict[str, tuple[Answered, asyncio.TimerHandle]] = {}
        self._closed = False
        self.answered = False  # the server has answered a frame over this socket
        socket.on_message = self._receive

    @property
    def closed(self) -> bool:
        """The socket has closed: no request over it can be answered any more."""
        return self._closed

    def ask(self, frame: dict | str, answered: Answered, *, timeout: float = ANSWER_SECONDS) -> None:
        """Send the frame now (a dict, or its JSON text when parts of it were encoded before).
        `answered` is called once: with the server's answer the moment the socket reads it, or
        with None if the socket closes first or no answer comes within `timeout` seconds (the
        socket is then closed, so the worker connects afresh). The hot paths (claims, results)
        use this, with no task in between; `request` is the same, awaited. Raises LinkClosed if
        the socket has closed already."""
        if self._closed:
            raise LinkClosed()
        ref = str(next(self._refs))
        if isinstance(frame, str):
            text = f'{frame[:-1]},"ref":"{ref}"}}'
        else:
            text = json.dumps({**frame, "ref": ref}, separators=(",", ":"))
        try:
            self.socket.send(text)
        except SocketClosed as exc:
            raise LinkClosed() from exc
        self._waiting[ref] = (answered, self._loop.call_later(timeout, self._no_answer, ref, text, timeout))

    async def request(self, frame: dict | str, *, timeout: float = ANSWER_SECONDS) -> dict:
        """Send the frame and return the server's answer to it. An error frame raises ApiError
        (`status` None); a socket that closes first, or no answer within `timeout` seconds,
        raises LinkClosed."""
        return answer_of(await self.reply(frame, timeout=timeout))

    async def reply(self, frame: dict | str, *, timeout: float = ANSWER_SECONDS) -> dict | None:
        """What `ask` would hand over, awaited."""
        answer = self._loop.create_future()
        self.ask(frame, partial(_settle, answer), timeout=timeout)
        return await answer

    def _no_answer(self, ref: str, text: str, timeout: float) -> None:
        answered, _ = self._waiting.pop(ref)
        op = text.partition('"op":"')[2].partition('"')[0]
        log.warning("no answer to %r in %g s; closing the socket to connect again", op, timeout)
        self._loop.create_task(self.socket.close())
        answered(None)

    def _receive(self, message: str) -> None:
        """A frame from the server: to the request that waits for its ref."""
        try:
            reply = json.loads(message)
        except ValueError:
            return
        if not isinstance(reply, dict):
            return
        self.answered = True
        waiting = self._waiting.pop(str(reply.get("ref")), None)
        if waiting is not None:
            answered, timer = waiting
            timer.cancel()
            answered(reply)

    async def serve_until_closed(self) -> None:
        """Wait until the socket closes; then tell every request still waiting (with None)."""
        try:
            await self.socket.wait_closed()
        finally:
            self._closed = True
            waiting, self._waiting = self._waiting, {}
            for answered, timer in waiting.values():
                timer.cancel()
                answered(None)


def _settle(future: asyncio.Future, reply: dict | None) -> None:
    if not future.done():  # else its request was cancelled meanwhile
        future.set_result(reply)
