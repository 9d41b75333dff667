"""A worker: holds the /work socket, claims only as many items as it has free slots, runs the
handler on each, keeps their leases while handlers run, hands results in (batched when many finish
together), reconnects by itself, and stops gracefully on SIGTERM/SIGINT.

Under load it spends few frames per item: what happens in one event-loop turn (handlers finishing,
a claim or an ack coming back) is acted on once at the end of the turn, with one `results` frame
for every result ready and one claim for every free slot; a few free slots wait a moment for more.

    Worker(url, token, queues=["thumbs"], concurrency=4).run(handler)

`handler(payload, job)` is a plain function (run in a thread of its own) or an async function;
`job` is a `Job` (id, queue, attempts, ...). What it returns is the item's result. If it raises,
the result is `{"error": {"type", "message", "traceback"}}` (on_error="result", the default), or
the item is released for another try (on_error="release").
"""

import asyncio
import logging
import math
import random
import signal
import threading
from collections import deque
from typing import Any

import websockets
from websockets.exceptions import InvalidHandshake, InvalidStatus

from .config import auth_headers, server_settings, work_socket_url
from .errors import ApiError, ConnectionFailed, TaskhosterError, Unauthorized
from .jobs import Handler, Job, call_handler, encoded_size, error_result
from .link import ANSWER_SECONDS, Link, LinkClosed

log = logging.getLogger("taskhoster.worker")

ON_ERROR = ("result", "release")
CLAIM_WAIT_SECONDS = 20  # how long one waiting claim lasts before it is asked again
CLAIM_MAX = 100  # the server's limit of items per claim
CLAIM_RETRY_SECONDS = 1.0  # after a claim the server refused for a passing reason
FILL_DELAY_SECONDS = 0.001  # fewer than half the slots free: wait this long for more to free up
# claim errors no retry can mend: the worker stops and raises them
FATAL_CLAIM_ERRORS = {"unauthorized", "forbidden", "unknown_queue", "invalid_request", "invalid_json"}
BATCH_ITEMS = 1000  # the server's limit for one `results` frame
BATCH_BYTES = 8 << 20  # half the server's default frame limit
# a result the server could not store (a full disk, say) stays in the outbox and goes in again
# after this pause; results refused for any other reason are dropped
RESULT_RETRY_SECONDS = 1.0
PASSING_RESULT_ERRORS = {"storage_unavailable"}
DRAIN_SECONDS = 10.0  # after the grace period: how long to keep trying to hand results in
BACKOFF_FIRST, BACKOFF_MAX = 0.25, 30.0
AUTH_CLOSE_CODE = 4401


def backoff_delay(failures: int) -> float:
    """Exponential backoff with jitter: half the step fixed, half random, so workers that lost the
    same server do not all come back in the same instant."""
    step = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (failures - 1))
    return step / 2 + random.uniform(0, step / 2)


def split_slots(free: int, queues: int) -> list[int]:
    """How many items each waiting claim may bring when `queues` queues are idle: one queue gets
    the most, each other one slot, never more than `free` in all."""
    count = min(free, queues)
    return [free - (count - 1)] + [1] * (count - 1) if count else []


