"""The users' workload, the same for every system measured (Taskhoster through its own client,
Celery, RQ): items posted one call each while the workers consume, then round trips one at a
time. A system is anything with the three methods of `System`; each uses only its library's
normal API, so what is timed is what a user of that library sees.
"""

import statistics
import time
from typing import Protocol

PAYLOAD = {"text": "x" * 100}  # a small job description, about 110 bytes as JSON
RESULT_TIMEOUT = 30.0  # seconds one item may take, from its post to its result


class System(Protocol):
    def begin(self) -> None:
        """Called untimed before an end-to-end run, with the workers idle."""

    def post(self) -> object:
        """Post one item (PAYLOAD) with one call of the library's API; its handle."""

    def result(self, handle: object) -> None:
        """Wait for that item's result (RESULT_TIMEOUT at most); raise if it failed or none came."""

    def wait_all(self, handles: list, *, timeout: float) -> None:
        """Return once every one of `handles` has its result, by the cheapest normal call the
        library has for that; raise if `timeout` seconds pass first."""


def enqueue_and_end_to_end(system: System, *, items: int) -> dict[str, float]:
    """Post `items` one call each while the workers consume them: the posts per second, and the
    items per second from the first post until every result is in. The last item posted is
    among the last worked (oldest first), so its result is waited for first; `wait_all` then
    catches the few that end after it."""
    system.begin()
    started = time.perf_counter()
    handles = [system.post() for _ in range(items)]
    posted = time.perf_counter()
    system.result(handles[-1])
    system.wait_all(handles, timeout=RESULT_TIMEOUT + items / 100)
    ended = time.perf_counter()
    return {"enqueuePerSecond": items / (posted - started), "endToEndPerSecond": items / (ended - started)}


def round_trip_ms(system: System, *, count: int) -> dict[str, float]:
    """`count` items one at a time, each from its post to its result in the producer's hands:
    the 50th, 95th and 99th percentiles in milliseconds."""
    took = []
    for _ in range(count):
        started = time.perf_counter()
        system.result(system.post())
        took.append((time.perf_counter() - started) * 1000)
    return percentiles(took, 50, 95, 99)


def percentiles(values: list[float], *cuts: int) -> dict[str, float]:
    """{"p50": ..., ...} for the given cuts (inclusive method: never beyond the extremes)."""
    every = statistics.quantiles(values, n=100, method="inclusive")
    return {f"p{cut}": every[cut - 1] for cut in cuts}
