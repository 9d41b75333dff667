"""The worker's /work socket: connect, serve each socket until it closes, connect again with
backoff, until the run is finished."""

import asyncio
import logging
import random
from collections.abc import Callable

from websockets.exceptions import InvalidHandshake, InvalidStatus

from .config import auth_headers, work_socket_url
from .errors import ConnectionFailed, Unauthorized
from .link import Link
from .websocket import WebSocket

log = logging.getLogger("taskhoster.worker")

BACKOFF_FIRST, BACKOFF_MAX = 0.25, 30.0
AUTH_CLOSE_CODE = 4401
OPEN_SECONDS = 10  # to connect and shake hands


def backoff_delay(failures: int) -> float:
    """Exponential backoff with jitter: half the step fixed, half random, so workers that lost the
    same server do not all come back in the same instant."""
    step = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (failures - 1))
    return step / 2 + random.uniform(0, step / 2)


class Connection:
    """Keeps one socket open at a time and says when one opens and closes. A server that cannot
    be reached at the start, or that refuses the token, is an error rather than a retry."""

    def __init__(self, url: str, token: str, *, finished: asyncio.Event,
                 on_open: Callable[[Link], None], on_close: Callable[[], None]):
        self._url = work_socket_url(url)
        self._headers = auth_headers(token)
        self._finished = finished
        self._on_open = on_open
        self._on_close = on_close
        self._link: Link | None = None

    @property
    def link(self) -> Link | None:
        """The open socket; None while connecting again."""
        return self._link

    async def stay_connected(self) -> None:
        failures = 0
        connected_once = False
        while not self._finished.is_set():
            try:
                socket = await WebSocket.open(self._url, self._headers, timeout=OPEN_SECONDS)
            except (OSError, TimeoutError, InvalidHandshake) as exc:
                if isinstance(exc, InvalidStatus) and exc.response.status_code in (401, 403):
                    raise Unauthorized("unauthorized", "the server refused the token") from exc
                if not connected_once:
                    raise ConnectionFailed(f"cannot reach {self._url}: {exc or type(exc).__name__}") from exc
                failures += 1
                delay = backoff_delay(failures)
                log.warning("cannot reach %s (%s); trying again in %.1f s", self._url, exc or type(exc).__name__,
                            delay)
                await self._pause(delay)
                continue
            if connected_once:
                log.warning("connected again to %s", self._url)
            connected_once, link = True, Link(socket)
            try:
                await self._serve(link)
            finally:
                await socket.close()
            if socket.close_code == AUTH_CLOSE_CODE:  # the server's reason says which right is missing
                raise Unauthorized("unauthorized", socket.close_reason or "the server refused the token")
            if link.answered:  # the socket worked: a later loss starts the backoff afresh
                failures = 0
            if not self._finished.is_set():
                failures += 1
                delay = backoff_delay(failures)
                log.warning("connection lost; connecting again in %.1f s", delay)
                await self._pause(delay)

    async def _serve(self, link: Link) -> None:
        """Serve one socket until it closes or the run is finished."""
        self._link = link
        serving = asyncio.create_task(link.serve_until_closed())
        finished = asyncio.create_task(self._finished.wait())
        self._on_open(link)
        try:
            await asyncio.wait({serving, finished}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._link = None
            finished.cancel()
            self._on_close()
            await link.socket.close()
            await serving

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._finished.wait(), seconds)
        except TimeoutError:
            pass
