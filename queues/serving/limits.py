"""What a served process allows and how it stops, whichever server serves it: pings of idle
worker sockets, keep-alive, the stop's grace, and the limits on what a client can take (a
connection over the cap is answered 503 at once, a request head must be complete within
HEAD_TIMEOUT_SECONDS and MAX_HEAD_BYTES, and the descriptor limit is raised to the hard limit
at start)."""

import asyncio
import logging
import resource

from django.conf import settings

from ..runtime import TRANSITIONS_END_SECONDS
from ..store import turn

log = logging.getLogger(__name__)

PING_INTERVAL = 10
PING_TIMEOUT = 20
SWEEP_STOP_SECONDS = 10
# Above the usual clients' own idle limit (httpx: 5 s), so the server is not the side that closes
# an idle keep-alive connection just as the client sends a request on it.
KEEP_ALIVE_SECONDS = 75
# Connections the kernel holds for daphne until it accepts them, as uvicorn's default: Twisted's
# 50 overflows under a burst of connections, and each one dropped waits a second to try again.
LISTEN_BACKLOG = 2048

# A request head (request line and headers) must be complete this long after its connection
# opened, or after its first byte on a kept-alive connection, however slowly it trickles in:
# otherwise a client sending a byte now and then holds a connection, and a descriptor, for ever.
HEAD_TIMEOUT_SECONDS = 10
# The most bytes a request head may take before it is answered 431: httptools sets no limit of
# its own (Twisted, under daphne, stops at 16 KiB).
MAX_HEAD_BYTES = 64 * 1024
# Descriptors kept for what is not a connection: the database's (one connection per thread that
# uses it), the sweep's, the queues' lock and tally files, the log.
RESERVED_DESCRIPTORS = 512
# A connection holds its socket, and, while a single post it sent is being flushed, that item's
# file too; so connections get half of the descriptors left beside the reserve.
DESCRIPTORS_PER_CONNECTION = 2
# Served however low the descriptor limit (the reserve shrinks instead).
MIN_CONNECTIONS = 64
# What a client refused for want of room is told to wait before it tries again.
BUSY_RETRY_SECONDS = 1

_BUSY_BODY = b'{"error":"busy","message":"the server has too many connections open; try again"}'
TOO_MANY_CONNECTIONS = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
    b"retry-after: %d\r\nconnection: close\r\n\r\n%s" % (len(_BUSY_BODY), BUSY_RETRY_SECONDS, _BUSY_BODY)
)
_HEAD_BODY = b"Request head too large"
HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_HEAD_BODY), _HEAD_BODY)
)

def raise_descriptor_limit() -> int:
    """Raise this process's soft limit on open descriptors to its hard limit (the soft one is
    often 1024, far below what the connections may need); the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # a hard limit the system will not grant as a soft one (macOS)
        return soft
    return hard


def max_connections(descriptor_limit: int) -> int:
    """How many connections may be open at once under `descriptor_limit`."""
    return max(MIN_CONNECTIONS, (descriptor_limit - RESERVED_DESCRIPTORS) // DESCRIPTORS_PER_CONNECTION)


def stop_grace_seconds() -> float:
    """On a stop, requests in flight (a long-polling read included) get this long to finish
    before they are cancelled; worker sockets are closed at once, which re-queues what they hold."""
    return settings.TASKHOSTER_STOP_GRACE_SECONDS


FRAME_SLACK_BYTES = 4 << 20


def max_frame_bytes() -> int:
    # a frame over the limit still gets a payload_too_large answer on an open socket, however
    # small the limit was set; only one far over it (twice the limit, and FRAME_SLACK_BYTES over
    # it at least) is not buffered: the socket is closed (1009)
    limit = settings.TASKHOSTER_MAX_BODY_BYTES
    return limit + max(limit, FRAME_SLACK_BYTES)


def finish_leftover_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what a stopped server left suspended on its loop (a worker socket's pending
    receive, a socket's re-queue still on the store's thread) and let it unwind, as asyncio.run
    does: collected at exit instead, such a coroutine crashed the interpreter under daphne
    (SIGSEGV, exit status -11)."""
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    # a store transition runs on even when its caller was cancelled: it must not be left asleep
    # holding item locks that the store's threads would wait on for good
    if not loop.run_until_complete(turn.transitions_ended(TRANSITIONS_END_SECONDS)):
        log.warning("store transitions still wait for the disk %d s after the stop; the process ends without them "
                    "(what they did not finish, the sweep mends)", TRANSITIONS_END_SECONDS)
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
