"""Serving with daphne (`serve --server daphne`), the server of `runserver`."""

import asyncio
import logging
import signal

from daphne.http_protocol import WebRequest
from twisted.internet.protocol import Protocol
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory

from ..runtime import server_stopping
from .limits import (
    HEAD_TIMEOUT_SECONDS,
    KEEP_ALIVE_SECONDS,
    LISTEN_BACKLOG,
    PING_INTERVAL,
    PING_TIMEOUT,
    TOO_MANY_CONNECTIONS,
    finish_leftover_tasks,
    max_frame_bytes,
    stop_grace_seconds,
)


log = logging.getLogger(__name__)


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


async def _let_requests_end(connections: dict, limits: "_DaphneLimits", ports: list) -> None:
    """Stop taking connections and requests, close the worker sockets, and wait for the HTTP
    requests running to end, for the stop grace at most, or until a second stop signal."""
    from daphne.ws_protocol import WebSocketProtocol  # here: importing it early would install another reactor

    for port in ports:
        port.stopListening()
    for wrapper in list(limits.protocols):
        protocol = wrapper.wrappedProtocol  # the socket's, once a request upgraded to it
        if isinstance(protocol, WebSocketProtocol):
            _close_socket(protocol)
            continue
        channel = protocol._channel  # Twisted's HTTP/1.1 channel, inside its protocol-choosing shell
        if not channel.requests:  # a kept-alive connection, idle: no request may start on it
            wrapper.loseConnection()
        else:  # closed once its answer is out, and the answer says so
            channel.persistent = False
            for request in channel.requests:
                if not request.startedWriting:
                    request.responseHeaders.setRawHeaders(b"connection", [b"close"])
    loop = asyncio.get_running_loop()
    cut_short = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: loop.call_soon_threadsafe(_settle, cut_short))
    deadline = loop.time() + stop_grace_seconds()
    while not cut_short.done() and loop.time() < deadline:
        instances = [details.get("application_instance") for protocol, details in list(connections.items())
                     if isinstance(protocol, WebRequest)]
        running = [instance for instance in instances if instance is not None and not instance.done()]
        if not running:
            return
        await asyncio.wait([*running, cut_short], timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED)


def _close_socket(protocol) -> None:
    """Close a worker's socket, which gives back what it holds; one still opening is dropped."""
    try:
        protocol.serverClose()
    except Exception:  # autobahn refuses to close a socket before it is open
        protocol.dropConnection(abort=True)


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def run(
    application, *, host: str, port: int, ready, background, max_connections: int
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

        def listen_success(self, port):
            ports.append(port)
            return super().listen_success(port)

        def kill_all_applications(self):
            """A stop, as under uvicorn: no new connections, worker sockets closed at once (what
            they hold goes back), requests in flight given the stop grace to end (a second signal
            ends it); then daphne cancels whatever still runs."""
            letting_end = asyncio.ensure_future(_let_requests_end(self.connections, self.http_factory, ports))
            return (defer.Deferred.fromFuture(letting_end)
                    .addErrback(lambda failure: log.error("the stop's grace failed: %s", failure.getTraceback()))
                    .addBoth(lambda _: daphne.server.Server.kill_all_applications(self)))

    ports = []  # where it listens, once it does
    endpoints = build_endpoint_description_strings(host=host, port=port)
    server = Server(
        application,
        endpoints=[f"{endpoint}:backlog={LISTEN_BACKLOG}" for endpoint in endpoints],
        ping_interval=PING_INTERVAL,
        ping_timeout=PING_TIMEOUT,
        websocket_timeout=-1,  # never close a worker's socket for its age
        websocket_max_message_size=max_frame_bytes(),
        websocket_max_frame_size=max_frame_bytes(),
    )
    tasks = []

    def start_background():
        loop = asyncio.get_event_loop()
        tasks.extend(loop.create_task(start()) for start in background)

    def stop_background():
        for task in tasks:
            task.cancel()
        return defer.Deferred.fromFuture(asyncio.gather(*tasks, return_exceptions=True))

    # Twisted takes SIGINT only from Python's own handler: a serve started with SIGINT ignored (a
    # background job of a script) would never stop on it, where uvicorn's does
    signal.signal(signal.SIGINT, signal.default_int_handler)
    reactor.callWhenRunning(start_background)
    # once running, not when daphne would (before the reactor takes SIGINT and SIGTERM): a stop
    # sent as soon as the banner shows must find the reactor's handlers
    reactor.callWhenRunning(lambda: ready(server.listening_addresses[0][1]))
    # before daphne's own trigger, which cancels every socket
    reactor.addSystemEventTrigger("before", "shutdown", server_stopping.set)
    reactor.addSystemEventTrigger("before", "shutdown", stop_background)
    server.run()
    # Twisted leaves its handlers in place, and they would call into the loop closed below
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    finish_leftover_tasks(daphne.server.twisted_loop)
    return bool(server.listening_addresses)
