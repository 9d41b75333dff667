"""What `manage.py serve` runs: the HTTP and /work server, the sweep loop beside it in a thread,
and the channel-layer bridge that carries wake-ups between server processes.

Two servers can serve the application: uvicorn (the default, it measures faster) and daphne, each
in a module of its own that is imported only when chosen. Both ping an idle worker socket every
PING_INTERVAL and drop it if no pong comes within PING_TIMEOUT, so a worker that vanished from
the network is re-queued within about 30 s, and neither closes a worker's socket for its age.
Both hold the limits of `limits`.
"""

import importlib
import threading
from collections.abc import Callable, Coroutine

from channels.layers import InMemoryChannelLayer, get_channel_layer
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from ..bridge import ChannelBridge
from ..runtime import get_registry, get_store
from ..sweep import Sweeper
from .limits import HEAD_TIMEOUT_SECONDS, MAX_HEAD_BYTES, SWEEP_STOP_SECONDS, max_connections, raise_descriptor_limit

__all__ = ["DEFAULT_SERVER", "HEAD_TIMEOUT_SECONDS", "MAX_HEAD_BYTES", "SERVERS", "max_connections", "serve"]

SERVERS = {"uvicorn": "uvicorn_server", "daphne": "daphne_server"}  # name -> its module here
DEFAULT_SERVER = "uvicorn"

Ready = Callable[[int], None]
Background = list[Callable[[], Coroutine]]


def prepare() -> None:
    """Bring the database schema up to date and make the data directory."""
    call_command("migrate", interactive=False, verbosity=0)
    store = get_store()
    get_registry().refresh()
    for config in get_registry().queues():
        store.ensure_queue(config.name)


def start_sweeper() -> tuple[threading.Thread, threading.Event]:
    """The sweep loop in a thread; what it re-queues or fails wakes waiting claims and reads (the
    store tells the hub)."""
    registry = get_registry()

    def configs():
        registry.refresh()
        return registry.queues()

    sweeper = Sweeper(get_store(), configs)
    stop = threading.Event()
    thread = threading.Thread(
        target=sweeper.run,
        kwargs={"interval": settings.TASKHOSTER_SWEEP_INTERVAL, "stop": stop},
        name="sweep",
        daemon=True,
    )
    thread.start()
    return thread, stop


def background_tasks() -> Background:
    """What runs on the server's event loop beside the application. The in-memory layer reaches
    no other process, so the bridge only runs on a shared (Redis) layer."""
    layer = get_channel_layer()
    if layer is None or isinstance(layer, InMemoryChannelLayer):
        return []
    return [ChannelBridge(layer).run]


def serve(*, host: str, port: int, ready: Ready, server: str = DEFAULT_SERVER) -> None:
    run = importlib.import_module(f"{__name__}.{SERVERS[server]}").run
    connections = max_connections(raise_descriptor_limit())
    prepare()
    sweep_thread, stop_sweep = start_sweeper()
    from taskhoster_site.asgi import application

    try:
        listening = run(
            application, host=host, port=port, ready=ready, background=background_tasks(), max_connections=connections
        )
    finally:
        stop_sweep.set()
        sweep_thread.join(SWEEP_STOP_SECONDS)
    if not listening:
        raise CommandError(f"cannot listen on {host}:{port}")
