"""Taskhoster's Python client: producers post items and read results over HTTP, workers claim
and finish items over the /work socket. It talks to the server over the network only."""

from .errors import (
    ApiError,
    ConnectionFailed,
    Forbidden,
    ItemFailed,
    ItemNotFound,
    ResultTimeout,
    TaskhosterError,
    Unauthorized,
    UnknownQueue,
)
from .jobs import Job, error_result
from .producer import AsyncProducer, Producer
from .worker import Worker

__all__ = [
    "ApiError",
    "AsyncProducer",
    "ConnectionFailed",
    "Forbidden",
    "ItemFailed",
    "ItemNotFound",
    "Job",
    "Producer",
    "ResultTimeout",
    "TaskhosterError",
    "Unauthorized",
    "UnknownQueue",
    "Worker",
    "error_result",
]
