"""The whole server as one ASGI application.

- `/api/...` and `/healthz`: the HTTP API, a lean ASGI app of its own (no Django middleware on
  the hot path: each sync middleware costs a thread hop per request).
- websockets: `/work` for workers (Channels).
- everything else: Django (admin, dashboard, login, /metrics), with its static files served here
  so `serve` needs no web server in front, even with DEBUG off, and its request bodies limited
  before Django reads them (queues/serving/bodies.py).
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "taskhoster_site.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_application = get_asgi_application()  # sets Django up before the apps below import models

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import WebsocketDenier  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.urls import path, re_path  # noqa: E402

from queues.access import AccessLog  # noqa: E402
from queues.api import application as api_application  # noqa: E402
from queues.consumers import WorkConsumer  # noqa: E402
from queues.dashboard.consumers import LIVE_PATH, DashboardConsumer  # noqa: E402
from queues.serving.bodies import LimitedBodies  # noqa: E402
from queues.serving.stopping import AnswerWhenCut  # noqa: E402


class RefusedSocket(WebsocketDenier):
    channel_layer_alias = None  # refusing takes no channel: with Redis down it would be a 500


http_routes = [
    # (path prefix, ASGI app): first match wins; added by the API.
    ("/api/", api_application),
    ("/healthz", api_application),
]
websocket_urlpatterns = [
    # django.urls.path(...) entries: /work and the dashboard's live socket.
    path("work", WorkConsumer.as_asgi()),  # checks its own Origin rule: workers send none
    # staff only, by session login; a browser's socket must come from one of our own pages
    path(LIVE_PATH, AuthMiddlewareStack(DashboardConsumer.as_asgi())),
    re_path(r"", RefusedSocket.as_asgi()),  # any other path: refused (HTTP 403), never a 500
]


class PathDispatcher:
    """Sends an HTTP request to the first app whose prefix matches its path, else to Django."""

    def __init__(self, routes, default):
        self.routes = routes
        self.default = default

    async def __call__(self, scope, receive, send):
        path = scope["path"]
        for prefix, app in self.routes:
            if path.startswith(prefix):
                return await app(scope, receive, send)
        return await self.default(scope, receive, send)


# every request and socket session timed and logged once (queues/access.py), a request cut by a
# stop with the 503 it was answered
application = AccessLog(
    AnswerWhenCut(
        ProtocolTypeRouter(
            {
                "http": PathDispatcher(http_routes, LimitedBodies(ASGIStaticFilesHandler(django_application))),
                "websocket": URLRouter(websocket_urlpatterns),
            }
        )
    )
)
