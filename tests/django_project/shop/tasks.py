"""The tasks the tests run: written against whichever framework this Django has."""

import asyncio
import os
import time

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
