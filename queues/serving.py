"""What `manage.py serve` runs: the HTTP and /work server, the sweep loop beside it in a thread,
and the channel-layer bridge that carries wake-ups between server processes."""

import asyncio
import threading
from collections.abc import Callable, Coroutine

import daphne.server  # noqa: F401  (first: installs Twisted's asyncio reactor)
from channels.layers import InMemoryChannelLayer, get_channel_layer
from daphne.endpoints import build_endpoint_description_strings
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from .bridge import ChannelBridge
from .events import hub
from .runtime import get_registry, get_store
from .sweep import Sweeper

# daphne pings an idle socket every PING_INTERVAL and drops it if no pong comes within
# PING_TIMEOUT, so a worker that vanished from the network is re-queued within about 30 s
PING_INTERVAL = 10
PING_TIMEOUT = 20
SWEEP_STOP_SECONDS = 10


def prepare() -> None:
    """Bring the database schema up to date and make the data directory."""
    call_command("migrate", interactive=False, verbosity=0)
    store = get_store()
    store.data_dir.mkdir(parents=True, exist_ok=True)
    get_registry().refresh()
    for config in get_registry().queues():
        store.ensure_queue(config.name)


def start_sweeper() -> tuple[threading.Thread, threading.Event]:
    """The sweep loop in a thread; what it re-queues or fails wakes waiting claims and reads."""
    registry = get_registry()

    def configs():
        registry.refresh()
        return registry.queues()

    sweeper = Sweeper(
        get_store(),
        configs,
        on_requeued=lambda queue, item_ids: hub.items_available(queue, len(item_ids)),
        on_failed=lambda queue, item_ids: hub.items_terminal(queue, item_ids),
    )
    stop = threading.Event()
    thread = threading.Thread(
        target=sweeper.run,
        kwargs={"interval": settings.TASKHOSTER_SWEEP_INTERVAL, "stop": stop},
        name="sweep",
        daemon=True,
    )
    thread.start()
    return thread, stop


def background_tasks() -> list[Callable[[], Coroutine]]:
    """What runs on the server's event loop beside the application. The in-memory layer reaches
    no other process, so the bridge only runs on a shared (Redis) layer."""
    layer = get_channel_layer()
    if layer is None or isinstance(layer, InMemoryChannelLayer):
        return []
    return [ChannelBridge(layer).run]


def run_daphne(application, *, host: str, port: int, ready: Callable[[int], None], background) -> bool:
    """Serve `application` until SIGINT/SIGTERM; call `ready(port)` once listening and start each
    of `background` on the event loop. False if it could not listen."""
    from twisted.internet import defer, reactor

    server = daphne.server.Server(
        application,
        endpoints=build_endpoint_description_strings(host=host, port=port),
        ping_interval=PING_INTERVAL,
        ping_timeout=PING_TIMEOUT,
        websocket_timeout=-1,  # never close a worker's socket for its age
        # a frame somewhat over the limit still gets a payload_too_large answer; far over, the
        # socket is closed (1009) rather than buffered
        websocket_max_message_size=2 * settings.TASKHOSTER_MAX_BODY_BYTES,
        websocket_max_frame_size=2 * settings.TASKHOSTER_MAX_BODY_BYTES,
        ready_callable=lambda: ready(server.listening_addresses[0][1]),
    )
    tasks = []

    def start_background():
        loop = asyncio.get_event_loop()
        tasks.extend(loop.create_task(start()) for start in background)

    def stop_background():
        for task in tasks:
            task.cancel()
        return defer.Deferred.fromFuture(asyncio.gather(*tasks, return_exceptions=True))

    reactor.callWhenRunning(start_background)
    reactor.addSystemEventTrigger("before", "shutdown", stop_background)
    server.run()
    return bool(server.listening_addresses)


def serve(*, host: str, port: int, ready: Callable[[int], None]) -> None:
    prepare()
    sweep_thread, stop_sweep = start_sweeper()
    from taskhoster_site.asgi import application

    try:
        listening = run_daphne(application, host=host, port=port, ready=ready, background=background_tasks())
    finally:
        stop_sweep.set()
        sweep_thread.join(SWEEP_STOP_SECONDS)
    if not listening:
        raise CommandError(f"cannot listen on {host}:{port}")
