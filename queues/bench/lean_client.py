"""The bench's producer side: one keep-alive HTTP/1.1 connection spoken over a plain socket. It
measures the server, not an HTTP library: httpx spends ~0.8 ms of CPU per request here, and the
standard library's http.client ~0.15 ms (mostly parsing the answer's headers with the email
package), against ~0.04 ms for a whole round trip to a bare uvicorn app this way. The workers
use our client (taskhoster.Worker).

It speaks just enough HTTP for our API: requests with a JSON body, answers with Content-Length.
"""

import json
import socket
import time
from urllib.parse import urlsplit

TERMINAL = ("finished", "failed")
READ_SIZE = 1 << 16


class LeanProducer:
    def __init__(self, url: str, token: str, *, timeout: float = 120):
        parts = urlsplit(url)
        self._address = (parts.hostname, parts.port or 80)
        self._timeout = timeout
        self._host = f"Host: {parts.netloc}\r\n".encode()
        self._head = self._host + f"Authorization: Bearer {token}\r\n".encode()
        self._socket: socket.socket | None = None
        self._buffer = b""

    def _call(self, method: str, path: str, body=None) -> dict:
        status, content = self._request(method, path, body, self._head)
        if status >= 400:
            raise RuntimeError(f"{method} {path} answered {status}: {content[:200]!r}")
        return json.loads(content)

    def _request(self, method: str, path: str, body, head: bytes) -> tuple[int, bytes]:
        data = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        request = b"%s %s HTTP/1.1\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            method.encode(), path.encode(), head, len(data), data,
        )
        reused = self._socket is not None
        try:
            status, headers, content = self._exchange(request)
        except ConnectionError:
            answered_in_part = bool(self._buffer)
            self.close()
            if not reused or answered_in_part:
                raise  # part of an answer came: the server took the request, so never send it twice
            # the server closed the idle connection before reading this request: ask again
            status, headers, content = self._exchange(request)
        if headers.get(b"connection", b"").lower() == b"close":
            self.close()
        return status, content

    def _exchange(self, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        connection = self._connect()
        connection.sendall(request)
        return self._read_answer(connection)

    def _connect(self) -> socket.socket:
        if self._socket is None:
            self._socket = socket.create_connection(self._address, timeout=self._timeout)
            self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._buffer = b""
        return self._socket

    def _read_answer(self, connection: socket.socket) -> tuple[int, dict[bytes, bytes], bytes]:
        while b"\r\n\r\n" not in self._buffer:
            self._receive(connection)
        head, _, self._buffer = self._buffer.partition(b"\r\n\r\n")
        status_line, *lines = head.split(b"\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if b"content-length" not in headers:
            raise RuntimeError(f"an answer without Content-Length: {head[:200]!r}")
        length = int(headers[b"content-length"])
        while len(self._buffer) < length:
            self._receive(connection)
        content, self._buffer = self._buffer[:length], self._buffer[length:]
        return int(status_line.split()[1]), headers, content

    def _receive(self, connection: socket.socket) -> None:
        chunk = connection.recv(READ_SIZE)
        if not chunk:
            raise ConnectionError("the server closed the connection before the answer ended")
        self._buffer += chunk

    def post(self, queue: str, payload) -> dict:
        return self._call("POST", f"/api/queues/{queue}/items", {"payload": payload})

    def post_refused(self, queue: str) -> None:
        """A post without a token: answered 401 before the body is read, with no disk, database or
        thread in the way, so its time is what any request costs through this server."""
        status, content = self._request("POST", f"/api/queues/{queue}/items", {"payload": 1}, self._host)
        if status != 401:
            raise RuntimeError(f"a post without a token answered {status}, not 401: {content[:200]!r}")

    def post_many(self, queue: str, payloads: list) -> list[dict]:
        return self._call("POST", f"/api/queues/{queue}/items", {"items": [{"payload": p} for p in payloads]})["items"]

    def wait(self, queue: str, item_id: str, *, timeout: float) -> dict:
        """The item once terminal (long-polling with GET ?wait), or as it is after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            step = max(0.0, min(60.0, deadline - time.monotonic()))
            item = self._call("GET", f"/api/queues/{queue}/items/{item_id}?wait={step}")
            if item["status"] in TERMINAL or time.monotonic() >= deadline:
                return item

    def stats(self, queue: str) -> dict:
        return self._call("GET", f"/api/queues/{queue}")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def __enter__(self) -> "LeanProducer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
