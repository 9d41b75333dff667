"""What a client can take from a real `serve` process, on each server `serve --server` offers:
a request head must be complete HEAD_TIMEOUT_SECONDS after it began, connections are capped
below the descriptor limit, and that limit is raised to the hard one at start.

The servers start with a descriptor limit of their own (soft SOFT_LIMIT, hard HARD_LIMIT), so
the cap these tests meet is the same on every machine.
"""

import asyncio
import functools
import json
import re
import resource
import select
import socket
import subprocess
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from queues.serving import HEAD_TIMEOUT_SECONDS, MAX_HEAD_BYTES, SERVERS, limits, max_connections
from queues.store import turn
from serverproc import Deployment

SOFT_LIMIT, HARD_LIMIT = 1024, 4096
DEFAULT_MAX_BODY_BYTES = 16 << 20  # TASKHOSTER_MAX_BODY_BYTES, which the servers here do not set
SLOW_CONNECTIONS = 1000
ANSWER_TIMEOUT = 30.0  # generous: what is asserted is what a client gets, not how fast
TRICKLE_SECONDS = 0.25  # one byte of the head this often


@contextmanager
def descriptor_limits(soft: int, hard: int):
    """Processes started meanwhile begin with these limits on open descriptors (as after
    `ulimit -Hn hard -Sn soft`); this process's own limits stay as they are."""

    def apply() -> None:  # in the child, before it runs Python
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "Popen", functools.partial(subprocess.Popen, preexec_fn=apply))
        yield


