"""The task runner's calls in its threads: a StopIteration raised there (which run_in_executor
alone would never hand back) comes back to the worker as a RuntimeError caused by it."""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from django_tasks import task  # the test extra installs it

from taskhoster.django.framework import task_finished
from taskhoster.django.runner import TaskRunner
from taskhoster.jobs import HandlerFailed, Job

MAX_ATTEMPTS = 2


@task
def answer():
    return 42


def job(attempts: int) -> Job:
    return Job(id="x", queue="default", attempts=attempts, payload=None, claimed_at="2026-11-30T14:24:00.000Z",
               lease_expires_at="", lease_seconds=60)


@pytest.fixture
def runner():
    backend = SimpleNamespace(alias="default", settings=SimpleNamespace(max_attempts=MAX_ATTEMPTS))
    threads = ThreadPoolExecutor(1)
    yield TaskRunner(backend, worker_id="here", threads=threads)
    threads.shutdown()


@pytest.fixture
def payload_of_a_module_that_stops(tmp_path, monkeypatch) -> dict:
    (tmp_path / "stops_on_import.py").write_text("raise StopIteration('an iterator ran dry at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return {"task": "stops_on_import.work", "args": [], "kwargs": {}}


async def test_a_last_try_whose_task_import_raises_stopiteration_ends_with_that_error(
    runner, payload_of_a_module_that_stops
):
    result = await asyncio.wait_for(runner(payload_of_a_module_that_stops, job(attempts=MAX_ATTEMPTS)), 10)
    error = result["error"]
    assert error["type"] == "RuntimeError" and "StopIteration" in error["message"]
    assert "an iterator ran dry at import" in error["traceback"]
    assert error["workerIds"] == ["unknown", "here"]


async def test_an_earlier_try_whose_task_import_raises_stopiteration_is_given_back_with_that_error(
    runner, payload_of_a_module_that_stops
):
    with pytest.raises(HandlerFailed) as failed:
        await asyncio.wait_for(runner(payload_of_a_module_that_stops, job(attempts=1)), 10)
    assert failed.value.details["type"] == "RuntimeError"
    assert "an iterator ran dry at import" in failed.value.details["traceback"]


async def test_a_task_finished_receiver_that_raises_stopiteration_fails_the_handler_rather_than_hang(runner):
    def receiver(**kwargs):
        raise StopIteration("a receiver's iterator ran dry")

    task_finished.connect(receiver)
    try:
        with pytest.raises(RuntimeError, match="StopIteration") as raised:
            await asyncio.wait_for(runner({"task": answer.module_path, "args": [], "kwargs": {}}, job(attempts=1)), 10)
    finally:
        task_finished.disconnect(receiver)
    assert isinstance(raised.value.__cause__, StopIteration)
