"""A graceful stop: no more claims; running handlers get the grace period; the items of those
that outlast it are given back; results not yet acknowledged get a while to go in. A second
stop (`now`) skips the waiting."""

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("taskhoster.worker")

DRAIN_SECONDS = 10.0  # after the grace period: how long to keep trying to hand results in


class Shutdown:
    """Waits for a stop and carries it out; `finished` is set once the run may close its socket.
    The run lends it what the steps need: `stop_claiming`, how many handlers are `busy`, a way
    to `abandon` those still running, how many results are `unsent`."""

    def __init__(self, grace: float, *, stop_claiming: Callable[[], None], busy: Callable[[], int],
                 abandon: Callable[[], Awaitable[None]], unsent: Callable[[], int]):
        self._grace = grace
        self._stop_claiming = stop_claiming
        self._busy = busy
        self._abandon = abandon
        self._unsent = unsent
        self._asked = asyncio.Event()
        self._hurry = asyncio.Event()
        self._finished = asyncio.Event()
        self.letting_handlers_finish = False  # a claim that was out when the stop came runs its items meanwhile

    @property
    def stopping(self) -> bool:
        return self._asked.is_set()

    @property
    def finished(self) -> asyncio.Event:
        return self._finished

    def request(self, now: bool = False) -> None:
        self._asked.set()
        if now:
            self._hurry.set()

    async def carry_out_when_asked(self) -> None:
        await self._asked.wait()
        self._stop_claiming()
        if self._busy():
            log.info("stopping: waiting up to %g s for %d running handlers", self._grace, self._busy())
            self.letting_handlers_finish = True
            try:
                await self._until(lambda: not self._busy(), self._grace)
            finally:
                self.letting_handlers_finish = False
        await self._abandon()
        if not self._hurry.is_set():
            await self._until(lambda: not self._unsent(), DRAIN_SECONDS)
        if self._unsent():
            # their items go back to their queues when the socket closes
            log.warning("stopping with %d results the server has not taken: their items go back to their queues, "
                        "to be worked again (or end max_attempts, if that was their last try)", self._unsent())
        self._finished.set()

    async def _until(self, condition: Callable[[], bool], seconds: float) -> None:
        """Wait until `condition()` holds, `seconds` pass, or a second stop asks to hurry."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not condition() and not self._hurry.is_set() and loop.time() < deadline:
            try:
                await asyncio.wait_for(self._hurry.wait(), min(0.05, max(0.0, deadline - loop.time())))
            except TimeoutError:
                pass
