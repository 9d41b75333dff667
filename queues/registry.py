"""Queue settings and API tokens as the hot paths see them: kept in memory and reloaded from the
database in the background every half second or so, so no request or frame with known names
makes an ORM call or waits for a reload, and a change made in the admin reaches every server
process within a second. A name not known waits for a reload that reads after it came: a new
queue or token works at once."""

import asyncio
import logging
import threading
import time
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass

from django.db import DatabaseError, close_old_connections, connection
from django.utils import timezone

from .models import ApiToken, Queue, hash_token
from .store import QueueConfig
from .threads import in_thread

MAX_AGE_SECONDS = 1.0
# of max_age: settings this old are reloaded in the background while callers go on with them (a
# reload writes the tokens' last use, and SQLite's commit waits for the disk); only settings older
# than max_age make a caller wait
REFRESH_AHEAD = 0.5
MISS_RELOAD_SECONDS = 0.1

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenGrant:
    """What one API token may do."""

    id: int
    name: str
    can_produce: bool
    can_work: bool
    queues: frozenset[str]  # empty: every queue
    can_read_metrics: bool = False

    @property
    def uses_queues(self) -> bool:
        """Whether it may use the API at all (a metrics-only token reads /metrics and nothing else)."""
        return self.can_produce or self.can_work

    def may_see(self, queue: str) -> bool:
        return self.uses_queues and (not self.queues or queue in self.queues)

    def may(self, right: str, queue: str) -> bool:
        allowed = self.can_produce if right == "produce" else self.can_work
        return allowed and self.may_see(queue)


@contextmanager
def _not_waiting_for_other_writers():
    if connection.vendor != "sqlite":  # PostgreSQL locks the rows written, not the database
        yield
        return
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA busy_timeout = 0")
    try:
        yield
    finally:
        waits = connection.settings_dict["OPTIONS"].get("timeout", 5)  # seconds, as settings.py gives them
        with connection.cursor() as cursor:
            cursor.execute(f"PRAGMA busy_timeout = {int(waits * 1000)}")


class Registry:
    def __init__(self, database_thread: Executor, *, max_age: float = MAX_AGE_SECONDS):
        self.max_age = max_age
        self._queues: dict[str, QueueConfig] = {}
        self._tokens: dict[str, TokenGrant] = {}
        self._loaded_at = float("-inf")
        self._loaded_once = False
        self._used: set[int] = set()
        self._lock = threading.Lock()
        self._db_thread = database_thread  # every database read, so connections are reused
        self._refreshing: asyncio.Future | None = None
        self._reloaded_after_miss_at = float("-inf")
        self._next_miss_reload: asyncio.Future | None = None

    @property
    def stale(self) -> bool:
        return self._age() > self.max_age

    def _age(self) -> float:
        return time.monotonic() - self._loaded_at

    def load(self) -> None:
        """Read every queue and token, then record which tokens were used since last time."""
        close_old_connections()
        try:
            read_at = time.monotonic()  # how old what is read now is: from here
            queues = {q.name: q.config() for q in Queue.objects.all()}
            tokens = {
                t.token_hash: TokenGrant(
                    t.id, t.name, t.can_produce, t.can_work, frozenset(t.queues or ()), t.can_read_metrics
                )
                for t in ApiToken.objects.all()
            }
            with self._lock:
                self._queues, self._tokens = queues, tokens
                self._loaded_at = read_at
                self._loaded_once = True
            self._record_use()
        finally:
            close_old_connections()

    def _record_use(self) -> None:
        """Write the tokens' last use, if the database takes it at once: one busy with another
        writer (SQLite has one at a time, an admin deleting a big queue holds it for long) is not
        waited for, or every reload behind this one would wait too; the next reload tries again."""
        used, self._used = self._used, set()
        if not used:
            return
        try:
            with _not_waiting_for_other_writers():
                ApiToken.objects.filter(id__in=used).update(last_used_at=timezone.now())
        except DatabaseError:
            self._used |= used

    def _load_or_keep(self) -> None:
        """Reload; when the database fails after a first good load, keep serving what was loaded
        (a database blip must not fail every call) and try again in `max_age`."""
        try:
            self.load()
        except DatabaseError:
            if not self._loaded_once:
                raise
            log.warning("cannot reload queues and tokens; serving the last ones loaded", exc_info=True)
            self._loaded_at = time.monotonic()

    def refresh(self) -> None:
        if self.stale:
            self._db_thread.submit(self._load_or_keep).result()

    async def arefresh(self) -> None:
        """Start a reload in the background once the settings are REFRESH_AHEAD of max_age old;
        wait for it only if they are older than max_age (the first load, a reload asked for at
        once, a slow database). Concurrent callers share one reload."""
        age = self._age()
        if age < self.max_age * REFRESH_AHEAD:
            return
        if self._refreshing is None or self._refreshing.done():
            self._start_reload()
        if age > self.max_age:
            await asyncio.shield(self._refreshing)

    def ping_database(self) -> bool:
        """True when the database answers a trivial query (for /healthz)."""
        try:
            close_old_connections()
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
            return True
        except DatabaseError:
            return False
        finally:
            close_old_connections()

    async def aping_database(self) -> bool:
        """`ping_database` on the registry's own database thread."""
        return await in_thread(self._db_thread, self.ping_database)

    def queue(self, name: str) -> QueueConfig | None:
        return self._queues.get(name)

    def queues(self) -> list[QueueConfig]:
        return sorted(self._queues.values(), key=lambda q: q.name)

    def authenticate(self, raw: str | None) -> TokenGrant | None:
        if not raw:
            return None
        grant = self._tokens.get(hash_token(raw))
        if grant is not None:
            self._used.add(grant.id)
        return grant

    async def afind_token(self, raw: str | None) -> TokenGrant | None:
        """The token's grant; an unknown token is looked for again in the database (it may be
        brand new)."""
        await self.arefresh()
        grant = self.authenticate(raw)
        if grant is None and raw:
            await self._areload_after_miss()
            grant = self.authenticate(raw)
        return grant

    async def afind_queue(self, name: str) -> QueueConfig | None:
        """The queue's settings; an unknown name is looked for again in the database (it may be
        brand new)."""
        await self.arefresh()
        config = self.queue(name)
        if config is None:
            await self._areload_after_miss()
            config = self.queue(name)
        return config

    async def _areload_after_miss(self) -> None:
        """Wait for a reload that reads after this call began, so a token or queue made before a
        request or frame came always works for it. Such reloads start at most once per
        MISS_RELOAD_SECONDS, so unknown names cannot flood the database: misses meanwhile wait
        for the next one, and share it."""
        if self._next_miss_reload is None or self._next_miss_reload.done():
            self._next_miss_reload = asyncio.ensure_future(self._reload_for_misses())
        await asyncio.shield(self._next_miss_reload)

    async def _reload_for_misses(self) -> None:
        wait = self._reloaded_after_miss_at + MISS_RELOAD_SECONDS - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        if self._refreshing is not None and not self._refreshing.done():
            # one under way may have read before the misses came: a new one after it
            await asyncio.wait([self._refreshing])
        self._next_miss_reload = None  # a miss from here on may come after this reload reads
        self._reloaded_after_miss_at = time.monotonic()
        # not invalidate(): callers with known names go on with what they have meanwhile
        await asyncio.shield(self._start_reload())

    def _start_reload(self) -> asyncio.Future:
        self._refreshing = in_thread(self._db_thread, self._load_or_keep)
        return self._refreshing

    def invalidate(self) -> None:
        """Forget what is cached (tests, and this process's own admin changes)."""
        self._loaded_at = float("-inf")
