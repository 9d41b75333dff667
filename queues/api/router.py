"""A tiny router: an HTTP method and a path pattern such as `/api/queues/{queue}` lead to one
async handler, with the `{name}` segments passed to it as keyword arguments."""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

Handler = Callable[..., Awaitable]


@dataclass(frozen=True)
class Route:
    method: str
    pattern: str
    handler: Handler
    _segments: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_segments", tuple(self.pattern.split("/")))

    def match(self, segments: list[str]) -> dict[str, str] | None:
        """The path's parameters if `segments` fit the pattern, else None."""
        if len(segments) != len(self._segments):
            return None
        params = {}
        for expected, actual in zip(self._segments, segments):
            if expected.startswith("{"):
                if not actual:
                    return None
                params[expected[1:-1]] = actual
            elif expected != actual:
                return None
        return params


@dataclass(frozen=True)
class Resolution:
    """The route a request goes to, or the methods its path takes when the method is wrong
    (none at all: no such path)."""

    route: Route | None
    params: dict[str, str]
    allowed: tuple[str, ...] = ()


class Router:
    def __init__(self):
        self.routes: list[Route] = []

    def add(self, method: str, pattern: str) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            self.routes.append(Route(method, pattern, handler))
            return handler

        return register

    def resolve(self, method: str, segments: list[str]) -> Resolution:
        """Where a request for the path `segments` (as Request.segments) goes."""
        allowed = []
        for route in self.routes:
            params = route.match(segments)
            if params is None:
                continue
            if route.method == method:
                return Resolution(route, params)
            allowed.append(route.method)
        return Resolution(None, {}, tuple(allowed))
