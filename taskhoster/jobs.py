"""What a worker's handler sees and how it is called: the `Job` beside the payload, plain
functions in threads kept for them, exceptions turned into in-band error results."""

import asyncio
import inspect
import json
import math
import queue
import random
import threading
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

TRACEBACK_TAIL_CHARS = 4000  # the end of a traceback is where the cause is
MESSAGE_CHARS = 4000  # an error result goes in as a result or a lastError: it must stay small
DEFAULT_LEASE_SECONDS = 60.0

Handler = Callable[[Any, "Job"], Any] | Callable[[Any, "Job"], Awaitable[Any]]


class Canceled(threading.Event):
    """Set when the item is canceled while its handler runs. It is true once set, so a blocking
    handler may check `if job.canceled:` between steps, or sleep with `job.canceled.wait(s)`."""

    def __bool__(self) -> bool:
        return self.is_set()


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
    max_attempts: int | None = None  # the queue's limit on claims of one item; None: no limit
    last_error: Any = None  # what the last release of the item said went wrong, if one did
    posted_at: str = ""  # ISO-8601, as the server wrote it
    canceled: Canceled = field(default_factory=Canceled, compare=False, repr=False)

    @property
    def is_last_try(self) -> bool:
        """The queue will not hand the item out again: giving it back ends it as max_attempts."""
        return self.max_attempts is not None and self.attempts >= self.max_attempts

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
            max_attempts=item.get("maxAttempts"),
            last_error=item.get("lastError"),
            posted_at=item.get("postedAt") or "",
        )


def _lease_seconds(item: dict) -> float:
    try:
        start = datetime.fromisoformat(item["claimedAt"])
        end = datetime.fromisoformat(item["leaseExpiresAt"])
    except (KeyError, TypeError, ValueError):
        return DEFAULT_LEASE_SECONDS
    return max(1.0, (end - start).total_seconds())


class HandlerFailed(Exception):
    """A handler's failure that says itself what its error result is: `details` goes in under
    "error" as it is (a program's exit status and stderr, say)."""

    def __init__(self, details: dict):
        super().__init__(details.get("message", ""))
        self.details = details


def error_result(exc: BaseException) -> dict:
    """The in-band result of a handler that raised: its type, message and the tail of its
    traceback, under "error", so a producer tells it from a normal result."""
    if isinstance(exc, HandlerFailed):
        return {"error": exc.details}
    text = "".join(traceback.format_exception(exc))  # never raises: it says where str() failed
    try:
        message = str(exc)
    except Exception as broken:  # an exception's own __str__ may raise: no reason to stop the worker
        message = f"<str() of the exception raised {type(broken).__name__}>"
    return {"error": {"type": type(exc).__name__, "message": message[:MESSAGE_CHARS],
                      "traceback": text[-TRACEBACK_TAIL_CHARS:]}}


def retry_delay(attempts: int, base: float, cap: float) -> float:
    """Exponential backoff with full jitter: anything from 0 up to base * 2^(attempts - 1), at
    most `cap`, so items that failed together do not all come back together."""
    return round(random.uniform(0, min(cap, base * 2 ** min(attempts - 1, 64))), 3)


# made once: json.dumps with any option makes a new encoder at every call
_encoder = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def decode(text: str | bytes) -> Any:
    """JSON as the server reads it: raises ValueError for what is not, NaN, the infinities and
    numbers too large for a float (1e999) included, which Python alone would read."""
    return json.loads(text, parse_constant=_not_json, parse_float=_finite)


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    number = float(text)
    if math.isinf(number):
        raise ValueError(f"{text} is out of range")
    return number


def encode(result: Any) -> str:
    """The result as JSON, as the server takes it; raises TypeError or ValueError if it is not
    JSON (NaN and infinities are not)."""
    return _encoder.encode(result)


def check_handler(handler: Callable) -> None:
    """Refuse, before anything is claimed, a handler that cannot be called as handler(payload, job):
    otherwise every item would end with a TypeError as its result."""
    if not callable(handler):
        raise TypeError(f"the handler must be a function, not {type(handler).__name__}")
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):  # some builtins have no signature to read: let them be
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"the handler {getattr(handler, '__name__', handler)!r} must take two arguments, (payload, job), "
            f"but its signature is {signature}; add a `job` parameter, e.g. def handle(payload, job): ..."
        ) from None


def is_async(handler: Callable) -> bool:
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(getattr(handler, "__call__", None))


class HandlerThreads:
    """The threads plain handlers run in, kept between items: starting a thread for each item cost
    more CPU than everything else the worker does for it. A thread waits for its next call when
    its handler returns; a new one starts only when none waits. They are daemons: a handler still
    running when the worker gives up on it (grace period over) does not keep the process alive.
    Only the loop hands out calls and keeps the waiting threads, so no lock is taken. close() ends
    the waiting ones; a busy one ends when its handler returns."""

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._waiting: list[_HandlerThread] = []
        self._closed = False

    def run(self, function: Callable, args: tuple, done: Callable[[Any, BaseException | None], None]) -> None:
        """`function(*args)` in one of the threads; then `done(value, exception)` on this loop."""
        thread = self._waiting.pop() if self._waiting else _HandlerThread(self)
        thread.calls.put((function, args, done))

    def close(self) -> None:
        self._closed = True
        for thread in self._waiting:
            thread.calls.put(None)
        self._waiting.clear()

    def returned(self, thread: "_HandlerThread", done: Callable, value: Any, exc: BaseException | None) -> None:
        """On the loop: a call returned; its thread waits for the next one (or ends)."""
        if self._closed:
            thread.calls.put(None)
        else:
            self._waiting.append(thread)
        done(value, exc)


class _HandlerThread:
    def __init__(self, threads: HandlerThreads):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()  # (function, args, done), or None: end
        self._threads = threads
        threading.Thread(target=self._serve, name="taskhoster-handler", daemon=True).start()

    def _serve(self) -> None:
        loop = self._threads._loop
        while (call := self.calls.get()) is not None:
            function, args, done = call
            try:
                value, exc = function(*args), None
            except BaseException as error:  # SystemExit too: the loop's side decides
                value, exc = None, error
            try:
                loop.call_soon_threadsafe(self._threads.returned, self, done, value, exc)
            except RuntimeError:  # the loop is closed: nobody waits for this result any more
                return
            del call, function, args, done, value, exc  # not kept alive while this thread waits
