"""The leases of the items whose handlers run: each renewed at every half of it, over the socket
the item was claimed over, until its handler finishes."""

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine

from .errors import ApiError
from .jobs import Job
from .link import Link, LinkClosed

log = logging.getLogger("taskhoster.worker")


async def release(link: Link, job: Job) -> None:
    """Give the item back to its queue now."""
    try:
        await link.request({"op": "release", "queue": job.queue, "id": job.id})
    except (ApiError, LinkClosed):
        pass  # not held any more, or the socket closed: either way it is not ours


class _Lease:
    """One held item, the socket it was claimed over, and the timer of its next renewal (a timer,
    not a task: most handlers finish long before it fires). No timer while a renewal is out."""

    __slots__ = ("job", "link", "timer")

    def __init__(self, job: Job, link: Link):
        self.job = job
        self.link = link
        self.timer: asyncio.TimerHandle | None = None


class Leases:
    """The items held while their handlers run. A renewal that fails is not tried again: the
    item is no longer held (finished elsewhere, timed out) or its socket closed, and the server
    has re-queued it; the handler's result may still be accepted."""

    def __init__(self, spawn: Callable[[Coroutine], asyncio.Task]):
        self._spawn = spawn
        self._loop = asyncio.get_running_loop()
        self._held: dict[str, _Lease] = {}

    def hold(self, job: Job, link: Link) -> None:
        """Keep the item's lease from now on. An item claimed again while its handler still runs
        (after a lost socket, say) is renewed over the new socket."""
        lease = self._held.get(job.id)
        if lease is None:
            lease = self._held[job.id] = _Lease(job, link)
        else:
            if lease.timer is not None:
                lease.timer.cancel()
            lease.job, lease.link = job, link
        self._renew_later(lease)

    def let_go(self, item_id: str) -> None:
        """The handler finished: stop renewing."""
        lease = self._held.pop(item_id, None)
        if lease is not None and lease.timer is not None:
            lease.timer.cancel()

    def held(self) -> list[tuple[Job, Link]]:
        return [(lease.job, lease.link) for lease in self._held.values()]

    async def give_back(self, item_id: str) -> None:
        """Release the item over the socket it was last claimed over."""
        lease = self._held.get(item_id)
        if lease is not None:
            await release(lease.link, lease.job)

    def _renew_later(self, lease: _Lease) -> None:
        lease.timer = self._loop.call_later(lease.job.lease_seconds / 2, self._renew, lease)

    def _renew(self, lease: _Lease) -> None:
        lease.timer = None
        if not lease.link.closed:
            self._spawn(self._extend(lease))

    async def _extend(self, lease: _Lease) -> None:
        job, link = lease.job, lease.link
        try:
            await link.request(
                {"op": "extend", "queue": job.queue, "id": job.id, "seconds": max(1, math.ceil(job.lease_seconds))}
            )
        except (ApiError, LinkClosed) as exc:
            log.info("stopped renewing the lease of %s %s: %s", job.queue, job.id, exc)
            return
        if self._held.get(job.id) is lease and lease.timer is None:  # not let go or claimed again meanwhile
            self._renew_later(lease)
