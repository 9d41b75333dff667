"""The process-wide objects built from settings, made lazily in one place."""

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from .exceptions import TaskhosterError
from .registry import Registry
from .store import Store

log = logging.getLogger(__name__)

# Store calls block on the disk (fsync), so they run off the event loop. Transitions run one at
# a time on one thread: each makes many short system calls, and every one of them hands the GIL
# to whichever other thread wants it, so several store threads mostly wait on each other
# (measured end to end, fsync off: ~2,300 items/s on one thread against ~1,750 on 16, with the
# server's CPU per item halved). Calls that may read a whole directory (counts, listings,
# health) run beside them, so a big queue's count never holds up a post.
_store_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")
# A post's or a result's second half (waiting for its files to reach the disk, then moving them
# into place) runs here, so the store's thread meanwhile writes the next one: in a round trip,
# the result is written while its post still flushes (see Store.begin_post).
_flush_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-flush")
_scan_threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="store-scan")
# at most this many items a claim takes on the event loop (~0.1 ms each), the rest in the
# store's thread, so a big claim never stalls the loop for long
CLAIMS_ON_LOOP = 8


@lru_cache(maxsize=1)
def get_store() -> Store:
    data_dir = settings.TASKHOSTER_DATA_DIR
    if not data_dir:
        raise ImproperlyConfigured("Set TASKHOSTER_DATA_DIR to the directory that holds the item files.")
    return Store(
        data_dir,
        fsync=settings.TASKHOSTER_FSYNC,
        max_payload_bytes=settings.TASKHOSTER_MAX_PAYLOAD_BYTES,
    )


@lru_cache(maxsize=1)
def get_registry() -> Registry:
    return Registry()


async def in_store_thread(function, /, *args, **kwargs):
    """Run a store transition or a one-item read off the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_store_thread, partial(function, *args, **kwargs))


async def in_store_threads(begin, /, *args, **kwargs):
    """Run a post or a result in two halves: `begin` (a Store.begin_* method) in the store's
    thread, then the half it returns in the flush thread, handed over there directly, and the
    event loop woken once, at the end. Once submitted, both halves run even if the caller is
    cancelled meanwhile, so no written file is left behind half done."""
    if not get_store().fsync:
        # no wait on the disk to overlap: both halves in one call, one hop (a second thread
        # would only vie for the GIL)
        return await in_store_thread(lambda: begin(*args, **kwargs)())
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(result, error) -> None:
        try:
            loop.call_soon_threadsafe(_settle, done, result, error)
        except RuntimeError:
            pass  # the loop is closed (the server stopped): nobody waits for the answer

    def second_half(half) -> None:
        try:
            result = half()
        except BaseException as error:
            settle(None, error)
        else:
            settle(result, None)

    def first_half() -> None:
        try:
            _flush_thread.submit(second_half, begin(*args, **kwargs))
        except BaseException as error:
            settle(None, error)

    _store_thread.submit(first_half)
    return await done  # a cancelled caller leaves both halves to run; _settle then skips it


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():
        return  # the caller was cancelled
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


async def in_scan_thread(function, /, *args, **kwargs):
    """Run a store call that may read whole directories (counts, listings) off the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_scan_threads, partial(function, *args, **kwargs))


async def claim_items(config, max_items: int) -> list:
    """Claim on the event loop while that never waits (see Store.claim_items_now): a claim is a
    rename and an xattr, cheaper than the hop to the store's thread and back (~0.15 ms here, more
    when the machine is idle). The rest goes to the store's thread. A process's first claim on a
    queue lists its pending directory first, beside that thread (1.7 s at a million items), so
    posts and results go on."""
    store = get_store()
    if not store.pending_listed(queue=config.name):
        await in_scan_thread(store.list_pending, queue=config.name)
    on_loop = min(max_items, CLAIMS_ON_LOOP)
    claimed = store.claim_items_now(config=config, max_items=on_loop)
    if claimed is not None and (len(claimed) < on_loop or on_loop == max_items):
        # paused, all it asked for, or it ran out of items (or met a busy one): the thread
        # would add nothing
        return claimed
    claimed = claimed or []
    try:
        claimed += await in_store_thread(store.claim_items, config=config, max_items=max_items - len(claimed))
    except TaskhosterError:
        if not claimed:
            raise
        log.warning("a claim on %s stopped early", config.name, exc_info=True)
    return claimed