@pytest.fixture(scope="module", autouse=True)
def _room_for_many_sockets():
    """The servers' hard limit must fit under this process's; and this process holds as many
    sockets as a server may, so its soft limit goes up to its hard one meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < HARD_LIMIT:
        pytest.fail(f"these tests need a hard descriptor limit of {HARD_LIMIT}; it is {hard} here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request, tmp_path_factory):
    deployment = Deployment(tmp_path_factory.mktemp(f"limits-{request.param}"))
    deployment.prepare(queues=["jobs"])
    process = deployment.server(server=request.param)
    with descriptor_limits(SOFT_LIMIT, HARD_LIMIT):
        process.start()
    try:
        yield process
    finally:
        process.stop()


def open_connections(server, count: int, *, first_bytes: bytes = b"") -> list[socket.socket]:
    connections = []
    for _ in range(count):
        connection = socket.create_connection(("127.0.0.1", server.port))
        connection.sendall(first_bytes)
        connection.setblocking(False)
        connections.append(connection)
    return connections


def closed_by_server(connection: socket.socket) -> bool:
    """Whether the server has closed the connection (whatever it said first); never waits."""
    try:
        while connection.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def answer_of(connection: socket.socket) -> bytes | None:
    """All the server sends until it closes the connection (waiting up to ANSWER_TIMEOUT); None
    if it reset the connection (closed it with bytes the client sent still unread)."""
    connection.settimeout(ANSWER_TIMEOUT)
    received = b""
    try:
        while data := connection.recv(65536):
            received += data
    except ConnectionResetError:
        return None
    return received


def silent(connections: list[socket.socket], seconds: float) -> bool:
    """Whether none of `connections` gets a byte or a close from the server within `seconds`."""
    poll = select.poll()  # not select(): these descriptors go past FD_SETSIZE
    for connection in connections:
        poll.register(connection, select.POLLIN)
    return not poll.poll(seconds * 1000)


def busy_answer(answer: bytes | None) -> dict:
    """The JSON body of a 503 answer with Retry-After; fails on any other answer."""
    assert answer is not None, "reset instead of answered"
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer[:200]
    assert b"\r\nretry-after: 1" in head.lower()
    return json.loads(body)


def api_answers(server) -> bool:
    headers = {"Authorization": f"Bearer {server.deployment.token}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=ANSWER_TIMEOUT) as client:
        return client.get("/healthz").status_code == 200 and client.get("/api/queues/jobs").status_code == 200


def close_all(connections: list[socket.socket]) -> None:
    for connection in connections:
        connection.close()


def test_serve_raises_its_descriptor_limit_to_the_hard_limit(server):
    limits = Path(f"/proc/{server.pid}/limits").read_text()
    [line] = [line for line in limits.splitlines() if line.startswith("Max open files")]
    soft, hard = line.split()[3:5]
    assert (int(soft), int(hard)) == (HARD_LIMIT, HARD_LIMIT)


class Trickler:
    """A connection that sends a request head a byte at a time, as its first request or after
    one answered at once."""

    HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000 + b"\r\n\r\n"

    def __init__(self, server, *, after_a_request: bool = False):
        self.connection = socket.create_connection(("127.0.0.1", server.port))
        if after_a_request:
            assert status_over(self.connection) == 200
        self.connection.setblocking(False)
        self.began, self.sent = time.monotonic(), 0

    def trickle(self) -> None:
        """One more byte, unless the server has closed the connection."""
        if not self.closed:
            try:
                self.connection.send(self.HEAD[self.sent : self.sent + 1])
                self.sent += 1
            except ConnectionError:
                pass

    @property
    def closed(self) -> bool:
        return closed_by_server(self.connection)


def status_over(connection: socket.socket) -> int:
    """The status of a GET /healthz sent over `connection`, which stays open."""
    connection.settimeout(ANSWER_TIMEOUT)
    connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return status_of_answer(connection)


def status_of_answer(connection: socket.socket) -> int:
    """The status of the next answer on `connection`, read whole (its body too)."""
    connection.settimeout(ANSWER_TIMEOUT)
    received = b""

    def more() -> bytes:
        data = connection.recv(65536)
        assert data, "the server closed the connection"
        return data

    while b"\r\n\r\n" not in received:
        received += more()
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE).group(1))
    while len(body) < length:
        body += more()
    return int(head.split(b" ", 2)[1])


def test_a_trickled_head_is_closed_about_ten_seconds_after_it_began(server):
    with ExitStack() as stack:
        kept_alive = stack.enter_context(socket.create_connection(("127.0.0.1", server.port)))
        assert status_over(kept_alive) == 200
        idle = open_connections(server, SLOW_CONNECTIONS, first_bytes=b"G")
        stack.callback(close_all, idle)
        # made after the idle ones, which take a while on a busy machine: their clocks start now
        tricklers = [Trickler(server), Trickler(server, after_a_request=True)]
        stack.callback(close_all, [trickler.connection for trickler in tricklers])
        # after a request, bytes that begin no head (a parser skips a blank line) start the clock too
        blank_line = stack.enter_context(socket.create_connection(("127.0.0.1", server.port)))
        assert status_over(blank_line) == 200
        blank_line.sendall(b"\r\n")
        blank_line.setblocking(False)
        idle.append(blank_line)
        assert api_answers(server)  # a new client is served while they are all open

        def trickle_until(seconds: float) -> None:
            while not all(trickler.closed for trickler in tricklers) and time.monotonic() - began < seconds:
                for trickler in tricklers:
                    trickler.trickle()
                time.sleep(TRICKLE_SECONDS)

        began = max(trickler.began for trickler in tricklers)
        trickle_until(HEAD_TIMEOUT_SECONDS / 2)
        assert not any(trickler.closed for trickler in tricklers)  # still open half way, a byte at a time
        trickle_until(1.5 * HEAD_TIMEOUT_SECONDS)
        assert all(trickler.closed for trickler in tricklers)
        while time.monotonic() - began < 1.5 * HEAD_TIMEOUT_SECONDS and not all(map(closed_by_server, idle)):
            time.sleep(0.1)
        assert all(map(closed_by_server, idle))  # the silent ones are closed too

        # a kept-alive connection is timed only while a head comes in: idle since, it still serves
        assert status_over(kept_alive) == 200
    assert api_answers(server)


def test_a_body_answered_before_it_is_all_sent_is_read_to_its_end_not_taken_for_a_head(server):
    """A post over the size limit is answered 413 from its Content-Length alone; a client that
    sends the whole body before it reads (as most do) must still find that answer, on an open
    connection, not a reset for a request head too large."""
    size = DEFAULT_MAX_BODY_BYTES + 1
    with socket.create_connection(("127.0.0.1", server.port)) as connection:
        connection.settimeout(ANSWER_TIMEOUT)
        connection.sendall(b"POST /api/queues/jobs/items HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                           b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n" % (server.deployment.token.encode(), size))
        connection.sendall(b" " * size)
        assert status_of_answer(connection) == 413
        assert status_over(connection) == 200  # and the connection serves the next request


def test_connections_over_the_cap_are_answered_503_at_once_and_the_server_recovers(server):
    cap, over, slack = max_connections(HARD_LIMIT), 20, 10  # slack: connections the server may still be closing
    with ExitStack() as stack:
        connections = open_connections(server, cap + over)
        stack.callback(close_all, connections)
        within, refused = connections[: cap - slack], connections[cap:]

        assert [busy_answer(answer_of(connection))["error"] for connection in refused] == ["busy"] * over
        assert silent(within, 0.5)  # those within the cap are held open, waiting for their heads
    deadline = time.monotonic() + ANSWER_TIMEOUT
    while time.monotonic() < deadline:
        try:
            if api_answers(server):
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert api_answers(server)


@pytest.mark.parametrize("server", ["uvicorn"], indirect=True)  # Twisted bounds daphne's heads: 16 KiB
def test_a_request_head_over_the_limit_is_refused(server):
    (connection,) = open_connections(server, 1)
    with connection:
        connection.setblocking(True)
        try:
            connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (2 * MAX_HEAD_BYTES))
            answer = answer_of(connection)
        except ConnectionError:
            answer = None  # reset while still sending
    # answered 431, or reset before the answer was read, as the rest of the head was still coming
    assert answer is None or answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert api_answers(server)


def test_a_stop_that_ends_without_a_transition_says_so(monkeypatch, caplog):
    """finish_leftover_tasks waits TRANSITIONS_END_SECONDS for transitions the disk holds up."""

    async def still_running(timeout):
        return False

    monkeypatch.setattr(turn, "transitions_ended", still_running)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # as the servers run it
    try:
        limits.finish_leftover_tasks(loop)
    finally:
        asyncio.set_event_loop(None)
    assert "store transitions still wait for the disk" in caplog.text
