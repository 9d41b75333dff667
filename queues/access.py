"""The access log and the request-duration histogram: one ASGI layer around the whole server
that writes one line per HTTP request (method, path, status, duration, client) and one per
socket session (path, how it ended, duration, frames each way) to the `taskhoster.access`
logger, at INFO. Query strings are never logged: a worker's token may be in one."""

import logging
import time

from .api.app import ROUTE_KEY
from .metrics.families import HTTP_IN_FLIGHT, HTTP_REQUESTS

log = logging.getLogger("taskhoster.access")

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# every other path is Django's, under one of these prefixes, or the dashboard's
SITE_ROUTES = (("/admin/", "admin"), ("/static/", "static"), ("/metrics", "/metrics"))


def route_of(scope) -> str:
    """A label that names the call, not the path: an API call's pattern (left in the scope by the
    API), else a part of the site, so item ids and queue names never multiply the series."""
    path = scope["path"]
    if path.startswith("/api/") or path == "/healthz":
        return scope.get(ROUTE_KEY, "unmatched")
    for prefix, route in SITE_ROUTES:
        if path.startswith(prefix):
            return route
    return "dashboard"


_timers: dict[tuple[str, str, str], object] = {}  # labels -> the histogram's child: labels() costs more


def _observe(method: str, route: str, status: str, seconds: float) -> None:
    timer = _timers.get((method, route, status))
    if timer is None:
        timer = _timers[(method, route, status)] = HTTP_REQUESTS.labels(method, route, status)
    timer.observe(seconds)


def _write(message: str, args: tuple, fields: dict) -> None:
    """One access line at INFO, its `fields` for the JSON log. Made here rather than by
    log.info(), which looks up the calling line in the stack for a record that never shows it."""
    log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, message, args, None, extra={"fields": fields}))


def _client(scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


class AccessLog:
    # HTTP requests being answered now, in this process: counted on the event loop (no lock, as
    # a Gauge's inc() takes) and read by the gauge when /metrics is scraped
    requests_in_flight = 0

    def __init__(self, application):
        self.application = application

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        else:
            await self.application(scope, receive, send)

    async def _http(self, scope, receive, send):
        started = time.perf_counter()
        status = 0

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        AccessLog.requests_in_flight += 1
        try:
            await self.application(scope, receive, sending)
        finally:
            AccessLog.requests_in_flight -= 1
            took = time.perf_counter() - started
            method = scope["method"] if scope["method"] in METHODS else "other"
            outcome = str(status) if status else "no answer"  # the client went away first
            _observe(method, route_of(scope), outcome, took)
            if log.isEnabledFor(logging.INFO):
                client = _client(scope)
                _write(
                    "%s %s %s %.1f ms from %s", (method, scope["path"], outcome, took * 1000, client),
                    {"kind": "http", "method": method, "path": scope["path"], "status": status or None,
                     "durationMs": round(took * 1000, 3), "client": client},
                )

    async def _websocket(self, scope, receive, send):
        started = time.perf_counter()
        session = {"accepted": False, "closedBy": None, "code": None, "framesIn": 0, "framesOut": 0}

        async def receiving():
            message = await receive()
            if message["type"] == "websocket.receive":
                session["framesIn"] += 1
            elif message["type"] == "websocket.disconnect" and session["closedBy"] is None:
                session["closedBy"], session["code"] = "client", message.get("code", 1005)
            return message

        async def sending(message):
            if message["type"] == "websocket.send":
                session["framesOut"] += 1
            elif message["type"] == "websocket.accept":
                session["accepted"] = True
            elif message["type"] == "websocket.close" and session["closedBy"] is None:
                session["closedBy"], session["code"] = "server", message.get("code", 1000)
            await send(message)

        try:
            await self.application(scope, receiving, sending)
        finally:
            self._log_session(scope, session, time.perf_counter() - started)

    @staticmethod
    def _log_session(scope, session: dict, took: float) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        if not session["accepted"]:
            outcome = "refused"
        elif session["closedBy"] is None:
            outcome = "ended"  # the server stopped the session's task
        else:
            outcome = f"closed by the {session['closedBy']} ({session['code']})"
        client = _client(scope)
        _write(
            "WS %s %s after %.3f s, %d frames in, %d out, from %s",
            (scope["path"], outcome, took, session["framesIn"], session["framesOut"], client),
            {"kind": "websocket", "path": scope["path"], "outcome": outcome, "durationMs": round(took * 1000, 3),
             **session, "client": client},
        )


HTTP_IN_FLIGHT.set_function(lambda: AccessLog.requests_in_flight)
