"""Which workers are connected, for the dashboard: every open /work socket of every server process.

Each process keeps its own sockets in a `Roster` (a socket joins once its token is accepted and
leaves when it closes). With a shared channel layer (Redis), a `RosterExchange` on each process's
event loop publishes that process's list every second to one group and keeps the lists the other
processes publish; a list not renewed within STALE_SECONDS is dropped (its process stopped). The
dashboard shows the local list and the others' together.
"""

import asyncio
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from . import ids
from .bridge import open_channel

log = logging.getLogger(__name__)

GROUP = "taskhoster.workers"
MESSAGE_TYPE = "taskhoster.roster"
PUBLISH_SECONDS = 1.0
STALE_SECONDS = 3.5  # three missed publications
HELD_SHOWN = 20  # items listed per worker; the count says how many in all


@dataclass
class Connection:
    """One open /work socket. `held` reads the items it holds now: (queue, id) pairs."""

    name: str  # the token's name
    address: str
    connected_at: float
    held: Callable[[], list[tuple[str, str]]]
    queues: set[str] = field(default_factory=set)  # the queues it has claimed from
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def describe(self) -> dict:
        held = self.held()
        return {
            "id": self.id,
            "name": self.name,
            "address": self.address,
            "connectedAt": ids.iso(self.connected_at),
            "queues": sorted(self.queues | {queue for queue, _ in held}),
            "holding": len(held),
            "held": [{"queue": queue, "id": item_id} for queue, item_id in sorted(held)[:HELD_SHOWN]],
        }


class Roster:
    """The sockets of this process, and the lists other processes published."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._lock = threading.Lock()  # the dashboard's page view reads from a thread
        self._local: dict[str, Connection] = {}
        self._remote: dict[str, tuple[float, list[dict]]] = {}  # process -> (received at, its workers)

    def join(self, connection: Connection) -> None:
        with self._lock:
            self._local[connection.id] = connection

    def leave(self, connection: Connection) -> None:
        with self._lock:
            self._local.pop(connection.id, None)

    def local(self) -> list[dict]:
        with self._lock:
            connections = list(self._local.values())
        return [connection.describe() for connection in connections]

    def by_queue(self) -> Counter:
        """This process's sockets by the queues each has claimed from (a socket is not bound to
        one queue: it counts for every queue it asked for items)."""
        with self._lock:
            return Counter(queue for connection in self._local.values() for queue in connection.queues)

    def heard(self, process: str, workers: list[dict]) -> None:
        with self._lock:
            self._remote[process] = (self.clock(), workers)

    def everyone(self) -> list[dict]:
        """Every connected worker, of this process and of the others, oldest connection first."""
        now = self.clock()
        with self._lock:
            for process in [p for p, (at, _) in self._remote.items() if now - at > STALE_SECONDS]:
                del self._remote[process]
            remote = [worker for _, workers in self._remote.values() for worker in workers]
        return sorted(self.local() + remote, key=lambda worker: (worker["connectedAt"], worker["id"]))


roster = Roster(time.time)  # this process's


def per_queue(workers: list[dict]) -> dict[str, int]:
    """How many connected workers work each queue."""
    counts: dict[str, int] = {}
    for worker in workers:
        for queue in worker["queues"]:
            counts[queue] = counts.get(queue, 0) + 1
    return counts


class RosterExchange:
    """Publishes this process's workers and takes in the other processes' lists, over the
    channel layer, until cancelled."""

    def __init__(self, layer, roster: Roster):
        self.layer = layer
        self.roster = roster
        self.channel: str | None = None

    async def run(self) -> None:
        self.channel = await open_channel(self.layer, "the workers of other processes")
        await asyncio.gather(self._publish(), self._receive())

    async def _publish(self) -> None:
        while True:
            try:
                await self.layer.group_add(GROUP, self.channel)  # again each time: memberships may expire
                message = {"type": MESSAGE_TYPE, "origin": self.channel, "workers": self.roster.local()}
                await self.layer.group_send(GROUP, message)
            except Exception:  # the layer is down for a moment: the others drop our list, then get it again
                log.warning("cannot publish the connected workers", exc_info=True)
            await asyncio.sleep(PUBLISH_SECONDS)

    async def _receive(self) -> None:
        while True:
            try:
                message = await self.layer.receive(self.channel)
            except Exception:
                log.warning("cannot receive the connected workers", exc_info=True)
                await asyncio.sleep(PUBLISH_SECONDS)
                continue
            origin, workers = message.get("origin"), message.get("workers")
            if origin != self.channel and isinstance(origin, str) and isinstance(workers, list):
                self.roster.heard(origin, workers)