class Worker:
    """Works one or more queues with a handler; see the module docstring. `url` and `token`
    default to TASKHOSTER_URL and TASKHOSTER_TOKEN. `grace` is how long a stop waits for running
    handlers before it releases their items."""

    def __init__(self, url: str | None = None, token: str | None = None, *, queues: list[str],
                 concurrency: int = 1, on_error: str = "result", grace: float = 30.0):
        if isinstance(queues, str) or not queues or not all(isinstance(q, str) and q for q in queues):
            raise TaskhosterError("queues must be a non-empty list of queue names")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise TaskhosterError("concurrency must be a whole number of at least 1")
        if on_error not in ON_ERROR:
            raise TaskhosterError(f"on_error must be one of {', '.join(ON_ERROR)}, not {on_error!r}")
        if grace < 0:
            raise TaskhosterError("grace must be 0 or more seconds")
        self.url, self._token = server_settings(url, token)
        self.queues = list(dict.fromkeys(queues))
        self.concurrency = concurrency
        self.on_error = on_error
        self.grace = grace
        self._lock = threading.Lock()  # stop() may come from any thread, even before the run starts
        self._run: _Run | None = None
        self._early_stop: bool | None = None  # a stop() that came before the run: its `now`

    def run(self, handler: Handler) -> None:
        """Work until SIGTERM or SIGINT (a second one skips the grace period). Raises
        ConnectionFailed if the server cannot be reached at the start, Unauthorized for a bad token,
        UnknownQueue or Forbidden for a queue it may not work."""
        asyncio.run(self._run_until_signalled(handler))

    async def run_async(self, handler: Handler) -> None:
        """Work on the running event loop until stop() is called; raises as run() does."""
        with self._lock:
            run = self._run = _Run(self, handler)
            if self._early_stop is not None:
                run.request_stop(self._early_stop)
                self._early_stop = None
        try:
            await run.main()
        finally:
            with self._lock:
                self._run = None

    def stop(self, *, now: bool = False) -> None:
        """Stop claiming, let running handlers finish within the grace period (`now`: skip it),
        release the rest, hand in what finished. Safe to call from any thread, also just before
        the run starts (it then stops at once)."""
        with self._lock:
            if self._run is None:
                self._early_stop = now
            else:
                self._run.loop.call_soon_threadsafe(self._run.request_stop, now)

    async def _run_until_signalled(self, handler: Handler) -> None:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)
        for signum in signals:
            loop.add_signal_handler(signum, self._on_signal)
        try:
            await self.run_async(handler)
        finally:
            for signum in signals:
                loop.remove_signal_handler(signum)

    def _on_signal(self) -> None:
        current = self._run
        if current is not None:
            current.request_stop(now=current.stopping)


class _Running:
    """A handler at work on one item, the socket the item was claimed over, and the timer of its
    next lease renewal (a timer, not a task: most handlers finish long before it fires)."""

    def __init__(self, job: Job, link: Link):
        self.job = job
        self.link = link
        self.task: asyncio.Task | None = None
        self.heartbeat: asyncio.TimerHandle | None = None


