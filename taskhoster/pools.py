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


class AsyncConnection(Framing):
    """One asyncio stream to the server, used by one task at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        super().__init__()
        self._reader = reader
        self._writer = writer
        self.loop = asyncio.get_running_loop()
        self._poll = select.poll()
        self._poll.register(writer.get_extra_info("socket").fileno(), select.POLLIN)
        self.idle_since = 0.0

    @classmethod
    async def open(cls, endpoint: Endpoint) -> "AsyncConnection":
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port, ssl=endpoint.tls,
                                                       server_hostname=endpoint.host if endpoint.tls else None)
        return cls(reader, writer)

    def usable(self, now: float) -> bool:
        if now - self.idle_since > IDLE_SECONDS or self.loop is not asyncio.get_running_loop():
            return False
        return not (self._writer.transport.is_closing() or self._reader.at_eof() or self._poll.poll(0))

    async def exchange(self, request: list[bytes], timeout: float) -> Answer:
        writer, reader = self._writer, self._reader
        async with asyncio.timeout(timeout) as deadline:
            for piece in request:
                writer.write(piece)
            if writer.transport.is_closing():  # writing failed at once: the server had closed
                raise Unanswered("the connection failed while the request was written", unsent=True)
            if writer.transport.get_write_buffer_size():  # a large body: wait for it to go out
                try:
                    await writer.drain()
                except OSError as exc:
                    raise Unanswered(f"the connection failed before the answer came ({exc})") from exc
            got_bytes = False
            while not self.ended:
                try:
                    data = await reader.read(READ_SIZE)
                except OSError as exc:
                    if got_bytes:
                        raise
                    raise Unanswered(f"the connection failed before the answer came ({exc})") from exc
                if not data:
                    self.closed_by_server(got_bytes)
                    break
                if got_bytes:  # a long answer: the timeout counts from the last bytes
                    deadline.reschedule(self.loop.time() + timeout)
                got_bytes = True
                self.parser.feed_data(data)
        return self.answer()

    def close(self) -> None:
        if not self.loop.is_closed():
            self._writer.close()

    async def wait_closed(self) -> None:
        try:
            await self._writer.wait_closed()
        except OSError:
            pass  # closed with an error: closed all the same


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
        slots = self._slots_of_this_loop()
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
            connection = self._reuse()
            try:
                if connection is None:
                    connection = await self._connect()
                    answer = await connection.exchange(request, timeout)
                else:
                    try:
                        answer = await connection.exchange(request, timeout)
                    except Unanswered as failure:
                        connection.close()
                        if not may_send_again(method, failure):
                            raise
                        connection = await self._connect()
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

    def _slots_of_this_loop(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots, self._slots_loop = asyncio.Semaphore(MAX_CONNECTIONS), loop
        return self._slots

    async def _connect(self) -> AsyncConnection:
        try:
            async with asyncio.timeout(self._timeout):
                return await AsyncConnection.open(self._endpoint)
        except (OSError, TimeoutError) as exc:
            raise unreachable(self._endpoint.url, exc, self._timeout) from exc

    def _reuse(self) -> AsyncConnection | None:
        if self._closed:
            raise TaskhosterError("this producer is closed")
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if connection.usable(now):
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
