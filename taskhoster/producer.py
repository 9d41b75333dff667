"""Producers: post items, read them, wait for their results. `Producer` blocks, `AsyncProducer`
is the same for asyncio. Both speak the server's Producer API over HTTP and nothing else, through
`wire`: each payload is encoded to JSON once, each answer parsed once."""

import asyncio
import json
import logging
import random
import secrets
import time
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote

from .config import server_settings
from .errors import PASSING_CODES, ApiError, ConnectionFailed, ItemFailed, ResultTimeout, TaskhosterError, api_error
from .pools import AsyncConnections, Connections
from .wire import Answer, Endpoint

log = logging.getLogger("taskhoster.producer")

MAX_BATCH_ITEMS = 1000  # the server's limit per post
MAX_BATCH_BYTES = 8 << 20  # half the server's default body limit: a batch of big payloads is split
MAX_WAIT_SECONDS = 60  # the longest the server holds a GET ?wait
TERMINAL = ("finished", "failed")
FIRST_RETRY_PAUSE = 0.2  # seconds before a post that failed in transport is sent again; doubled each time
LONGEST_RETRY_PAUSE = 5.0
# what a proxy in front of the server answers when the server is down or went away mid-request
GATEWAY_FAILURES = frozenset({502, 503, 504})


def _queue_path(queue: str) -> str:
    return f"/api/queues/{quote(queue, safe='')}"


def _items_path(queue: str, item_id: str | None = None) -> str:
    path = _queue_path(queue) + "/items"
    return path if item_id is None else f"{path}/{quote(item_id, safe='')}"


# made once: json.dumps with any option makes a new encoder at every call
_encoder = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def _encode(value: Any) -> bytes:
    """JSON as the server accepts it; NaN and infinities are not JSON, so they fail here."""
    return _encoder.encode(value).encode()


Delay = float | timedelta | None
RunAt = datetime | str | None


def _when(delay: Delay, run_at: RunAt) -> bytes:
    """The fields that schedule an item, to go inside its JSON object: `,"delay":S` or
    `,"runAt":T`, or nothing. A datetime without a time zone is refused: which instant it means
    would depend on the machine."""
    if delay is not None and run_at is not None:
        raise ValueError("give delay or run_at, not both")
    if delay is not None:
        if isinstance(delay, timedelta):
            delay = delay.total_seconds()
        if isinstance(delay, bool) or not isinstance(delay, (int, float)):
            raise TypeError(f"delay must be seconds or a timedelta, not {delay!r}")
        return b',"delay":' + _encode(delay)
    if run_at is not None:
        if isinstance(run_at, datetime):
            if run_at.utcoffset() is None:
                raise ValueError("run_at must have a time zone (datetime.now(timezone.utc), say)")
            run_at = run_at.isoformat()
        if not isinstance(run_at, str):
            raise TypeError(f"run_at must be a datetime or an ISO-8601 string, not {run_at!r}")
        return b',"runAt":' + _encode(run_at)
    return b""


def _item_body(payload: Any, when: bytes, key: str | None) -> bytes:
    body = b'{"payload":' + _encode(payload) + when
    if key is not None:
        if not isinstance(key, str):
            raise TypeError(f"an idempotency key is a string, not {key!r}")
        body += b',"key":' + _encode(key)
    return body + b"}"


def _keys_for(count: int, keys: Iterable[str | None] | None, make_keys: bool) -> list[str | None]:
    """One key per item: the given ones (None: no key), with keys made for the others when posts
    are retried (a retry is only safe with a key)."""
    given = [None] * count if keys is None else list(keys)
    if len(given) != count:
        raise ValueError(f"{len(given)} keys for {count} payloads: give one key (or None) per payload")
    return [_new_key() if key is None and make_keys else key for key in given]


def _new_key() -> str:
    return secrets.token_urlsafe(18)


