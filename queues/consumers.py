"""The /work socket: workers claim items, hand in results, and extend or release leases.

Each frame's `op` maps to one `handle_<op>` method that validates the frame, calls the store
where queues.runtime runs it and answers; the lifecycle rules live in the store. A connection
remembers the items it holds (with their claim tokens) so that closing the socket re-queues them
at once (G8), and is told (a `canceled` frame) when one of them is canceled. No well-formed
frame closes the socket: any error, expected or not, is answered with an error frame.
"""

import asyncio
import contextlib
import json
import logging
import re
import time
from functools import partial
from urllib.parse import parse_qs

from channels.consumer import get_handler_name
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.http.request import split_domain_port, validate_host

from . import ids
from .budget import BODIES_AT_ONCE, receiving
from .events import hub
from .exceptions import (Forbidden, InvalidJson, InvalidRequest, NotHeld, PayloadTooLarge, TaskhosterError, UnknownQueue,
                         client_error)
from .protocol import (
    MAX_CLAIM,
    MAX_LEASE_SECONDS,
    MAX_RELEASE_DELAY_SECONDS,
    MAX_RESULTS,
    MAX_SOCKET_CLAIM_WAIT_SECONDS,
    MAX_WAITING_CLAIMS,
    RECHECK_SECONDS,
    NumberOutOfRange,
    bearer_token,
    claimed,
    integer_field,
    json_object,
    number_field,
    parse_json,
    string_field,
    value_field,
)
from .roster import Connection, roster
from .runtime import get_registry, get_store, run, server_stopping
from .store import ABSENT, QueueConfig, Release, single

log = logging.getLogger(__name__)

UNAUTHORIZED = 4401  # close code for a handshake without a valid token with the right to work

FIELDS = {
    "claim": {"op", "ref", "queue", "max", "wait"},
    "result": {"op", "ref", "queue", "id", "result"},
    "results": {"op", "ref", "items"},
    "extend": {"op", "ref", "queue", "id", "seconds"},
    "release": {"op", "ref", "queue", "id", "delay", "error"},
}
RESULT_FIELDS = {"queue", "id", "result"}


def origin_allowed(scope) -> bool:
    """Workers are not browsers: no Origin header is fine; one that is given must name a host in
    ALLOWED_HOSTS (so a web page elsewhere cannot drive a worker socket)."""
    origins = [value for name, value in scope["headers"] if name == b"origin"]
    if not origins:
        return True
    _, _, netloc = origins[0].decode("latin-1").partition("://")
    domain, _ = split_domain_port(netloc.split("/")[0])
    return bool(domain) and validate_host(domain, settings.ALLOWED_HOSTS)


def token_from(scope) -> str | None:
    """The token from `Authorization: Bearer ...`, else from `?token=`."""
    for name, value in scope["headers"]:
        if name == b"authorization" and (token := bearer_token(value.decode("latin-1"))):
            return token
    tokens = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
    return tokens[0] if tokens else None


def _closing_reason() -> str:
    """Why a socket's items go back: "shutdown" (never ending an item max_attempts) only while
    this process's server stops, which closes the socket (uvicorn with code 1012, daphne 1000) or,
    once its grace is over, cancels it."""
    return "shutdown" if server_stopping.is_set() else "socket"


# a ref as the first or last field of a frame, as clients put it: found without reading the rest
_REF_VALUE = r'("(?:[^"\\]|\\.){0,64}"|-?\d{1,19})'
_REF_FIRST = re.compile(r'^\s*\{\s*"ref"\s*:\s*' + _REF_VALUE + r'\s*[,}]')
_REF_LAST = re.compile(r'[{,]\s*"ref"\s*:\s*' + _REF_VALUE + r'\s*\}\s*$')
REF_LOOK_CHARS = 128


def ref_of_unread(data: str | bytes):
    """The ref of a frame too large to be read, so its answer still names it: looked for in its
    head and its tail only (None if it is not there)."""
    for part, pattern in ((data[:REF_LOOK_CHARS], _REF_FIRST), (data[-REF_LOOK_CHARS:], _REF_LAST)):
        text = part if isinstance(part, str) else part.decode("utf-8", "replace")
        if found := pattern.search(text):
            try:
                return json.loads(found.group(1))
            except ValueError:
                return None
    return None


def frame_too_large(size: int) -> PayloadTooLarge:
    limit = settings.TASKHOSTER_MAX_BODY_BYTES
    return PayloadTooLarge(f"the frame is {size} bytes or more; the limit is {limit} (TASKHOSTER_MAX_BODY_BYTES)")


