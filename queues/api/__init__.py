"""The producer and HTTP worker API, served at `/api/...` and `/healthz`."""

from .app import application

__all__ = ["application"]