def _batch_bodies(payloads: list[Any], when: bytes, keys: list[str | None]) -> Iterator[tuple[bytes, list[str | None]]]:
    """Bodies of `{"items": [...]}` posts, each at most 1000 items and about 8 MiB, with their
    items' keys. Every payload
    is encoded before the first body is made, so a payload that is not JSON fails before anything
    is sent."""
    encoded = [_item_body(payload, when, key) for payload, key in zip(payloads, keys)]
    start = 0
    while start < len(encoded):
        end, size = start, 0
        while end < len(encoded) and end - start < MAX_BATCH_ITEMS:
            if end > start and size + len(encoded[end]) > MAX_BATCH_BYTES:
                break
            size += len(encoded[end]) + 1
            end += 1
        yield b'{"items":[' + b",".join(encoded[start:end]) + b"]}", keys[start:end]
        start = end


def _check_retries(post_retries: int) -> int:
    if isinstance(post_retries, bool) or not isinstance(post_retries, int) or post_retries < 0:
        raise ValueError(f"post_retries must be a whole number, 0 or more, not {post_retries!r}")
    return post_retries


class _PostTries:
    """The tries of one post under `post_retries`: sent again after a failed transport or a
    server that sheds load for now (503), under the same keys."""

    def __init__(self, retries: int, keys: list[str | None]):
        self.left, self.keys = retries, keys
        self.retry = 0
        self.maybe_done: ConnectionFailed | None = None  # a try the server may have carried out

    def pause_after(self, exc: TaskhosterError) -> float:
        """How long to wait before the next try; raises when there is none. Once a try may have
        been carried out, giving up says so, whatever the last try met, with the keys to post
        again with."""
        again = _passing(exc)
        if isinstance(exc, ConnectionFailed) and exc.maybe_done:
            self.maybe_done = exc
        if not again or not self.left:
            if self.maybe_done is not None and self.maybe_done is not exc:
                raise ConnectionFailed(f"an earlier try of this post may have been carried out ({self.maybe_done}), "
                                       f"and the last one met: {exc}; post again with the same keys to learn what "
                                       "became of it", maybe_done=True, keys=self.keys) from exc
            if isinstance(exc, ConnectionFailed) and exc.maybe_done and all(self.keys):
                exc.keys = self.keys
            raise exc
        self.left -= 1
        self.retry += 1
        return _pause(self.retry - 1, exc)


class _Outage:
    """The server lost while `wait` and `result` wait for an item (a restart, say): its reads go
    on, paced as post retries, until the item ends or the deadline passes. Only once the server
    has answered one: a first read that fails (a wrong address, a server that is not there) raises."""

    def __init__(self, deadline: float | None, url: str):
        self.deadline = deadline
        self.url = url
        self.answered = False
        self.retry = 0

    def answer(self) -> None:
        self.answered, self.retry = True, 0

    def pause_after(self, exc: TaskhosterError) -> float:
        """How long to wait before the next read; raises `exc` when there is none."""
        if not (self.answered and _passing(exc)) or _expired(self.deadline):
            raise exc
        if self.retry == 0:
            log.warning("%s does not answer for now (%s); waiting for it", self.url, exc)
        pause = _pause(self.retry, exc)
        self.retry += 1
        return pause if self.deadline is None else max(0.0, min(pause, self.deadline - time.monotonic()))


def _passing(exc: TaskhosterError) -> bool:
    """A failure that says nothing of the request: the connection failed, or the server could
    not take it for now."""
    return isinstance(exc, ConnectionFailed) or (isinstance(exc, ApiError) and exc.code in PASSING_CODES)


def _pause(retry: int, exc: TaskhosterError) -> float:
    """The pause before try `retry` + 1: the doubling one, or the server's Retry-After if longer
    (within reason)."""
    asked = getattr(exc, "retry_after", None) or 0.0
    return max(_retry_pause(retry), min(asked, LONGEST_RETRY_PAUSE))


def _retry_pause(retry: int) -> float:
    """Half to all of the doubling pause: producers that lost the server together come back apart."""
    return min(LONGEST_RETRY_PAUSE, FIRST_RETRY_PAUSE * 2**retry) * random.uniform(0.5, 1.0)


