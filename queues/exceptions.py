"""Every error the store and the services raise, each mapped once to an HTTP status and a code.

Views and the socket consumer turn these into `{"error": code, "message": ...}` answers; nothing
else decides a status code for a domain error.
"""

from django.core.exceptions import SuspiciousOperation


class TaskhosterError(Exception):
    """Base of every error a client may be told about."""

    code = "invalid_request"
    status = 400

    def __init__(self, message: str = ""):
        super().__init__(message or self.__doc__)

    @property
    def message(self) -> str:
        return str(self)


class InvalidRequest(TaskhosterError):
    """The request is well-formed but its content breaks a rule."""


class InvalidJson(TaskhosterError):
    """The body or frame is not valid JSON."""

    code = "invalid_json"


class Unauthorized(TaskhosterError):
    """No valid API token was given."""

    code = "unauthorized"
    status = 401


class Forbidden(TaskhosterError):
    """The token lacks the right or the queue for this call."""

    code = "forbidden"
    status = 403


class UnknownQueue(TaskhosterError):
    """No queue has this name."""

    code = "unknown_queue"
    status = 404


class ItemNotFound(TaskhosterError):
    """No item has this id in this queue."""

    code = "not_found"
    status = 404


class MethodNotAllowed(TaskhosterError):
    """This path does not take this method."""

    code = "method_not_allowed"
    status = 405


class NotHeld(TaskhosterError):
    """The item is not processing (or not held by this claim)."""

    code = "not_held"
    status = 409


class NotEnded(TaskhosterError):
    """The item has not ended (it is scheduled, pending or processing)."""

    code = "not_ended"
    status = 409


class KeyConflict(TaskhosterError):
    """An item posted with this idempotency key has another payload."""

    code = "key_conflict"
    status = 409


class PayloadTooLarge(TaskhosterError):
    """A body, payload or result is over its size limit."""

    code = "payload_too_large"
    status = 413


class StorageUnavailable(TaskhosterError):
    """The data directory cannot be written (disk full or read-only)."""

    code = "storage_unavailable"
    status = 503


class UnsafePath(SuspiciousOperation):
    """A queue name, state or item id that must never reach the file system."""


class Busy(TaskhosterError):
    """The server is shedding load; try again after `retry_after` seconds."""

    code = "busy"
    status = 503

    def __init__(self, message: str = "", *, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class InternalError(TaskhosterError):
    """An unexpected fault of the server; its traceback is in the server's log."""

    code = "internal_error"
    status = 500


def client_error(error: Exception) -> TaskhosterError:
    """What a client is told of an error a call raised: a domain error as it is; a failure of the
    disk or the database as `storage_unavailable`; anything else as `internal_error` (which the
    caller logs with its traceback)."""
    from django.db import DatabaseError

    if isinstance(error, TaskhosterError):
        return error
    if isinstance(error, DatabaseError):
        return StorageUnavailable("the database does not answer; try again")
    if isinstance(error, OSError):
        return StorageUnavailable(f"the data directory cannot be used: {error.strerror or error}")
    return InternalError("the server failed on this request; see its log")

