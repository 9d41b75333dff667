"""Shared by the API tests: queues, tokens, a client for the whole ASGI application, and a
snapshot of the data directory to prove that a refused call changed nothing."""

import asyncio
from pathlib import Path

import httpx
import pytest

from queues.models import ApiToken
from queues.runtime import get_registry, get_store
from queues.services import save_queue
from taskhoster_site.asgi import application


def make_token(name: str = "token", *, produce: bool = True, work: bool = True, queues=()) -> str:
    token = ApiToken(name=name, can_produce=produce, can_work=work, queues=list(queues))
    raw = token.set_new_value()
    token.full_clean()
    token.save()
    get_registry().invalidate()
    return raw


def bearer(raw: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {raw}"}


def disk_snapshot() -> list[str]:
    """Every file and directory under the data directory, with its place; but the queue's lock
    file, which the store makes on a queue's first item lookup and which holds no data."""
    root = Path(get_store().data_dir)
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.parent.name != "locks")


@pytest.fixture
def queues(transactional_db) -> None:
    """Two queues: `jobs`, and `other` for the scoped token's tests."""
    save_queue("jobs")
    save_queue("other")
    get_registry().invalidate()


@pytest.fixture
def tokens(transactional_db) -> dict[str, str]:
    return {
        "all": make_token("all"),
        "producer": make_token("producer", work=False),
        "worker": make_token("worker", produce=False),
        "other_only": make_token("other only", queues=["other"]),
    }


@pytest.fixture
async def api():
    transport = httpx.ASGITransport(app=application)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        yield client


class FedRequest:
    """An HTTP request to the ASGI application `app`, its body handed over by the test a message
    at a time (`parts`): `reads` counts how often the application asked for more, `messages` holds
    what it sent back, `task` runs it."""

    def __init__(self, app, scope: dict):
        self.reads = 0
        self.parts: asyncio.Queue = asyncio.Queue()
        self.messages: list[dict] = []
        self.task = asyncio.ensure_future(app(scope, self._receive, self._send))

    async def _receive(self) -> dict:
        self.reads += 1
        return await self.parts.get()

    async def _send(self, message: dict) -> None:
        self.messages.append(message)