def _read(answer: Answer, method: str, url: str) -> Any:
    """The JSON answer of a successful call; the server's error as an ApiError otherwise (with
    its Retry-After); a proxy's answer for a server it could not reach as ConnectionFailed."""
    try:
        body = json.loads(answer.body)
    except ValueError:
        body = None
    if 200 <= answer.status < 300 and body is not None:
        return body
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        error = api_error(body["error"], str(body.get("message", "")), answer.status)
        error.retry_after = answer.retry_after
        raise error
    if answer.status in GATEWAY_FAILURES:  # the server's own errors are JSON: a proxy's, then
        maybe = f" (the {method} may have been carried out)" if method != "GET" else ""
        raise ConnectionFailed(f"HTTP {answer.status} from {url}: a proxy in front of the server could not "
                               f"reach it, or lost it during the request{maybe}", maybe_done=bool(maybe))
    raise ApiError("unexpected_answer", f"HTTP {answer.status} from {url}", answer.status)


def _get_target(queue: str, item_id: str, wait: float, payload: bool) -> str:
    target = _items_path(queue, item_id)
    if wait:
        target += "?wait=" + format(round(wait, 3), "g")
    if payload:
        target += ("&" if wait else "?") + "payload=1"
    return target


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if not timeout >= 0:  # NaN too, which would never run out
        raise ValueError(f"timeout must be None or 0 or more seconds, not {timeout!r}")
    return time.monotonic() + timeout


def _wait_step(deadline: float | None) -> float:
    """How long the next GET may wait: what is left, in steps of at most 60 s."""
    if deadline is None:
        return MAX_WAIT_SECONDS
    return max(0.0, min(MAX_WAIT_SECONDS, deadline - time.monotonic()))


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _followed(item: dict, follow_retries: bool) -> str | None:
    """The retry to follow from an item that ended, if asked to and there is one."""
    return item.get("retriedAs") if follow_retries and item["status"] in TERMINAL else None


def _outcome(item: dict, timeout: float | None) -> Any:
    """The result of an item that `wait` returned, or why there is none."""
    if item["status"] == "finished":
        return item.get("result")
    if item["status"] == "failed":
        raise ItemFailed(item)
    raise ResultTimeout(item, timeout)


def _note_posted(exc: TaskhosterError, posted: list[dict]) -> None:
    # a later batch failed: tell the caller which items of the earlier batches are in
    exc.posted = posted


