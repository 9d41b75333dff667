"""The process-wide objects built from settings, made once and lazily, and where store calls run.

Async code calls the store through `run`, and only here is it decided where each call runs:
- reads and claims on the event loop: each is a few small file operations, never waits for a
  flush or for a large directory to be listed, and costs less than a hop to a thread and back;
- the other transitions in the store's threads, since they wait for the disk to flush; concurrent
  posts and results there share their flushes (see store.files);
- calls that may read whole directories (counts, listings, health, sweeps) in threads of their
  own, so a big queue's count never holds up a post.
"""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from .events import hub
from .metrics.transitions import transition_counter
from .registry import Registry
from .store import Store

STORE_THREADS = 2  # enough concurrent posts and results to share a flush; more only contend for the GIL
SCAN_THREADS = 2
ON_LOOP = frozenset({"read_item", "claim_items"})
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


async def run(call, /, **kwargs):
    """Run a store method (or any blocking call) where it belongs and return what it returns.
    Once started it runs to its end even if the caller is cancelled meanwhile, so a transition
    is never left half done."""
    name = getattr(call, "__name__", "")
    if name in ON_LOOP:
        return call(**kwargs)
    threads = _scan_threads() if name in SCANS else _store_threads()
    return await asyncio.get_running_loop().run_in_executor(threads, partial(call, **kwargs))
