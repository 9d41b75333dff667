"""Results not yet acknowledged: handed in one frame at a time, many to a frame, and kept until
the server has answered for each. Each result is encoded to JSON once, when it comes in; frames
are put together from those texts."""

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from .errors import ApiError
from .jobs import Job, encode
from .link import Link, LinkClosed

if TYPE_CHECKING:
    from .run import Run

log = logging.getLogger("taskhoster.worker")

BATCH_ITEMS = 1000  # the server's limit for one `results` frame
BATCH_BYTES = 8 << 20  # half the server's default frame limit
# a result the server could not store (a full disk, say) stays in the outbox and goes in again
# after this pause; results refused for any other reason are dropped
RESULT_RETRY_SECONDS = 1.0
PASSING_RESULT_ERRORS = {"storage_unavailable"}


class Outbox:
    """A result stays here until the server accepts or refuses it; over a socket that closes
    first, it goes in again over the next one."""

    def __init__(self, run: "Run"):
        self._run = run
        self._results: dict[str, tuple[str, Any, str]] = {}  # id -> queue, result, the result as JSON
        self._sending: asyncio.Task | None = None  # the frame waiting for its answer
        self._resting: set[str] = set()  # ids the server could not store: not sent until
        self._rest_timer: asyncio.TimerHandle | None = None  # this fires and frees them all

    def __len__(self) -> int:
        return len(self._results)

    def __contains__(self, item_id: str) -> bool:
        return item_id in self._results

    def add(self, job: Job, result: Any) -> None:
        """Raises TypeError or ValueError, and keeps nothing, if the result is not JSON."""
        self._results[job.id] = (job.queue, result, encode(result))

    def hand_in(self, link: Link) -> None:
        """Hand in the results not yet acknowledged, one frame at a time: results that finish
        while a frame is out go together in the next one. Results resting after a storage error
        wait for their pause to end; the others go in meanwhile."""
        if self._sending is not None:
            return
        batch = self._next_batch()
        if not batch:
            return
        task = self._sending = self._run.spawn(self._hand_in_batch(link, batch))
        task.add_done_callback(self._handed_in)

    def socket_closed(self) -> None:
        """The socket closed: the frame out will get no answer; its results stay."""
        if self._sending is not None:
            self._sending.cancel()

    def stop(self) -> None:
        """The run is over: no more tries."""
        if self._rest_timer is not None:
            self._rest_timer.cancel()
            self._rest_timer = None

    def _handed_in(self, task: asyncio.Task) -> None:
        if self._sending is task:
            self._sending = None
            if not self._run.failed:  # a hand-in that failed for good must not be sent again and again
                self._run.nudge()

    def _next_batch(self) -> list[tuple[str, str, Any, str]]:
        batch, total = [], 0
        for item_id, (queue, result, text) in self._results.items():
            if item_id in self._resting:
                continue
            if batch and (len(batch) == BATCH_ITEMS or total + len(text) > BATCH_BYTES):
                break
            batch.append((item_id, queue, result, text))
            total += len(text)
        return batch

    async def _hand_in_batch(self, link: Link, batch: list[tuple[str, str, Any, str]]) -> None:
        try:
            if len(batch) == 1:
                await self._hand_in_one(link, *batch[0])
            else:
                await self._hand_in_many(link, batch)
        except LinkClosed:
            pass  # kept for the next socket

    async def _hand_in_many(self, link: Link, batch: list[tuple[str, str, Any, str]]) -> None:
        frame = '{"op":"results","items":[' + ",".join(_entry(i, q, t) for i, q, _, t in batch) + "]}"
        try:
            answer = await link.request(frame)
        except ApiError as exc:
            if exc.code in PASSING_RESULT_ERRORS:
                self._rest([item_id for item_id, _, _, _ in batch], str(exc))
                return
            # refused as a whole (one result too large, say): hand each in alone to find it
            for entry in batch:
                await self._hand_in_one(link, *entry)
            return
        acks = answer.get("items") or []
        unstored = []
        for index, (item_id, queue, result, _) in enumerate(batch):
            ack = acks[index] if index < len(acks) else {}
            error = ack.get("error")
            if error in PASSING_RESULT_ERRORS:
                unstored.append(item_id)
            elif error == "payload_too_large" and self._too_large(
                    item_id, queue, result, "the result is larger than the server accepts"):
                continue
            else:
                self._settle(item_id, ack)
        if unstored:
            self._rest(unstored, "storage_unavailable")

    async def _hand_in_one(self, link: Link, item_id: str, queue: str, result: Any, text: str) -> None:
        try:
            ack = await link.request('{"op":"result",' + _entry(item_id, queue, text)[1:])
        except ApiError as exc:
            if exc.code == "payload_too_large" and self._too_large(item_id, queue, result, exc.message):
                return
            if exc.code in PASSING_RESULT_ERRORS:
                self._rest([item_id], str(exc))
                return
            ack = {"accepted": False, "error": exc.code}
        self._settle(item_id, ack)

    def _too_large(self, item_id: str, queue: str, result: Any, message: str) -> bool:
        """The item must still end: an error result saying why takes the result's place and goes
        in next (True), unless the result is an error result already."""
        if _is_error_result(result):
            return False
        error = {"error": {"type": "PayloadTooLarge", "message": message}}
        self._results[item_id] = (queue, error, encode(error))
        return True

    def _rest(self, item_ids: list[str], reason: str) -> None:
        """The server could not store these results for now (a full disk, say): keep them, and
        send them again once RESULT_RETRY_SECONDS have passed (results refused meanwhile go with
        them), not at once and again and again."""
        log.warning("the server could not store the results of %d items (%s); trying again in %g s",
                    len(item_ids), reason, RESULT_RETRY_SECONDS)
        self._resting.update(item_ids)
        if self._rest_timer is None:
            self._rest_timer = asyncio.get_running_loop().call_later(RESULT_RETRY_SECONDS, self._end_rest)

    def _end_rest(self) -> None:
        self._rest_timer = None
        self._resting.clear()
        self._run.nudge()

    def _settle(self, item_id: str, ack: dict) -> None:
        self._results.pop(item_id, None)
        if not ack.get("accepted"):
            log.info("result for %s not accepted (%s)", item_id, ack.get("error", "already finished or timed out"))


def _entry(item_id: str, queue: str, text: str) -> str:
    """One result as the server takes it, its result already JSON."""
    return '{"queue":' + json.dumps(queue) + ',"id":' + json.dumps(item_id) + ',"result":' + text + "}"


def _is_error_result(result: Any) -> bool:
    return isinstance(result, dict) and set(result) == {"error"}