class Producer:
    """Post items and read them back, blocking. `url` and `token` default to TASKHOSTER_URL and
    TASKHOSTER_TOKEN. `timeout` bounds each HTTP call (a long-poll gets its wait on top): the
    connection, and each wait for the server's next bytes. Safe to share between threads; it keeps
    its connections open between calls. Use it as a context manager, or call close().

    `post_retries`: how many times a post that failed in transport (the connection failed, the
    answer never came, or a proxy in front of the server answered 502, 503 or 504 for it) or
    that the server could not take for now (503 `busy`, `storage_unavailable`) is sent again,
    after about 0.2 s, 0.4 s, ... (at most 5 s), or its Retry-After if longer. Every post
    then carries an idempotency key, one made for it where none is given, so a post the server did
    store is answered with that item the second time, never made twice. (A keyed post costs the
    server one more link and directory flush.) When the tries run out after one that may have
    been carried out, ConnectionFailed says so, whatever the last try met, and its `keys` are the
    keys to post again with."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: float = 30.0,
                 post_retries: int = 0):
        self.url, token = server_settings(url, token)
        self._timeout = timeout
        self._post_retries = _check_retries(post_retries)
        self._http = Connections(Endpoint(self.url, token), timeout)

    def _call(self, method: str, target: str, body: bytes | None = None, wait: float = 0) -> Any:
        return _read(self._http.call(method, target, body, self._timeout + wait), method, self.url + target)

    def _post(self, queue: str, body: bytes, keys: list[str | None]) -> Any:
        tries = _PostTries(self._post_retries, keys)
        while True:
            try:
                return self._call("POST", _items_path(queue), body)
            except TaskhosterError as exc:
                time.sleep(tries.pause_after(exc))

    def post(self, queue: str, payload: Any, *, delay: Delay = None, run_at: RunAt = None,
             key: str | None = None) -> dict:
        """Post one item; returns it as the server made it (its `id` above all). With `delay`
        (seconds, or a timedelta) or `run_at` (a datetime with a time zone, or an ISO-8601 string
        with an offset) it is scheduled: no worker gets it before then. With `key` (1 to 200
        printable ASCII characters), a post whose key an item in the queue holds makes nothing
        and returns that item as it is now; with another payload it raises ApiError
        `key_conflict`."""
        [key] = _keys_for(1, [key], self._post_retries > 0)
        return self._post(queue, _item_body(payload, _when(delay, run_at), key), [key])

    def post_many(self, queue: str, payloads: Iterable[Any], *, delay: Delay = None,
                  run_at: RunAt = None, keys: Iterable[str | None] | None = None) -> list[dict]:
        """Post many items, in batches of up to 1000; returns them in order. Each batch is all or
        nothing; if one fails, the error's `posted` lists the items of the batches before it.
        `delay` or `run_at` schedules every item, as for post(). `keys` gives each payload its
        idempotency key (or None); an item an earlier post with its key made comes back as it
        is now, with `"duplicate": true`."""
        payloads = list(payloads)
        keys = _keys_for(len(payloads), keys, self._post_retries > 0)
        posted: list[dict] = []
        for body, batch_keys in _batch_bodies(payloads, _when(delay, run_at), keys):
            try:
                answer = self._post(queue, body, batch_keys)
            except TaskhosterError as exc:
                _note_posted(exc, posted)
                raise
            posted.extend(answer["items"])
        return posted

    def get(self, queue: str, item_id: str, *, wait: float = 0, payload: bool = False) -> dict:
        """Read an item. With `wait` (0 to 60 s) the server answers as soon as the item is
        finished or failed, or when the wait is over. `payload=True` includes the payload."""
        return self._call("GET", _get_target(queue, item_id, wait, payload), wait=wait)

    def wait(self, queue: str, item_id: str, *, timeout: float | None = None, payload: bool = False) -> dict:
        """Read the item once it is finished or failed, or as it is when `timeout` seconds have
        passed (None: no limit). Long-polls in steps of at most 60 s. Once the server has
        answered, losing it (a restart: a failed connection, 503) is waited out within the
        timeout (a warning is logged); losing it past the timeout raises ConnectionFailed or the
        ApiError."""
        return self._wait(queue, item_id, _Outage(_deadline(timeout), self.url), payload)

    def _wait(self, queue: str, item_id: str, outage: _Outage, payload: bool = False) -> dict:
        while True:
            try:
                item = self.get(queue, item_id, wait=_wait_step(outage.deadline), payload=payload)
            except TaskhosterError as exc:
                time.sleep(outage.pause_after(exc))
                continue
            outage.answer()
            if item["status"] in TERMINAL or _expired(outage.deadline):
                return item

    def result(self, queue: str, item_id: str, *, timeout: float | None = None,
               follow_retries: bool = False) -> Any:
        """Wait for the item to end and return its result. Raises ItemFailed if it failed (its
        `error` says why) and ResultTimeout if `timeout` seconds pass first (None: no limit).
        With `follow_retries`, an item that ended and was retried (`retriedAs`) stands for its
        retry: the result is that of the last retry, within the same timeout. A server restart
        meanwhile is waited out, as by `wait` (one that outlasts the timeout raises
        ConnectionFailed or the ApiError, not ResultTimeout)."""
        outage = _Outage(_deadline(timeout), self.url)  # one for the retries too: the server answered
        item = self._wait(queue, item_id, outage)
        while (retry := _followed(item, follow_retries)) is not None:
            item = self._wait(queue, retry, outage)
        return _outcome(item, timeout)

    def retry(self, queue: str, item_id: str) -> dict:
        """Post a finished or failed item again, as a new item with its payload; returns the new
        item (`retryOf` is the old id). Asked again, it returns the same new item. Raises
        ApiError `not_ended` if the item has not ended."""
        return self._call("POST", _items_path(queue, item_id) + "/retry", b"{}")

    def cancel(self, queue: str, item_id: str) -> dict:
        """End a scheduled, pending or processing item now, as failed with error "canceled"; a
        worker that holds it is told. Returns the item; its `canceled` is False if the item had
        ended already (it is then left as it was)."""
        return self._call("POST", _items_path(queue, item_id) + "/cancel", b"{}")

    def stats(self, queue: str | None = None) -> dict | list[dict]:
        """One queue's settings and counts, or (no queue) every queue the token may see."""
        if queue is not None:
            return self._call("GET", _queue_path(queue))
        return self._call("GET", "/api/queues")["queues"]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncProducer:
    """`Producer` for asyncio: the same methods, awaited. Tasks may call it at once. Use
    `async with`, or await aclose(). Use it from one event loop: its connections belong to the
    loop that opened them."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout: float = 30.0,
                 post_retries: int = 0):
        self.url, token = server_settings(url, token)
        self._timeout = timeout
        self._post_retries = _check_retries(post_retries)
        self._http = AsyncConnections(Endpoint(self.url, token), timeout)

    async def _call(self, method: str, target: str, body: bytes | None = None, wait: float = 0) -> Any:
        return _read(await self._http.call(method, target, body, self._timeout + wait), method, self.url + target)

    async def _post(self, queue: str, body: bytes, keys: list[str | None]) -> Any:
        tries = _PostTries(self._post_retries, keys)
        while True:
            try:
                return await self._call("POST", _items_path(queue), body)
            except TaskhosterError as exc:
                await asyncio.sleep(tries.pause_after(exc))

    async def post(self, queue: str, payload: Any, *, delay: Delay = None, run_at: RunAt = None,
                   key: str | None = None) -> dict:
        [key] = _keys_for(1, [key], self._post_retries > 0)
        return await self._post(queue, _item_body(payload, _when(delay, run_at), key), [key])

    async def post_many(self, queue: str, payloads: Iterable[Any], *, delay: Delay = None,
                        run_at: RunAt = None, keys: Iterable[str | None] | None = None) -> list[dict]:
        payloads = list(payloads)
        keys = _keys_for(len(payloads), keys, self._post_retries > 0)
        posted: list[dict] = []
        for body, batch_keys in _batch_bodies(payloads, _when(delay, run_at), keys):
            try:
                answer = await self._post(queue, body, batch_keys)
            except TaskhosterError as exc:
                _note_posted(exc, posted)
                raise
            posted.extend(answer["items"])
        return posted

    async def get(self, queue: str, item_id: str, *, wait: float = 0, payload: bool = False) -> dict:
        return await self._call("GET", _get_target(queue, item_id, wait, payload), wait=wait)

    async def wait(self, queue: str, item_id: str, *, timeout: float | None = None,
                   payload: bool = False) -> dict:
        return await self._wait(queue, item_id, _Outage(_deadline(timeout), self.url), payload)

    async def _wait(self, queue: str, item_id: str, outage: _Outage, payload: bool = False) -> dict:
        while True:
            try:
                item = await self.get(queue, item_id, wait=_wait_step(outage.deadline), payload=payload)
            except TaskhosterError as exc:
                await asyncio.sleep(outage.pause_after(exc))
                continue
            outage.answer()
            if item["status"] in TERMINAL or _expired(outage.deadline):
                return item

    async def result(self, queue: str, item_id: str, *, timeout: float | None = None,
                     follow_retries: bool = False) -> Any:
        outage = _Outage(_deadline(timeout), self.url)  # one for the retries too: the server answered
        item = await self._wait(queue, item_id, outage)
        while (retry := _followed(item, follow_retries)) is not None:
            item = await self._wait(queue, retry, outage)
        return _outcome(item, timeout)

    async def retry(self, queue: str, item_id: str) -> dict:
        return await self._call("POST", _items_path(queue, item_id) + "/retry", b"{}")

    async def cancel(self, queue: str, item_id: str) -> dict:
        return await self._call("POST", _items_path(queue, item_id) + "/cancel", b"{}")

    async def stats(self, queue: str | None = None) -> dict | list[dict]:
        if queue is not None:
            return await self._call("GET", _queue_path(queue))
        return (await self._call("GET", "/api/queues"))["queues"]

    async def aclose(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> "AsyncProducer":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()
