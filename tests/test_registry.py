"""The registry: cached queues and tokens that still see a brand-new one at once."""

import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
import time

import pytest
from asgiref.sync import sync_to_async
from django.db import OperationalError
from django.db.models import QuerySet

from queues import registry as registry_module
from queues.models import ApiToken
from queues.registry import Registry
from queues.services import save_queue

pytestmark = pytest.mark.django_db(transaction=True)


def make_token(name: str) -> str:
    token = ApiToken(name=name)
    raw = token.set_new_value()
    token.save()
    return raw


async def test_a_token_and_a_queue_made_after_the_last_load_work_at_once():
    registry = Registry(ThreadPoolExecutor(max_workers=1))
    await registry.arefresh()
    time.sleep(registry_module.MISS_RELOAD_SECONDS)
    raw = await sync_to_async(make_token)("new")
    await sync_to_async(save_queue)("fresh")
    assert not registry.stale  # the cache alone would not know them for up to a second
    grant = await registry.afind_token(raw)
    assert grant is not None and grant.name == "new"
    assert (await registry.afind_queue("fresh")).name == "fresh"


async def test_misses_that_come_while_a_miss_reload_runs_wait_for_it(monkeypatch):
    """A worker's first frames for a queue made a moment ago arrive together: each must find it,
    not only the first, even when the first waits for a background reload that read before."""
    registry = Registry(ThreadPoolExecutor(max_workers=1), max_age=60)
    async with a_reload_that_read_before(registry, monkeypatch, lambda: a_background_reload(registry)):
        await sync_to_async(save_queue)("together")
    found = await asyncio.wait_for(asyncio.gather(*(registry.afind_queue("together") for _ in range(4))), 10)
    assert [config and config.name for config in found] == ["together"] * 4


async def test_unknown_names_reload_at_most_once_per_interval_and_misses_meanwhile_share_one(monkeypatch):
    registry = Registry(ThreadPoolExecutor(max_workers=1), max_age=60)  # no reloads but the misses'
    await registry.arefresh()
    loads = []
    real_load = registry.load
    monkeypatch.setattr(registry, "load", lambda: (loads.append(1), real_load()))
    flood = [registry.afind_token("th_unknown") for _ in range(20)] + [registry.afind_queue("nope") for _ in range(20)]
    assert await asyncio.wait_for(asyncio.gather(*flood), 10) == [None] * 40
    assert len(loads) == 1

    first_started = registry._reloaded_after_miss_at
    for _ in range(4):
        assert await asyncio.wait_for(registry.afind_queue("nope"), 10) is None
    assert len(loads) == 5
    assert registry._reloaded_after_miss_at - first_started >= 3.9 * registry_module.MISS_RELOAD_SECONDS


async def test_a_queue_made_just_after_a_reload_for_an_unknown_name_is_found_at_once():
    """A miss is answered from settings read after it came, even within the reloads' interval
    (a worker whose queue is refused stops)."""
    registry = Registry(ThreadPoolExecutor(max_workers=1))
    await registry.arefresh()
    assert await registry.afind_queue("typo") is None
    await sync_to_async(save_queue)("made-just-after")
    assert (await asyncio.wait_for(registry.afind_queue("made-just-after"), 10)).name == "made-just-after"


async def test_a_miss_that_comes_while_a_miss_reload_reads_waits_for_the_next(monkeypatch):
    registry = Registry(ThreadPoolExecutor(max_workers=1), max_age=60)
    async with a_reload_that_read_before(registry, monkeypatch, lambda: registry.afind_queue("typo")) as typo:
        await sync_to_async(save_queue)("made-while-reading")
        made = asyncio.ensure_future(registry.afind_queue("made-while-reading"))
    assert await asyncio.wait_for(typo, 10) is None
    assert (await asyncio.wait_for(made, 10)).name == "made-while-reading"


async def test_known_names_do_not_wait_for_a_reload_for_an_unknown_one(monkeypatch):
    await sync_to_async(save_queue)("known")
    registry = Registry(ThreadPoolExecutor(max_workers=1), max_age=60)
    await registry.arefresh()
    reading, go_on = threading.Event(), threading.Event()
    real_load = registry.load
    monkeypatch.setattr(registry, "load", lambda: (reading.set(), go_on.wait(30), real_load()))
    typo = asyncio.ensure_future(registry.afind_queue("typo"))
    try:
        assert await asyncio.to_thread(reading.wait, 10)
        assert (await asyncio.wait_for(registry.afind_queue("known"), 10)).name == "known"
    finally:
        go_on.set()
    assert await asyncio.wait_for(typo, 10) is None


