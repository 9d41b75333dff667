"""What a claim and a quiet sweep pass cost as a queue grows, and what items scheduled for later
cost the rest. Plain functions, no Django needed:

    .venv/bin/python -m queues.bench.store_costs 10 100000
    .venv/bin/python -m queues.bench.store_costs --scheduled 1000000 --due-together 100000
    .venv/bin/python -m queues.bench.store_costs --keyed 1000000

Each figure is measured on a fresh data directory in a temporary directory of the system's
(set TMPDIR to measure another disk), built by posting through the store in batches of 1,000
with fsync off, and on a fresh Store, as a newly started server process would have.
"""

import argparse
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from queues.store import MAX_BATCH, NewItem, QueueConfig, Store
from queues.sweep import PROMOTE_SECONDS, Promoter, Sweeper

CONFIG = QueueConfig(name="bench")
SCHEDULED_SPREAD_SECONDS = 3600  # scheduled items of the bench come due over the hour after the next


def _post(store: Store, count: int, due: Callable[[int], float | None] = lambda n: None) -> None:
    """`count` items, in batches of 1,000; item n due at `due(n)` (None: pending now)."""
    for start in range(0, count, MAX_BATCH):
        batch = range(start, min(count, start + MAX_BATCH))
        store.post_items(config=CONFIG, items=[NewItem({"n": n}, run_at=due(n)) for n in batch])


@contextmanager
def _queue_with(pending: int, scheduled: int = 0) -> Iterator[Path]:
    """A data directory holding `pending` pending items, and `scheduled` more coming due over
    the hour after the next (none while it is built)."""
    with tempfile.TemporaryDirectory(prefix="store-costs-") as data_dir:
        builder = Store(data_dir, fsync=False)
        builder.ensure_queue(CONFIG.name)
        _post(builder, pending)
        later = time.time() + SCHEDULED_SPREAD_SECONDS  # none comes due while a big queue is built
        _post(builder, scheduled, lambda n: later + n * SCHEDULED_SPREAD_SECONDS / scheduled)
        os.sync()  # else the first fsync measured pays for writing the whole build out
        yield Path(data_dir)


def _first_claim(store: Store) -> None:
    """A fresh process's first claim: it finds items once the pending directory, which a large
    queue has listed in the background, is in view."""
    while not store.claim_items(config=CONFIG):
        time.sleep(0.005)


def first_claim_seconds(pending: int, *, fsync: bool = False) -> float:
    """A fresh process's first claim, from its start until the item is in hand."""
    with _queue_with(pending + 1) as data_dir:
        started = time.perf_counter()
        _first_claim(Store(data_dir, fsync=fsync))
        return time.perf_counter() - started


def claim_cost(pending: int, *, fsync: bool, claims: int = 200) -> float:
    """Mean seconds per one-item claim with `pending` items waiting (after the first claim, once
    the pending directory is in view)."""
    with _queue_with(pending + claims + 1) as data_dir:
        store = Store(data_dir, fsync=fsync)
        _first_claim(store)
        started = time.perf_counter()
        for _ in range(claims):
            (item,) = store.claim_items(config=CONFIG)
        return (time.perf_counter() - started) / claims


def quiet_sweep_seconds(pending: int) -> float:
    """One sweep pass over a queue with `pending` pending items and nothing to do."""
    with _queue_with(pending) as data_dir:
        sweeper = Sweeper(Store(data_dir, fsync=False), lambda: [CONFIG])
        started = time.perf_counter()
        changes = sweeper.sweep_once()
        took = time.perf_counter() - started
        if changes:
            raise AssertionError(f"the pass was not quiet: {changes}")
        return took


def _mean_seconds(operation: Callable[[], object], times: int) -> float:
    started = time.perf_counter()
    for _ in range(times):
        operation()
    return (time.perf_counter() - started) / times


def with_scheduled(scheduled: int, *, operations: int = 200) -> dict[str, dict[str, float]]:
    """A claim, a one-item post and a quiet sweep pass (each on a fresh process's store, fsync
    off) on a queue without scheduled items and on one with `scheduled` items waiting for later:
    {"claimMicroseconds": {"without": ..., "with": ...}, "postMicroseconds": ..., "quietSweepMs": ...}."""
    figures: dict[str, dict[str, float]] = {"claimMicroseconds": {}, "postMicroseconds": {}, "quietSweepMs": {}}
    for label, count in (("without", 0), ("with", scheduled)):
        with _queue_with(operations + 1, count) as data_dir:
            store = Store(data_dir, fsync=False)
            _first_claim(store)
            figures["claimMicroseconds"][label] = _mean_seconds(
                lambda: store.claim_items(config=CONFIG), operations) * 1e6
            figures["postMicroseconds"][label] = _mean_seconds(
                lambda: store.post_items(config=CONFIG, items=[NewItem({"n": 0})]), operations) * 1e6
            sweeper = Sweeper(store, lambda: [CONFIG])
            started = time.perf_counter()
            changes = sweeper.sweep_once()
            figures["quietSweepMs"][label] = (time.perf_counter() - started) * 1e3
            if changes:
                raise AssertionError(f"the pass was not quiet: {changes}")
    return figures


