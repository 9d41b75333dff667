"""What `manage.py serve` runs: the HTTP and /work server, the sweep loop beside it in a thread,
and the channel-layer bridge that carries wake-ups between server processes.

Two servers can serve the application: uvicorn (httptools, websockets, uvloop when available) and
daphne. `SERVERS` maps each name to the one function that runs it; uvicorn is the default because
it measures faster (README, "Performance"). Both ping an idle worker socket every PING_INTERVAL
and drop it if no pong comes within PING_TIMEOUT, so a worker that vanished from the network is
re-queued within about 30 s, and neither closes a worker's socket for its age.
"""

import asyncio
import resource
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager

from channels.layers import InMemoryChannelLayer, get_channel_layer
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from .bridge import ChannelBridge
from .events import hub
from .runtime import get_registry, get_store
from .sweep import Sweeper

PING_INTERVAL = 10
PING_TIMEOUT = 20
SWEEP_STOP_SECONDS = 10
# On a stop, requests in flight (a long-polling read included) get this long to finish before
# they are cancelled; worker sockets are closed at once, which re-queues what they hold.
STOP_GRACE_SECONDS = 3
# Above the usual clients' own idle limit (httpx: 5 s), so the server is not the side that closes
# an idle keep-alive connection just as the client sends a request on it.
KEEP_ALIVE_SECONDS = 75
# Connections the kernel holds for daphne until it accepts them, as uvicorn's default: Twisted's
# 50 overflows under a burst of connections, and each one dropped waits a second to try again.
LISTEN_BACKLOG = 2048

Ready = Callable[[int], None]
Background = list[Callable[[], Coroutine]]


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


def background_tasks() -> Background:
    """What runs on the server's event loop beside the application. The in-memory layer reaches
    no other process, so the bridge only runs on a shared (Redis) layer."""
    layer = get_channel_layer()
    if layer is None or isinstance(layer, InMemoryChannelLayer):
        return []
    return [ChannelBridge(layer).run]


def raise_descriptor_limit() -> int:
    """Raise this process's soft limit on open descriptors to its hard limit (the soft one is
    often 1024, far below what the connections may need); the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # a hard limit the system will not grant as a soft one (macOS)
        return soft
    return hard


def max_frame_bytes() -> int:
    # a frame somewhat over the limit still gets a payload_too_large answer; far over, the socket
    # is closed (1009) rather than buffered
    return 2 * settings.TASKHOSTER_MAX_BODY_BYTES


def run_uvicorn(application, *, host: str, port: int, ready: Ready, background: Background) -> bool:
    """Serve `application` with uvicorn until SIGINT/SIGTERM; call `ready(port)` once listening
    and run each of `background` on the same event loop. False if it could not listen."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                ready(self.servers[0].sockets[0].getsockname()[1])

    config = uvicorn.Config(
        application,
        host=host,
        port=port,  # bound here, not passed in as a file descriptor: that left Nagle's algorithm on
        loop="none",  # ours, made below
        http="httptools",
        ws="websockets-sansio",  # measured alike to "websockets", which uvicorn deprecates
        ws_max_size=max_frame_bytes(),
        ws_ping_interval=PING_INTERVAL,
        ws_ping_timeout=PING_TIMEOUT,
        ws_per_message_deflate=False,  # frames are small JSON: compressing costs more than it saves
        lifespan="off",
        access_log=False,
        log_level="warning",
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        timeout_graceful_shutdown=STOP_GRACE_SECONDS,
    )
    server = Server(config)

    async def main() -> bool:
        tasks = [asyncio.create_task(start()) for start in background]
        try:
            with _stop_signals_end_quietly():
                await server.serve()
        except SystemExit:  # uvicorn's answer to an address it cannot bind (it logged why)
            return False
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return True

    loop = _new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main())
    finally:
        _finish_leftover_tasks(loop)  # uvicorn cancels what outlived the grace, but never awaits it
        asyncio.set_event_loop(None)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


@contextmanager
def _stop_signals_end_quietly() -> Iterator[None]:
    """uvicorn catches SIGINT and SIGTERM while it serves, and once stopped raises them again
    against the handlers it found, to die of them. Ignored here, so a stop ends in exit status 0."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_daphne(application, *, host: str, port: int, ready: Ready, background: Background) -> bool:
    """Serve `application` with daphne until SIGINT/SIGTERM; call `ready(port)` once listening
    and run each of `background` on the event loop. False if it could not listen."""
    import daphne.server  # first: installs Twisted's asyncio reactor
    from daphne.endpoints import build_endpoint_description_strings
    from twisted.internet import defer, reactor

    endpoints = build_endpoint_description_strings(host=host, port=port)
    server = daphne.server.Server(
        application,
        endpoints=[f"{endpoint}:backlog={LISTEN_BACKLOG}" for endpoint in endpoints],
        ping_interval=PING_INTERVAL,
        ping_timeout=PING_TIMEOUT,
        websocket_timeout=-1,  # never close a worker's socket for its age
        websocket_max_message_size=max_frame_bytes(),
        websocket_max_frame_size=max_frame_bytes(),
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
    _finish_leftover_tasks(daphne.server.twisted_loop)
    return bool(server.listening_addresses)


def _finish_leftover_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what a stopped server left suspended on its loop (a worker socket's pending
    receive, a socket's re-queue still on the store's thread) and let it unwind, as asyncio.run
    does: collected at exit instead, such a coroutine crashed the interpreter under daphne
    (SIGSEGV, exit status -11)."""
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


SERVERS = {"uvicorn": run_uvicorn, "daphne": run_daphne}
DEFAULT_SERVER = "uvicorn"


def serve(*, host: str, port: int, ready: Ready, server: str = DEFAULT_SERVER) -> None:
    run = SERVERS[server]
    raise_descriptor_limit()
    prepare()
    sweep_thread, stop_sweep = start_sweeper()
    from taskhoster_site.asgi import application

    try:
        listening = run(application, host=host, port=port, ready=ready, background=background_tasks())
    finally:
        stop_sweep.set()
        sweep_thread.join(SWEEP_STOP_SECONDS)
    if not listening:
        raise CommandError(f"cannot listen on {host}:{port}")
