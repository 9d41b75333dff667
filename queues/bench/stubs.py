"""Stub servers for timing the client library's own CPU (client_cpu.py): they answer as a
Taskhoster server does, at once and from memory, and run in a process of their own, so none of
their CPU is counted as the client's.

    HttpStub  the Producer API: any POST is answered 201 with a new pending item, any GET 200
              with a finished one (keep-alive, Content-Length, the headers and JSON of `serve`)
    WorkStub  the /work socket (docs/socket.md): a claim gets as many items as it asks for, at
              once; `result` and `results` are acked, `release` and `extend` answered. With
              `items` it hands out that many in all, then holds claims that wait (as the server
              does on an empty queue); without, it never runs out

    python -m queues.bench.stubs    serves both; prints {"http": PORT, "work": PORT}; ends when
                                    its standard input closes (StubServers does that)
"""

import asyncio
import itertools
import json
import selectors
import subprocess
import sys

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from .servers import PROJECT_DIR

START_TIMEOUT = 60.0  # a busy machine starts Python slowly
STOP_TIMEOUT = 10.0
# timestamps as the server writes them: a claim's lease of 60 s
POSTED_AT, CLAIMED_AT, LEASE_EXPIRES_AT = "2026-12-01T22:17:47.391Z", "2026-12-01T22:17:48.002Z", "2026-12-01T22:18:48.002Z"


def _item_id(serial: int) -> str:
    """A UUIDv7-shaped id, as the server's (only its shape matters to the client)."""
    return f"01a233af-787f-7{serial >> 48 & 0xFFF:03x}-8000-{serial & 0xFFFFFFFFFFFF:012x}"


class HttpStub(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; requests are answered in the order they come."""

    serials = itertools.count()

    def __init__(self):
        self._transport: asyncio.Transport | None = None
        self._buffer = b""

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            head = self._buffer[:end]
            length = _content_length(head)
            if len(self._buffer) < end + 4 + length:
                return
            self._buffer = self._buffer[end + 4 + length:]
            self._transport.write(self._answer(head.split(b" ", 1)[0]))

    def _answer(self, method: bytes) -> bytes:
        item_id = _item_id(next(self.serials))
        if method == b"POST":
            status, body = b"201 Created", {"id": item_id, "queue": "bench", "status": "pending", "attempts": 0,
                                            "postedAt": POSTED_AT, "claimedAt": None, "leaseExpiresAt": None,
                                            "finishedAt": None}
        else:
            status, body = b"200 OK", {"id": item_id, "queue": "bench", "status": "finished", "attempts": 1,
                                       "postedAt": POSTED_AT, "claimedAt": CLAIMED_AT, "leaseExpiresAt": None,
                                       "finishedAt": LEASE_EXPIRES_AT, "result": None}
        text = json.dumps(body, separators=(",", ":")).encode()
        return (b"HTTP/1.1 %s\r\ndate: Tue, 01 Dec 2026 22:17:47 GMT\r\nserver: uvicorn\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s") % (status, len(text), text)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


class WorkStub:
    """The /work socket's side of docs/socket.md, for any number of sockets. `handed_out` and
    `acked` (the ids whose results came in, in order) say what went on."""

    def __init__(self, items: int | None = None):
        self._left = items
        self._serials = itertools.count()
        self.handed_out = 0
        self.acked: list[str] = []

    async def serve(self, connection: ServerConnection) -> None:
        try:
            async for message in connection:
                answer = self.answer(json.loads(message))
                if answer is not None:
                    await connection.send(json.dumps(answer, separators=(",", ":")))
        except ConnectionClosed:
            pass  # the worker stopped while an answer went out: nothing is owed to it

    def answer(self, frame: dict) -> dict | None:
        """The answer to one frame; None for a claim that waits for items that will never come."""
        op, ref = frame.get("op"), frame.get("ref")
        if op == "claim":
            items = self._claim(frame["queue"], frame.get("max", 1))
            if not items and frame.get("wait", 0):
                return None  # the socket's close ends it, as the server's would
            return {"op": "items", "ref": ref, "items": items}
        if op == "result":
            return {"op": "ack", "ref": ref, **self._ack(frame["id"])}
        if op == "results":
            return {"op": "acks", "ref": ref, "items": [self._ack(entry["id"]) for entry in frame["items"]]}
        if op == "release":
            return {"op": "released", "ref": ref, "id": frame["id"]}
        if op == "extend":
            return {"op": "extended", "ref": ref, "id": frame["id"], "leaseExpiresAt": LEASE_EXPIRES_AT}
        return {"op": "error", "ref": ref, "code": "invalid_request", "message": f"unknown op {op!r}"}

    def _claim(self, queue: str, most: int) -> list[dict]:
        count = most if self._left is None else min(most, self._left)
        if self._left is not None:
            self._left -= count
        self.handed_out += count
        return [
            {"id": _item_id(next(self._serials)), "queue": queue, "status": "processing", "attempts": 1,
             "postedAt": POSTED_AT, "claimedAt": CLAIMED_AT, "leaseExpiresAt": LEASE_EXPIRES_AT, "finishedAt": None,
             "payload": {"text": "x" * 100}, "maxAttempts": None}
            for _ in range(count)
        ]

    def _ack(self, item_id: str) -> dict:
        self.acked.append(item_id)
        return {"id": item_id, "accepted": True}


async def start_work_stub(stub: WorkStub, host: str = "127.0.0.1"):
    """The stub's /work socket listening on a port of its own (any path is taken as /work);
    a websockets server: close() it, then await its wait_closed()."""
    return await serve(stub.serve, host, 0, compression=None)


async def _serve_until_stdin_closes() -> None:
    loop = asyncio.get_running_loop()
    http = await loop.create_server(HttpStub, "127.0.0.1", 0)
    work = await start_work_stub(WorkStub())
    ports = {"http": http.sockets[0].getsockname()[1], "work": work.sockets[0].getsockname()[1]}
    print(json.dumps(ports), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # returns at the end of its input
    http.close()
    work.close()


class StubServers:
    """`python -m queues.bench.stubs` in a process of its own, while the block runs: `http_url`
    is the Producer API's, `work_url` the server URL a Worker is given (its /work socket)."""

    def __enter__(self) -> "StubServers":
        self._process = subprocess.Popen(
            [sys.executable, "-m", "queues.bench.stubs"], cwd=PROJECT_DIR,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        try:
            ports = json.loads(self._first_line())
            self.http_url = f"http://127.0.0.1:{ports['http']}"
            self.work_url = f"http://127.0.0.1:{ports['work']}"
        except BaseException:
            self._stop()
            raise
        return self

    def _first_line(self) -> str:
        """The ports the stubs print once listening; RuntimeError if they do not within START_TIMEOUT."""
        with selectors.DefaultSelector() as selector:
            selector.register(self._process.stdout, selectors.EVENT_READ)
            if selector.select(START_TIMEOUT) and (line := self._process.stdout.readline()):
                return line
        raise RuntimeError(f"the stub servers did not start within {START_TIMEOUT:g} s (python -m queues.bench.stubs)")

    def __exit__(self, *exc_info) -> None:
        self._stop()

    def _stop(self) -> None:
        self._process.stdin.close()
        try:
            self._process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process.stdout.close()


if __name__ == "__main__":
    asyncio.run(_serve_until_stdin_closes())
