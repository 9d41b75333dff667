"""One Worker.run: its parts wired together, each handler run on its item, and the one place that
acts on what changed, once per event-loop turn.

    Connection  the /work socket, connected again after a loss
    Claims      asking for items as slots free up
    Leases      renewing the items the handlers work on
    Outbox      the results until the server has answered for them
    Shutdown    a graceful stop
"""

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, NamedTuple

from .claims import Claims
from .connection import Connection
from .jobs import Handler, HandlerThreads, Job, error_result, is_async, retry_delay
from .leases import Leases, release
from .link import Link
from .outbox import Outbox
from .shutdown import Shutdown

log = logging.getLogger("taskhoster.worker")


class Run:
    """One Worker.run. What the parts may ask of it: `spawn` a task, `fail` for good, `nudge` it to
    act this turn, `take` a claimed job, how many handlers are `busy`, whether it has `failed`."""

    def __init__(self, handler: Handler, *, url: str, token: str, queues: list[str], concurrency: int,
                 on_error: str, retry_base: float, retry_cap: float, grace: float):
        self.loop = asyncio.get_running_loop()
        self._handler = handler
        self._in_threads = not is_async(handler)  # decided once, not for every item
        self._threads = HandlerThreads()
        self._on_error = on_error
        self._retry_base, self._retry_cap = retry_base, retry_cap
        self._claims = Claims(self, queues, concurrency, url)
        self._shutdown = Shutdown(grace, stop_claiming=self._claims.stop, busy=self.busy,
                                  abandon=self._abandon_handlers, unsent=self._unsent)
        self._connection = Connection(url, token, finished=self._shutdown.finished,
                                      on_open=self._socket_opened, on_close=self._socket_closed)
        self._leases = Leases(self.spawn)
        self._outbox = Outbox(self)
        self._handlers: dict[str, asyncio.Task | InThread] = {}  # item id -> its running handler
        # item id -> whether a claim brought it again since its failed run's release went out
        self._giving_back: dict[str, bool] = {}
        self._turn: asyncio.Handle | None = None  # the end-of-turn step, when one is due
        self._fatal: BaseException | None = None

    async def main(self) -> None:
        shutdown = self.spawn(self._shutdown.carry_out_when_asked())
        try:
            await self._connection.stay_connected()
        finally:
            shutdown.cancel()
            if self._turn is not None:
                self._turn.cancel()
            self._outbox.stop()
            for running in list(self._handlers.values()):
                running.cancel()
            self._threads.close()
        if self._fatal is not None:
            raise self._fatal

    def request_stop(self, now: bool = False) -> None:
        self._shutdown.request(now)

    @property
    def stopping(self) -> bool:
        return self._shutdown.stopping

    @property
    def letting_handlers_finish(self) -> bool:
        """Stopping, and waiting for running handlers within the grace period."""
        return self._shutdown.letting_handlers_finish

    @property
    def failed(self) -> bool:
        return self._fatal is not None

    def spawn(self, coroutine: Coroutine) -> asyncio.Task:
        """A task of this run. Should it ever fail unexpectedly (a bug), the run stops and raises
        the error, rather than live on with a part missing (no more claims, say)."""
        task = self.loop.create_task(coroutine)
        task.add_done_callback(self._check)
        return task

    def _check(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.fail(task.exception())

    def fail(self, exc: BaseException) -> None:
        """An error no retry can mend (unknown queue, forbidden, a bug): stop, then raise it."""
        if self._fatal is None:
            self._fatal = exc
        self.request_stop()

    # -- once per event-loop turn --------------------------------------------------------------

    def nudge(self) -> None:
        """Something changed (a handler finished, a claim or an ack came back): act on it once this
        event-loop turn is over, so that everything that happened in the same turn goes together."""
        if self._turn is None:
            self._turn = self.loop.call_soon(self._take_turn)

    def _take_turn(self) -> None:
        self._turn = None
        link = self._connection.link
        if link is None:
            return  # connecting again: the next socket starts with a turn of its own
        link.socket.hold()  # the claim and the results go out in one write
        try:
            if self._claims.items_likely_waiting():
                # claim first: the server hands out the next items while it stores these results
                self._claims.fill()
                self._outbox.hand_in(link)
            else:
                # results first: a producer waiting for one sees it sooner; the claim waits for items
                self._outbox.hand_in(link)
                self._claims.fill()
        except Exception as exc:  # a bug: the run stops and raises it
            self.fail(exc)
        finally:
            link.socket.flush()

    def _socket_opened(self, link: Link) -> None:
        link.on_canceled = self._canceled
        self._claims.socket_opened(link)
        self.nudge()  # results that finished while away go in first

    def _socket_closed(self) -> None:
        self._claims.socket_closed()
        self._outbox.socket_closed()

    # -- the handlers --------------------------------------------------------------------------

    def busy(self) -> int:
        return len(self._handlers)

    def take(self, job: Job, link: Link) -> None:
        """Run the handler on a job one of our claims brought: an async one in a task of its own,
        a plain one in a thread, which calls back when it returns (no task waits for it)."""
        if job.id in self._outbox:
            return  # claimed again before our result for it went in: that result finishes it
        self._leases.hold(job, link)
        if job.id in self._handlers:
            # it still runs, from a claim over a socket since lost; or its failed run is going
            # back, and the server handed it out again before it answered: its next try, which
            # starts when that answer comes (_finished)
            if job.id in self._giving_back:
                self._giving_back[job.id] = True
            return
        self._start(job)

    def _start(self, job: Job) -> None:
        if self._in_threads:
            running = self._handlers[job.id] = InThread(self, job)
            self._threads.run(self._handler, (job.payload, job), running.returned)
        else:
            self._handlers[job.id] = self.spawn(self._work(job))

    async def _work(self, job: Job) -> None:
        """An async handler's task."""
        try:
            try:
                value, exc = await self._handler(job.payload, job), None
            except (Exception, SystemExit) as error:
                value, exc = None, error
            except asyncio.CancelledError as error:
                if asyncio.current_task().cancelling():
                    raise  # this task was cancelled: the run stops, or the item was canceled
                value, exc = None, error  # the handler's own: something it awaited was cancelled
            except GeneratorExit:
                raise  # the loop is closing over this task
            except BaseException as error:  # not the handler's failure but the run's
                self.fail(error)  # the stop comes first: the slot this frees must not claim again
                raise
            give_back = self._keep_outcome(job, value, exc)
            if give_back is not None:
                await self._send_back(job, give_back)
        finally:
            self._finished(job)

    def returned(self, job: Job, value: Any, exc: BaseException | None) -> None:
        """A plain handler returned (or raised), told on the loop by its thread."""
        try:
            if exc is not None and not isinstance(exc, (Exception, SystemExit)):
                raise exc  # KeyboardInterrupt, say: not the handler's failure but the run's
            give_back = self._keep_outcome(job, value, exc)
            if give_back is not None:
                self.spawn(self._give_back(job, give_back))
                return  # the slot stays taken until the item is back
        except BaseException as fatal:
            self.fail(fatal)
        self._finished(job)

    async def _give_back(self, job: Job, give_back: "GiveBack") -> None:
        try:
            await self._send_back(job, give_back)
        finally:
            self._finished(job)

    async def _send_back(self, job: Job, give_back: "GiveBack") -> None:
        self._giving_back[job.id] = False  # only a claim that comes from now on is its next try
        try:
            await self._leases.give_back(job.id, delay=give_back.delay, error=give_back.error)
        except BaseException:  # cancelled (the grace period is over): no next try here
            del self._giving_back[job.id]
            raise

    def _keep_outcome(self, job: Job, value: Any, exc: BaseException | None) -> "GiveBack | None":
        """The handler's result, or its error as an in-band result, into the outbox; or, when
        the item is to be given back instead (on_error "release", or "retry" with tries left),
        how. The outcome of a canceled item is dropped: the server would refuse it."""
        if job.canceled:
            log.info("%s %s was canceled; its handler's outcome is dropped", job.queue, job.id)
            return None
        if exc is None:
            try:
                self._outbox.add(job, value)
                return None
            except Exception as error:  # the result is not JSON
                exc = error
        result = error_result(exc)
        if self._on_error == "release":
            log.warning("handler failed on %s %s (%s); releasing it", job.queue, job.id, exc)
            return GiveBack(0, result)
        if self._on_error == "retry" and not job.is_last_try:
            delay = retry_delay(job.attempts, self._retry_base, self._retry_cap)
            log.warning("handler failed on %s %s (%s); trying again in %.1f s", job.queue, job.id, exc, delay)
            return GiveBack(delay, result)
        log.warning("handler failed on %s %s: %r", job.queue, job.id, exc)
        self._outbox.add(job, result)
        return None

    def _canceled(self, queue: str, item_id: str) -> None:
        """The server says the item was canceled: whatever its handler makes would be refused.
        An async handler's task is cancelled; a blocking handler sees `job.canceled`."""
        self._outbox.discard(item_id)
        job = self._leases.job(item_id)
        if job is None or job.queue != queue:
            return  # its handler is over
        job.canceled.set()
        self._leases.let_go(item_id)
        running = self._handlers.get(item_id)
        if isinstance(running, asyncio.Task):
            running.cancel()

    def _finished(self, job: Job) -> None:
        del self._handlers[job.id]
        next_try = self._leases.holding(job.id) if self._giving_back.pop(job.id, False) else None
        if next_try is None or self.stopping:
            if next_try is not None:  # as a claim answered after the stop: give it back
                self.spawn(release(next_try[1], next_try[0]))
            self._leases.let_go(job.id)
        else:
            self._start(next_try[0])
        self.nudge()

    async def _abandon_handlers(self) -> None:
        """The grace period is over: cancel the handlers still running and give their items back."""
        # an item claimed over a socket that has closed since is back in its queue already
        leftovers = [(job, link) for job, link in self._leases.held() if not link.closed]
        for running in list(self._handlers.values()):
            running.cancel()
        if leftovers:
            log.info("releasing %d items whose handlers did not finish", len(leftovers))
            await asyncio.gather(*(release(link, job) for job, link in leftovers))

    def _unsent(self) -> int:
        return len(self._outbox)


class GiveBack(NamedTuple):
    """How a failed item goes back: scheduled `delay` seconds from now, with `error` as its lastError."""

    delay: float
    error: Any


class InThread:
    """A plain handler running in one of the threads, kept by the run beside the tasks of async
    ones. cancel() stops waiting for it (a thread cannot be stopped): what it returns later is
    dropped."""

    __slots__ = ("_run", "_job", "_over")

    def __init__(self, run: Run, job: Job):
        self._run = run
        self._job = job
        self._over = False

    def returned(self, value: Any, exc: BaseException | None) -> None:
        if not self._over:
            self._over = True
            self._run.returned(self._job, value, exc)

    def cancel(self) -> None:
        if not self._over:
            self._over = True
            self._run._finished(self._job)
