"""The leases of the items whose handlers run: each renewed at every half of it, over the socket
the item was claimed over, until its handler finishes."""

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any

from .errors import PASSING_CODES, ApiError
from .jobs import Job
from .link import Link, LinkClosed

log = logging.getLogger("taskhoster.worker")


async def release(link: Link, job: Job, *, delay: float = 0, error: Any = None) -> None:
    """Give the item back to its queue: pending now, or scheduled `delay` seconds from now;
    `error` (if not None) is kept on the item as its lastError. A refusal is logged, not raised."""
    try:
        await _ask_release(link, job, delay=delay, error=error)
    except (ApiError, LinkClosed) as exc:
        # not held any more, the socket closed (its items are back in their queues), or the
        # server could not make it for now: none of it is for the caller to mend
        _not_taken(job, exc)


def _not_taken(job: Job, exc: Exception) -> None:
    log.info("release of %s %s not taken (%s)", job.queue, job.id, str(exc) or "the socket closed")


async def _ask_release(link: Link, job: Job, *, delay: float, error: Any) -> None:
    frame = {"op": "release", "queue": job.queue, "id": job.id}
    if delay:
        frame["delay"] = delay
    if error is not None:
        frame["error"] = error
    await link.request(frame)


DUE_SLACK_SECONDS = 0.001  # a timer may fire this much before its time: what is due then is due
EXTEND_RETRY_SECONDS = 1.0  # after a renewal the server could not make for now (errors.PASSING_CODES)
RELEASE_RETRY_SECONDS = 1.0  # after a release it could not make for now


def _show_latest_claim(running: Job, claim: Job) -> None:
    """The item of a handler still running (its job, `running`) was claimed again (after a lost
    socket): that job shows the new claim from now on, so whoever asks whether this is the last
    try (the worker, the handler) hears the server's count. Jobs are frozen to handlers, not here."""
    for name in ("attempts", "claimed_at", "lease_expires_at", "lease_seconds", "max_attempts", "last_error"):
        object.__setattr__(running, name, getattr(claim, name))


class _Lease:
    """One held item, the socket it was claimed over, and when its next renewal is due (None
    while a renewal is out)."""

    __slots__ = ("job", "link", "due")

    def __init__(self, job: Job, link: Link, due: float):
        self.job = job
        self.link = link
        self.due: float | None = due


class Leases:
    """The items held while their handlers run. One timer serves them all, set for the earliest
    renewal due: most handlers finish long before theirs, and a timer per item would be made and
    cancelled for nothing (each one a push into the loop's heap of timers). A renewal the server
    could not make for now (busy, a full disk) is tried again soon; one refused otherwise
    is not: the item is no longer held (finished elsewhere, timed out) or its socket closed, and
    the server has re-queued it; the handler's result may still be accepted."""

    def __init__(self, spawn: Callable[[Coroutine], asyncio.Task]):
        self._spawn = spawn
        self._loop = asyncio.get_running_loop()
        self._held: dict[str, _Lease] = {}
        self._timer: asyncio.TimerHandle | None = None

    def hold(self, job: Job, link: Link) -> None:
        """Keep the item's lease from now on. An item claimed again while its handler still runs
        (after a lost socket, say) is renewed over the new socket."""
        due = self._loop.time() + job.lease_seconds / 2
        lease = self._held.get(job.id)
        if lease is None:
            self._held[job.id] = _Lease(job, link, due)
        else:
            _show_latest_claim(lease.job, job)
            lease.link, lease.due = link, due
        if self._timer is None or due < self._timer.when():
            self._set_timer(due)

    def let_go(self, item_id: str) -> None:
        """The handler finished: stop renewing (the timer, if it fires, finds nothing due)."""
        self._held.pop(item_id, None)

    def job(self, item_id: str) -> Job | None:
        lease = self._held.get(item_id)
        return None if lease is None else lease.job

    def holding(self, item_id: str) -> tuple[Job, Link] | None:
        """The item's job and the socket it was claimed over, if that socket is still open (else
        the server has put the item back in its queue)."""
        lease = self._held.get(item_id)
        return None if lease is None or lease.link.closed else (lease.job, lease.link)

    def held(self) -> list[tuple[Job, Link]]:
        return [(lease.job, lease.link) for lease in self._held.values()]

    async def give_back(self, item_id: str, *, delay: float = 0, error: Any = None) -> None:
        """Release the item over the socket it was last claimed over (see `release`). One the
        server could not make for now (busy, a full disk) goes again after a pause, its delay
        shortened by the wait, while the item is held here (its lease renewed meanwhile): let go,
        it would wait for its lease to lapse rather than for its delay."""
        started = self._loop.time()
        while (lease := self._held.get(item_id)) is not None:
            waited = self._loop.time() - started
            try:
                await _ask_release(lease.link, lease.job, delay=max(0.0, delay - waited), error=error)
                return
            except ApiError as exc:
                if exc.code not in PASSING_CODES or lease.link.closed:
                    _not_taken(lease.job, exc)
                    return
                pause = min(RELEASE_RETRY_SECONDS, lease.job.lease_seconds / 8)
                log.warning("could not release %s %s (%s); trying again in %g s", lease.job.queue, item_id, exc, pause)
                await asyncio.sleep(pause)
            except LinkClosed as exc:  # its items are back in their queues
                _not_taken(lease.job, exc)
                return

    def _set_timer(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._renew_due)

    def _renew_due(self) -> None:
        self._timer = None
        now, next_due = self._loop.time() + DUE_SLACK_SECONDS, None
        for lease in self._held.values():
            if lease.due is None:
                continue
            if lease.due <= now:
                lease.due = None
                if not lease.link.closed:
                    self._spawn(self._extend(lease))
            elif next_due is None or lease.due < next_due:
                next_due = lease.due
        if next_due is not None:
            self._set_timer(next_due)

    async def _extend(self, lease: _Lease) -> None:
        job, link = lease.job, lease.link
        try:
            await link.request(
                {"op": "extend", "queue": job.queue, "id": job.id, "seconds": max(1, math.ceil(job.lease_seconds))}
            )
        except ApiError as exc:
            if exc.code in PASSING_CODES and self._held.get(job.id) is lease and lease.due is None:
                pause = min(EXTEND_RETRY_SECONDS, job.lease_seconds / 8)  # several tries before it lapses
                log.warning("could not renew the lease of %s %s (%s); trying again in %g s", job.queue, job.id,
                            exc, pause)
                self._due_at(lease, self._loop.time() + pause)
            else:
                log.info("stopped renewing the lease of %s %s: %s", job.queue, job.id, exc)
            return
        except LinkClosed as exc:
            log.info("stopped renewing the lease of %s %s: %s", job.queue, job.id, exc)
            return
        if self._held.get(job.id) is lease and lease.due is None:  # not let go or claimed again meanwhile
            self._due_at(lease, self._loop.time() + job.lease_seconds / 2)

    def _due_at(self, lease: _Lease, when: float) -> None:
        lease.due = when
        if self._timer is None or when < self._timer.when():
            self._set_timer(when)
