"""One async handler per API call: parse and validate, call the store, answer JSON.
The lifecycle rules live in the store; a handler only translates."""

import asyncio
import logging
import time

from .. import ids
from ..events import hub
from ..exceptions import InvalidRequest, ItemNotFound
from ..protocol import (
    MAX_CLAIM,
    MAX_HTTP_WAIT_SECONDS,
    MAX_LEASE_SECONDS,
    MAX_RELEASE_DELAY_SECONDS,
    RECHECK_SECONDS,
    claimed,
    flag_param,
    integer_field,
    json_object,
    number_field,
    number_param,
    run_at_field,
)
from ..runtime import TRANSITIONS_END_SECONDS, get_registry, get_store, run, store_threads_answer
from ..services import describe_queue
from ..store import ABSENT, NewItem, Posted, Release, single
from ..store.keys import check_key
from .answers import Answer
from .auth import PRODUCE, WORK, authenticate, authorize
from .openapi import DOCUMENT
from .requests import Request
from .router import Router

HEALTH_TIMEOUT_SECONDS = 5.0
POST_SHAPE = 'post {"payload": P} or {"items": [{"payload": P}, ...]}'
ITEM_FIELDS = {"payload", "delay", "runAt", "key"}

router = Router()
log = logging.getLogger(__name__)


def _item_id(item_id: str) -> str:
    """The id if it has the form of one; 404 otherwise, without going near the disk."""
    if not ids.is_valid_id(item_id):
        raise ItemNotFound("no item has this id")
    return item_id


def _clock() -> float:
    return asyncio.get_running_loop().time()


def _new_items(body: dict, header_key: str | None) -> tuple[list[NewItem], bool]:
    """The items a post makes, and whether it is a batch. A single post's key may come in the
    Idempotency-Key header or its "key" field; a batch's only in each item's field."""
    if ("payload" in body) == ("items" in body) or not isinstance(body.get("items", []), list):
        raise InvalidRequest(POST_SHAPE)
    now = time.time()
    if "payload" in body:
        json_object(body, allowed=ITEM_FIELDS, what="the body")
        key = _key_field(body) or header_key
        if header_key is not None and key != header_key:
            raise InvalidRequest("the Idempotency-Key header and the \"key\" field name different keys")
        return [NewItem(body["payload"], run_at_field(body, now=now), key)], False
    if header_key is not None:
        raise InvalidRequest('the Idempotency-Key header is for a single post: give each item of a batch its own "key"')
    beside = sorted(set(body) - {"items"})
    if beside:
        raise InvalidRequest(f'a batch takes only "items": give each item its own {", ".join(map(repr, beside))}')
    entries = [json_object(e, allowed=ITEM_FIELDS, required={"payload"}, what="each item") for e in body["items"]]
    return [NewItem(entry["payload"], run_at_field(entry, now=now), _key_field(entry)) for entry in entries], True


async def _changed(call, /, **kwargs):
    """What a store change did, awaited to its end even if the request is cut meanwhile (a stop
    cancels the requests its grace did not see end; daphne cancels them at once). Begun, the
    change runs on regardless (see runtime.run), so the answer says what it did rather than 503
    "try again", after which a post sent again would make a second item. It waits at most
    TRANSITIONS_END_SECONDS after the cut, as the stopping server does for such changes."""
    changing = run(call, **kwargs)
    try:
        return await asyncio.shield(changing)
    except asyncio.CancelledError:
        if not await _ended_within(changing, TRANSITIONS_END_SECONDS):
            # one still waiting for a store thread then never runs, and its 503 is true; one
            # that began still ends, and its request is answered 503 all the same
            changing.cancel()
            raise
        asyncio.current_task().uncancel()  # the cut is over: answered, not cancelled
        return changing.result()


