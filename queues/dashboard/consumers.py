"""The dashboard's live socket: pushes the shared snapshot to a staff browser about once a second."""

import asyncio
import logging
import time
from importlib import import_module
from urllib.parse import urlsplit

from channels.auth import get_user
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.http.request import split_domain_port, validate_host
from django.utils.http import is_same_domain

from .feed import get_feed

LIVE_PATH = "dashboard/live"  # routed in taskhoster_site/asgi.py
CLOSE_NOT_LOGGED_IN = 4401
CLOSE_NOT_STAFF = 4403
# how often an open socket looks at its login again: a user logged out, deactivated or no longer
# staff stops getting the feed, as they would on their next page
RECHECK_SECONDS = 30.0

DEFAULT_PORTS = {"http": "80", "https": "443"}

log = logging.getLogger(__name__)


def from_own_page(scope) -> bool:
    """Whether the socket was opened by one of our own pages: the browser's Origin names the host
    and port it connected to, by the scheme it used (as Django's CSRF check counts them), a host
    of ALLOWED_HOSTS, or is one of CSRF_TRUSTED_ORIGINS. ALLOWED_HOSTS alone ignores the port, and
    another site on the same host shares our cookies."""
    headers = dict(scope["headers"])
    origin = headers.get(b"origin", b"").decode("latin-1").lower()
    host = headers.get(b"host", b"").decode("latin-1").lower()
    if _trusted(origin):
        return True
    domain, _ = split_domain_port(host)
    own = f"{'https' if scope.get('scheme') == 'wss' else 'http'}://{host}"
    return bool(domain) and validate_host(domain, _allowed_hosts()) and _with_port(origin) == _with_port(own)


def _allowed_hosts() -> list[str]:
    if settings.DEBUG and not settings.ALLOWED_HOSTS:  # as Django's own pages take them
        return [".localhost", "127.0.0.1", "[::1]"]
    return settings.ALLOWED_HOSTS


def _trusted(origin: str) -> bool:
    """One of CSRF_TRUSTED_ORIGINS, matched as Django's CSRF check does (`https://*.example.com`
    takes every subdomain)."""
    parsed = urlsplit(origin)
    for trusted in settings.CSRF_TRUSTED_ORIGINS:
        trusted = trusted.lower()
        if "*" not in trusted:
            if origin == trusted:
                return True
        elif (pattern := urlsplit(trusted)).scheme == parsed.scheme and is_same_domain(
                parsed.netloc, pattern.netloc.lstrip("*")):
            return True
    return False


def _with_port(origin: str) -> str:
    """`scheme://host:port`, the port written out when it is the scheme's default."""
    scheme, _, netloc = origin.partition("://")
    if netloc.endswith("]") or ":" not in netloc:  # "[::1]" or "example.com": no port given
        return f"{scheme}://{netloc}:{DEFAULT_PORTS.get(scheme, '')}"
    return origin


class DashboardConsumer(AsyncWebsocketConsumer):
    channel_layer_alias = None  # fed in-process (feed.py): a Redis outage must not refuse staff with a 500
    box: asyncio.Queue | None = None
    pump: asyncio.Task | None = None

    async def connect(self):
        if not from_own_page(self.scope):
            await self.close(code=CLOSE_NOT_STAFF)
            return
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_NOT_LOGGED_IN)
            return
        if not (user.is_active and user.is_staff):
            await self.close(code=CLOSE_NOT_STAFF)
            return
        await self.accept()
        self.box = get_feed().subscribe()
        self.pump = asyncio.create_task(self._forward(self.box))

    async def _forward(self, box: asyncio.Queue) -> None:
        checked = time.monotonic()
        while True:
            snapshot = await box.get()
            if time.monotonic() - checked >= RECHECK_SECONDS:
                try:
                    code = await self._login_lost()
                except Exception:  # the database is down: keep feeding, look again next time
                    log.warning("cannot look at a live dashboard's login again", exc_info=True)
                else:
                    if code:
                        await self.close(code=code)
                        return
                    checked = time.monotonic()
            await self.send(text_data=snapshot)

    async def _login_lost(self) -> int | None:
        """The close code if the session, read afresh, no longer holds an active staff user."""
        session = import_module(settings.SESSION_ENGINE).SessionStore(self.scope["session"].session_key)
        user = await get_user({"session": session})
        if not user.is_authenticated:
            return CLOSE_NOT_LOGGED_IN
        return None if user.is_active and user.is_staff else CLOSE_NOT_STAFF

    async def disconnect(self, code):
        if self.pump is not None:
            self.pump.cancel()
            get_feed().unsubscribe(self.box)
