"""Serving with uvicorn (httptools, websockets-sansio, uvloop when available): the default."""

import asyncio
import functools

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..runtime import server_stopping
from .limits import (
    HEAD_TIMEOUT_SECONDS,
    HEAD_TOO_LARGE,
    KEEP_ALIVE_SECONDS,
    MAX_HEAD_BYTES,
    PING_INTERVAL,
    PING_TIMEOUT,
    TOO_MANY_CONNECTIONS,
    finish_leftover_tasks,
    max_frame_bytes,
    stop_grace_seconds,
)


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
        if self.cycle is None or (self.cycle.response_complete and not self.cycle.more_body):
            # between requests (not the rest of a body answered early): these bytes begin a head,
            # even those the parser skips without beginning a message (a blank line), which
            # would else hold the connection for good
            self._start_head_clock()
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


def run(
    application, *, host: str, port: int, ready, background, max_connections: int
) -> bool:
    """Serve `application` with uvicorn until SIGINT/SIGTERM; call `ready(port)` once listening
    and run each of `background` on the same event loop. False if it could not listen."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                ready(self.servers[0].sockets[0].getsockname()[1])

        def handle_exit(self, sig, frame):
            # uvicorn forces a stop only on a second SIGINT: a second signal of either kind
            # (systemd, a supervisor, a second Ctrl-C) ends the grace at once
            if self.should_exit:
                self.force_exit = True
            server_stopping.set()
            super().handle_exit(sig, frame)

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
        access_log=False,  # ours is queues/access.py
        log_config=None,  # our LOGGING's handler and format (JSON too), not uvicorn's own
        log_level="warning",
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        timeout_graceful_shutdown=stop_grace_seconds(),
    )
    server = Server(config)

    async def main() -> bool:
        tasks = [asyncio.create_task(start()) for start in background]
        try:
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
        finish_leftover_tasks(loop)  # uvicorn cancels what outlived the grace, but never awaits it
        asyncio.set_event_loop(None)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