async def _ended_within(future: asyncio.Future, seconds: float) -> bool:
    """Whether `future` ends within `seconds`, waited for through any further cut."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    deadline = loop.time() + seconds
    while not future.done() and (left := deadline - loop.time()) > 0:
        try:
            await asyncio.wait([future], timeout=left)
        except asyncio.CancelledError:  # cut again: the change still ends on its own
            task.uncancel()
    return future.done()


def _key_field(entry: dict) -> str | None:
    if "key" not in entry:
        return None
    check_key(entry["key"])  # here too, so null is not taken for no key at all
    return entry["key"]


async def _within(check, default):
    """What a health check says, or `default` if it says nothing within HEALTH_TIMEOUT_SECONDS
    (a check still waiting for its thread then never runs)."""
    try:
        return await asyncio.wait_for(check, HEALTH_TIMEOUT_SECONDS)
    except asyncio.TimeoutError:
        return default


@router.add("GET", "/healthz")
async def health(request: Request) -> Answer:
    """The database answers, the data directory takes a real write and has room above its
    reserve, and the store's threads (big batches run there) take a call; none of it waited for
    longer than HEALTH_TIMEOUT_SECONDS, so a disk call hung in a thread makes /healthz 503 (one
    hung on the event loop, a transition's flush, stops the server: docs/deployment.md)."""
    database, disk, store_threads = await asyncio.gather(
        _within(get_registry().aping_database(), False),
        _within(run(get_store().check_health), None),
        _within(store_threads_answer(), False),
    )
    if database and disk is not None and disk.ok and store_threads:
        return Answer(200, {"ok": True})
    failures = [
        *([] if database else ["the database does not answer"]),
        *([] if disk and disk.writable else ["the data directory does not take a write"]),
        *([] if store_threads else ["the store's threads do not take a call"]),
    ]
    if disk is not None and disk.free_bytes < disk.min_free_bytes:
        failures.append(f"the disk is nearly full: {disk.free_bytes} bytes free, {disk.min_free_bytes} kept in reserve")
    # an error's shape, as every error of the API, with what failed beside it
    return Answer(503, {"error": "storage_unavailable", "message": "; ".join(failures), "ok": False,
                        "database": database, "dataDirectory": bool(disk and disk.writable),
                        "storeThread": store_threads})


@router.add("GET", "/api/schema")
async def schema(request: Request) -> Answer:
    return Answer(200, DOCUMENT)


@router.add("GET", "/api/queues")
async def list_queues(request: Request) -> Answer:
    grant = await authenticate(request)
    configs = [config for config in get_registry().queues() if grant.may_see(config.name)]
    store = get_store()
    counts = await asyncio.gather(*(run(store.count_items, queue=c.name) for c in configs))
    now = store.clock()
    return Answer(200, {"queues": [describe_queue(c, n, now) for c, n in zip(configs, counts)]})


@router.add("GET", "/api/queues/{queue}")
async def queue_stats(request: Request, queue: str) -> Answer:
    config = await authorize(request, queue, PRODUCE, WORK)
    store = get_store()
    counts = await run(store.count_items, queue=queue)
    return Answer(200, describe_queue(config, counts, store.clock()))


@router.add("POST", "/api/queues/{queue}/items")
async def post_items(request: Request, queue: str) -> Answer:
    config = await authorize(request, queue, PRODUCE)
    body = json_object(await request.json(), allowed={*ITEM_FIELDS, "items"})
    new, batch = _new_items(body, request.header(b"idempotency-key"))
    posted = await _changed(get_store().post_items, config=config, items=new)
    if batch:
        return Answer(201, {"items": [_posted_json(entry) for entry in posted]})
    return Answer(200 if posted[0].duplicate else 201, posted[0].item.to_json())


def _posted_json(posted: Posted) -> dict:
    """An item in a batch's answer; one an earlier post with its key made says so."""
    return {**posted.item.to_json(), "duplicate": True} if posted.duplicate else posted.item.to_json()


@router.add("GET", "/api/queues/{queue}/items/{item_id}")
async def read_item(request: Request, queue: str, item_id: str) -> Answer:
    """With `wait`, hold the answer until the item is terminal: woken by the hub when the item
    ends in this process or another, re-reading at least once a second in case a wake-up was
    missed. The answer that shows the item terminal counts as its fetch."""
    await authorize(request, queue, PRODUCE)
    item_id = _item_id(item_id)
    with_payload = flag_param(request.query, "payload")
    wait = number_param(request.query, "wait", low=0, high=MAX_HTTP_WAIT_SECONDS, default=0)
    store, deadline = get_store(), _clock() + wait
    if wait:
        request.watch_disconnect()
    while True:
        ended = hub.terminal_mark(queue)
        # a reader who left is shown nothing: its read must not start a retention from the fetch
        item = await run(store.read_item, queue=queue, item_id=item_id, fetch=not request.gone)
        remaining = deadline - _clock()
        if item.terminal or remaining <= 0 or request.gone:
            return Answer(200, item.to_json(payload=with_payload))
        await request.until_gone(hub.wait_terminal(queue, item_id, min(remaining, RECHECK_SECONDS), since=ended))


@router.add("POST", "/api/queues/{queue}/claim")
async def claim(request: Request, queue: str) -> Answer:
    """Claim up to `max` items; with `wait`, keep trying until one comes or time is up (woken by
    the hub on a post or re-queue, re-trying at least once a second for what it missed)."""
    await authorize(request, queue, WORK)
    body = json_object(await request.json(when_empty={}), allowed={"max", "wait"})
    max_items = integer_field(body, "max", low=1, high=MAX_CLAIM, default=1)
    wait = number_field(body, "wait", low=0, high=MAX_HTTP_WAIT_SECONDS, default=0)
    store, deadline = get_store(), _clock() + wait
    if wait:
        request.watch_disconnect()
    while True:
        # a token revoked or narrowed, the queue deleted or paused, its lease changed: all take
        # effect while the claim waits
        config = await authorize(request, queue, WORK)
        posted = hub.available_mark(queue)
        if request.gone:  # nobody to hand items to: claiming them would spend their tries
            items = []
            break
        items = await _claim_whole(store, config, max_items)
        remaining = deadline - _clock()
        if items or remaining <= 0:
            break
        await request.until_gone(hub.wait_available(queue, min(remaining, RECHECK_SECONDS), since=posted))
    if items and request.gone:
        # nobody will work them: hand them to the next claimant now, never ending one max_attempts
        # (shielded: a stop that cuts this wait must not cancel a release still waiting for a store
        # thread)
        await asyncio.shield(run(store.release_items, releases=_given_back(config, items, reason="unsent")))
        items = []
    return Answer(200, {"items": claimed(items, config.max_attempts)})


_giving_back: set[asyncio.Future] = set()  # kept referenced until they end


async def _claim_whole(store, config, max_items: int) -> list:
    """A claim that the request's cancellation cannot cut in two, leaving items claimed for
    nobody: if it comes while the claim waits (for an item's lock, or for its rest in a store
    thread), the claim's items go back as soon as it ends. (At a stop, what has not ended when the
    grace is over may be cancelled: those items wait for their lease.)"""
    claiming = run(store.claim_items, config=config, max_items=max_items)
    try:
        return await asyncio.shield(claiming)
    except asyncio.CancelledError:
        claiming.add_done_callback(lambda done: _give_back(store, config, done))
        raise


def _give_back(store, config, claiming: asyncio.Future) -> None:
    if claiming.cancelled() or claiming.exception() is not None or not claiming.result():
        return
    releases = _given_back(config, claiming.result(), reason="shutdown")
    giving_back = run(store.release_items, releases=releases)
    _giving_back.add(giving_back)
    giving_back.add_done_callback(_gave_back)


def _given_back(config, items: list, *, reason: str) -> list[Release]:
    return [Release(config, item.id, item.claim_token, reason=reason) for item in items]


def _gave_back(giving_back: asyncio.Future) -> None:
    _giving_back.discard(giving_back)
    if not giving_back.cancelled() and giving_back.exception() is not None:
        log.warning("could not give back the items of a cancelled claim", exc_info=giving_back.exception())


@router.add("POST", "/api/queues/{queue}/items/{item_id}/result")
async def hand_in_result(request: Request, queue: str, item_id: str) -> Answer:
    config = await authorize(request, queue, WORK)
    item_id = _item_id(item_id)
    body = json_object(await request.json(), allowed={"result"}, required={"result"})
    outcome = single(await _changed(get_store().finish_items, results=[(config, item_id, body["result"])]))
    return Answer(200, {"id": outcome.id, "accepted": outcome.accepted, "status": outcome.status})


@router.add("POST", "/api/queues/{queue}/items/{item_id}/extend")
async def extend_lease(request: Request, queue: str, item_id: str) -> Answer:
    await authorize(request, queue, WORK)
    item_id = _item_id(item_id)
    body = json_object(await request.json(), allowed={"seconds"})
    seconds = number_field(body, "seconds", low=1, high=MAX_LEASE_SECONDS)
    item = await _changed(get_store().extend_lease, queue=queue, item_id=item_id, seconds=seconds)
    return Answer(200, item.to_json())


@router.add("POST", "/api/queues/{queue}/items/{item_id}/release")
async def release_item(request: Request, queue: str, item_id: str) -> Answer:
    """Give a processing item back, now or after `delay` seconds, with `error` kept as its
    lastError (HTTP workers hold no claim token: the lease is theirs alone)."""
    config = await authorize(request, queue, WORK)
    item_id = _item_id(item_id)
    body = json_object(await request.json(when_empty={}), allowed={"delay", "error"})
    delay = number_field(body, "delay", low=0, high=MAX_RELEASE_DELAY_SECONDS, default=0)
    release = Release(config, item_id, delay=delay, error=body.get("error", ABSENT))
    item = single(await _changed(get_store().release_items, releases=[release]))
    return Answer(200, item.to_json())


@router.add("POST", "/api/queues/{queue}/items/{item_id}/retry")
async def retry_item(request: Request, queue: str, item_id: str) -> Answer:
    """Post an ended item again as a new item: 201 the new item, 200 the same one asked again."""
    config = await authorize(request, queue, PRODUCE)
    item_id = _item_id(item_id)
    json_object(await request.json(when_empty={}), allowed=set())
    item, made = await _changed(get_store().retry_item, config=config, item_id=item_id)
    return Answer(201 if made else 200, item.to_json())


@router.add("POST", "/api/queues/{queue}/items/{item_id}/cancel")
async def cancel_item(request: Request, queue: str, item_id: str) -> Answer:
    """End an item that has not ended, failed `canceled`; an ended one is answered as it is."""
    config = await authorize(request, queue, PRODUCE)
    item_id = _item_id(item_id)
    json_object(await request.json(when_empty={}), allowed=set())
    item, canceled = await _changed(get_store().cancel_item, config=config, item_id=item_id)
    return Answer(200, {**item.to_json(), "canceled": canceled})
