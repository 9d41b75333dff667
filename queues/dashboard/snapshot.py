"""What the dashboard shows, read from the disk through the store.

Counts are directory listings and throughput is the store's per-minute tallies, so the figures
are right whichever server process or sweeper made the changes.
"""

from collections.abc import Iterable

from ..ids import iso
from ..services import describe_queue
from ..store import QueueConfig, Store

THROUGHPUT_MINUTES = 15


def take_snapshot(store: Store, configs: Iterable[QueueConfig]) -> dict:
    """Every queue as the API shows it, plus items finished and failed per minute."""
    now = store.clock()
    return {"at": iso(now), "queues": [_describe(store, config, now) for config in configs]}


def _describe(store: Store, config: QueueConfig, now: float) -> dict:
    data = describe_queue(config, store.count_items(queue=config.name), now)
    data["throughput"] = [
        {"minute": iso(start), "finished": finished, "failed": failed}
        for start, finished, failed in store.throughput(queue=config.name, minutes=THROUGHPUT_MINUTES)
    ]
    return data
