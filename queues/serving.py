"""What `manage.py serve` runs: the HTTP and /work server, the sweep loop beside it in a thread,
and the channel-layer bridge that carries wake-ups between server processes.

Two servers can serve the application: uvicorn (httptools, websockets, uvloop when available) and
daphne. `SERVERS` maps each name to the one function that runs it; uvicorn is the default because
it measures faster (README, "Performance"). Both ping an idle worker socket every PING_INTERVAL
and drop it if no pong comes within PING_TIMEOUT, so a worker that vanished from the network is
re-queued within about 30 s, and neither closes a worker's socket for its age.

Both also hold what a client can take (see "Connection limits" below): a connection over
the cap is answered 503 at once, a request head must be complete HEAD_TIMEOUT_SECONDS after it
began, and the descriptor limit is raised to the hard limit at start.
"""

import asyncio
import functools
import resource
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager

from channels.layers import InMemoryChannelLayer, get_channel_layer
from daphne.http_protocol import WebRequest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from twisted.internet.protocol import Protocol
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .bridge import ChannelBridge
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

# ---- Connection limits -------------------------------------------------------------------------
# A request head (request line and headers) must be complete this long after its connection
# opened, or after its first byte on a kept-alive connection, however slowly it trickles in:
# otherwise a client sending a byte now and then holds a connection, and a descriptor, for ever.
HEAD_TIMEOUT_SECONDS = 10
# The most bytes a request head may take before it is answered 431: httptools sets no limit of
# its own (Twisted, under daphne, stops at 16 KiB).
MAX_HEAD_BYTES = 64 * 1024
# Descriptors kept for what is not a connection: the database's (one connection per thread that
# uses it), the sweep's, the queues' lock and tally files, the log.
RESERVED_DESCRIPTORS = 512
# A connection holds its socket, and, while a single post it sent is being flushed, that item's
# file too; so connections get half of the descriptors left beside the reserve.
DESCRIPTORS_PER_CONNECTION = 2
# Served however low the descriptor limit (the reserve shrinks instead).
MIN_CONNECTIONS = 64
# What a client refused for want of room is told to wait before it tries again.
BUSY_RETRY_SECONDS = 1

_BUSY_BODY = b'{"error":"busy","message":"the server has too many connections open; try again"}'
TOO_MANY_CONNECTIONS = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
    b"retry-after: %d\r\nconnection: close\r\n\r\n%s" % (len(_BUSY_BODY), BUSY_RETRY_SECONDS, _BUSY_BODY)
)
_HEAD_BODY = b"Request head too large"
HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_HEAD_BODY), _HEAD_BODY)
)

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


