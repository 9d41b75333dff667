"""Taskhoster as its users see it: every call through our own client (`taskhoster.Producer`;
the workers are `taskhoster.Worker` processes, queues/bench/worker.py). The workload shared with
the peers is in workload.py; the concurrent producers and the batches are ours alone."""

import itertools
import threading
import time

from taskhoster import Producer

from .workload import PAYLOAD, RESULT_TIMEOUT, percentiles

POLL_SECONDS = 0.01
TERMINAL = ("finished", "failed")


class TaskhosterSystem:
    """The workload's `System` through a `Producer` on a queue that `Worker`s work."""

    def __init__(self, producer: Producer, queue: str):
        self.producer = producer
        self.queue = queue
        self._ended_before = 0

    def post(self) -> str:
        return self.producer.post(self.queue, PAYLOAD)["id"]

    def result(self, handle: str) -> None:
        self.producer.result(self.queue, handle, timeout=RESULT_TIMEOUT)  # raises if failed or late

    def wait_all(self, handles: list, *, timeout: float) -> None:
        """The queue's counts (one call each) until every item posted since `begin()` has ended."""
        deadline = time.monotonic() + timeout
        while True:
            counts = self.producer.stats(self.queue)["counts"]
            ended = counts["finished"] + counts["failed"]
            if ended >= self._ended_before + len(handles) and counts["pending"] == counts["processing"] == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers did not finish {len(handles)} items: {counts}")
            time.sleep(POLL_SECONDS)

    def begin(self) -> None:
        """What has ended so far, so `wait_all` counts only what comes after."""
        counts = self.producer.stats(self.queue)["counts"]
        self._ended_before = counts["finished"] + counts["failed"]


def concurrent_posts(url: str, token: str, queue: str, *, threads: int, seconds: float) -> dict:
    """`threads` threads, each with its own `Producer`, posting single items back to back for
    `seconds`: the items per second of them all, and one post's time (p50, p99, ms)."""
    producers = [Producer(url, token, timeout=60) for _ in range(threads)]
    took: list[list[float]] = [[] for _ in range(threads)]
    failures: list[BaseException] = []
    clock = {"began": 0.0, "deadline": 0.0}

    def set_clock() -> None:  # run by the barrier before it lets anyone go
        clock["began"] = time.perf_counter()
        clock["deadline"] = clock["began"] + seconds

    start = threading.Barrier(threads + 1, action=set_clock)

    def post_for_a_while(producer: Producer, mine: list[float]) -> None:
        try:
            producer.post(queue, PAYLOAD)  # untimed: opens the connection
            start.wait()
            while (started := time.perf_counter()) < clock["deadline"]:
                producer.post(queue, PAYLOAD)
                mine.append((time.perf_counter() - started) * 1000)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)
            start.abort()

    workers = [
        threading.Thread(target=post_for_a_while, args=(producer, mine), daemon=True)
        for producer, mine in zip(producers, took)
    ]
    try:
        for worker in workers:
            worker.start()
        try:
            start.wait()
        except threading.BrokenBarrierError:
            pass  # a thread failed before the start: its error is raised below
        for worker in workers:
            worker.join()
        elapsed = time.perf_counter() - clock["began"]
    finally:
        for producer in producers:
            producer.close()
    if failures:
        raise RuntimeError(f"a producer thread failed: {failures[0]!r}") from failures[0]
    every = [ms for mine in took for ms in mine]
    return {"postsPerSecond": len(every) / elapsed, "postMs": percentiles(every, 50, 99)}


def batch_items_per_second(producer: Producer, queue: str, *, seconds: float, batch: int) -> float:
    """Items per second through `Producer.post_many`, `batch` items a call, back to back."""
    payloads = [PAYLOAD] * batch
    producer.post_many(queue, payloads)  # untimed: opens the connection
    count, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        count += len(producer.post_many(queue, payloads))
    return count / elapsed


def keyed_and_plain_posts(producer: Producer, queue: str, *, seconds: float, batch: int) -> dict:
    """Posts with a new idempotency key per item and without, through `Producer.post` and
    `Producer.post_many` (`batch` a call), in turns of a tenth of `seconds` so the disk's moods
    fall on both alike: {"singlePostsPerSecond": {"plain", "keyed"}, "postManyItemsPerSecond": ...}."""
    serial = itertools.count()
    payloads = [PAYLOAD] * batch

    def single(keyed: bool) -> int:
        producer.post(queue, PAYLOAD, key=f"bench-{next(serial)}" if keyed else None)
        return 1

    def many(keyed: bool) -> int:
        keys = [f"bench-{next(serial)}" for _ in payloads] if keyed else None
        return len(producer.post_many(queue, payloads, keys=keys))

    figures = {}
    for name, post in (("singlePostsPerSecond", single), ("postManyItemsPerSecond", many)):
        counts, spent = {False: 0, True: 0}, {False: 0.0, True: 0.0}
        for turn in range(20):
            keyed = bool(turn % 2)
            started = time.perf_counter()
            while (elapsed := time.perf_counter() - started) < seconds / 10:
                counts[keyed] += post(keyed)
            spent[keyed] += elapsed
        figures[name] = {"plain": counts[False] / spent[False], "keyed": counts[True] / spent[True]}
    return figures
