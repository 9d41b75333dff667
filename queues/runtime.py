"""The process-wide objects built from settings, made once and lazily, and where store calls run.

Async code calls the store through `run`, and only here is it decided where each call runs:
- transitions of a few items on the event loop, flushes included (see store.turn): while one
  waits for a lock or for a flush the loop goes on, and concurrent posts and results flush their
  files and directories together (see store.files);
- bigger ones in the store's threads, taking turns, so a batch of many files never keeps the loop
  from its sockets: a claim takes its first few items on the loop and any more there;
- calls that may read whole directories (counts, listings, health, sweeps) in threads of their
  own, so a big queue's count never holds up a post.
"""

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from .events import hub
from .exceptions import StorageUnavailable
from .metrics.transitions import transition_counter
from .registry import Registry
from .store import Store, turn
from .threads import in_thread

log = logging.getLogger(__name__)

# set by the server (serving/, and runserver) once it begins to stop: what its sockets hold then
# goes back without counting the try; a worker's own close never does, whatever its close code
server_stopping = threading.Event()

STORE_THREADS = 2  # one runs while the other waits for the disk; more would only queue for the turn
SCAN_THREADS = 2
ITEMS_ON_LOOP = 8  # items a call may have to run on the event loop
TRANSITIONS_END_SECONDS = 10  # what store transitions still running get when the server stops
ITEM_LISTS = ("items", "results", "releases")  # the arguments that hold a call's items
SCANS = frozenset(
    {"count_items", "list_items", "throughput", "check_health", "sweep_queue", "take_snapshot", "count_queues"}
)


@lru_cache(maxsize=1)
def get_store() -> Store:
    data_dir = settings.TASKHOSTER_DATA_DIR
    if not data_dir:
        raise ImproperlyConfigured("Set TASKHOSTER_DATA_DIR to the directory that holds the item files.")
    return Store(
        data_dir,
        fsync=settings.TASKHOSTER_FSYNC,
        max_payload_bytes=settings.TASKHOSTER_MAX_PAYLOAD_BYTES,
        min_free_bytes=settings.TASKHOSTER_MIN_FREE_BYTES,
        events=hub,
        observer=transition_counter,
    )


@lru_cache(maxsize=1)
def get_registry() -> Registry:
    # one thread for every database read, so the hot path never waits on a new connection
    return Registry(ThreadPoolExecutor(max_workers=1, thread_name_prefix="database"))


@lru_cache(maxsize=1)
def _store_threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=STORE_THREADS, thread_name_prefix="store")


@lru_cache(maxsize=1)
def _scan_threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=SCAN_THREADS, thread_name_prefix="scan")


def run(call, /, **kwargs) -> asyncio.Future:
    """Start a store method where it belongs, now, and return what it returns as a future to
    await (one on the loop has run up to its first wait by then; a call that blocks for long
    must be a scan, or have more than ITEMS_ON_LOOP items, or it holds the loop). Once started it
    runs to its end even if the future is cancelled meanwhile, so a transition is never left
    half done."""
    name = getattr(call, "__name__", "")
    if name == "claim_items":
        return _claim(call, **kwargs)
    if name in SCANS:
        return in_thread(_scan_threads(), call, **kwargs)
    if max((len(kwargs[arg]) for arg in ITEM_LISTS if arg in kwargs), default=1) <= ITEMS_ON_LOOP:
        return turn.on_loop(call, **kwargs)
    return _in_store_thread(call, **kwargs)


async def store_threads_answer() -> bool:
    """Whether the store's threads take a call (one not started when its caller gives up never
    runs)."""
    return await in_thread(_store_threads(), bool, True)


def _in_store_thread(call, /, **kwargs) -> asyncio.Future:
    """`call` in the store's threads, taking turns."""
    return in_thread(_store_threads(), turn.taking, call, **kwargs)


def _claim(claim_items, /, *, max_items: int = 1, **kwargs) -> asyncio.Future:
    """A claim's first items on the loop, the rest (if it found all it took there) in the store's
    threads; a failure there ends the claim with what it had, as within one claim. Chained by
    callbacks, not a task: a stopping server cancels the tasks it leaves, and a claim cut there
    would hold the items it took for nobody."""
    first = turn.on_loop(claim_items, max_items=min(max_items, ITEMS_ON_LOOP), **kwargs)
    if max_items <= ITEMS_ON_LOOP:
        return first
    whole = asyncio.get_running_loop().create_future()

    def took_first(done: asyncio.Future) -> None:
        if done.cancelled() or done.exception() is not None or len(done.result()) < ITEMS_ON_LOOP:
            _settle_as(whole, done)
            return
        items = done.result()
        try:
            more = _in_store_thread(claim_items, max_items=max_items - len(items), **kwargs)
        except RuntimeError:  # the store's threads take no more (the process is ending)
            log.warning("a claim stopped early", exc_info=True)
            whole.set_result(items)
            return
        more.add_done_callback(lambda more: took_more(items, more))

    def took_more(items: list, more: asyncio.Future) -> None:
        if not more.cancelled() and isinstance(more.exception(), StorageUnavailable):
            log.warning("a claim stopped early", exc_info=more.exception())
            if not whole.done():
                whole.set_result(items)
        elif more.cancelled() or more.exception() is not None:
            _settle_as(whole, more)
        elif not whole.done():
            whole.set_result(items + more.result())

    first.add_done_callback(took_first)
    return whole


def _settle_as(future: asyncio.Future, done: asyncio.Future) -> None:
    """End `future` as `done` ended, unless it has ended already."""
    if future.done():
        return
    if done.cancelled():
        future.cancel()
    elif done.exception() is not None:
        future.set_exception(done.exception())
    else:
        future.set_result(done.result())
