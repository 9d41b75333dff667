"""The process-wide objects built from settings, made lazily in one place."""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from .registry import Registry
from .store import Store

# Store calls block on the disk (fsync); they run here so the event loop keeps serving.
_store_threads = ThreadPoolExecutor(max_workers=16, thread_name_prefix="store")


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
    """Run a blocking store call off the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_store_threads, partial(function, *args, **kwargs))
