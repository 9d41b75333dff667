"""What the store keeps and answers: items, queue settings, the outcomes of transitions, and how
an item is written to its file and read back.

An item file holds the item as JSON, written once. A claim does not rewrite it: the claim record
(attempts, claim time, lease, claim token) goes beside the bytes, in an extended attribute (see
`files`), and overrides what the file says.
"""

import json
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from .. import ids

TERMINAL = ("finished", "failed")
STATUSES = ("scheduled", "pending", "processing", *TERMINAL)
SERVER_FAILURES = ("timeout", "max_attempts", "canceled")  # the errors the server declares


class _Absent:
    """A field that was never given (unlike null, which a client may give on purpose)."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()


class Unreadable(ValueError):
    """A file that is not an item record of ours (truncated, not JSON, not an item object)."""


@dataclass(frozen=True)
class QueueConfig:
    """A queue's settings as the store needs them (the database owns the real record)."""

    name: str
    lease_seconds: int = 60
    queue_seconds: int = 86400
    retain_seconds: int = 3600
    retain_from: str = "finished"
    paused: bool = False
    max_attempts: int | None = None  # None: no limit


@dataclass(frozen=True)
class Item:
    id: str
    queue: str
    status: str
    attempts: int = 0
    claimed_at: float | None = None
    lease_expires_at: float | None = None
    finished_at: float | None = None
    payload: Any = None
    result: Any = None
    error: str | None = None
    claim_token: str | None = field(default=None, repr=False)
    run_at: float | None = None  # when a scheduled item comes due (kept once it did)
    last_error: Any = ABSENT  # what the last release said went wrong
    retry_of: str | None = None
    retried_as: str | None = None
    key: str | None = None  # its idempotency key

    @property
    def posted_at(self) -> float:
        return ids.id_millis(self.id) / 1000

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def to_json(self, *, payload: bool = False) -> dict:
        """The item as the API shows it."""
        data = {
            "id": self.id,
            "queue": self.queue,
            "status": self.status,
            "attempts": self.attempts,
            "postedAt": ids.iso(self.posted_at),
            "claimedAt": ids.iso(self.claimed_at),
            "leaseExpiresAt": ids.iso(self.lease_expires_at),
            "finishedAt": ids.iso(self.finished_at),
        }
        if self.status == "finished":
            data["result"] = self.result
        if self.status == "failed":
            data["error"] = self.error
        # what only the features beyond the seed give an item: shown only when used
        if self.run_at is not None:
            data["runAt"] = ids.iso(self.run_at)
        if self.last_error is not ABSENT:
            data["lastError"] = self.last_error
        for name, value in (("retryOf", self.retry_of), ("retriedAs", self.retried_as), ("key", self.key)):
            if value is not None:
                data[name] = value
        if payload:
            data["payload"] = self.payload
        return data


@dataclass(frozen=True)
class NewItem:
    """An item to post: its payload, when it is due (None: now), and its idempotency key."""

    payload: Any
    run_at: float | None = None
    key: str | None = None


@dataclass(frozen=True)
class Posted:
    """What a post did with one of its items: made `item`, or found it made already by an
    earlier post with the same idempotency key (`duplicate`), as it is now."""

    item: Item
    duplicate: bool = False


@dataclass(frozen=True)
class Release:
    """An item given back for another try: by the claim holding it (`claim_token`; None stands
    for any holder), after `delay` seconds, with `error` kept as its lastError. `reason` says who
    gives it back: "release" (a worker), "socket" (its socket closed), "lease" (its lease
    lapsed), "staff", "shutdown" (the server stops) or "unsent" (claimed for an HTTP client that
    left before the answer); the last two never end an item for its attempts."""

    config: "QueueConfig"
    item_id: str
    claim_token: str | None = None
    delay: float = 0.0
    error: Any = ABSENT
    reason: str = "release"


@dataclass(frozen=True)
class FinishOutcome:
    id: str
    accepted: bool
    status: str


@dataclass(frozen=True)
class Counts:
    scheduled: int
    pending: int
    processing: int
    finished: int
    failed: int
    oldest_pending_posted_at: float | None
    errors: int = 0  # of the finished: those whose result is an error a worker handed in


def is_error_result(result: Any) -> bool:
    """Whether a result has the clients' shape of an error (`{"error": {"type", "message", ...}}`):
    a worker's handler failed, though the item finished."""
    if not (isinstance(result, dict) and len(result) == 1 and isinstance(result.get("error"), dict)):
        return False
    error = result["error"]
    return isinstance(error.get("type"), str) or isinstance(error.get("message"), str)


