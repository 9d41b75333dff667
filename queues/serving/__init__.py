"""What `manage.py serve` runs: the HTTP and /work server, the sweep loop beside it in a thread,
and the channel-layer bridge that carries wake-ups between server processes.

Two servers can serve the application: uvicorn (the default, it measures faster) and daphne, each
in a module of its own that is imported only when chosen. Both ping an idle worker socket every
PING_INTERVAL and drop it if no pong comes within PING_TIMEOUT, so a worker that vanished from
the network is re-queued within about 30 s, and neither closes a worker's socket for its age.
Both hold the limits of `limits`.
"""

import fcntl
import importlib
import os
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager

from channels.layers import InMemoryChannelLayer, get_channel_layer
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from ..bridge import ChannelBridge
from ..exceptions import StorageUnavailable
from ..roster import RosterExchange, roster
from ..runtime import get_registry, get_store
from ..sweep import PROMOTE_SECONDS, Promoter, Sweeper
from .banner import busy_port_hint
from .limits import HEAD_TIMEOUT_SECONDS, MAX_HEAD_BYTES, SWEEP_STOP_SECONDS, max_connections, raise_descriptor_limit

__all__ = ["DEFAULT_SERVER", "HEAD_TIMEOUT_SECONDS", "MAX_HEAD_BYTES", "SERVERS", "max_connections", "serve"]

SERVERS = {"uvicorn": "uvicorn_server", "daphne": "daphne_server"}  # name -> its module here
MIGRATE_LOCK = ".migrate-lock"  # in the data directory; no queue name starts with a dot
DEFAULT_SERVER = "uvicorn"

Ready = Callable[[int], None]
Background = list[Callable[[], Coroutine]]


def prepare() -> None:
    """Make the data directory and bring the database schema up to date: one process at a time,
    so servers of one installation started together on a new database do not make its tables
    twice (one of them would fail)."""
    store = get_store()
    try:
        store.make_data_directory()
        with _one_at_a_time(os.path.join(settings.TASKHOSTER_DATA_DIR, MIGRATE_LOCK)):
            call_command("migrate", interactive=False, verbosity=0)
        get_registry().refresh()
        for config in get_registry().queues():
            store.ensure_queue(config.name)
    except (StorageUnavailable, OSError) as exc:  # OSError: a file where a directory must be
        raise CommandError(f"cannot use the data directory {settings.TASKHOSTER_DATA_DIR} "
                           f"(TASKHOSTER_DATA_DIR): {exc}") from exc


@contextmanager
def _one_at_a_time(lock_file: str) -> Iterator[None]:
    """Hold a record lock on `lock_file`, in the data directory every process of an installation
    shares: a record lock, as the store's item locks, is what network file systems (NFS, EFS)
    carry from host to host."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it


def start_sweeper(stop: threading.Event) -> list[threading.Thread]:
    """The sweep loop and the promotion of due items, each in a thread, until `stop` is set;
    what they re-queue, promote or fail wakes waiting claims and reads (the store tells the hub)."""
    registry = get_registry()

    def configs():
        registry.refresh()
        return registry.queues()

    loops = [
        ("sweep", Sweeper(get_store(), configs).run, settings.TASKHOSTER_SWEEP_INTERVAL),
        ("promote", Promoter(get_store(), configs).run, PROMOTE_SECONDS),
    ]
    threads = [
        threading.Thread(target=run, kwargs={"interval": interval, "stop": stop}, name=name, daemon=True)
        for name, run, interval in loops
    ]
    for thread in threads:
        thread.start()
    return threads


def background_tasks() -> Background:
    """What runs on the server's event loop beside the application. The in-memory layer reaches
    no other process, so the bridge and the exchange of connected workers only run on a shared
    (Redis) layer."""
    layer = get_channel_layer()
    if layer is None or isinstance(layer, InMemoryChannelLayer):
        return []
    return [ChannelBridge(layer).run, RosterExchange(layer, roster).run]


@contextmanager
def _stop_signals_held() -> Iterator[Callable[[], None]]:
    """The servers take SIGINT and SIGTERM while they serve (uvicorn raises them again once
    stopped, against the handlers it found, to die of them). Outside that they are held: one that
    comes before the server has taken them over (importing it, binding its port) is raised again
    by the function this yields, to be called once the server has its handlers, so a stop sent
    just after start is not lost; one that comes after the stop, during its clean-up (which gives
    back what sockets held), is dropped, so that a stop ends in exit status 0."""
    held: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda sig, frame: held.append(sig)) for sig in signals}

    def raise_held() -> None:
        if held:
            signal.raise_signal(held[0])

    try:
        yield raise_held
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve(*, host: str, port: int, ready: Ready, server: str = DEFAULT_SERVER) -> None:
    run = importlib.import_module(f"{__name__}.{SERVERS[server]}").run
    connections = max_connections(raise_descriptor_limit())
    prepare()
    stop_sweeping = threading.Event()
    sweeping = start_sweeper(stop_sweeping)
    from taskhoster_site.asgi import application

    with _stop_signals_held() as raise_held:

        def listening_now(port: int) -> None:  # called once the server has its signal handlers
            ready(port)
            raise_held()

        try:
            listening = run(
                application, host=host, port=port, ready=listening_now, background=background_tasks(),
                max_connections=connections,
            )
        finally:
            stop_sweeping.set()
            for thread in sweeping:
                thread.join(SWEEP_STOP_SECONDS)
    if not listening:
        raise CommandError(f"cannot listen on {host}:{port}" + (f"; {busy_port_hint(port)}" if port else ""))
