"""Who is calling, and whether they may use this queue: the token comes from the cached registry,
so no request makes a database call.

Order of checks, the same for every call: no or unknown token -> 401; a token without the call's
right (a metrics-only token has none), or whose queue list leaves this queue out -> 403 (whether or not the queue exists, so a
scoped token learns nothing about other queues); a queue the token may use that does not exist,
or whose name breaks the rule -> 404 unknown_queue.
"""

from ..exceptions import Forbidden, Unauthorized, UnknownQueue
from ..protocol import bearer_token
from ..registry import TokenGrant
from ..runtime import get_registry
from ..store import QueueConfig
from .requests import Request

PRODUCE, WORK = "produce", "work"


async def authenticate(request: Request) -> TokenGrant:
    grant = await get_registry().afind_token(bearer_token(request.header(b"authorization")))
    if grant is None:
        raise Unauthorized("give a valid API token as 'Authorization: Bearer <token>'")
    if not grant.uses_queues:
        raise Forbidden("this token may only read /metrics")
    return grant


async def authorize(request: Request, queue: str, *rights: str) -> QueueConfig:
    """The queue's settings, if the caller's token has one of `rights` on it."""
    grant = await authenticate(request)
    if not any(grant.may(right, queue) for right in rights):
        raise Forbidden(f"this token may not {' or '.join(rights)} on this queue")
    config = await get_registry().afind_queue(queue)
    if config is None:
        raise UnknownQueue(f"no queue named {queue[:80]!r}")
    return config
