"""One async handler per API call: parse and validate, call the store, answer JSON.
The lifecycle rules live in the store; a handler only translates."""

import asyncio
from functools import partial

from .. import ids
from ..events import hub
from ..exceptions import InvalidRequest, ItemNotFound, UnknownQueue
from ..runtime import claim_items, get_registry, get_store, in_scan_thread, in_store_thread, in_store_threads
from ..services import describe_queue
from .answers import Answer
from .auth import PRODUCE, WORK, authenticate, authorize
from .fields import flag_param, integer_field, json_object, number_field, number_param
from .openapi import DOCUMENT
from .requests import Request
from .router import Router

MAX_WAIT_SECONDS = 60
MAX_CLAIM = 100
MAX_LEASE_SECONDS = 86400
# a waiting call re-reads the disk at least this often, for changes made by other processes
RECHECK_SECONDS = 1.0
HEALTH_TIMEOUT_SECONDS = 5.0
POST_SHAPE = 'post {"payload": P} or {"items": [{"payload": P}, ...]}'

router = Router()


def _item_id(item_id: str) -> str:
    """The id if it has the form of one; 404 otherwise, without going near the disk."""
    if not ids.is_valid_id(item_id):
        raise ItemNotFound("no item has this id")
    return item_id


def _clock() -> float:
    return asyncio.get_running_loop().time()


def _payloads(body: dict) -> tuple[list, bool]:
    """The payloads a post carries, and whether it is a batch."""
    if ("payload" in body) == ("items" in body) or not isinstance(body.get("items", []), list):
        raise InvalidRequest(POST_SHAPE)
    if "payload" in body:
        return [body["payload"]], False
    entries = [json_object(e, allowed={"payload"}, required={"payload"}, what="each item") for e in body["items"]]
    return [entry["payload"] for entry in entries], True


def _no_op() -> bool:
    return True


async def _within(check) -> bool:
    """What a health check says, or False if it says nothing within HEALTH_TIMEOUT_SECONDS (a
    check still waiting for its thread then never runs)."""
    try:
        return await asyncio.wait_for(check, HEALTH_TIMEOUT_SECONDS)
    except asyncio.TimeoutError:
        return False


@router.add("GET", "/healthz")
async def health(request: Request) -> Answer:
    """The database answers, the data directory is writable, and the store's thread (every
    transition waits for it) is free to take a call; all three at once, none waited for longer
    than HEALTH_TIMEOUT_SECONDS, so a disk call hung in a thread makes /healthz 503. (Reads and
    most claims touch the disk on the event loop itself: a disk that hangs there stalls every
    answer, this one's too.)"""
    database, data_directory, store_thread = await asyncio.gather(
        _within(get_registry().aping_database()),
        _within(in_scan_thread(get_store().check_writable)),
        _within(in_store_thread(_no_op)),
    )
    if database and data_directory and store_thread:
        return Answer(200, {"ok": True})
    return Answer(
        503, {"ok": False, "database": database, "dataDirectory": data_directory, "storeThread": store_thread}
    )


@router.add("GET", "/api/schema")
async def schema(request: Request) -> Answer:
    return Answer(200, DOCUMENT)


@router.add("GET", "/api/queues")
async def list_queues(request: Request) -> Answer:
    grant = await authenticate(request)
    configs = [config for config in get_registry().queues() if grant.may_see(config.name)]
    store = get_store()

    def describe_all() -> list[dict]:
        now = store.clock()
        return [describe_queue(c, store.count_items(queue=c.name), now) for c in configs]

    return Answer(200, {"queues": await in_scan_thread(describe_all)})


@router.add("GET", "/api/queues/{queue}")
async def queue_stats(request: Request, queue: str) -> Answer:
    config = await authorize(request, queue, PRODUCE, WORK)
    store = get_store()
    counts = await in_scan_thread(store.count_items, queue=queue)
    return Answer(200, describe_queue(config, counts, store.clock()))


@router.add("POST", "/api/queues/{queue}/items")
async def post_items(request: Request, queue: str) -> Answer:
    await authorize(request, queue, PRODUCE)
    payloads, batch = _payloads(json_object(await request.json(), allowed={"payload", "items"}))
    # a waiting claim is woken as soon as the items can be claimed: a single item's while its
    # post waits for the disk, so the worker's part overlaps the flush
    wake = partial(hub.items_available, queue, len(payloads))
    items = await in_store_threads(get_store().begin_post, queue=queue, payloads=payloads, on_claimable=wake)
    if batch:
        return Answer(201, {"items": [item.to_json() for item in items]})
    return Answer(201, items[0].to_json())