def canceled_notice(queue: str, item_id: str) -> str:
    # a notice, not an answer: it carries no ref
    return json.dumps({"op": "canceled", "queue": queue, "id": item_id}, separators=(",", ":"))


def parse_frame(data: str | bytes) -> dict:
    """A text frame, or a binary one holding UTF-8 JSON, as a JSON object."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if len(raw) > settings.TASKHOSTER_MAX_BODY_BYTES:
        raise frame_too_large(len(raw))
    frame = parse_json(raw)
    if not isinstance(frame, dict):
        raise InvalidRequest("a frame must be a JSON object")
    return frame


class WorkConsumer(AsyncWebsocketConsumer):
    # No channel per socket: wake-ups from other processes arrive once per process through
    # queues/bridge.py, which feeds the in-process hub.
    channel_layer_alias = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.token: str | None = None
        self.held: dict[tuple[str, str], str] = {}  # (queue, id) -> claim token
        self.waiting: set[asyncio.Task] = set()  # claims waiting for items
        self.claiming: set[asyncio.Future] = set()  # store claims in flight
        self.connection: Connection | None = None  # on the dashboard's list of workers while open

    async def dispatch(self, message):
        # Channels' dispatch awaits aclose_old_connections() (a thread hop) before every message;
        # this consumer never touches the ORM (the registry reads the database in its own
        # thread), so the hop would only slow every frame down.
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"no handler for message type {message['type']}")
        await handler(message)

    # ---- connection ----------------------------------------------------------------------

    async def connect(self):
        if not origin_allowed(self.scope):
            await self.close()  # before accepting: the handshake is answered HTTP 403
            return
        token = token_from(self.scope)
        grant = await get_registry().afind_token(token)
        await self.accept()
        if grant is None or not grant.can_work:
            await self.close(code=UNAUTHORIZED, reason="a valid API token with the right to work is required")
            return
        self.token = token
        host, port = self.scope.get("client") or ("?", 0)
        self.connection = Connection(name=grant.name, address=f"{host}:{port}", connected_at=time.time(),
                                     held=lambda: list(self.held.copy()))  # copied at once: safe from any thread
        roster.join(self.connection)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            await self.let_go(reason=_closing_reason())  # daphne cancels every socket when it stops
            raise
        finally:
            # also when a handler failed, which skips disconnect(); and when a stopping server
            # cancelled this socket again, after the grace: its try is not counted then either
            await self.let_go(reason=_closing_reason())

    async def disconnect(self, code):
        await self.let_go(reason=_closing_reason())

    async def let_go(self, *, reason: str) -> None:
        """Stop the waiting claims and re-queue every item this connection still holds (G8). A
        server that stops gives them back without counting the try against maxAttempts."""
        if self.connection is not None:
            roster.leave(self.connection)
        for task in self.waiting:
            task.cancel()
        await asyncio.gather(*self.waiting, return_exceptions=True)
        # a claim still under way when the socket went away will hold items: wait for it to end
        # (shielded: were this wait cancelled, the claim still ends and records them for the next)
        await asyncio.gather(*map(asyncio.shield, self.claiming), return_exceptions=True)
        held, self.held = self.held, {}
        for (queue, item_id), token in held.items():
            hub.let_go(queue, item_id, token)
        registry = get_registry()
        releases = [
            Release(registry.queue(queue) or QueueConfig(name=queue), item_id, token, reason=reason)
            for (queue, item_id), token in held.items()
        ]
        if releases:
            try:
                # shielded: a stop that cancels this wait must not cancel a re-queue waiting for a
                # store thread, which would then never run
                await asyncio.shield(run(get_store().release_items, releases=releases))
            except Exception:
                log.exception("could not re-queue the %d items a closed socket held", len(releases))

    # ---- frames --------------------------------------------------------------------------

    async def receive(self, text_data=None, bytes_data=None):
        if self.token is None:
            return  # refused; the close is on its way
        data = text_data if text_data is not None else bytes_data
        if len(data) > settings.TASKHOSTER_MAX_BODY_BYTES:  # refused unread: it takes no share of the budget
            await self.answer_error(ref_of_unread(data), frame_too_large(len(data)))
            return
        await receiving.wait_for_room(len(data), limit=BODIES_AT_ONCE * settings.TASKHOSTER_MAX_BODY_BYTES)
        ref = None
        try:
            frame = parse_frame(data)
            ref = frame.get("ref")
            op = frame.get("op")
            if not isinstance(op, str) or op not in FIELDS:
                raise InvalidRequest(f"'op' must be one of: {', '.join(FIELDS)}")
            json_object(frame, allowed=FIELDS[op], what="the frame")
            await getattr(self, f"handle_{op}")(frame, ref)
        except Exception as exc:
            if ref is None and isinstance(exc, (PayloadTooLarge, InvalidJson)):  # too large, or too deep, to be read
                ref = ref_of_unread(data)
            elif ref is None and isinstance(exc, NumberOutOfRange) and isinstance(exc.value, dict):
                ref = exc.value.get("ref")  # JSON after all: its answer names it
            await self.answer_error(ref, exc)
        finally:
            receiving.give_back(len(data))

    async def answer(self, op: str, ref, **fields) -> None:
        # ASCII-escaped, so any text a client sent (even a lone surrogate) encodes safely
        await self.send(text_data=json.dumps({"op": op, "ref": ref, **fields}, separators=(",", ":")))

    async def answer_error(self, ref, exc: Exception) -> None:
        error = client_error(exc)
        if error is not exc:
            log.error("a frame on /work failed", exc_info=exc)
        await self.answer("error", ref, code=error.code, message=error.message)

    async def work_queue(self, name: str) -> QueueConfig:
        """The queue's current settings, if this connection's token may work it (checked per frame,
        so a token changed in the admin takes effect within a second)."""
        registry = get_registry()
        await registry.arefresh()
        grant = registry.authenticate(self.token)
        if grant is None or not grant.may("work", name):
            raise Forbidden("this token may not work on this queue")
        config = await registry.afind_queue(name)
        if config is None:
            raise UnknownQueue(f"no queue named {name[:80]!r}")
        return config

    async def handle_claim(self, frame: dict, ref) -> None:
        name = string_field(frame, "queue")
        max_items = integer_field(frame, "max", low=1, high=MAX_CLAIM, default=1)
        wait = number_field(frame, "wait", low=0, high=MAX_SOCKET_CLAIM_WAIT_SECONDS, default=0)
        if wait and len(self.waiting) >= MAX_WAITING_CLAIMS:
            raise InvalidRequest(f"{MAX_WAITING_CLAIMS} claims wait on this socket already: one claim may ask for "
                                 f"{MAX_CLAIM} items")
        config = await self.work_queue(name)
        self.connection.queues.add(name)
        posted = hub.available_mark(name)
        items = await self.claim(config, max_items)
        if items or not wait:
            await self.answer("items", ref, items=claimed(items, config.max_attempts))
            return
        task = asyncio.create_task(self.wait_and_claim(config, max_items, wait, ref, posted))
        self.waiting.add(task)
        task.add_done_callback(self.waiting.discard)

    async def wait_and_claim(self, config: QueueConfig, max_items: int, wait: float, ref, posted: int) -> None:
        """Wait for a wake-up (or the periodic re-check) and claim; a wake-up that finds nothing
        (another claimant was first) just waits again. `config` and `posted` (the hub's mark) are
        those of the claim that found nothing; the queue's settings are read again at each try."""
        name = config.name
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        items = []
        try:
            while not items and (remaining := deadline - loop.time()) > 0:
                await hub.wait_available(name, min(remaining, RECHECK_SECONDS), since=posted)
                config = await self.work_queue(name)
                posted = hub.available_mark(name)
                items = await self.claim(config, max_items)
            await self.answer("items", ref, items=claimed(items, config.max_attempts))
        except Exception as exc:
            await self.answer_error(ref, exc)

    async def claim(self, config: QueueConfig, max_items: int) -> list:
        claiming = run(get_store().claim_items, config=config, max_items=max_items)
        # its items are recorded as held when it ends, by a callback, not by this caller: if this
        # connection closes meanwhile, the claim still completes and let_go() re-queues them.
        # (One ended already, on the loop, is recorded now: its callback would come too late.)
        if claiming.done():
            self.hold_claimed(config.name, claiming)
        else:
            claiming.add_done_callback(partial(self.hold_claimed, config.name))
        self.claiming.add(claiming)
        claiming.add_done_callback(self.claiming.discard)
        items = await asyncio.shield(claiming)
        # an item canceled while the claim was under way is held no more: its worker never sees it
        return [item for item in items if self.held.get((config.name, item.id)) == item.claim_token]

    def hold_claimed(self, queue: str, claiming: asyncio.Future) -> None:
        if claiming.cancelled() or claiming.exception() is not None:
            return
        loop = asyncio.get_running_loop()
        for item in claiming.result():
            if hub.hold(queue, item.id, item.claim_token,
                        lambda queue, item_id: loop.call_soon_threadsafe(self.was_canceled, queue, item_id)):
                self.held[(queue, item.id)] = item.claim_token
            else:  # canceled meanwhile: an older claim of it this socket had lapsed
                self.held.pop((queue, item.id), None)

    def was_canceled(self, queue: str, item_id: str) -> None:
        """One of the items this connection holds was canceled: it holds it no more, and its
        worker is told, so it can stop working on it."""
        if self.held.pop((queue, item_id), None) is not None:
            asyncio.ensure_future(self.send(text_data=canceled_notice(queue, item_id)))

    def let_go_of(self, queue: str, item_id: str) -> None:
        if (token := self.held.pop((queue, item_id), None)) is not None:
            hub.let_go(queue, item_id, token)

    async def handle_result(self, frame: dict, ref) -> None:
        name, item_id, result = string_field(frame, "queue"), string_field(frame, "id"), value_field(frame, "result")
        config = await self.work_queue(name)
        outcome = single(await run(get_store().finish_items, results=[(config, item_id, result)]))
        self.let_go_of(name, item_id)
        await self.answer("ack", ref, id=item_id, accepted=outcome.accepted)

    async def handle_results(self, frame: dict, ref) -> None:
        """Hand in a batch. A bad frame, or a queue that is unknown or not allowed, refuses the
        whole batch; each item's own outcome (including `not_found`) is in its ack."""
        entries = frame.get("items")
        if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_RESULTS:
            raise InvalidRequest(f"'items' must be a list of 1 to {MAX_RESULTS} results")
        parsed = []
        for entry in entries:
            json_object(entry, allowed=RESULT_FIELDS, what="each result")
            parsed.append((string_field(entry, "queue"), string_field(entry, "id"), value_field(entry, "result")))
        configs = {name: await self.work_queue(name) for name in {name for name, _, _ in parsed}}
        outcomes = await run(
            get_store().finish_items, results=[(configs[name], item_id, result) for name, item_id, result in parsed]
        )
        acks = []
        for (name, item_id, _), outcome in zip(parsed, outcomes):
            if isinstance(outcome, TaskhosterError):
                acks.append({"id": item_id, "accepted": False, "error": outcome.code})
                continue
            self.let_go_of(name, item_id)
            acks.append({"id": item_id, "accepted": outcome.accepted})
        await self.answer("acks", ref, items=acks)

    async def handle_extend(self, frame: dict, ref) -> None:
        """Extend the lease of an item this connection holds (else `not_held`)."""
        name, item_id = string_field(frame, "queue"), string_field(frame, "id")
        seconds = number_field(frame, "seconds", low=1, high=MAX_LEASE_SECONDS)
        await self.work_queue(name)
        token = await self.held_token(name, item_id)
        try:
            item = await run(get_store().extend_lease, queue=name, item_id=item_id, seconds=seconds, claim_token=token)
        except NotHeld:
            with contextlib.suppress(TaskhosterError):  # an item gone or unreadable since: not_held stands
                await self.tell_if_canceled(name, item_id, token)
            raise
        await self.answer("extended", ref, id=item_id, leaseExpiresAt=ids.iso(item.lease_expires_at))

    async def tell_if_canceled(self, queue: str, item_id: str, token: str) -> None:
        """An item this connection held, and may no longer extend: if it was canceled, its worker
        is told now. The notice from another server process travels the channel layer, which
        drops it while Redis is down or restarting; a worker renewing its lease hears it so."""
        item = await run(get_store().read_item, queue=queue, item_id=item_id)
        if (item.status, item.error) == ("failed", "canceled") and self.held.get((queue, item_id)) == token:
            del self.held[(queue, item_id)]
            hub.let_go(queue, item_id, token)
            await self.send(text_data=canceled_notice(queue, item_id))  # before the refusal it explains

    async def handle_release(self, frame: dict, ref) -> None:
        """Give an item this connection holds back (else `not_held`): now, or after `delay`
        seconds, with `error` kept as its lastError."""
        name, item_id = string_field(frame, "queue"), string_field(frame, "id")
        delay = number_field(frame, "delay", low=0, high=MAX_RELEASE_DELAY_SECONDS, default=0)
        config = await self.work_queue(name)
        token = await self.held_token(name, item_id)
        release = Release(config, item_id, token, delay=delay, error=frame.get("error", ABSENT))
        single(await run(get_store().release_items, releases=[release]))
        self.let_go_of(name, item_id)
        await self.answer("released", ref, id=item_id)

    async def held_token(self, queue: str, item_id: str) -> str:
        """This connection's claim token for the item; `not_held` if it holds none (`not_found`
        if the server has no such item)."""
        token = self.held.get((queue, item_id))
        if token is None:
            await run(get_store().read_item, queue=queue, item_id=item_id)
            raise NotHeld(f"item {item_id} is not held by this connection")
        return token
