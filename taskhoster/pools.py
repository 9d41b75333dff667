"""The connections a producer keeps open between calls: `Connections` for a `Producer` (safe to
share between threads: each call takes a connection of its own), `AsyncConnections` for an
`AsyncProducer` (tasks may call at once). Each call takes an idle connection that is still good
(see `wire` for when one is not, and for what is sent again), or opens one; at most
MAX_CONNECTIONS at once."""

import asyncio
import select
import socket
import ssl
import threading
import time

import httptools

from .errors import ConnectionFailed, TaskhosterError
from .wire import IDLE_SECONDS, Answer, Endpoint, Framing, Unanswered, failed, may_send_again, unreachable

READ_SIZE = 1 << 16
MAX_CONNECTIONS = 100  # per producer at once, as httpx's default pool had; more calls wait for one
MAX_IDLE_CONNECTIONS = 20  # kept open between calls


class Connection(Framing):
    """One socket to the server, used by one thread at a time."""

    def __init__(self, endpoint: Endpoint, timeout: float):
        super().__init__()
        sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if endpoint.tls is not None:
                sock = endpoint.tls.wrap_socket(sock, server_hostname=endpoint.host)
        except BaseException:
            sock.close()
            raise
        self._socket = sock
        self._timeout = timeout
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self.idle_since = 0.0

    def usable(self, now: float) -> bool:
        """Worth sending on: not idle too long, and nothing to read (the server's close or bytes
        nobody asked for)."""
        if now - self.idle_since > IDLE_SECONDS or self._poll.poll(0):
            return False
        return not isinstance(self._socket, ssl.SSLSocket) or not self._socket.pending()

    def exchange(self, request: list[bytes], timeout: float) -> Answer:
        sock = self._socket
        if timeout != self._timeout:
            sock.settimeout(timeout)
            self._timeout = timeout
        try:
            for piece in request:
                sock.sendall(piece)
        except TimeoutError:
            raise
        except OSError as exc:
            raise Unanswered(f"the connection failed while the request was written ({exc})", unsent=True) from exc
        got_bytes = False
        while not self.ended:
            try:
                data = sock.recv(READ_SIZE)
            except TimeoutError:
                raise
            except OSError as exc:
                if got_bytes:
                    raise
                raise Unanswered(f"the connection failed before the answer came ({exc})") from exc
            if not data:
                self.closed_by_server(got_bytes)
                break
            got_bytes = True
            self.parser.feed_data(data)
        return self.answer()

    def close(self) -> None:
        self._socket.close()


class Connections:
    """The connections of one Producer: at most MAX_CONNECTIONS at once, the idle ones kept for
    the next call (the most recently used first). Safe to use from several threads."""

    def __init__(self, endpoint: Endpoint, timeout: float):
        self._endpoint = endpoint
        self._timeout = timeout
        self._idle: list[Connection] = []
        self._room = threading.Condition(threading.Lock())
        self._busy = 0  # connections out with a call
        self._waiting = 0  # calls waiting for room
        self._closed = False

    def call(self, method: str, target: str, body: bytes | None, timeout: float) -> Answer:
        request = self._endpoint.request(method, target, body)
        connection = self._take()
        try:
            if connection is None:
                connection = self._connect()
                answer = connection.exchange(request, timeout)
            else:
                try:
                    answer = connection.exchange(request, timeout)
                except Unanswered as failure:
                    connection.close()
                    if not may_send_again(method, failure):
                        raise
                    connection = self._connect()
                    answer = connection.exchange(request, timeout)
        except BaseException as exc:
            self._give_back(connection, reusable=False)
            failure = failed(self._endpoint.url, method, exc, timeout)
            if failure is exc:
                raise
            raise failure from exc
        self._give_back(connection, reusable=connection.reusable)
        return answer

    def _take(self) -> Connection | None:
        """Room for one more connection, and an idle one that is still good if there is one."""
        now, stale, connection = time.monotonic(), [], None
        with self._room:
            if self._closed:
                raise TaskhosterError("this producer is closed")
            if self._busy >= MAX_CONNECTIONS:
                self._waiting += 1
                try:
                    if not self._room.wait_for(lambda: self._busy < MAX_CONNECTIONS, self._timeout):
                        raise ConnectionFailed(f"all {MAX_CONNECTIONS} connections to {self._endpoint.url} "
                                               f"stayed busy for {self._timeout:g} s")
                finally:
                    self._waiting -= 1
            self._busy += 1
            while self._idle:
                candidate = self._idle.pop()
                if candidate.usable(now):
                    connection = candidate
                    break
                stale.append(candidate)
        for candidate in stale:
            candidate.close()
        return connection

    def _give_back(self, connection: Connection | None, *, reusable: bool) -> None:
        if reusable:
            connection.idle_since = time.monotonic()
        with self._room:
            self._busy -= 1
            if self._waiting:
                self._room.notify()
            if reusable and not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(connection)
                return
        if connection is not None:
            connection.close()

    def _connect(self) -> Connection:
        try:
            return Connection(self._endpoint, self._timeout)
        except OSError as exc:
            raise unreachable(self._endpoint.url, exc, self._timeout) from exc

    def close(self) -> None:
        with self._room:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


# ---- asyncio -----------------------------------------------------------------------------------