@dataclass(frozen=True)
class SweepChanges:
    """What one sweep pass over a queue changed: the ids it touched, and tmp files removed."""

    repaired: list[str]
    failed: list[str]
    requeued: list[str]
    deleted: list[str]
    tmp_removed: int
    promoted: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Health:
    writable: bool
    free_bytes: int
    min_free_bytes: int

    @property
    def ok(self) -> bool:
        return self.writable and self.free_bytes >= self.min_free_bytes


# allow_nan=False: NaN and Infinity are not JSON, and no client could read them back
_to_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode


def json_size(value: Any) -> int:
    """The value's size as stored (UTF-8 JSON); TypeError or ValueError if it is not JSON."""
    return len(_to_json(value).encode())


def single(outcomes: list):
    """The one outcome of a batch call made for one item, raised if it is an error."""
    (outcome,) = outcomes
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def encode(item: Item) -> bytes:
    record = item.to_json(payload=True)
    record["result"] = item.result
    record["error"] = item.error
    record["claimToken"] = item.claim_token
    return _to_json(record).encode()


def decode(raw: bytes, *, state: str, queue: str, item_id: str, claim: bytes | None = None) -> Item:
    """The item in a file of `state`/ named for `item_id`, as its claim record says if it has one
    (`claim`, see `encode_claim`); Unreadable unless it is one of ours."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise Unreadable(f"not JSON: {exc}") from None
    if not isinstance(record, dict):
        raise Unreadable("not a JSON object")
    if record.get("id") != item_id or record.get("queue") != queue:
        raise Unreadable("its id or queue does not match the file's place")
    status = record.get("status") if state == "done" else state
    if status not in STATUSES:
        raise Unreadable(f"bad status {status!r}")
    processing = state == "processing"
    attempts, claimed_at = _count(record.get("attempts", 0)), _moment(record.get("claimedAt"))
    # a file moved but not yet rewritten (a crash mid-transition) shows its directory's truth
    lease_expires_at = _moment(record.get("leaseExpiresAt")) if processing else None
    claim_token = _text(record.get("claimToken")) if processing else None
    if claim:  # the claim record overrides what the file says
        attempts, claimed_at, lease_expires_at, claim_token = _claim_record(claim)
    return Item(
        id=item_id,
        queue=queue,
        status=status,
        attempts=attempts,
        claimed_at=claimed_at,
        lease_expires_at=lease_expires_at if processing else None,
        finished_at=_moment(record.get("finishedAt")) if state == "done" else None,
        payload=record.get("payload"),
        result=record.get("result"),
        error=_text(record.get("error")) if status == "failed" else None,
        claim_token=claim_token if processing else None,
        run_at=_moment(record.get("runAt")),
        last_error=record.get("lastError", ABSENT),
        retry_of=_id(record.get("retryOf")),
        retried_as=_id(record.get("retriedAs")),
        key=_text(record.get("key")),
    )


def encode_claim(item: Item) -> bytes:
    # "attempts claimedAt leaseExpiresAt claimToken": small enough to live inside the inode. Times
    # to the millisecond, as shown: rounded twice (to microseconds, then by ids.iso) a time could
    # read back a millisecond later than the claim's answer said
    return f"{item.attempts} {item.claimed_at:.3f} {item.lease_expires_at:.3f} {item.claim_token}".encode()


def _claim_record(raw: bytes) -> tuple[int, float, float, str]:
    """attempts, claim time, lease and claim token from a claim record: attempts and claim time
    hold always (they outlive a re-queue), lease and claim token while the item is processing."""
    try:
        attempts, claimed_at, lease_expires_at, claim_token = raw.decode("ascii").split(" ")
        return int(attempts), float(claimed_at), float(lease_expires_at), claim_token
    except ValueError:
        raise Unreadable("bad claim record") from None


def ended(item: Item, *, status: str, at: float, result: Any = None, error: str | None = None) -> Item:
    """The item as done/ keeps it once it ended."""
    return replace(
        item, status=status, lease_expires_at=None, finished_at=at, result=result, error=error, claim_token=None
    )


def failed(item: Item, error: str, now: float) -> Item:
    """The item failed by the server: `error` is one of SERVER_FAILURES."""
    return ended(item, status="failed", at=now, error=error)


def timed_out(item: Item, now: float) -> Item:
    return failed(item, "timeout", now)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Unreadable(f"bad count {value!r}")
    return value


def _moment(value: Any) -> float | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise Unreadable(f"bad time {value!r}")
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise Unreadable(f"bad time {value[:40]!r}") from None


def _id(value: Any) -> str | None:
    if value is not None and not ids.is_valid_id(value):
        raise Unreadable(f"bad id {value!r}")
    return value


def _text(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise Unreadable(f"bad text {value!r}")
    return value