class _Run:
    """The state of one Worker.run: slots, results waiting for an ack, the current socket."""

    def __init__(self, worker: Worker, handler: Handler):
        self.worker = worker
        self.handler = handler
        self.loop = asyncio.get_running_loop()
        self.running: dict[str, _Running] = {}
        self.outbox: dict[str, tuple[str, Any, int]] = {}  # id -> queue, result, size; until acked
        self.handing_in: asyncio.Task | None = None  # the results frame waiting for its ack
        self.resting: set[str] = set()  # outbox ids the server could not store: not sent until
        self.rest_timer: asyncio.TimerHandle | None = None  # this fires and frees them all
        self.link: Link | None = None
        self.claiming: dict[str, int] = {}  # queue -> slots its outstanding claim may fill
        self.known_empty: set[str] = set()  # queues whose last claim brought fewer items than asked
        self.rotation = deque(worker.queues)
        self.claim_tasks: set[asyncio.Task] = set()
        # claims wait for a moment when only a few slots are free: half of them is enough at once
        self.enough_slots = max(1, min(worker.concurrency, CLAIM_MAX) // 2)
        self.turn: asyncio.Handle | None = None  # the end-of-turn step, when one is due
        self.fill_timer: asyncio.TimerHandle | None = None
        self.stopping = False
        self.stop_asked = asyncio.Event()
        self.hurry = asyncio.Event()
        self.finished = asyncio.Event()
        self.fatal: BaseException | None = None
        self.announced = False

    # -- the whole run -------------------------------------------------------------------------

    async def main(self) -> None:
        shutdown = self._spawn(self._shut_down_when_asked())
        try:
            await self._stay_connected()
        finally:
            shutdown.cancel()
            for handle in (self.turn, self.fill_timer, self.rest_timer):
                if handle is not None:
                    handle.cancel()
            for running in list(self.running.values()):
                running.task.cancel()
        if self.fatal is not None:
            raise self.fatal

    def request_stop(self, now: bool = False) -> None:
        self.stop_asked.set()
        if now:
            self.hurry.set()

    def _spawn(self, coroutine) -> asyncio.Task:
        """A task of this run. Should it ever fail unexpectedly (a bug), the run stops and raises
        the error, rather than live on with a part missing (no more claims, say)."""
        task = asyncio.create_task(coroutine)
        task.add_done_callback(self._check)
        return task

    def _check(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._fail(task.exception())

    def _fail(self, exc: BaseException) -> None:
        """An error no retry can mend (unknown queue, forbidden, a bug): stop, then raise it."""
        if self.fatal is None:
            self.fatal = exc
        self.request_stop()

    async def _stay_connected(self) -> None:
        url = work_socket_url(self.worker.url)
        failures = 0
        connected_once = False
        while not self.finished.is_set():
            try:
                socket = await websockets.connect(
                    url, additional_headers=auth_headers(self.worker._token), max_size=None, open_timeout=10
                )
            except (OSError, TimeoutError, InvalidHandshake) as exc:
                if isinstance(exc, InvalidStatus) and exc.response.status_code in (401, 403):
                    raise Unauthorized("unauthorized", "the server refused the token") from exc
                if not connected_once:
                    raise ConnectionFailed(f"cannot reach {url}: {exc or type(exc).__name__}") from exc
                failures += 1
                delay = backoff_delay(failures)
                log.warning("cannot reach %s (%s); trying again in %.1f s", url, exc or type(exc).__name__, delay)
                await self._pause(delay)
                continue
            if connected_once:
                log.warning("connected again to %s", url)
            connected_once, link = True, Link(socket)
            try:
                await self._serve(link)
            finally:
                await socket.close()
            if socket.close_code == AUTH_CLOSE_CODE:
                raise Unauthorized("unauthorized", "the server refused the token")
            if link.answered:  # the socket worked: a later loss starts the backoff afresh
                failures = 0
            if not self.finished.is_set():
                failures += 1
                delay = backoff_delay(failures)
                log.warning("connection lost; connecting again in %.1f s", delay)
                await self._pause(delay)

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.finished.wait(), seconds)
        except TimeoutError:
            pass

    async def _serve(self, link: Link) -> None:
        """Work over one socket until it closes or the run is finished."""
        self.link = link
        self.claiming.clear()
        self.known_empty.clear()
        reader = asyncio.create_task(link.read_answers())
        finished = asyncio.create_task(self.finished.wait())
        self._nudge()  # results that finished while away go in first
        try:
            await asyncio.wait({reader, finished}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.link = None
            for task in (finished, self.handing_in, *self.claim_tasks):
                if task is not None:
                    task.cancel()
            self.claim_tasks.clear()
            await link.socket.close()
            await reader

    # -- once per event-loop turn --------------------------------------------------------------

    def _nudge(self) -> None:
        """Something changed (a handler finished, a claim or an ack came back): act on it once this
        event-loop turn is over, so that everything that happened in the same turn goes together."""
        if self.turn is None:
            self.turn = self.loop.call_soon(self._take_turn)

    def _take_turn(self) -> None:
        self.turn = None
        link = self.link
        if link is None:
            return  # connecting again: the next socket starts with a turn of its own
        if self._items_likely_waiting():
            # claim first: the server hands out the next items while it stores these results
            self._fill(link)
            self._hand_in(link)
        else:
            # results first: a producer waiting for one sees it sooner; the claim waits for items
            self._hand_in(link)
            self._fill(link)

    def _items_likely_waiting(self) -> bool:
        return any(queue not in self.known_empty for queue in self.rotation)

    # -- claiming ------------------------------------------------------------------------------

    def _free_slots(self) -> int:
        return self.worker.concurrency - len(self.running) - sum(self.claiming.values())

    def _fill(self, link: Link, *, waited: bool = False) -> None:
        """Claim for the free slots: first from queues that may have items (answered at once),
        then, when all are known empty, one waiting claim per idle queue. Fewer than
        `enough_slots` free wait FILL_DELAY_SECONDS for more, so a claim brings a batch."""
        if self.stopping:
            return
        free = min(self._free_slots(), CLAIM_MAX)
        idle = [q for q in self.rotation if q not in self.claiming]
        if free <= 0 or not idle:
            return
        if free < self.enough_slots and not waited:
            if self.fill_timer is None:
                self.fill_timer = self.loop.call_later(FILL_DELAY_SECONDS, self._fill_after_delay)
            return
        if self.fill_timer is not None:
            self.fill_timer.cancel()
            self.fill_timer = None
        ready = [q for q in idle if q not in self.known_empty]
        if ready:
            self._claim(link, ready[0], free, wait=self._first_claim_wait(link))
            return
        for queue, slots in zip(idle, split_slots(free, len(idle))):
            self._claim(link, queue, slots, wait=CLAIM_WAIT_SECONDS)

    def _fill_after_delay(self) -> None:
        self.fill_timer = None
        if self.link is not None:
            self._fill(self.link, waited=True)

    def _first_claim_wait(self, link: Link) -> int:
        """How long a claim on a queue that may have items waits. With one queue nothing else
        could use the slots meanwhile, so it waits (and saves the empty answer and the claim
        after it); but not before the server has answered on this socket, so a server that
        takes frames and never answers is noticed within ANSWER_SECONDS."""
        return CLAIM_WAIT_SECONDS if len(self.rotation) == 1 and link.answered else 0

    def _claim(self, link: Link, queue: str, slots: int, wait: int) -> None:
        self.claiming[queue] = slots
        self.rotation.remove(queue)
        self.rotation.append(queue)  # the next claim starts with another queue
        task = self._spawn(self._claim_items(link, queue, slots, wait))
        self.claim_tasks.add(task)
        task.add_done_callback(self.claim_tasks.discard)

    async def _claim_items(self, link: Link, queue: str, slots: int, wait: int) -> None:
        try:
            items = await self._ask_for_items(link, queue, slots, wait)
        finally:
            if self.link is link:
                self.claiming.pop(queue, None)
        if items is None or self.link is not link:
            return  # if the socket closed meanwhile, the server has re-queued what it claimed
        jobs = [Job.from_item(item) for item in items]
        if self.stopping:  # a claim that was waiting when the stop came: give its items back
            await asyncio.gather(*(self._release(link, job) for job in jobs))
            return
        if len(jobs) < slots:  # the server had no more: the next claim on it may wait
            self.known_empty.add(queue)
        else:
            self.known_empty.discard(queue)
        for job in jobs:
            self._take(job, link)
        if self._free_slots() > 0:
            # only then: a turn due now would come before these handlers and split their results
            self._nudge()

    async def _ask_for_items(self, link: Link, queue: str, slots: int, wait: int) -> list[dict] | None:
        """The items one claim brings; None if the socket closed or the claim can never work."""
        try:
            answer = await link.request({"op": "claim", "queue": queue, "max": slots, "wait": wait},
                                        timeout=wait + ANSWER_SECONDS)
        except LinkClosed:
            return None
        except ApiError as exc:
            if exc.code in FATAL_CLAIM_ERRORS:
                self._fail(exc)
                return None
            log.warning("the server refused a claim on %s (%s); trying again in %g s", queue, exc, CLAIM_RETRY_SECONDS)
            await asyncio.sleep(CLAIM_RETRY_SECONDS)  # a full disk, say: do not ask again at once
            return []
        if not self.announced:  # said once the server has taken a claim: token and queue are good
            log.info("working %s at %s", ", ".join(self.worker.queues), self.worker.url)
            self.announced = True
        return answer.get("items") or []

    def _take(self, job: Job, link: Link) -> None:
        if job.id in self.outbox:
            return  # claimed again before our result for it went in: that result finishes it
        running = self.running.get(job.id)
        if running is not None:
            # re-claimed after a lost socket while its handler still runs: keep that handler
            running.heartbeat.cancel()
            running.job, running.link = job, link
        else:
            running = self.running[job.id] = _Running(job, link)
            running.task = self._spawn(self._work(running))
        self._renew_later(running)

    # -- running a handler ---------------------------------------------------------------------

    async def _work(self, running: _Running) -> None:
        job = running.job
        try:
            try:
                result = await call_handler(self.handler, job)
                size = encoded_size(result)
            except (Exception, SystemExit) as exc:
                if self.worker.on_error == "release":
                    log.warning("handler failed on %s %s (%s); releasing it", job.queue, job.id, exc)
                    if running.link is self.link:
                        await self._release(running.link, running.job)
                    return
                log.warning("handler failed on %s %s: %r", job.queue, job.id, exc)
                result = error_result(exc)
                size = encoded_size(result)
            self.outbox[job.id] = (running.job.queue, result, size)
        finally:
            running.heartbeat.cancel()
            if self.running.get(job.id) is running:
                del self.running[job.id]
            self._nudge()

    def _renew_later(self, running: _Running) -> None:
        """Renew the lease at every half of it while the handler runs."""
        running.heartbeat = self.loop.call_later(running.job.lease_seconds / 2, self._renew, running, running.link)

    def _renew(self, running: _Running, link: Link) -> None:
        if link is self.link and self.running.get(running.job.id) is running:
            self._spawn(self._extend(running, link))

    async def _extend(self, running: _Running, link: Link) -> None:
        """Stops renewing when the item is no longer held (finished elsewhere, timed out) or the
        socket it came over closed: the server has re-queued it then, and the handler's result
        may still be accepted."""
        job = running.job
        try:
            await link.request(
                {"op": "extend", "queue": job.queue, "id": job.id, "seconds": max(1, math.ceil(job.lease_seconds))}
            )
        except (ApiError, LinkClosed) as exc:
            log.info("stopped renewing the lease of %s %s: %s", job.queue, job.id, exc)
            return
        if running.link is link and self.running.get(job.id) is running:
            self._renew_later(running)

    async def _release(self, link: Link, job: Job) -> None:
        try:
            await link.request({"op": "release", "queue": job.queue, "id": job.id})
        except (ApiError, LinkClosed):
            pass  # not held any more, or the socket closed: either way it is not ours

    # -- handing results in --------------------------------------------------------------------

    def _hand_in(self, link: Link) -> None:
        """Hand in the results not yet acknowledged, one frame at a time: results that finish
        while a frame is out go together in the next one. Results resting after a storage error
        wait for their pause to end; the others go in meanwhile."""
        if self.handing_in is not None:
            return
        batch = self._next_batch()
        if not batch:
            return
        task = self.handing_in = self._spawn(self._hand_in_batch(link, batch))
        task.add_done_callback(self._handed_in)

    def _handed_in(self, task: asyncio.Task) -> None:
        if self.handing_in is task:
            self.handing_in = None
            if self.fatal is None:  # a hand-in that failed for good must not be sent again and again
                self._nudge()

    async def _hand_in_batch(self, link: Link, batch: list[tuple[str, str, Any]]) -> None:
        try:
            if len(batch) == 1:
                await self._hand_in_one(link, *batch[0])
            else:
                await self._hand_in_many(link, batch)
        except LinkClosed:
            pass  # kept in the outbox for the next socket

    def _next_batch(self) -> list[tuple[str, str, Any]]:
        batch, total = [], 0
        for item_id, (queue, result, size) in self.outbox.items():
            if item_id in self.resting:
                continue
            if batch and (len(batch) == BATCH_ITEMS or total + size > BATCH_BYTES):
                break
            batch.append((item_id, queue, result))
            total += size
        return batch

    async def _hand_in_many(self, link: Link, batch: list[tuple[str, str, Any]]) -> None:
        frame = {"op": "results", "items": [{"queue": q, "id": i, "result": r} for i, q, r in batch]}
        try:
            answer = await link.request(frame)
        except ApiError as exc:
            if exc.code in PASSING_RESULT_ERRORS:
                self._rest([item_id for item_id, _, _ in batch], str(exc))
                return
            # refused as a whole (one result too large, say): hand each in alone to find it
            for entry in batch:
                await self._hand_in_one(link, *entry)
            return
        acks = answer.get("items") or []
        unstored = []
        for index, (item_id, _, _) in enumerate(batch):
            ack = acks[index] if index < len(acks) else {}
            if ack.get("error") in PASSING_RESULT_ERRORS:
                unstored.append(item_id)
            else:
                self._settle(item_id, ack)
        if unstored:
            self._rest(unstored, "storage_unavailable")

    async def _hand_in_one(self, link: Link, item_id: str, queue: str, result: Any) -> None:
        try:
            ack = await link.request({"op": "result", "queue": queue, "id": item_id, "result": result})
        except ApiError as exc:
            if exc.code == "payload_too_large" and not _is_error_result(result):
                # the item must still end: say why instead of the result
                self.outbox[item_id] = (queue, {"error": {"type": "PayloadTooLarge", "message": exc.message}}, 0)
                return
            if exc.code in PASSING_RESULT_ERRORS:
                self._rest([item_id], str(exc))
                return
            ack = {"accepted": False, "error": exc.code}
        self._settle(item_id, ack)

    def _rest(self, item_ids: list[str], reason: str) -> None:
        """The server could not store these results for now (a full disk, say): keep them in the
        outbox, and send them again once RESULT_RETRY_SECONDS have passed (results refused
        meanwhile go with them), not at once and again and again."""
        log.warning("the server could not store the results of %d items (%s); trying again in %g s",
                    len(item_ids), reason, RESULT_RETRY_SECONDS)
        self.resting.update(item_ids)
        if self.rest_timer is None:
            self.rest_timer = self.loop.call_later(RESULT_RETRY_SECONDS, self._end_rest)

    def _end_rest(self) -> None:
        self.rest_timer = None
        self.resting.clear()
        self._nudge()

    def _settle(self, item_id: str, ack: dict) -> None:
        self.outbox.pop(item_id, None)
        if not ack.get("accepted"):
            log.info("result for %s not accepted (%s)", item_id, ack.get("error", "already finished or timed out"))

    # -- stopping ------------------------------------------------------------------------------

    async def _shut_down_when_asked(self) -> None:
        await self.stop_asked.wait()
        self.stopping = True
        if self.running:
            log.info("stopping: waiting up to %g s for %d running handlers", self.worker.grace, len(self.running))
            await self._until(lambda: not self.running, self.worker.grace)
        leftover = list(self.running.values())
        for running in leftover:
            running.task.cancel()
        link = self.link
        if leftover and link is not None:
            log.info("releasing %d items whose handlers did not finish", len(leftover))
            await asyncio.gather(*(self._release(link, r.job) for r in leftover if r.link is link))
        if not self.hurry.is_set():
            await self._until(lambda: not self.outbox, DRAIN_SECONDS)
        self.finished.set()

    async def _until(self, condition, seconds: float) -> None:
        """Wait until `condition()` holds, `seconds` pass, or a second stop asks to hurry."""
        deadline = self.loop.time() + seconds
        while not condition() and not self.hurry.is_set() and self.loop.time() < deadline:
            try:
                await asyncio.wait_for(self.hurry.wait(), min(0.05, max(0.0, deadline - self.loop.time())))
            except TimeoutError:
                pass


def _is_error_result(result: Any) -> bool:
    return isinstance(result, dict) and set(result) == {"error"}
