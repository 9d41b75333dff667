"""A local HTTP/1.1 server for the producer's tests: it answers each request with what a test's
handler says, counts connections and requests, can close its idle connections on demand (as a
server's keep-alive limit does), and can speak TLS."""

import json
import select
import socket
import ssl
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    headers: dict[str, str]  # names in lower case
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Reply:
    """What the stub writes back: `status` and `json` as an answer with Content-Length, or `raw`
    bytes as they are; `close` closes the connection after writing them, without saying so."""

    status: int = 200
    json: Any = None
    raw: bytes | None = None
    close: bool = False

    def encode(self) -> bytes:
        if self.raw is not None:
            return self.raw
        body = json.dumps(self.json).encode()
        return b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            self.status, len(body), body)


# What a handler returns: a Reply, or None to close the connection without answering.
Handler = Callable[[Request], Reply | None]


def _head_and_body(sock: socket.socket, buffer: bytes) -> tuple[bytes, bytes, bytes] | None:
    """One request's head and body read from `sock` (after what `buffer` holds already), and what
    came after them; None if the client closed first."""
    while b"\r\n\r\n" not in buffer:
        data = sock.recv(65536)
        if not data:
            return None
        buffer += data
    head, _, buffer = buffer.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(buffer) < length:
        data = sock.recv(65536)
        if not data:
            return None
        buffer += data
    return head, buffer[:length], buffer[length:]


def _poller(sock: socket.socket) -> Callable[[int], bool]:
    """ready(ms): whether `sock` has something to read within that many milliseconds (poll, not
    select: a test process may hold descriptors past select's 1024)."""
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return lambda ms: bool(poll.poll(ms))


@dataclass
class StubServer:
    handler: Handler
    tls: ssl.SSLContext | None = None
    requests: list[Request] = field(default_factory=list)
    connections: int = 0  # accepted so far
    errors: list[BaseException] = field(default_factory=list)  # what broke a connection (TLS refused, say)

    def __post_init__(self):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        self._lock = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._close_idle: str | None = None  # "close" or "reset" while close_idle() runs
        self._idle = 0  # connections waiting for their next request

    def __enter__(self) -> "StubServer":
        self._start(self._accept)
        return self

    def __exit__(self, *exc_info) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self._listener.close()

    def close_idle(self, *, reset: bool = False) -> int:
        """Close every connection that waits for its next request, as a server does at its keep-alive
        limit (`reset`: abortively, with a TCP reset); returns once they are closed, with how many."""
        with self._lock:
            count = self._idle
            self._close_idle = "reset" if reset else "close"
            closed = self._lock.wait_for(lambda: self._idle == 0, timeout=5)
            self._close_idle = None
        assert closed, "the stub's idle connections did not close"
        return count

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        ready = _poller(self._listener)
        while not self._stopping.is_set():
            if not ready(50):
                continue
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            self._start(self._serve, sock)

    def _serve(self, sock: socket.socket) -> None:
        self._count_idle(1)  # idle from the moment a connection stands until its request begins
        idle = True
        try:
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True)
            buffer = b""
            while self._wait_for_request(sock, buffer):
                self._count_idle(-1)
                idle = False
                got = _head_and_body(sock, buffer)
                if got is None:
                    return
                head, body, buffer = got
                reply = self.handler(self._record(head, body))
                if reply is None:
                    return
                if reply.close:
                    sock.sendall(reply.encode())
                    return
                self._count_idle(1)  # before the answer goes out: the client may act on it at once
                idle = True
                sock.sendall(reply.encode())
        except (OSError, ssl.SSLError) as exc:
            self.errors.append(exc)
        finally:
            sock.close()
            if idle:
                self._count_idle(-1)

    def _count_idle(self, change: int) -> None:
        with self._lock:
            self._idle += change
            self._lock.notify_all()

    def _wait_for_request(self, sock: socket.socket, buffer: bytes) -> bool:
        """Wait until a request begins; False if the stub stops or closes the idle connection."""
        if buffer or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
            return True
        ready = _poller(sock)
        while not self._stopping.is_set():
            if self._close_idle is not None:
                if self._close_idle == "reset":
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
                return False
            if ready(20):
                return True
        return False

    def _record(self, head: bytes, body: bytes) -> Request:
        line, *lines = head.decode("latin-1").split("\r\n")
        method, target, _ = line.split(" ", 2)
        headers = {}
        for header in lines:
            name, _, value = header.partition(":")
            headers[name.strip().lower()] = value.strip()
        request = Request(method, target, headers, body)
        with self._lock:
            self.requests.append(request)
        return request