def max_connections(descriptor_limit: int) -> int:
    """How many connections may be open at once under `descriptor_limit`."""
    return max(MIN_CONNECTIONS, (descriptor_limit - RESERVED_DESCRIPTORS) // DESCRIPTORS_PER_CONNECTION)


def max_frame_bytes() -> int:
    # a frame somewhat over the limit still gets a payload_too_large answer; far over, the socket
    # is closed (1009) rather than buffered
    return 2 * settings.TASKHOSTER_MAX_BODY_BYTES


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits it lacks: a connection that finds
    `max_connections` open is answered 503 at once (`limit_concurrency` answers only once a
    request head is in, so slow heads over it would still hold descriptors), and a request head
    must be complete within HEAD_TIMEOUT_SECONDS and MAX_HEAD_BYTES."""

    head_clock: asyncio.TimerHandle | None = None
    head_bytes = 0

    def __init__(self, *args, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_connections = max_connections

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.connections.discard(self)  # it never counts against the others
            self._refuse(TOO_MANY_CONNECTIONS)
        else:
            self._start_head_clock()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.head_clock is not None:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self._refuse(HEAD_TOO_LARGE)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._start_head_clock()  # a later request on a kept-alive connection

    def on_headers_complete(self) -> None:
        self._stop_head_clock()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_clock()
        super().connection_lost(exc)

    def _start_head_clock(self) -> None:
        if self.head_clock is None:
            self.head_bytes = 0
            self.head_clock = self.loop.call_later(HEAD_TIMEOUT_SECONDS, self.transport.close)

    def _stop_head_clock(self) -> None:
        if self.head_clock is not None:
            self.head_clock.cancel()
            self.head_clock = None

    def _refuse(self, answer: bytes) -> None:
        self._stop_head_clock()
        if not self.transport.is_closing():
            self.transport.write(answer)
            self.transport.close()


def run_uvicorn(
    application, *, host: str, port: int, ready: Ready, background: Background, max_connections: int
) -> bool:
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
        http=functools.partial(LimitedHttpToolsProtocol, max_connections=max_connections),
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


class _RefusedConnection(Protocol):
    """What a connection over the cap gets under daphne: a 503, and closed."""

    def connectionMade(self):
        self.transport.write(TOO_MANY_CONNECTIONS)
        self.transport.loseConnection()


class _HeadClock(ProtocolWrapper):
    """Closes its connection when a request head is not complete HEAD_TIMEOUT_SECONDS after the
    connection opened, or after the head's first byte on a kept-alive connection. (Twisted's own
    timeout is for idleness: every byte restarts it, so a trickle never meets it.)"""

    clock = None
    awaiting_head = True

    def makeConnection(self, transport):
        super().makeConnection(transport)
        self._start()

    def dataReceived(self, data):
        if self.awaiting_head:
            self._start()
        super().dataReceived(data)

    def head_received(self) -> None:
        self.awaiting_head = False
        self._stop()

    def request_done(self) -> None:
        self.awaiting_head = True  # the next head's clock starts with its first byte

    def connectionLost(self, reason):
        self._stop()
        super().connectionLost(reason)

    def _start(self) -> None:
        if self.clock is None:
            self.clock = self.factory.call_later(HEAD_TIMEOUT_SECONDS, self.transport.loseConnection)

    def _stop(self) -> None:
        if self.clock is not None:
            if self.clock.active():
                self.clock.cancel()
            self.clock = None


class _HeadTimedRequest(WebRequest):
    """daphne's request, telling its connection's `_HeadClock` when its head is in and when it
    is answered."""

    def gotLength(self, length):  # Twisted calls it once the head is in
        self.channel.transport.head_received()
        super().gotLength(length)

    def finish(self):
        if self.channel is not None:  # else the connection is gone already
            self.channel.transport.request_done()
        super().finish()


class _DaphneLimits(WrappingFactory):
    """Wraps daphne's HTTP factory: a connection that finds `max_connections` open is answered
    503 at once, each request head is timed, and an idle kept-alive connection closes after
    KEEP_ALIVE_SECONDS as under uvicorn (Twisted's default: 12 hours)."""

    protocol = _HeadClock

    def __init__(self, http_factory, *, max_connections: int):
        super().__init__(http_factory)
        http_factory.timeOut = KEEP_ALIVE_SECONDS
        self.call_later = http_factory.reactor.callLater
        self.max_connections = max_connections

    def buildProtocol(self, addr):
        if len(self.protocols) >= self.max_connections:
            return _RefusedConnection()
        wrapper = super().buildProtocol(addr)
        wrapper.wrappedProtocol.requestFactory = _HeadTimedRequest
        return wrapper


def run_daphne(
    application, *, host: str, port: int, ready: Ready, background: Background, max_connections: int
) -> bool:
    """Serve `application` with daphne until SIGINT/SIGTERM; call `ready(port)` once listening
    and run each of `background` on the event loop. False if it could not listen."""
    import daphne.server  # first: installs Twisted's asyncio reactor
    from daphne.endpoints import build_endpoint_description_strings
    from twisted.internet import defer, reactor

    class Server(daphne.server.Server):
        # daphne makes its HTTP factory inside run(): wrapped here as run() stores it
        @property
        def http_factory(self):
            return self._limited_http_factory

        @http_factory.setter
        def http_factory(self, factory):
            self._limited_http_factory = _DaphneLimits(factory, max_connections=max_connections)

    endpoints = build_endpoint_description_strings(host=host, port=port)
    server = Server(
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
