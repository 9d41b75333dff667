"""The users' workload, the same for every system measured (Taskhoster through its own client,
Celery, RQ): items posted one call each while the workers consume, then round trips one at a
time. A system is anything with the three methods of `System`; each uses only its library's
normal API, so what is timed is what a user of that library sees. Posts from several threads at
once (`threaded_posts`) take a post function per thread instead, so each system's producers are
set up as its users set them up, and all are timed by the same loop.
"""

import statistics
import threading
import time
from collections.abc import Callable
from typing import Protocol

PAYLOAD = {"text": "x" * 100}  # a small job description, about 110 bytes as JSON
RESULT_TIMEOUT = 30.0  # seconds one item may take, from its post to its result


class System(Protocol):
    def begin(self) -> None:
        """Called untimed before an end-to-end run, with the workers idle."""

    def post(self) -> object:
        """Post one item (PAYLOAD) with one call of the library's API; its handle."""

    def result(self, handle: object, *, timeout: float = RESULT_TIMEOUT) -> None:
        """Wait for that item's result (`timeout` seconds at most); raise if it failed or none came."""

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
    backlog_timeout = RESULT_TIMEOUT + items / 100  # the workers may be far behind the posts
    system.result(handles[-1], timeout=backlog_timeout)
    system.wait_all(handles, timeout=backlog_timeout)
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


def threaded_posts(posts: list[Callable[[], object]], *, seconds: float) -> dict:
    """Each of `posts` called back to back on a thread of its own for `seconds`, after one untimed
    call (it opens that thread's connection): the posts per second of them all, one post's time
    (p50, p99, ms), and how many were made, the untimed ones too. The threads start together, at
    a barrier, so none is timed alone."""
    took: list[list[float]] = [[] for _ in posts]
    failures: list[BaseException] = []
    clock = {"began": 0.0, "deadline": 0.0}

    def set_clock() -> None:  # run by the barrier before it lets anyone go
        clock["began"] = time.perf_counter()
        clock["deadline"] = clock["began"] + seconds

    start = threading.Barrier(len(posts) + 1, action=set_clock)

    def post_for_a_while(post: Callable[[], object], mine: list[float]) -> None:
        try:
            post()  # untimed: opens the connection
            start.wait()
            while (started := time.perf_counter()) < clock["deadline"]:
                post()
                mine.append((time.perf_counter() - started) * 1000)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)
            start.abort()

    threads = [
        threading.Thread(target=post_for_a_while, args=(post, mine), daemon=True) for post, mine in zip(posts, took)
    ]
    for thread in threads:
        thread.start()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass  # a thread failed before the start: its error is raised below
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - clock["began"]
    if failures:
        raise RuntimeError(f"a producer thread failed: {failures[0]!r}") from failures[0]
    every = [ms for mine in took for ms in mine]
    return {"postsPerSecond": len(every) / elapsed, "postMs": percentiles(every, 50, 99), "posts": len(every) + len(posts)}


def percentiles(values: list[float], *cuts: int) -> dict[str, float]:
    """{"p50": ..., ...} for the given cuts (inclusive method: never beyond the extremes)."""
    every = statistics.quantiles(values, n=100, method="inclusive")
    return {f"p{cut}": every[cut - 1] for cut in cuts}
