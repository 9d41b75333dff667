"""What a claim and a quiet sweep pass cost as a queue grows. Plain functions, no Django needed:

    .venv/bin/python -m queues.bench.store_costs 10 100000

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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from queues.store import MAX_BATCH, NewItem, QueueConfig, Store
from queues.sweep import Sweeper

CONFIG = QueueConfig(name="bench")


@contextmanager
def _queue_with(pending: int) -> Iterator[Path]:
    """A data directory holding `pending` pending items."""
    with tempfile.TemporaryDirectory(prefix="store-costs-") as data_dir:
        builder = Store(data_dir, fsync=False)
        builder.ensure_queue(CONFIG.name)
        for start in range(0, pending, MAX_BATCH):
            count = min(MAX_BATCH, pending - start)
            builder.post_items(config=CONFIG, items=[NewItem({"n": start + n}) for n in range(count)])
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


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="+", type=int, help="numbers of pending items to measure")
    parser.add_argument("--claims", type=int, default=200)
    args = parser.parse_args(argv)
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
