"""The process-wide objects built from settings, made lazily in one place."""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from .registry import Registry
from .store import Store

# Store calls block on the disk (fsync), so they run off the event loop. Transitions run one at
# a time on one thread: each makes many short system calls, and every one of them hands the GIL
# to whichever other thread wants it, so several store threads mostly wait on each other
# (measured end to end, fsync off: ~2,300 items/s on one thread against ~1,750 on 16, with the
# server's CPU per item halved). Calls that may read a whole directory (counts, listings,
# health) run beside them, so a big queue's count never holds up a post.
_store_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")
# A batch's second half (waiting for its files to reach the disk, then moving them into place)
# runs here, so the store's thread meanwhile writes the next batch (see Store.begin_post).
_flush_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-flush")
_scan_threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="store-scan")


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
    """Run a batch transition in two halves: `begin` (a Store.begin_* method) in the store's
    thread, then the half it returns in the flush thread."""
    loop = asyncio.get_running_loop()
    finish = await loop.run_in_executor(_store_thread, partial(begin, *args, **kwargs))
    # with fsync off there is no wait on the disk to overlap: a second thread would only vie
    # for the GIL
    return await loop.run_in_executor(_flush_thread if get_store().fsync else _store_thread, finish)


async def in_scan_thread(function, /, *args, **kwargs):
    """Run a store call that may read whole directories (counts, listings) off the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_scan_threads, partial(function, *args, **kwargs))
