"""What a worker's handler sees and how it is called: the `Job` beside the payload, plain
functions in threads kept for them, exceptions turned into in-band error results."""

import asyncio
import inspect
import json
import queue
import threading
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

TRACEBACK_TAIL_CHARS = 4000  # the end of a traceback is where the cause is
DEFAULT_LEASE_SECONDS = 60.0

Handler = Callable[[Any, "Job"], Any] | Callable[[Any, "Job"], Awaitable[Any]]


@dataclass(frozen=True)
class Job:
    """The claimed item, passed to the handler as its second argument."""

    id: str
    queue: str
    attempts: int  # how many times the item has been claimed, this claim included
    payload: Any
    claimed_at: str  # ISO-8601, as the server wrote it
    lease_expires_at: str
    lease_seconds: float  # the queue's lease, which the worker renews while the handler runs

    @classmethod
    def from_item(cls, item: dict) -> "Job":
        return cls(
            id=item["id"],
            queue=item["queue"],
            attempts=item.get("attempts", 1),
            payload=item.get("payload"),
            claimed_at=item.get("claimedAt") or "",
            lease_expires_at=item.get("leaseExpiresAt") or "",
            lease_seconds=_lease_seconds(item),
        )


def _lease_seconds(item: dict) -> float:
    try:
        start = datetime.fromisoformat(item["claimedAt"])
        end = datetime.fromisoformat(item["leaseExpiresAt"])
    except (KeyError, TypeError, ValueError):
        return DEFAULT_LEASE_SECONDS
    return max(1.0, (end - start).total_seconds())


def error_result(exc: BaseException) -> dict:
    """The in-band result of a handler that raised: its type, message and the tail of its
    traceback, under "error", so a producer tells it from a normal result."""
    text = "".join(traceback.format_exception(exc))
    return {"error": {"type": type(exc).__name__, "message": str(exc), "traceback": text[-TRACEBACK_TAIL_CHARS:]}}


def encode(result: Any) -> str:
    """The result as JSON, as the server takes it; raises TypeError or ValueError if it is not
    JSON (NaN and infinities are not)."""
    return json.dumps(result, allow_nan=False, separators=(",", ":"))


def is_async(handler: Callable) -> bool:
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(getattr(handler, "__call__", None))


def handler_caller(handler: Handler, threads: "HandlerThreads") -> Callable[[Job], Awaitable[Any]]:
    """How to run the handler on a job, decided once rather than for every item: an async one on
    this loop, a plain one in one of `threads` so it never blocks the loop."""
    if is_async(handler):
        return lambda job: handler(job.payload, job)
    return lambda job: threads.run(handler, job.payload, job)


class HandlerThreads:
    """The threads plain handlers run in, kept between items: starting a thread for each item cost
    more CPU than everything else the worker does for it. A thread waits for the next item when
    its handler returns, and a new one starts only when none waits. They are daemons: a handler
    still running when the worker gives up on it (grace period over) does not keep the process
    alive. close() ends the waiting ones; a busy one ends when its handler returns."""

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (future, function, args), or None: end
        self._lock = threading.Lock()
        self._waiting = 0  # threads waiting for a call, not yet promised one
        self._closed = False

    def run(self, function: Callable, *args) -> asyncio.Future:
        """`function(*args)` in one of the threads; the future settles on this loop."""
        future = self._loop.create_future()
        with self._lock:
            start = not self._waiting
            if not start:
                self._waiting -= 1
        if start:
            threading.Thread(target=self._serve, name="taskhoster-handler", daemon=True).start()
        self._calls.put((future, function, args))
        return future

    def close(self) -> None:
        with self._lock:
            self._closed = True
            waiting, self._waiting = self._waiting, 0
        for _ in range(waiting):
            self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, function, args = call
            try:
                value, exc = function(*args), None
            except BaseException as error:  # SystemExit too: the awaiting side decides
                value, exc = None, error
            with self._lock:  # waiting from now on: the next item, which may follow at once, is ours
                closed = self._closed
                if not closed:
                    self._waiting += 1
            try:
                self._loop.call_soon_threadsafe(_settle, future, value, exc)
            except RuntimeError:  # the loop is closed: nobody waits for this result any more
                return
            if closed:
                return
            del future, value, exc  # not kept alive while this thread waits


def _settle(future: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    if not future.done():
        if exc is None:
            future.set_result(value)
        else:
            future.set_exception(exc)
