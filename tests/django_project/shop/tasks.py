"""The tasks the tests run: written against whichever framework this Django has."""

import asyncio
import os
import time

from django.db import connection

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task


@task
def add(a, b):
    return a + b


@task
async def greet(name, punctuation="!"):
    await asyncio.sleep(0)
    return {"greeting": f"hello {name}{punctuation}"}


@task(takes_context=True)
def whoami(context):
    return {"id": context.task_result.id, "attempt": context.attempt,
            "worker_ids": context.task_result.worker_ids}


@task
def always_fails(reason):
    raise ValueError(f"refused: {reason}")


@task(takes_context=True)
async def fails_once(context):
    if context.attempt == 1:
        raise RuntimeError("the first try fails")
    return context.attempt


@task
def wait_for(path):
    """Runs until `path` exists (a test creates it), so that the test sees the task RUNNING."""
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.path.exists(path)


@task
def returns_no_json():
    return object()


@task
def finds_the_database_connection_closed():
    """Whether the connection was closed when this run began (CONN_MAX_AGE is 0: a connection
    lasts one task), and then uses it."""
    was_closed = connection.connection is None
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return was_closed
