"""Real `manage.py serve` processes for end-to-end tests: the installations of
queues/bench/servers.py, plus a PostgreSQL database and a Redis database of a test's own.
"""

import secrets
from collections.abc import Iterator
from contextlib import contextmanager

from queues.bench.servers import MANAGE, PROJECT_DIR, Deployment, ServerProcess

__all__ = ["MANAGE", "PROJECT_DIR", "Deployment", "ServerProcess", "postgres_database", "redis_database"]

POSTGRES_SERVER = "postgresql://postgres@127.0.0.1:5432"
REDIS_SERVER = "redis://127.0.0.1:6379"


@contextmanager
def postgres_database() -> Iterator[str]:
    """A new, empty PostgreSQL database for the duration; its URL. Dropped afterwards."""
    import psycopg

    name = f"taskhoster_e2e_{secrets.token_hex(6)}"
    with psycopg.connect(f"{POSTGRES_SERVER}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{POSTGRES_SERVER}/{name}"
    finally:
        with psycopg.connect(f"{POSTGRES_SERVER}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def redis_database(number: int) -> str:
    """The URL of Redis database `number`, flushed first. (Pub/sub, which the channel layer uses,
    is shared by every database number: other users of this Redis can only cause spare wake-ups.)"""
    import redis

    url = f"{REDIS_SERVER}/{number}"
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    return url
