"""Wake-ups across server processes, through the channel layer.

Each server process runs one `ChannelBridge`: one channel for the whole process (not one per
socket), added to a group per queue. What the in-process hub is told (items available, with a
count; items terminal, with their ids; items canceled, with their ids and the claims canceled) is
published to the queue's group; what other processes publish is fed into this process's hub with
`local_only=True`, and our own messages are ignored.
Wake-ups are hints: a lost one costs a waiter at most its one-second re-check of the disk.
"""

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable

from . import events
from .runtime import get_registry

log = logging.getLogger(__name__)

MESSAGE_TYPE = "taskhoster.wake"
REJOIN_SECONDS = 1.0  # how soon a new queue's group is joined (and memberships refreshed)
RETRY_SECONDS = 1.0


def group_name(queue: str) -> str:
    return f"taskhoster.queue.{queue}"


async def registered_queue_names() -> list[str]:
    registry = get_registry()
    await registry.arefresh()
    return [config.name for config in registry.queues()]


async def open_channel(layer, what: str) -> str:
    """A channel of the layer to receive on, once the layer can be reached: a server started while
    Redis is down works alone meanwhile (claims still find items by their re-check)."""
    while True:
        try:
            return await layer.new_channel()
        except Exception:
            log.warning("cannot reach the channel layer for %s; trying again", what, exc_info=True)
            await asyncio.sleep(RETRY_SECONDS)


class ChannelBridge:
    def __init__(
        self,
        layer,
        *,
        hub: events.Hub = events.hub,
        queue_names: Callable[[], Awaitable[Iterable[str]]] = registered_queue_names,
    ):
        self.layer = layer
        self.hub = hub
        self.queue_names = queue_names
        self.channel: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._available: dict[str, int] = {}
        self._terminal: dict[str, list[str]] = {}
        self._canceled: dict[str, list[list]] = {}  # queue -> [id, claim token] pairs
        self._flush_scheduled = False
        self._outbox_ready: asyncio.Event | None = None

    async def run(self) -> None:
        """Join the groups, publish what the hub is told and feed in what others publish; until
        cancelled."""
        self._loop = asyncio.get_running_loop()
        self._outbox_ready = asyncio.Event()
        self.channel = await open_channel(self.layer, "wake-ups and cancels from other processes")
        self.hub.bridge = self
        try:
            await asyncio.gather(self._join_groups(), self._send_outbox(), self._receive())
        finally:
            if self.hub.bridge is self:
                self.hub.bridge = None

    def publish(self, kind: str, queue: str, payload) -> None:
        """Called by the hub from any thread (the sweep's too): queue the notification and let the
        event loop send it. Notifications made meanwhile are merged into one message per queue."""
        with self._lock:
            if kind == "available":
                self._available[queue] = self._available.get(queue, 0) + payload
            else:
                (self._terminal if kind == "terminal" else self._canceled).setdefault(queue, []).extend(payload)
            schedule, self._flush_scheduled = not self._flush_scheduled, True
        if schedule:
            self._loop.call_soon_threadsafe(self._outbox_ready.set)

    async def _send_outbox(self) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            with self._lock:
                available, self._available = self._available, {}
                terminal, self._terminal = self._terminal, {}
                canceled, self._canceled = self._canceled, {}
                self._flush_scheduled = False
            for queue, count in available.items():
                await self._send(queue, {"kind": "available", "count": count})
            for queue, item_ids in terminal.items():
                await self._send(queue, {"kind": "terminal", "ids": item_ids})
            for queue, item_ids in canceled.items():
                await self._send(queue, {"kind": "canceled", "ids": item_ids})

    async def _send(self, queue: str, fields: dict) -> None:
        message = {"type": MESSAGE_TYPE, "origin": self.channel, "queue": queue, **fields}
        try:
            await self.layer.group_send(group_name(queue), message)
        except Exception:  # the layer is down for a moment: waiters fall back to their re-check
            log.warning("cannot publish a wake-up for queue %s", queue, exc_info=True)

    async def _receive(self) -> None:
        while True:
            try:
                message = await self.layer.receive(self.channel)
            except Exception:
                log.warning("cannot receive wake-ups", exc_info=True)
                await asyncio.sleep(RETRY_SECONDS)
                continue
            if message.get("origin") != self.channel:
                self._deliver(message)

    def _deliver(self, message: dict) -> None:
        queue, kind = message.get("queue"), message.get("kind")
        if not isinstance(queue, str):
            return
        if kind == "available" and isinstance(message.get("count"), int):
            self.hub.items_available(queue, message["count"], local_only=True)
        elif kind == "terminal" and isinstance(message.get("ids"), list):
            self.hub.items_terminal(queue, message["ids"], local_only=True)
        elif kind == "canceled" and isinstance(message.get("ids"), list):
            for canceled in message["ids"]:  # [id, claim token]
                if isinstance(canceled, list) and len(canceled) == 2:
                    self.hub.item_canceled(queue, *canceled, local_only=True)

    async def _join_groups(self) -> None:
        """Be in the group of every queue, re-joining each time (memberships may expire)."""
        joined: set[str] = set()
        while True:
            try:
                names = set(await self.queue_names())
                for name in names:
                    await self.layer.group_add(group_name(name), self.channel)
                for name in joined - names:
                    await self.layer.group_discard(group_name(name), self.channel)
                joined = names
            except Exception:
                log.warning("cannot join the queue groups", exc_info=True)
            await asyncio.sleep(REJOIN_SECONDS)
