"""One HTTP request as the handlers see it: headers, query parameters, and a body read with a
size limit and within the process's budget of body bytes."""

import asyncio
from collections.abc import Coroutine
from functools import cached_property
from urllib.parse import parse_qsl, unquote

from ..budget import BODIES_AT_ONCE, BODY_IDLE_SECONDS, BodyBudget, receiving
from ..exceptions import InvalidRequest, PayloadTooLarge
from ..protocol import parse_json

NO_BODY = object()

class ClientGone(Exception):
    """The client disconnected before its request was read: nobody is left to answer."""


class Request:
    def __init__(self, scope: dict, receive, *, max_body_bytes: int, budget: BodyBudget = receiving):
        self.scope = scope
        self._receive = receive
        self.max_body_bytes = max_body_bytes
        self._budget = budget
        self._budget_taken = 0  # given back by close()
        self._watcher: asyncio.Task | None = None
        self._gone = False
        self._left: asyncio.Future | None = None  # settled when the client leaves, once watched

    @property
    def method(self) -> str:
        return self.scope["method"]

    @property
    def path(self) -> str:
        return self.scope["path"]

    @property
    def segments(self) -> list[str]:
        """The path's segments, each percent-decoded on its own: an encoded slash (`%2F`) stays
        inside its segment, so `/api/queues/a%2Fb` names the queue `a/b` (refused as any bad name)."""
        raw = self.scope.get("raw_path")
        if raw is None:
            return self.path.split("/")
        return [unquote(segment) for segment in raw.decode("latin-1").split("/")]

    def header(self, name: bytes) -> str | None:
        for key, value in self.scope["headers"]:
            if key.lower() == name:
                return value.decode("latin-1")
        return None

    @cached_property
    def query(self) -> dict[str, str]:
        """Query parameters; a parameter given twice is refused rather than guessed at."""
        pairs = parse_qsl(self.scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        query = {}
        for key, value in pairs:
            if key in query:
                raise InvalidRequest(f"the query parameter {key[:40]!r} is given more than once")
            query[key] = value
        return query

    async def body(self) -> bytes:
        """The whole body, refused with 413 as soon as it passes the limit (before reading it
        when Content-Length says so), with 503 `busy` as soon as what has come does not fit the
        budget, and with 400 when it stops coming for BODY_IDLE_SECONDS: the budget holds what
        has arrived, so a client that declares a large body and sends nothing holds none of it."""
        declared = self.header(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise InvalidRequest("Content-Length is not a number")
            self._check_size(int(declared))
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(self._receive(), BODY_IDLE_SECONDS)
            except TimeoutError:
                raise InvalidRequest(f"the body stopped coming for {BODY_IDLE_SECONDS} s") from None
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            self._check_size(size)
            self._hold_budget(size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def json(self, *, when_empty=NO_BODY):
        """The body parsed as JSON; `when_empty` stands in for an empty body if given."""
        raw = await self.body()
        if not raw.strip() and when_empty is not NO_BODY:
            return when_empty
        return parse_json(raw)

    def _check_size(self, size: int) -> None:
        if size > self.max_body_bytes:
            raise PayloadTooLarge(f"the body is over {self.max_body_bytes} bytes (TASKHOSTER_MAX_BODY_BYTES)")

    def _hold_budget(self, size: int) -> None:
        """Hold `size` bytes of the budget in all."""
        if size > self._budget_taken:
            self._budget.take(size - self._budget_taken, limit=BODIES_AT_ONCE * self.max_body_bytes)
            self._budget_taken = size

    # ---- noticing a client that left while its answer waits (long-polls) --------------------

    def watch_disconnect(self) -> None:
        """Start noticing a disconnect; call once the body has been read and handled, before a
        long wait: its bytes leave the budget then, so a long poll padded with spaces holds none."""
        self._budget.give_back(self._budget_taken)
        self._budget_taken = 0
        if self._watcher is None:
            self._left = asyncio.get_running_loop().create_future()
            self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._gone = True
        self._left.set_result(None)

    @property
    def gone(self) -> bool:
        return self._gone

    async def until_gone(self, wait: Coroutine) -> None:
        """Await `wait` (a long poll's wait for the hub), ended early if the client leaves: its
        waiter is taken off at once, and the next wake-up goes to a request that still waits."""
        if self._left is None:  # not watched
            await wait
            return
        waiting = asyncio.ensure_future(wait)
        try:
            await asyncio.wait([waiting, self._left], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()

    def close(self) -> None:
        """The request is done, whatever its outcome: stop watching, give the budget back."""
        if self._watcher is not None:
            self._watcher.cancel()
        self._budget.give_back(self._budget_taken)
        self._budget_taken = 0
