"""The queue gauges: items by state and the age of the oldest pending item, per queue.

They are read from the data directory that every server process shares, so any process gives
the same figures. Counting lists the state directories, so the counts are kept and taken again
only once they are older than MIN_AGE_SECONDS, and never more often than lets the listings take
more than COST_SHARE of the time: a queue of a million items is listed every few seconds at
most, however often it is scraped. The age of the oldest pending item is reckoned at each
scrape from its posting time, so it grows between listings as it should.
"""

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client.core import GaugeMetricFamily

from ..roster import roster
from ..runtime import get_store, run
from ..store import Counts
from .families import REGISTRY

MIN_AGE_SECONDS = 1.0
COST_SHARE = 0.05
STATES = ("scheduled", "pending", "processing", "finished", "failed")

log = logging.getLogger(__name__)


def count_queues(names: list[str]) -> dict[str, Counts]:
    """Every queue's counts (a queue the disk cannot count now is left out, and logged)."""
    store, counts = get_store(), {}
    for name in names:
        try:
            counts[name] = store.count_items(queue=name)
        except Exception:
            log.warning("could not count the items of queue %s", name, exc_info=True)
    return counts


class QueueFigures:
    """The counts of every queue as last listed, and a Prometheus collector of them."""

    def __init__(
        self,
        *,
        min_age: float = MIN_AGE_SECONDS,
        cost_share: float = COST_SHARE,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.min_age = min_age
        self.cost_share = cost_share
        self.clock = clock
        self.counts: dict[str, Counts] = {}
        self._names: tuple[str, ...] = ()
        self._taken_at = float("-inf")
        self._took = 0.0
        self._taking: asyncio.Future | None = None

    def max_age(self) -> float:
        return max(self.min_age, self._took / self.cost_share)

    async def refresh(self, names: list[str]) -> None:
        """Count again if the counts are too old or the queues changed; concurrent scrapes share
        one count."""
        names = tuple(names)
        fresh = self.clock() - self._taken_at < self.max_age()
        if fresh and names == self._names:
            return
        if self._taking is None or self._taking.done():
            self._taking = asyncio.ensure_future(self._take(names))
        await asyncio.shield(self._taking)

    async def _take(self, names: tuple[str, ...]) -> None:
        started = self.clock()
        counts = await run(count_queues, names=list(names))
        self._took = self.clock() - started
        self.counts, self._names, self._taken_at = counts, names, self.clock()

    def collect(self):
        items = GaugeMetricFamily(
            "taskhoster_queue_items", "Items in each state, per queue (the same from every server process).",
            labels=["queue", "state"],
        )
        oldest = GaugeMetricFamily(
            "taskhoster_queue_oldest_item_age_seconds",
            "Age of the oldest pending item, per queue; 0 when none is pending.",
            labels=["queue"],
        )
        workers = GaugeMetricFamily(
            "taskhoster_workers_connected",
            "Worker sockets open on this server process that have claimed from the queue.",
            labels=["queue"],
        )
        now = time.time()
        connected = roster.by_queue()
        for name in self._names:
            counts = self.counts.get(name)
            if counts is not None:
                for state in STATES:
                    items.add_metric([name, state], getattr(counts, state))
                posted_at = counts.oldest_pending_posted_at
                oldest.add_metric([name], max(0.0, now - posted_at) if posted_at is not None else 0.0)
            workers.add_metric([name], connected.get(name, 0))
        return [items, oldest, workers]


queue_figures = QueueFigures()
REGISTRY.register(queue_figures)