@router.add("GET", "/api/queues/{queue}/items/{item_id}")
async def read_item(request: Request, queue: str, item_id: str) -> Answer:
    """With `wait`, hold the answer until the item is terminal: woken by the hub when a result
    arrives in this process, re-reading at least once a second for other processes."""
    config = await authorize(request, queue, PRODUCE)
    item_id = _item_id(item_id)
    with_payload = flag_param(request.query, "payload")
    wait = number_param(request.query, "wait", low=0, high=MAX_WAIT_SECONDS, default=0)
    store, deadline = get_store(), _clock() + wait
    if wait:
        request.watch_disconnect()
    while True:
        ended = hub.terminal_mark(queue)
        # a fetch is recorded only on a terminal item, and this read is the answer that shows it.
        # Read here on the event loop (one small file, never waiting for a lock: cheaper than a
        # hop to the store's thread, and never queued behind a batch there); an item a move hides
        # for an instant, or a done item whose lock is taken (its result may not be on disk
        # yet), is read under its lock in the store's thread
        item = store.read_item_unlocked(queue=queue, item_id=item_id, fetch=True, retain_from=config.retain_from)
        if item is None:
            item = await in_store_thread(
                store.read_item, queue=queue, item_id=item_id, fetch=True, retain_from=config.retain_from
            )
        remaining = deadline - _clock()
        if item.terminal or remaining <= 0 or request.gone:
            return Answer(200, item.to_json(payload=with_payload))
        await hub.wait_terminal(queue, item_id, min(remaining, RECHECK_SECONDS), since=ended)


@router.add("POST", "/api/queues/{queue}/claim")
async def claim(request: Request, queue: str) -> Answer:
    """Claim up to `max` items; with `wait`, keep trying until one comes or time is up (woken by
    the hub on a post or re-queue here, re-trying at least once a second for other processes)."""
    await authorize(request, queue, WORK)
    body = json_object(await request.json(when_empty={}), allowed={"max", "wait"})
    max_items = integer_field(body, "max", low=1, high=MAX_CLAIM, default=1)
    wait = number_field(body, "wait", low=0, high=MAX_WAIT_SECONDS, default=0)
    registry, deadline = get_registry(), _clock() + wait
    if wait:
        request.watch_disconnect()
    while True:
        await registry.arefresh()  # a pause or a change of lease takes effect while waiting
        config = registry.queue(queue)
        if config is None:
            raise UnknownQueue(f"queue {queue!r} was deleted")
        posted = hub.available_mark(queue)
        items = await claim_items(config, max_items)
        remaining = deadline - _clock()
        if items or remaining <= 0 or request.gone:
            break
        await hub.wait_available(queue, min(remaining, RECHECK_SECONDS), since=posted)
    if items and request.gone:
        await _release(queue, items)  # nobody will work them: hand them to the next claimant now
        items = []
    return Answer(200, {"items": [item.to_json(payload=True) for item in items]})


async def _release(queue: str, items: list) -> None:
    store = get_store()

    def release_all() -> int:
        return sum(store.requeue_item(queue=queue, item_id=i.id, claim_token=i.claim_token) for i in items)

    hub.items_available(queue, await in_store_thread(release_all))


@router.add("POST", "/api/queues/{queue}/items/{item_id}/result")
async def hand_in_result(request: Request, queue: str, item_id: str) -> Answer:
    config = await authorize(request, queue, WORK)
    item_id = _item_id(item_id)
    body = json_object(await request.json(), allowed={"result"}, required={"result"})
    outcome = await in_store_threads(
        get_store().begin_finish_item, config=config, item_id=item_id, result=body["result"]
    )
    hub.items_terminal(queue, [item_id])  # accepted or not, the item is terminal now
    return Answer(200, {"id": outcome.id, "accepted": outcome.accepted, "status": outcome.status})


@router.add("POST", "/api/queues/{queue}/items/{item_id}/extend")
async def extend_lease(request: Request, queue: str, item_id: str) -> Answer:
    await authorize(request, queue, WORK)
    item_id = _item_id(item_id)
    body = json_object(await request.json(), allowed={"seconds"})
    seconds = number_field(body, "seconds", low=1, high=MAX_LEASE_SECONDS)
    item = await in_store_thread(get_store().extend_lease, queue=queue, item_id=item_id, seconds=seconds)
    return Answer(200, item.to_json())
