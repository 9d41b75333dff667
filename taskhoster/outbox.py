"""Results not yet acknowledged: handed in one frame at a time, many to a frame, and kept until
the server has answered for each. Each result is encoded to JSON once, when it comes in; frames
are put together from those texts."""

import asyncio
import json
import logging
from functools import partial
from typing import TYPE_CHECKING, Any

from .errors import PASSING_CODES, ApiError
from .jobs import Job, encode
from .link import Link, LinkClosed, answer_of

if TYPE_CHECKING:
    from .run import Run

log = logging.getLogger("taskhoster.worker")

BATCH_ITEMS = 1000  # the server's limit for one `results` frame
BATCH_BYTES = 8 << 20  # half the server's default frame limit
# a result the server could not take for now (a full disk, say: errors.PASSING_CODES) stays in
# the outbox and goes in again after this pause; results refused for any other reason are dropped
RESULT_RETRY_SECONDS = 1.0
MESSAGE_TOO_BIG = 1009  # the close code of a server that will not read a frame that large
# what the server says of a result it will never take -> the type of the error result sent instead
REFUSED_RESULTS = {"payload_too_large": "PayloadTooLarge", "invalid_request": "InvalidResult",
                   "invalid_json": "InvalidResult"}


class Outbox:
    """A result stays here until the server accepts or refuses it; over a socket that closes
    first, it goes in again over the next one."""

    def __init__(self, run: "Run"):
        self._run = run
        self._results: dict[str, tuple[str, Any, str]] = {}  # id -> queue, result, the result as JSON
        self._sending = False  # a frame is out, waiting for its answer
        self._one_by_one: asyncio.Task | None = None  # results a refused frame held, going in one by one
        self._resting: set[str] = set()  # ids the server could not store: not sent until
        self._rest_timer: asyncio.TimerHandle | None = None  # this fires and frees them all
        self._alone: set[str] = set()  # ids of a frame too big for the server: each goes in alone
        self._replaced: set[str] = set()  # ids whose refused result an error result replaced

    def __len__(self) -> int:
        return len(self._results)

    def __contains__(self, item_id: str) -> bool:
        return item_id in self._results

    def add(self, job: Job, result: Any) -> None:
        """Raises TypeError or ValueError, and keeps nothing, if the result is not JSON."""
        self._results[job.id] = (job.queue, result, encode(result))

    def discard(self, item_id: str) -> None:
        """Not to be handed in after all (the item was canceled)."""
        self._results.pop(item_id, None)
        self._alone.discard(item_id)
        self._replaced.discard(item_id)

    def hand_in(self, link: Link) -> None:
        """Hand in the results not yet acknowledged, one frame at a time: results that finish
        while a frame is out go together in the next one. Results resting after a storage error
        wait for their pause to end; the others go in meanwhile. The answer is taken the moment
        the socket reads it (no task in between)."""
        if self._sending:
            return
        batch = self._next_batch()
        if not batch:
            return
        if len(batch) == 1:
            frame, answered = _one_frame(batch[0]), partial(self._answered_one, link, batch[0])
        else:
            frame = '{"op":"results","items":[' + ",".join(_entry(i, q, t) for i, q, _, t in batch) + "]}"
            answered = partial(self._answered_many, link, batch)
        self._sending = True
        try:
            link.ask(frame, answered)
        except LinkClosed:
            self._sending = False  # kept for the next socket

    def socket_closed(self) -> None:
        """The socket closed: the frame out will get no answer; its results stay."""
        if self._one_by_one is not None:
            self._one_by_one.cancel()

    def stop(self) -> None:
        """The run is over: no more tries."""
        if self._rest_timer is not None:
            self._rest_timer.cancel()
            self._rest_timer = None

    def _sent(self) -> None:
        """The frame out has its answer (or will get none): the next one may go."""
        self._sending = False
        # a turn only if results wait for this frame's end; and a hand-in that failed for good
        # must not be sent again and again
        if self._results and not self._run.failed:
            self._run.nudge()

    def _next_batch(self) -> list[tuple[str, str, Any, str]]:
        batch, total = [], 0
        for item_id, (queue, result, text) in self._results.items():
            if item_id in self._resting:
                continue
            if batch and (len(batch) == BATCH_ITEMS or total + len(text) > BATCH_BYTES or item_id in self._alone):
                break
            batch.append((item_id, queue, result, text))
            total += len(text)
            if item_id in self._alone:
                break
        return batch

    def _answered_one(self, link: Link, entry: tuple[str, str, Any, str], reply: dict | None) -> None:
        try:
            self._take_ack(link, entry, reply)
        except Exception as exc:  # a bug: the run stops and raises it
            self._run.fail(exc)
        self._sent()

    def _answered_many(self, link: Link, batch: list[tuple[str, str, Any, str]], reply: dict | None) -> None:
        try:
            answer = answer_of(reply)
        except LinkClosed:
            answer = None  # kept for the next socket
            if _too_big(link):  # one of them at least: each goes in alone, to find it
                self._alone.update(item_id for item_id, _, _, _ in batch)
        except ApiError as exc:
            answer = None
            if exc.code in PASSING_CODES:
                self._rest([item_id for item_id, _, _, _ in batch], str(exc))
            else:
                # refused as a whole (one result too large, say): hand each in alone to find it
                task = self._one_by_one = self._run.spawn(self._hand_in_each(link, batch))
                task.add_done_callback(self._handed_in_each)
                return
        try:
            if answer is not None:
                self._take_acks(batch, answer.get("items") or [])
        except Exception as exc:  # a bug: the run stops and raises it
            self._run.fail(exc)
        self._sent()

    def _take_acks(self, batch: list[tuple[str, str, Any, str]], acks: list[dict]) -> None:
        unstored, passing = [], set()
        for index, (item_id, queue, result, _) in enumerate(batch):
            ack = acks[index] if index < len(acks) else {}
            error = ack.get("error")
            if error in PASSING_CODES:
                unstored.append(item_id)
                passing.add(error)
            elif error in REFUSED_RESULTS and self._replaced_by_error(
                    item_id, queue, result, error, f"the server refused the result: {error}"):
                continue
            else:
                self._settle(item_id, ack)
        if unstored:
            self._rest(unstored, ", ".join(sorted(passing)))

    def _take_ack(self, link: Link, entry: tuple[str, str, Any, str], reply: dict | None) -> None:
        item_id, queue, result, _ = entry
        try:
            ack = answer_of(reply)
        except LinkClosed:
            if _too_big(link) and not self._replaced_by_error(
                    item_id, queue, result, "payload_too_large", "the result is larger than the server reads"):
                self._settle(item_id, {"accepted": False, "error": "an error result larger than the server reads"})
            return  # else kept for the next socket
        except ApiError as exc:
            if exc.code in REFUSED_RESULTS and self._replaced_by_error(item_id, queue, result, exc.code, exc.message):
                return
            if exc.code in PASSING_CODES:
                self._rest([item_id], str(exc))
                return
            ack = {"accepted": False, "error": exc.code}
        self._settle(item_id, ack)

    async def _hand_in_each(self, link: Link, batch: list[tuple[str, str, Any, str]]) -> None:
        for entry in batch:
            try:
                reply = await link.reply(_one_frame(entry))
            except LinkClosed:
                return  # kept for the next socket
            self._take_ack(link, entry, reply)

    def _handed_in_each(self, task: asyncio.Task) -> None:
        if self._one_by_one is task:
            self._one_by_one = None
            self._sent()

    def _replaced_by_error(self, item_id: str, queue: str, result: Any, code: str, message: str) -> bool:
        """The server will never take this result (`code`: too large, or JSON it refuses, such
        as a lone surrogate or nesting too deep), yet the item must end, not wait out its lease
        and run again: an error result saying why takes the result's place and goes in next
        (True), unless one took its place already."""
        if item_id in self._replaced:
            return False  # the error result in its place was refused too: nothing more to send
        self._replaced.add(item_id)
        # ASCII, and short: nothing in it for the server to refuse (a handler's own error result
        # may be what was refused, its message holding a lone surrogate, say)
        message = message[:500].encode("ascii", "backslashreplace").decode()
        error = {"error": {"type": REFUSED_RESULTS[code], "message": message}}
        self._results[item_id] = (queue, error, encode(error))
        return True

    def _rest(self, item_ids: list[str], reason: str) -> None:
        """The server could not take these results for now (a full disk, say): keep them, and
        send them again once RESULT_RETRY_SECONDS have passed (results refused meanwhile go with
        them), not at once and again and again."""
        log.warning("the server could not take the results of %d items (%s); trying again in %g s",
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
        self._alone.discard(item_id)
        self._replaced.discard(item_id)
        if not ack.get("accepted"):
            log.info("result for %s not accepted (%s)", item_id, ack.get("error", "already finished or timed out"))


def _too_big(link: Link) -> bool:
    """The server closed the socket for a frame larger than it reads: the result frame out, as
    the frames after it go unread and the others are small."""
    return link.socket.close_code == MESSAGE_TOO_BIG


def _one_frame(entry: tuple[str, str, Any, str]) -> str:
    item_id, queue, _, text = entry
    return '{"op":"result",' + _entry(item_id, queue, text)[1:]


def _entry(item_id: str, queue: str, text: str) -> str:
    """One result as the server takes it, its result already JSON."""
    return '{"queue":' + json.dumps(queue) + ',"id":' + json.dumps(item_id) + ',"result":' + text + "}"
