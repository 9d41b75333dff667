"""Taskhoster as its users see it: every call through our own client (`taskhoster.Producer`;
the workers are `taskhoster.Worker` processes, queues/bench/worker.py). The workload shared with
the peers is in workload.py, with the loop that times concurrent producers (ours and theirs);
the batches and the keyed posts are ours alone."""

import itertools
import time
from functools import partial

from taskhoster import Producer

from .workload import PAYLOAD, RESULT_TIMEOUT, threaded_posts

POLL_SECONDS = 0.01


class TaskhosterSystem:
    """The workload's `System` through a `Producer` on a queue that `Worker`s work."""

    def __init__(self, producer: Producer, queue: str):
        self.producer = producer
        self.queue = queue
        self._ended_before = 0

    def post(self) -> str:
        return self.producer.post(self.queue, PAYLOAD)["id"]

    def result(self, handle: str, *, timeout: float = RESULT_TIMEOUT) -> None:
        self.producer.result(self.queue, handle, timeout=timeout)  # raises if failed or late

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
    """`threads` threads, each with its own `Producer` (as users give each thread its own),
    posting single items back to back for `seconds`, timed as the peers' are
    (workload.threaded_posts)."""
    producers = [Producer(url, token, timeout=60) for _ in range(threads)]
    try:
        return threaded_posts([partial(producer.post, queue, PAYLOAD) for producer in producers], seconds=seconds)
    finally:
        for producer in producers:
            producer.close()


def end_to_end_in_batches(users: TaskhosterSystem, *, items: int, batch: int) -> float:
    """`items` posted through `Producer.post_many`, `batch` a call, while the workers consume
    them: items per second from the first post until every result is in (as the single posts'
    end to end, workload.enqueue_and_end_to_end)."""
    users.begin()
    started = time.perf_counter()
    handles = []
    for first in range(0, items, batch):
        posted = users.producer.post_many(users.queue, [PAYLOAD] * min(batch, items - first))
        handles.extend(item["id"] for item in posted)
    backlog_timeout = RESULT_TIMEOUT + items / 100  # the workers may be far behind the posts
    users.result(handles[-1], timeout=backlog_timeout)
    users.wait_all(handles, timeout=backlog_timeout)
    return items / (time.perf_counter() - started)


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
