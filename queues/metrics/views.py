"""GET /metrics: the Prometheus text format, for a token with the metrics right or a staff
session; anyone else gets 401 (no or unknown token, not logged in) or 403 (a token without the
right, a user who is not staff), as JSON like the API's errors; 503 `storage_unavailable` when
the database cannot say who a session is."""

from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from ..exceptions import StorageUnavailable, client_error
from ..protocol import bearer_token
from ..runtime import get_registry
from .families import REGISTRY
from .gauges import queue_figures

REFUSED = {401: "unauthorized", 403: "forbidden", StorageUnavailable.status: StorageUnavailable.code}


async def _refusal(request: HttpRequest) -> tuple[int, str] | None:
    """Why this caller may not read the metrics (status, message); None if it may."""
    token = bearer_token(request.headers.get("Authorization"))
    if token is not None:
        grant = await get_registry().afind_token(token)
        if grant is None:
            return 401, "the API token is not valid"
        return None if grant.can_read_metrics else (403, "this token has no right to read metrics")
    try:
        user = await request.auser()  # the session, from the database
    except DatabaseError as error:
        unavailable = client_error(error)
        return unavailable.status, unavailable.message
    if not user.is_authenticated:
        return 401, "give an API token with the metrics right as 'Authorization: Bearer <token>', or log in as staff"
    return None if user.is_active and user.is_staff else (403, "only staff may read metrics")


@require_GET
async def metrics(request: HttpRequest) -> HttpResponse:
    refusal = await _refusal(request)
    if refusal is not None:
        status, message = refusal
        answer = JsonResponse({"error": REFUSED[status], "message": message}, status=status)
        if status == 401:
            answer["WWW-Authenticate"] = "Bearer"
        return answer
    registry = get_registry()
    await registry.arefresh()
    await queue_figures.refresh([config.name for config in registry.queues()])
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_PLAIN_0_0_4)