async def test_settings_past_half_their_max_age_are_reloaded_in_the_background_and_only_old_ones_wait(monkeypatch):
    """A reload writes and reads the database (tens of ms on a busy disk): no caller waits for
    one while the settings it has are under max_age old."""
    registry = Registry(ThreadPoolExecutor(max_workers=1), max_age=60)
    await registry.arefresh()
    held, loads = threading.Event(), []
    real_load = registry.load

    def held_load():
        loads.append("started")
        held.wait(10)
        real_load()

    monkeypatch.setattr(registry, "load", held_load)
    await registry.arefresh()
    assert loads == []  # fresh: nothing to do

    registry._loaded_at -= 45  # past REFRESH_AHEAD of max_age, under max_age
    await asyncio.wait_for(registry.arefresh(), 5)  # returns while the reload is held
    await asyncio.wait_for(registry.arefresh(), 5)  # and starts no second one
    await asyncio.to_thread(lambda: [time.sleep(0.01) for _ in range(500) if not loads])
    assert loads == ["started"] and registry._age() > 45
    held.set()
    await asyncio.wait_for(registry._refreshing, 10)
    assert registry._age() < 5

    held.clear()
    registry._loaded_at -= 120  # older than max_age: the caller waits for the reload
    waiting = asyncio.ensure_future(registry.arefresh())
    await asyncio.sleep(0.2)
    assert not waiting.done()
    held.set()
    await asyncio.wait_for(waiting, 10)
    assert not registry.stale and loads == ["started"] * 2


@contextlib.asynccontextmanager
async def a_reload_that_read_before(registry, monkeypatch, start):
    """Calls `start()` (a coroutine, run as a task: what the block gets) so that it starts a
    reload, which reads the database at once and ends only a moment after the block (which makes
    something new): what comes in the block sees a reload under way that missed it."""
    await registry.arefresh()
    read, made = threading.Event(), threading.Event()
    real_load = registry.load

    def load_that_read_before():
        real_load()
        read.set()
        made.wait(30)

    monkeypatch.setattr(registry, "load", load_that_read_before)
    started = asyncio.ensure_future(start())
    assert await asyncio.to_thread(read.wait, 10)
    yield started
    monkeypatch.setattr(registry, "load", real_load)
    asyncio.get_running_loop().call_later(0.1, made.set)


async def a_background_reload(registry):
    registry._loaded_at -= registry.max_age * 0.75  # past REFRESH_AHEAD: the call reloads in the background
    await registry.arefresh()


async def test_a_token_made_while_a_background_reload_runs_works_at_once(monkeypatch):
    """The reload under way may have read the tokens before it was made: a miss waits for that
    one, then reloads again."""
    registry = Registry(ThreadPoolExecutor(max_workers=1), max_age=60)
    async with a_reload_that_read_before(registry, monkeypatch, lambda: a_background_reload(registry)):
        raw = await sync_to_async(make_token)("made meanwhile")
    grant = await asyncio.wait_for(registry.afind_token(raw), 10)
    assert grant is not None and grant.name == "made meanwhile"


@pytest.mark.parametrize("method", ["load", "ping_database"])
async def test_a_database_call_that_raises_stopiteration_fails_its_caller_rather_than_leave_it_waiting(
    monkeypatch, method
):
    registry = Registry(ThreadPoolExecutor(max_workers=1))
    monkeypatch.setattr(registry, method, lambda: next(iter(())))
    call = registry.arefresh if method == "load" else registry.aping_database
    with pytest.raises(RuntimeError, match="StopIteration") as raised:
        await asyncio.wait_for(call(), 10)
    assert isinstance(raised.value.__cause__, StopIteration)
    monkeypatch.undo()  # the database thread is still there for the next call
    await asyncio.wait_for(registry.arefresh(), 10)
    assert not registry.stale
    assert await asyncio.wait_for(registry.aping_database(), 10) is True


def test_a_database_busy_with_another_writer_never_holds_a_reload_back(monkeypatch):
    """The tokens' last use is written after the reload is served, and only if the database takes
    it at once; the tokens wait for the next reload."""
    raw = make_token("busy")
    registry = Registry(ThreadPoolExecutor(1))
    registry.load()
    assert registry.authenticate(raw) is not None  # used since the load
    save_queue("made-meanwhile")
    real_update = QuerySet.update

    def locked(queryset, **fields):
        raise OperationalError("database is locked")

    monkeypatch.setattr(QuerySet, "update", locked)
    registry.load()
    assert registry.queue("made-meanwhile") is not None
    assert ApiToken.objects.get(name="busy").last_used_at is None
    monkeypatch.setattr(QuerySet, "update", real_update)
    registry.load()
    assert ApiToken.objects.get(name="busy").last_used_at is not None
