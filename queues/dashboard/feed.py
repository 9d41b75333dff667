"""One snapshot per process per tick, shared by every connected dashboard.

A ticker task runs while at least one dashboard listens: it computes the snapshot once (off the
event loop), encodes it once, and hands the same text to every listener. Each listener keeps only
the newest snapshot, so a slow socket never holds up the others or piles up old ones.
"""

import asyncio
import json
import logging
import weakref

from ..roster import roster
from ..runtime import get_registry, get_store, run
from .rates import LastMinute
from .snapshot import take_snapshot

log = logging.getLogger(__name__)

TICK_SECONDS = 1.0


async def snapshot_text(last_minute: LastMinute) -> str:
    """The queues (with what ended in the last 60 s) and the connected workers, as one message."""
    registry = get_registry()
    await registry.arefresh()
    store = get_store()
    snapshot = await run(take_snapshot, store=store, configs=registry.queues(), workers=roster.everyone())
    ended = last_minute.update(store.clock(), {queue["name"]: queue["throughput"] for queue in snapshot["queues"]})
    for queue in snapshot["queues"]:
        queue["lastMinute"] = ended[queue["name"]]
    return json.dumps({"type": "snapshot", **snapshot}, separators=(",", ":"))


class SnapshotFeed:
    def __init__(self, compute=None, *, interval: float = TICK_SECONDS):
        last_minute = LastMinute()  # kept between tickers: a page opened again finds the last minute's looks
        self.compute = compute or (lambda: snapshot_text(last_minute))
        self.interval = interval
        self._listeners: set[asyncio.Queue] = set()
        self._ticker: asyncio.Task | None = None

    def subscribe(self) -> asyncio.Queue:
        """A box that always holds the newest snapshot not yet taken."""
        box: asyncio.Queue = asyncio.Queue(maxsize=1)
        self._listeners.add(box)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick())
        return box

    def unsubscribe(self, box: asyncio.Queue) -> None:
        self._listeners.discard(box)
        if not self._listeners and self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None

    async def _tick(self) -> None:
        while self._listeners:
            try:
                text = await self.compute()
            except Exception:  # a bad tick (database away for a moment) must not end the feed
                log.exception("dashboard snapshot failed")
            else:
                for box in list(self._listeners):
                    _put_newest(box, text)
            await asyncio.sleep(self.interval)


def _put_newest(box: asyncio.Queue, text: str) -> None:
    if box.full():
        box.get_nowait()
    box.put_nowait(text)


# One feed per event loop: a server process has one loop; tests start a fresh loop per test.
_feeds: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SnapshotFeed]" = weakref.WeakKeyDictionary()


def get_feed() -> SnapshotFeed:
    loop = asyncio.get_running_loop()
    feed = _feeds.get(loop)
    if feed is None:
        feed = _feeds[loop] = SnapshotFeed()
    return feed
