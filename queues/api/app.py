"""The API as a raw ASGI application: no Django request cycle on the hot path (each sync
middleware would cost a thread hop per request). It routes, runs the handler, and turns every
error into a JSON answer."""

import logging

from django.conf import settings

from ..exceptions import ItemNotFound, MethodNotAllowed, TaskhosterError, Unauthorized, client_error
from .answers import Answer, answer_for
from .handlers import router
from .requests import ClientGone, Request
from .router import Router

log = logging.getLogger(__name__)

ASK_FOR_TOKEN = ((b"www-authenticate", b"Bearer"),)
ROUTE_KEY = "taskhoster.route"  # the scope key where the call's pattern is left


class ApiApplication:
    def __init__(self, router: Router):
        self.router = router

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            raise ValueError(f"the API serves HTTP only, not {scope['type']!r}")
        request = Request(scope, receive, max_body_bytes=settings.TASKHOSTER_MAX_BODY_BYTES)
        try:
            answer = await self._answer(request)
        except ClientGone:
            return
        finally:
            request.close()
        await answer.send(send)

    async def _answer(self, request: Request) -> Answer:
        try:
            found = self.router.resolve(request.method, request.segments)
            if found.route is None and found.allowed:
                allow = ", ".join(found.allowed).encode()
                return answer_for(MethodNotAllowed(f"{request.method} is not allowed here"), ((b"allow", allow),))
            if found.route is None:
                raise ItemNotFound("no API call has this path")
            request.scope[ROUTE_KEY] = found.route.pattern  # for the access log and its metric
            return await found.route.handler(request, **found.params)
        except ClientGone:
            raise
        except Unauthorized as exc:
            return answer_for(exc, ASK_FOR_TOKEN)
        except TaskhosterError as exc:
            return answer_for(exc)
        except Exception as exc:  # the disk, the database, or a fault of ours
            log.exception("%s %s failed", request.method, request.path)
            return answer_for(client_error(exc))


application = ApiApplication(router)
