"""What the HTTP API and the /work socket share: the protocol's limits, the bearer token of an
Authorization header, strict parsing of JSON bodies and frames, their fields and query parameters
(anything of the wrong shape is refused with a clear `invalid_json` or `invalid_request`), and the
shape of a claimed item."""

import json
import math
from datetime import datetime
from typing import Any

from .exceptions import InvalidJson, InvalidRequest

MAX_CLAIM = 100  # items per claim
MAX_HTTP_WAIT_SECONDS = 60  # a long-polling read or claim over HTTP
MAX_SOCKET_CLAIM_WAIT_SECONDS = 300
MAX_WAITING_CLAIMS = 1000  # claims waiting at once on one socket: each costs the loop a look a second
MAX_LEASE_SECONDS = 86400  # an extension
MAX_RESULTS = 1000  # results in one socket frame
MAX_POST_DELAY_SECONDS = 30 * 86400  # a scheduled post's `delay`
MAX_RELEASE_DELAY_SECONDS = 86400  # a release's `delay`
# a waiting claim or read re-checks the disk at least this often, in case a wake-up was missed
RECHECK_SECONDS = 1.0
# Deep nesting is refused up front: near Python's recursion limit a payload that parses here could
# fail to encode or decode later, in another thread, and stop its queue.
MAX_DEPTH = 128
TOO_DEEP = f"the JSON nests deeper than {MAX_DEPTH} levels"

REQUIRED = object()


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class NumberOutOfRange(InvalidRequest):
    """JSON holding a number no value here can hold: beyond a double's range (1e999 would be
    stored, then answered as Infinity, which is not JSON) or an integer of thousands of digits.
    `value`: the JSON as read with such numbers as null (so an answer can still name its ref)."""

    def __init__(self, message: str, value: Any = None):
        super().__init__(message)
        self.value = value


class _OutOfRange(ValueError):
    """A float beyond a double's range, found by the first, strict read."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _OutOfRange(f"the number {text[:40]} is out of range")
    return value


def _float_or_none(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def _integer_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:  # over Python's limit on the digits of an integer read from text
        return None


# the default parse_int keeps the decoder's fast path for integers; one too long to read fails it
# with a ValueError of its own (TOO_LONG), told apart from JSON that is not JSON
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
_OUT_OF_RANGE_AS_NULL = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_float_or_none,
                                         parse_int=_integer_or_none)
TOO_LONG = "integer string conversion"


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header's value; None for any other value."""
    scheme, _, token = (authorization or "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def claimed(items: list, max_attempts: int | None) -> list[dict]:
    """Claimed items as a worker gets them: with payloads, and the queue's maxAttempts, so a worker
    knows its last try."""
    return [{**item.to_json(payload=True), "maxAttempts": max_attempts} for item in items]


def parse_json(raw: bytes) -> Any:
    """The JSON value of a body or frame: InvalidJson if it is not JSON, NumberOutOfRange if it
    is but holds a number no value here can hold."""
    try:
        return _decoded(raw, _DECODER)
    except InvalidJson as exc:
        if not isinstance(exc.__cause__, _OutOfRange) and TOO_LONG not in str(exc.__cause__):
            raise
        value = _decoded(raw, _OUT_OF_RANGE_AS_NULL)  # JSON after all?
        what = exc.__cause__ if isinstance(exc.__cause__, _OutOfRange) else "an integer of over 4,300 digits"
        raise NumberOutOfRange(f"the JSON holds a number out of range: {what}", value) from None


def _decoded(raw: bytes, decoder: json.JSONDecoder) -> Any:
    try:
        value = decoder.decode(raw.decode())  # JSON on the wire is UTF-8 (RFC 8259)
    except RecursionError:
        raise InvalidJson(f"the body cannot be read: {TOO_DEEP}") from None
    except ValueError as exc:  # also bad UTF-8
        raise InvalidJson(f"the body is not valid JSON: {str(exc)[:200]}") from exc
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:  # else it cannot nest that deep: skip the walk
        _check_depth(value)
    return value


def _check_depth(value: Any) -> None:
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InvalidJson(f"the body cannot be read: {TOO_DEEP}")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def json_object(value: Any, *, allowed: set[str], required: set[str] = frozenset(), what: str = "the body") -> dict:
    """`value` as a JSON object holding every field in `required` and none beyond `allowed`."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"{what} must be a JSON object")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise InvalidRequest(f"{what} has unknown fields: {', '.join(repr(k[:40]) for k in unknown[:5])}")
    missing = sorted(required - set(value))
    if missing:
        raise InvalidRequest(f"{what} lacks the field {missing[0]!r}")
    return value


def _present(body: dict, name: str, default: Any) -> Any:
    if name in body:
        return body[name]
    if default is REQUIRED:
        raise InvalidRequest(f"the field {name!r} is required")
    return default


def integer_field(body: dict, name: str, *, low: int, high: int, default: Any = REQUIRED) -> int:
    value = _present(body, name, default)
    if isinstance(value, float) and value.is_integer():  # JSON has one kind of number: 2.0 is 2
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(f"{name!r} must be an integer from {low} to {high}")
    return value


def number_field(body: dict, name: str, *, low: float, high: float, default: Any = REQUIRED) -> float:
    value = _present(body, name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise InvalidRequest(f"{name!r} must be a number from {low} to {high}")
    return value


def string_field(body: dict, name: str) -> str:
    value = _present(body, name, REQUIRED)
    if not isinstance(value, str):
        raise InvalidRequest(f"{name!r} must be a string")
    return value


def value_field(body: dict, name: str) -> Any:
    """A field that may hold any JSON value, but must be there."""
    return _present(body, name, REQUIRED)


def run_at_field(body: dict, *, now: float) -> float | None:
    """When a post's item is due: `delay` seconds from `now`, or `runAt`, an ISO-8601 time with
    an offset; None when neither is given (now)."""
    if "delay" in body and "runAt" in body:
        raise InvalidRequest("give 'delay' or 'runAt', not both")
    if "delay" in body:
        return now + number_field(body, "delay", low=0, high=MAX_POST_DELAY_SECONDS)
    if "runAt" in body:
        return moment_field(body, "runAt")
    return None


def moment_field(body: dict, name: str) -> float:
    """An ISO-8601 time with an explicit offset (`Z` or `+02:00`), as a timestamp."""
    text = body[name]
    if not isinstance(text, str) or len(text) > 64:
        raise InvalidRequest(f"{name!r} must be an ISO-8601 time such as 2026-12-01T14:00:00Z")
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidRequest(f"{name!r} must be an ISO-8601 time such as 2026-12-01T14:00:00Z") from None
    if moment.tzinfo is None:
        raise InvalidRequest(f"{name!r} needs an offset, such as Z for UTC or +02:00: {text!r} has none")
    return moment.timestamp()


def number_param(query: dict[str, str], name: str, *, low: float, high: float, default: float) -> float:
    text = query.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidRequest(f"the query parameter {name!r} must be a number from {low} to {high}")
    return value


def flag_param(query: dict[str, str], name: str) -> bool:
    text = query.get(name, "0").lower()
    if text not in ("0", "1", "false", "true"):
        raise InvalidRequest(f"the query parameter {name!r} must be 1 or 0")
    return text in ("1", "true")