def due_together_seconds(count: int, *, fsync: bool) -> float:
    """Seconds from the moment `count` scheduled items come due, all in the same second, until a
    fresh process's promoter (a look every PROMOTE_SECONDS, as `serve` runs it) has moved them
    all to pending."""
    with tempfile.TemporaryDirectory(prefix="store-costs-") as data_dir:
        due = time.time() + 3600
        _post(Store(data_dir, fsync=False), count, lambda n: due)
        os.sync()
        ahead = due - time.time()  # the process's clock is moved on to their runAt
        promoter = Promoter(Store(data_dir, fsync=fsync, clock=lambda: time.time() + ahead), lambda: [CONFIG])
        started, promoted = time.perf_counter(), 0
        while True:
            promoted += sum(promoter.promote_once().values())
            if promoted >= count:
                return time.perf_counter() - started
            time.sleep(PROMOTE_SECONDS)


def with_keyed(keyed: int, *, operations: int = 200) -> dict[str, dict[str, float]]:
    """A keyed one-item post with a new key, and one repeating a key (answered with its item),
    on a fresh process's store (fsync off) beside 10 keyed items and beside `keyed`:
    {"newKeyMicroseconds": {"10": ..., "KEYED": ...}, "repeatMicroseconds": ...}."""
    figures: dict[str, dict[str, float]] = {"newKeyMicroseconds": {}, "repeatMicroseconds": {}}
    for count in (10, keyed):
        with tempfile.TemporaryDirectory(prefix="store-costs-") as data_dir:
            builder = Store(data_dir, fsync=False)
            for start in range(0, count, MAX_BATCH):
                batch = range(start, min(count, start + MAX_BATCH))
                builder.post_items(config=CONFIG, items=[NewItem({"n": n}, key=f"built-{n}") for n in batch])
            os.sync()
            store, fresh = Store(data_dir, fsync=False), iter(range(operations))
            figures["newKeyMicroseconds"][str(count)] = _mean_seconds(
                lambda: store.post_items(config=CONFIG, items=[NewItem({"n": 0}, key=f"new-{next(fresh)}")]),
                operations) * 1e6
            repeated = iter(range(operations))
            figures["repeatMicroseconds"][str(count)] = _mean_seconds(
                lambda: store.post_items(config=CONFIG, items=[NewItem({"n": (n := next(repeated) % count)}, key=f"built-{n}")]),
                operations) * 1e6
    return figures


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", type=int, help="numbers of pending items to measure")
    parser.add_argument("--claims", type=int, default=200)
    parser.add_argument("--scheduled", type=int, help="scheduled items to measure a claim, a post and a sweep beside")
    parser.add_argument("--due-together", type=int, help="scheduled items coming due in one second")
    parser.add_argument("--keyed", type=int, help="keyed items to measure a keyed post beside (and beside 10)")
    args = parser.parse_args(argv)
    if args.scheduled:
        print(f"with {args.scheduled:,} scheduled items:", with_scheduled(args.scheduled, operations=args.claims))
    if args.keyed:
        print(f"a keyed post beside 10 and {args.keyed:,} keyed items:", with_keyed(args.keyed, operations=args.claims))
    if args.due_together:
        for fsync in (False, True):
            seconds = due_together_seconds(args.due_together, fsync=fsync)
            print(f"{args.due_together:,} items due together, fsync {'on' if fsync else 'off'}: all pending "
                  f"in {seconds:.2f} s")
    if not args.sizes:
        return
    columns = ("pending", "claim", "claim fsync", "first claim", "quiet sweep", "peak RSS")
    print("".join(f"{name:>13}" for name in columns))
    for pending in args.sizes:
        claim = claim_cost(pending, fsync=False, claims=args.claims)
        claim_synced = claim_cost(pending, fsync=True, claims=args.claims)
        first = first_claim_seconds(pending)
        sweep = quiet_sweep_seconds(pending)
        figures = (f"{claim * 1e6:.0f} µs", f"{claim_synced * 1e6:.0f} µs", f"{first * 1e3:.1f} ms",
                   f"{sweep * 1e3:.1f} ms", f"{_peak_rss_mb():.0f} MB")
        print(f"{pending:>13}" + "".join(f"{figure:>13}" for figure in figures), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
