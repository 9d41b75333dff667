"""The worker's WebSocket: websockets' Sans-I/O protocol (the opening handshake, frames and their
masks, pongs to the server's pings, the closing handshake) driven by an asyncio.Protocol of our
own. Each text message goes to `on_message` the moment it is parsed, and each frame is written
the moment it is sent: no task, queue or lock between the TCP connection and the Link. Those of
websockets' asyncio connection cost a worker working one item at a time about half its CPU per
item (two frames each way per item).

Like websockets' own connection, it pings a quiet server every PING_SECONDS and gives the
connection up when a ping goes unanswered until the next one. It does not follow redirects or
go through proxies."""

import asyncio
import logging
import os
import ssl
from collections.abc import Callable

from websockets.client import ClientProtocol
from websockets.exceptions import InvalidMessage
from websockets.frames import Opcode
from websockets.http11 import USER_AGENT, Response
from websockets.protocol import State
from websockets.uri import parse_uri

log = logging.getLogger("taskhoster.worker")

READ_SIZE = 1 << 16
PING_SECONDS = 20.0  # websockets' own keepalive: a ping this often, its pong due by the next one
CLOSE_SECONDS = 10.0  # how long a close waits for the server's side of the closing handshake


class SocketClosed(Exception):
    """The socket is closed or closing: nothing more can be sent over it."""


class WebSocket(asyncio.BufferedProtocol):
    """One open /work socket. `on_message(text)` gets every text message; `close_code` is the
    server's close code once the socket has closed. It reads into a buffer of its own: asyncio's
    plain protocols get a fresh 256 KiB buffer for every read (an mmap and munmap each)."""

    def __init__(self, protocol: ClientProtocol):
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._protocol = protocol
        self._buffer = memoryview(bytearray(READ_SIZE))
        self._transport: asyncio.Transport | None = None
        self._answered = loop.create_future()  # the handshake's answer came, or the connection went
        self._closed = loop.create_future()  # the TCP connection is gone
        self._fragments: list[bytes] = []  # of a message that comes in several frames
        self._text = False  # that message is text (binary ones are read and dropped)
        self._keepalive: asyncio.TimerHandle | None = None
        self._ping_unanswered = False
        self._closing: asyncio.TimerHandle | None = None
        self._held = False  # frames sent meanwhile wait for flush(), to go out in one write
        self.on_message: Callable[[str], None] | None = None

    @classmethod
    async def open(cls, url: str, headers: dict[str, str], *, timeout: float) -> "WebSocket":
        """Connect and shake hands within `timeout` seconds. Raises OSError, TimeoutError, or
        InvalidHandshake (InvalidStatus when the server refuses, with its status code)."""
        uri = parse_uri(url)
        protocol = ClientProtocol(uri, max_size=None)
        tls = ssl.create_default_context() if uri.secure else None
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            transport, socket = await loop.create_connection(
                lambda: cls(protocol), uri.host, uri.port, ssl=tls, server_hostname=uri.host if tls else None)
            try:
                await socket._shake_hands(headers)
            except BaseException:
                transport.abort()
                raise
        return socket

    @property
    def close_code(self) -> int | None:
        return self._protocol.close_code

    @property
    def close_reason(self) -> str:
        """What the server said when it closed the socket ("" when it said nothing)."""
        return self._protocol.close_reason or ""

    def send(self, text: str) -> None:
        if self._protocol.state is not State.OPEN:
            raise SocketClosed()
        self._protocol.send_text(text.encode())
        if not self._held:
            self._write()

    def hold(self) -> None:
        """Keep the frames sent from now on until flush(), which writes them all at once: one
        system call (and one TCP segment, most often) for what one event-loop turn sends."""
        self._held = True

    def flush(self) -> None:
        self._held = False
        self._write()

    async def close(self) -> None:
        """Close with code 1000 and wait for the server's side of it, at most CLOSE_SECONDS."""
        if self._protocol.state is State.OPEN:
            self._protocol.send_close(1000)
            self._write()
        if not self._closed.done():
            try:
                async with asyncio.timeout(CLOSE_SECONDS):
                    await asyncio.shield(self._closed)
            except TimeoutError:
                self._transport.abort()
                await asyncio.shield(self._closed)  # connection_lost comes at once

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    async def _shake_hands(self, headers: dict[str, str]) -> None:
        request = self._protocol.connect()
        request.headers.update(headers)
        request.headers.setdefault("User-Agent", USER_AGENT)
        self._protocol.send_request(request)
        self._write()
        await self._answered
        if self._protocol.handshake_exc is not None:
            raise self._protocol.handshake_exc
        if self._protocol.state is State.CONNECTING:  # the connection went without an answer
            raise InvalidMessage("the connection closed during the opening handshake")
        # open, or closing already (a server that refuses the token closes at once with 4401)
        self._keepalive = self._loop.call_later(PING_SECONDS, self._ping)

    def _write(self) -> None:
        writes = self._protocol.data_to_send()
        if len(writes) > 1 and all(writes):
            writes = [b"".join(writes)]
        for data in writes:
            if data:
                self._transport.write(data)
            elif self._transport.can_write_eof():  # the end of what we send: half-close
                self._transport.write_eof()
            else:  # TLS cannot half-close
                self._transport.close()

    def _ping(self) -> None:
        if self._protocol.state is not State.OPEN:
            return
        if self._ping_unanswered:
            log.warning("the server did not answer a ping in %g s; closing the socket", PING_SECONDS)
            self._transport.abort()
            return
        self._protocol.send_ping(os.urandom(4))
        self._write()
        self._ping_unanswered = True
        self._keepalive = self._loop.call_later(PING_SECONDS, self._ping)

    def _take(self, events: list) -> None:
        for event in events:
            if isinstance(event, Response):
                if not self._answered.done():
                    self._answered.set_result(None)
            elif event.opcode is Opcode.TEXT and event.fin:  # a whole message: nearly every one
                self._deliver(event.data)
            elif event.opcode is Opcode.TEXT or event.opcode is Opcode.BINARY:
                self._fragments, self._text = [event.data], event.opcode is Opcode.TEXT
                if event.fin:
                    self._deliver_fragments()
            elif event.opcode is Opcode.CONT:
                self._fragments.append(event.data)
                if event.fin:
                    self._deliver_fragments()
            elif event.opcode is Opcode.PONG:
                self._ping_unanswered = False
        if self._closing is None and self._protocol.close_expected():
            self._closing = self._loop.call_later(CLOSE_SECONDS, self._transport.abort)

    def _deliver_fragments(self) -> None:
        data, self._fragments = b"".join(self._fragments), []
        if self._text:
            self._deliver(data)

    def _deliver(self, data: bytes) -> None:
        try:
            text = data.decode()
        except UnicodeDecodeError:
            return  # not a frame of ours
        if self.on_message is not None:
            self.on_message(text)

    # -- asyncio.BufferedProtocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        self._protocol.receive_data(bytes(self._buffer[:nbytes]))
        events = self._protocol.events_received()
        self._write()  # pongs, the answer to a close
        self._take(events)

    def eof_received(self) -> None:
        self._protocol.receive_eof()
        events = self._protocol.events_received()
        self._write()
        self._take(events)

    def connection_lost(self, exc: Exception | None) -> None:
        self._protocol.receive_eof()  # the protocol's state is CLOSED from here on
        for timer in (self._keepalive, self._closing):
            if timer is not None:
                timer.cancel()
        for waiter in (self._answered, self._closed):
            if not waiter.done():
                waiter.set_result(None)

