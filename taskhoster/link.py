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

# made once: json.dumps with any option makes a new encoder at every call
_encode_frame = json.JSONEncoder(separators=(",", ":")).encode

# A server that takes longer than this to answer a frame (beyond a claim's own wait) is treated as
# gone: the socket is closed, so the worker connects afresh instead of waiting forever.
ANSWER_SECONDS = 30.0
# How often the link looks for requests past their time, while any is out: one timer for all of
# them rather than one per request (each made and cancelled for nothing, almost always).
WATCH_SECONDS = 1.0


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
        # ref -> (answered, deadline, timeout, the frame as sent)
        self._waiting: dict[str, tuple[Answered, float, float, str]] = {}
        self._watch: asyncio.TimerHandle | None = None
        self._closed = False
        self.answered = False  # the server has answered a frame over this socket
        # called with (queue, id) when the server says an item held over this socket was canceled
        self.on_canceled: Callable[[str, str], None] | None = None
        socket.on_message = self._receive

    @property
    def closed(self) -> bool:
        """The socket has closed: no request over it can be answered any more."""
        return self._closed

    def ask(self, frame: dict | str, answered: Answered, *, timeout: float = ANSWER_SECONDS) -> None:
        """Send the frame now (a dict, or its JSON text when parts of it were encoded before).
        `answered` is called once: with the server's answer the moment the socket reads it, or
        with None if the socket closes first or no answer comes within `timeout` seconds, give or
        take WATCH_SECONDS (the socket is then closed, so the worker connects afresh). The hot
        paths (claims, results) use this, with no task in between; `request` is the same,
        awaited. Raises LinkClosed if the socket has closed already."""
        if self._closed:
            raise LinkClosed()
        ref = str(next(self._refs))
        if isinstance(frame, str):
            text = f'{frame[:-1]},"ref":"{ref}"}}'
        else:
            text = _encode_frame({**frame, "ref": ref})
        try:
            self.socket.send(text)
        except SocketClosed as exc:
            raise LinkClosed() from exc
        self._waiting[ref] = (answered, self._loop.time() + timeout, timeout, text)
        if self._watch is None:
            self._watch = self._loop.call_later(min(timeout, WATCH_SECONDS), self._look_for_late)

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

    def _look_for_late(self) -> None:
        self._watch = None
        now = self._loop.time()
        late = [ref for ref, (_, deadline, _, _) in self._waiting.items() if deadline <= now]
        if late:
            _, _, timeout, text = self._waiting[late[0]]
            op = text.partition('"op":"')[2].partition('"')[0]
            log.warning("no answer to %r in %g s; closing the socket to connect again", op, timeout)
            self._loop.create_task(self.socket.close())
            for ref in late:
                self._waiting.pop(ref)[0](None)
        if self._waiting:
            self._watch = self._loop.call_later(WATCH_SECONDS, self._look_for_late)

    def _receive(self, message: str) -> None:
        """A frame from the server: to the request that waits for its ref, or (a `canceled`
        notice, which answers no request) to `on_canceled`."""
        try:
            reply = json.loads(message)
        except ValueError:
            return
        if not isinstance(reply, dict):
            return
        self.answered = True
        waiting = self._waiting.pop(str(reply.get("ref")), None)
        if waiting is not None:
            waiting[0](reply)
        elif reply.get("op") == "canceled" and self.on_canceled is not None:
            self.on_canceled(str(reply.get("queue")), str(reply.get("id")))

    async def serve_until_closed(self) -> None:
        """Wait until the socket closes; then tell every request still waiting (with None)."""
        try:
            await self.socket.wait_closed()
        finally:
            self._closed = True
            if self._watch is not None:
                self._watch.cancel()
            waiting, self._waiting = self._waiting, {}
            for answered, _, _, _ in waiting.values():
                answered(None)


def _settle(future: asyncio.Future, reply: dict | None) -> None:
    if not future.done():  # else its request was cancelled meanwhile
        future.set_result(reply)
