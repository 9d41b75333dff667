import pytest

from faults import faults  # noqa: F401  (a fixture for every test module)

from queues.runtime import get_registry, get_store
from queues.store import QueueConfig, Store, files
from storekit import post_batch

START = 1_796_000_000.0  # 2026-11-30, a fixed instant for the injected clock


class FakeClock:
    """A clock the test moves by hand, so lease and retention tests never sleep."""

    def __init__(self, now: float = START):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["claim-xattrs", "claim-rewrites"])
def store(request, tmp_path, clock, monkeypatch) -> Store:
    """A store as on Linux (claims recorded in an xattr), and as on a file system without
    xattrs (claims rewrite the file)."""
    if request.param == "claim-rewrites":
        monkeypatch.setattr(files, "set_xattr", lambda path, name, value: False)
    return Store(tmp_path / "store", fsync=False, max_payload_bytes=1024, clock=clock)


def alongside(store: Store, **options) -> Store:
    """Another store over the same data directory, as another process would open it."""
    return Store(store.data_dir, fsync=False, **options)


@pytest.fixture
def config() -> QueueConfig:
    return QueueConfig(name="jobs", lease_seconds=30, queue_seconds=600, retain_seconds=60)


@pytest.fixture(autouse=True)
def _isolated_data_dir(settings, tmp_path):
    """Every test gets its own data directory and fresh process-wide objects."""
    settings.TASKHOSTER_DATA_DIR = tmp_path / "data"
    get_store.cache_clear()
    get_registry.cache_clear()
    yield
    _let_database_reads_end()
    get_store.cache_clear()
    get_registry.cache_clear()


@pytest.fixture
def transactional_db(transactional_db):
    """pytest-django's, for tests that ask for it by name: they set it up after the autouse
    fixture above, so it empties the database before that one's teardown would wait."""
    yield
    _let_database_reads_end()


def _let_database_reads_end() -> None:
    """Wait for a reload the registry began in the background (a request does not wait for it)
    to end: the test database is emptied after this, and a read running then fails that."""
    if get_registry.cache_info().currsize:
        get_registry()._db_thread.submit(lambda: None).result()


@pytest.fixture
def post_lands_mid_claim(monkeypatch) -> list[str]:
    """The first claim of the test finds the "jobs" queue empty, then an item is posted (and the
    hub told) before the claim can wait: the race a waiting claim must not lose. The posted
    ids, once posted."""
    store = get_store()
    real_claim = store.claim_items
    posted: list[str] = []

    def claim_then_post(**kwargs):
        items = real_claim(**kwargs)
        if not posted:
            posted.extend(item.id for item in post_batch(store, "jobs", ["late"]))  # tells the hub
        return items

    monkeypatch.setattr(store, "claim_items", claim_then_post)
    return posted
