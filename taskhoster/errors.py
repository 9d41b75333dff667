"""What the client raises. Every error carries one line that says what went wrong."""


class TaskhosterError(Exception):
    """Base of every error the server or the network causes (arguments a call cannot take raise
    ValueError or TypeError, as Python's own do)."""


class ConnectionFailed(TaskhosterError):
    """The server could not be reached (refused, timed out, name not resolved, TLS refused), or the
    connection failed before its answer came; the message says whether a POST may have been
    carried out, and so does `maybe_done` (it is sent again only by a Producer with
    `post_retries`, under an idempotency key: then `keys` holds the post's keys, to post again
    with and learn what became of it)."""

    def __init__(self, message: str, *, maybe_done: bool = False, keys: list[str] | None = None):
        super().__init__(message)
        self.maybe_done = maybe_done
        self.keys = keys


class ApiError(TaskhosterError):
    """The server answered with an error: `code` is the API's error code (e.g. `unknown_queue`; the
    list is in docs/api.md), `status` the HTTP status (None for an error frame on the socket),
    `retry_after` the seconds it asked the client to wait before trying again, if it did."""

    retry_after: float | None = None

    def __init__(self, code: str, message: str, status: int | None = None):
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message
        self.status = status


class Unauthorized(ApiError):
    """The token is missing or not valid."""


class Forbidden(ApiError):
    """The token lacks the right (produce or work) or the queue."""


class UnknownQueue(ApiError):
    """No queue has this name."""


class ItemNotFound(ApiError):
    """No item has this id in this queue (never posted, or deleted by retention)."""


_BY_CODE = {
    "unauthorized": Unauthorized,
    "forbidden": Forbidden,
    "unknown_queue": UnknownQueue,
    "not_found": ItemNotFound,
}


# codes that say nothing of the request itself: the server could not do it just now (its disk is
# full, it sheds load), and the same request may well succeed a moment later. An unexpected fault
# (internal_error) may come of the request itself: a result is not sent again and again for it
PASSING_CODES = frozenset({"storage_unavailable", "busy"})


def api_error(code: str, message: str, status: int | None = None) -> ApiError:
    """The most specific ApiError for a server error code."""
    return _BY_CODE.get(code, ApiError)(code, message, status)


class ItemFailed(TaskhosterError):
    """The item ended `failed` (the server declared it, e.g. `error: "timeout"`), so it has no
    result. `item` is the item as the server showed it."""

    def __init__(self, item: dict):
        super().__init__(f"item {item.get('id')} failed: {item.get('error', 'no reason given')}")
        self.item = item
        self.error = item.get("error")


class ResultTimeout(TaskhosterError, TimeoutError):
    """The wait for a result ran out while the item was still pending or processing.
    `item` is the item as last seen."""

    def __init__(self, item: dict, timeout: float):
        super().__init__(f"item {item.get('id')} is still {item.get('status')} after {timeout:g} s")
        self.item = item
