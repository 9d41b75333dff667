"""What the dashboard shows, read from the disk through the store.

Counts are directory listings and throughput is the store's per-minute tallies, so the figures
are right whichever server process or sweeper made the changes.
"""

from collections.abc import Iterable

from ..ids import iso
from ..roster import per_queue
from ..services import describe_queue
from ..store import QueueConfig, Store
from .rates import estimate

THROUGHPUT_MINUTES = 15


def take_snapshot(store: Store, configs: Iterable[QueueConfig], workers: Iterable[dict] = ()) -> dict:
    """Every queue as the API shows it, plus items finished and failed per minute (and an estimate
    of the last 60 s, which the live feed replaces with its own count) and how many of `workers`
    work it; and the workers."""
    now = store.clock()
    workers = list(workers)
    working = per_queue(workers)
    return {
        "at": iso(now),
        "queues": [_describe(store, config, now, working.get(config.name, 0)) for config in configs],
        "workers": workers,
    }


def _describe(store: Store, config: QueueConfig, now: float, workers: int) -> dict:
    counts = store.count_items(queue=config.name)
    data = describe_queue(config, counts, now)
    data["errorResults"] = counts.errors  # of the finished: the dashboard tells them apart
    data["throughput"] = [
        {"minute": iso(start), "finished": finished, "failed": failed}
        for start, finished, failed in store.throughput(queue=config.name, minutes=THROUGHPUT_MINUTES)
    ]
    data["lastMinute"] = estimate(data["throughput"], now)
    data["workers"] = workers
    return data