class AsyncConnection(Framing, asyncio.BufferedProtocol):
    """One connection to the server on an event loop, used by one task at a time. asyncio's
    callbacks feed the parser as bytes come, and a call waits on one future with one timer. It
    reads into a buffer of its own: asyncio gives a plain protocol (and so its streams) a fresh
    256 KiB buffer for every read, an mmap and munmap each."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__()
        self.loop = loop
        self._buffer = memoryview(bytearray(READ_SIZE))
        self._transport: asyncio.Transport | None = None
        self._poll = select.poll()
        self._waiter: asyncio.Future | None = None  # the answer of the call in progress
        self._timer: asyncio.TimerHandle | None = None
        self._timeout = 0.0
        self._got_bytes = False
        self._lost = False  # the connection is gone, or the server sent what nobody asked for
        self._closed = loop.create_future()
        self.idle_since = 0.0

    @classmethod
    async def open(cls, endpoint: Endpoint, loop: asyncio.AbstractEventLoop) -> "AsyncConnection":
        _, connection = await loop.create_connection(lambda: cls(loop), endpoint.host, endpoint.port,
                                                     ssl=endpoint.tls,
                                                     server_hostname=endpoint.host if endpoint.tls else None)
        return connection

    def usable(self, now: float, loop: asyncio.AbstractEventLoop) -> bool:
        if now - self.idle_since > IDLE_SECONDS or self.loop is not loop or self._lost:
            return False
        return not (self._transport.is_closing() or self._poll.poll(0))

    async def exchange(self, request: list[bytes], timeout: float) -> Answer:
        transport = self._transport
        for piece in request:
            transport.write(piece)
        if transport.is_closing():  # writing failed at once: the server had closed
            raise Unanswered("the connection failed while the request was written", unsent=True)
        self._got_bytes = False
        self._timeout = timeout
        waiter = self._waiter = self.loop.create_future()
        self._timer = self.loop.call_later(timeout, self._time_out)
        try:
            await waiter
        finally:
            self._timer.cancel()
            self._waiter = None
        return self.answer()

    def close(self) -> None:
        if self._transport is not None and not self.loop.is_closed():
            self._transport.close()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    def _time_out(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(TimeoutError())

    def _went_on(self) -> None:
        """Bytes moved: the timeout counts from now (a long answer, a large body)."""
        self._timer.cancel()
        self._timer = self.loop.call_later(self._timeout, self._time_out)

    # -- asyncio.BufferedProtocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._poll.register(transport.get_extra_info("socket").fileno(), select.POLLIN)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            self._lost = True  # bytes nobody asked for: this connection is not reused
            return
        if self._got_bytes:
            self._went_on()
        self._got_bytes = True
        try:
            self.parser.feed_data(bytes(self._buffer[:nbytes]))
        except httptools.HttpParserError as exc:
            waiter.set_exception(exc)
            return
        if self.ended:
            waiter.set_result(None)

    def resume_writing(self) -> None:
        if self._waiter is not None:
            self._went_on()

    def eof_received(self) -> bool:
        return False  # close: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if not self._closed.done():
            self._closed.set_result(None)
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        try:
            self.closed_by_server(self._got_bytes)  # the end of an answer that runs until the close
        except Unanswered as failure:
            reason = f"the connection failed before the answer came ({exc})" if exc is not None else str(failure)
            waiter.set_exception(Unanswered(reason))
        except OSError as failure:
            waiter.set_exception(failure)
        else:
            waiter.set_result(None)


class AsyncConnections:
    """The connections of one AsyncProducer: at most MAX_CONNECTIONS at once, the idle ones kept
    for the next call. Connections belong to the event loop they were opened on."""

    def __init__(self, endpoint: Endpoint, timeout: float):
        self._endpoint = endpoint
        self._timeout = timeout
        self._idle: list[AsyncConnection] = []
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    async def call(self, method: str, target: str, body: bytes | None, timeout: float) -> Answer:
        request = self._endpoint.request(method, target, body)
        loop = asyncio.get_running_loop()  # once: in Python 3.11 each call costs a getpid()
        slots = self._slots_of(loop)
        if slots.locked():
            try:
                async with asyncio.timeout(self._timeout):
                    await slots.acquire()
            except TimeoutError:
                raise ConnectionFailed(f"all {MAX_CONNECTIONS} connections to {self._endpoint.url} stayed "
                                       f"busy for {self._timeout:g} s") from None
        else:
            await slots.acquire()  # free: does not wait
        try:
            connection = self._reuse(loop)
            try:
                if connection is None:
                    connection = await self._connect(loop)
                    answer = await connection.exchange(request, timeout)
                else:
                    try:
                        answer = await connection.exchange(request, timeout)
                    except Unanswered as failure:
                        connection.close()
                        if not may_send_again(method, failure):
                            raise
                        connection = await self._connect(loop)
                        answer = await connection.exchange(request, timeout)
            except BaseException as exc:
                if connection is not None:
                    connection.close()
                failure = failed(self._endpoint.url, method, exc, timeout)
                if failure is exc:
                    raise
                raise failure from exc
            self._keep(connection)
            return answer
        finally:
            slots.release()

    def _slots_of(self, loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
        if self._slots is None or self._slots_loop is not loop:
            self._slots, self._slots_loop = asyncio.Semaphore(MAX_CONNECTIONS), loop
        return self._slots

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> AsyncConnection:
        try:
            async with asyncio.timeout(self._timeout):
                return await AsyncConnection.open(self._endpoint, loop)
        except (OSError, TimeoutError) as exc:
            raise unreachable(self._endpoint.url, exc, self._timeout) from exc

    def _reuse(self, loop: asyncio.AbstractEventLoop) -> AsyncConnection | None:
        if self._closed:
            raise TaskhosterError("this producer is closed")
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if connection.usable(now, loop):
                return connection
            connection.close()
        return None

    def _keep(self, connection: AsyncConnection) -> None:
        if connection.reusable and not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            connection.close()

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
        await asyncio.gather(*(connection.wait_closed() for connection in idle
                               if connection.loop is asyncio.get_running_loop()))
