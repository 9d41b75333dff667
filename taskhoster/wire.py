"""HTTP/1.1 as the producers speak it: the request bytes written by hand, the answer framed by
httptools (the parser uvicorn uses: Content-Length, chunked, or until the server closes), and
which failed request may go out again. `pools` keeps the connections these bytes travel on.
https is the standard library's ssl with the system's CAs (SSL_CERT_FILE and SSL_CERT_DIR apply).

A connection kept alive may be closed by the server while it sits idle. One found closed, or
holding bytes nobody asked for, or idle longer than IDLE_SECONDS, is closed instead of reused,
before anything is sent on it. Should a request still fail on a reused connection before any byte
of the answer came (the server's close crossed it on the wire), it is sent once more, on a new
connection, only where the server cannot have acted on it twice:
  - a GET: reading twice changes nothing that reading once did not;
  - a POST whose request could not be written: the server had closed the connection, so it never
    read the whole request.
A POST that was written in full is never sent again: the server may have read it, posted the item
and closed before it answered. The call raises ConnectionFailed saying so, and the caller decides.
A timeout is never retried either: the server may be at work on the request.
"""

import ssl
from typing import NamedTuple
from urllib.parse import urlsplit

import httptools

from .errors import ConnectionFailed, TaskhosterError

# Below uvicorn's default idle limit (5 s, as httpx's own) and far below ours (75 s), so against
# those the client, not the server, ends an idle connection; against a server that ends them
# sooner, the look before each reuse does.
IDLE_SECONDS = 4.0
WRITE_AT_ONCE = 1 << 16  # a body larger than this is written after its head, not copied onto it


class Answer(NamedTuple):
    status: int
    body: bytes
    retry_after: float | None = None  # seconds, when the answer says how long to wait (Retry-After)


class Endpoint:
    """The server as the connections see it: where to connect, whether with TLS, and the head
    lines every request carries."""

    def __init__(self, url: str, token: str):
        parts = urlsplit(url)
        self.url = url
        self.host = parts.hostname or ""
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.tls else 80)
        self._prefix = parts.path.rstrip("/").encode()
        host = parts.netloc.rpartition("@")[2]
        self._head = f"Host: {host}\r\nAuthorization: Bearer {token}\r\nUser-Agent: taskhoster\r\n".encode()

    def request(self, method: str, target: str, body: bytes | None) -> list[bytes]:
        """The request's bytes, in one piece unless its body is large."""
        line = f"{method} ".encode() + self._prefix + target.encode() + b" HTTP/1.1\r\n" + self._head
        if body is None:
            return [line + b"\r\n"]
        head = line + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        return [head + body] if len(body) <= WRITE_AT_ONCE else [head, body]


class Unanswered(Exception):
    """The connection failed before any byte of the answer came. `unsent`: writing the request
    failed, so the server did not read all of it."""

    def __init__(self, reason: str, *, unsent: bool = False):
        super().__init__(reason)
        self.unsent = unsent


def may_send_again(method: str, failure: Unanswered) -> bool:
    """See the module docstring: only where the server cannot have acted on the request."""
    return method == "GET" or failure.unsent


class Framing:
    """httptools' callbacks: where one answer ends and what it says. A connection is one: it feeds
    `parser` what it reads until `ended`, then takes the `answer()`."""

    def __init__(self):
        self.parser = httptools.HttpResponseParser(self)
        self.reusable = False  # the last answer left the connection open for the next request
        self._begin()

    def _begin(self) -> None:
        self._status = 0
        self._body: list[bytes] = []
        self._framed = False  # Content-Length or Transfer-Encoding; else the body ends at close
        self._retry_after: float | None = None
        self._headed = False
        self.ended = False

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in (b"content-length", b"transfer-encoding"):
            self._framed = True
        elif name == b"retry-after" and value.strip().isdigit():  # seconds (not the HTTP-date form)
            self._retry_after = float(value)

    def on_headers_complete(self) -> None:
        self._status = self.parser.get_status_code()
        self._headed = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if 100 <= self._status < 200:  # an interim answer (100 Continue, 103): the real one follows
            self._begin()
            return
        self.reusable = self.parser.should_keep_alive()
        self.ended = True

    def closed_by_server(self, got_bytes: bool) -> None:
        """The server closed the connection while we read: the end of an answer whose body runs
        until the close, or a failure."""
        if self._headed and not self._framed:
            self.ended = True
            self.reusable = False
            return
        if not got_bytes:
            raise Unanswered("the server closed the connection without answering")
        raise ConnectionResetError("the server closed the connection in the middle of its answer")

    def answer(self) -> Answer:
        answer = Answer(self._status, b"".join(self._body), self._retry_after)
        self._begin()
        return answer


# ---- what the caller sees ----------------------------------------------------------------------


def unreachable(url: str, exc: BaseException, timeout: float) -> ConnectionFailed:
    if isinstance(exc, TimeoutError):
        return ConnectionFailed(f"cannot reach {url}: no connection within {timeout:g} s")
    return ConnectionFailed(f"cannot reach {url}: {exc or type(exc).__name__}")


def failed(url: str, method: str, exc: BaseException, timeout: float) -> BaseException:
    """What a failed call raises: a ConnectionFailed that says what happened and whether a POST
    may have been carried out; any other error as it is."""
    if isinstance(exc, TaskhosterError) or not isinstance(exc, (OSError, Unanswered, httptools.HttpParserError)):
        return exc
    maybe = f" (the {method} may have been carried out; it is not sent again)" if method != "GET" else ""
    if isinstance(exc, TimeoutError):
        return ConnectionFailed(f"{url} did not answer the {method} within {timeout:g} s{maybe}",
                                maybe_done=bool(maybe))
    if isinstance(exc, Unanswered):
        maybe = "" if exc.unsent else maybe
        return ConnectionFailed(f"{url}: {exc}{maybe}", maybe_done=bool(maybe))
    if isinstance(exc, httptools.HttpParserError):
        return ConnectionFailed(f"{url} did not answer in HTTP/1.1 ({exc}){maybe}", maybe_done=bool(maybe))
    return ConnectionFailed(f"the connection to {url} failed during the {method}: {exc}{maybe}", maybe_done=bool(maybe))
