"""What a worker's handler sees and how it is called: the `Job` beside the payload, plain
functions in their own threads, exceptions turned into in-band error results."""

import asyncio
import inspect
import json
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


def encoded_size(result: Any) -> int:
    """The result's size as JSON; raises TypeError or ValueError if it is not JSON."""
    return len(json.dumps(result, allow_nan=False, separators=(",", ":")))


def is_async(handler: Callable) -> bool:
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(getattr(handler, "__call__", None))


def handler_caller(handler: Handler) -> Callable[[Job], Awaitable[Any]]:
    """How to run the handler on a job, decided once rather than for every item: an async one on
    this loop, a plain one in a thread of its own so it never blocks the loop. The thread is a
    daemon: a handler still running when the worker gives up on it (grace period over) does not
    keep the process alive."""
    if is_async(handler):
        return lambda job: handler(job.payload, job)
    return lambda job: _in_daemon_thread(handler, job.payload, job)


def _in_daemon_thread(function: Callable, *args) -> asyncio.Future:
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value, exc):
        if not future.done():
            if exc is None:
                future.set_result(value)
            else:
                future.set_exception(exc)

    def target():
        try:
            value, exc = function(*args), None
        except BaseException as error:  # SystemExit too: the awaiting side decides
            value, exc = None, error
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:  # the loop is closed: nobody waits for this result any more
            pass

    threading.Thread(target=target, name="taskhoster-handler", daemon=True).start()
    return future
