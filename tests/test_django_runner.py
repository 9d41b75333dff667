"""The task runner: a StopIteration raised in its threads (which run_in_executor alone would
never hand back) comes back to the worker as a RuntimeError caused by it; a task_finished
receiver that raises is logged and leaves the run's outcome as it was, and the receivers of a
failed run find its error in sys.exc_info(), a coroutine's too; a task_started receiver that
raises fails the try before the task runs."""

import asyncio
import sys
import threading
import traceback
from types import SimpleNamespace

import pytest
from django_tasks import task  # the test extra installs it

from taskhoster.django.framework import task_finished, task_started
from taskhoster.django.runner import TaskRunner
from taskhoster.jobs import HandlerFailed, Job

# the runner closes the database connections grown old around each task, as Django does around a
# request; for a coroutine task it does so in sync_to_async's shared thread, where an earlier test
# may have left a connection open
pytestmark = pytest.mark.django_db

MAX_ATTEMPTS = 2


@task
def answer():
    return 42


@task
async def answer_async():
    return 42


@task
def fails():
    raise KeyError("the task's own error")


@task
async def fails_async():
    raise KeyError("the coroutine's own error")


def job(attempts: int) -> Job:
    return Job(id="x", queue="default", attempts=attempts, payload=None, claimed_at="2026-11-30T14:24:00.000Z",
               lease_expires_at="", lease_seconds=60)


@pytest.fixture
def runner():
    backend = SimpleNamespace(alias="default", settings=SimpleNamespace(max_attempts=MAX_ATTEMPTS))
    runner = TaskRunner(backend, worker_id="here")
    yield runner
    runner.close()


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


@pytest.fixture(params=[ValueError, StopIteration])
def raising_receiver(request):
    def receiver(**kwargs):
        raise request.param("a receiver broke")

    task_finished.connect(receiver)
    yield request.param
    task_finished.disconnect(receiver)


def payload(of_task) -> dict:
    return {"task": of_task.module_path, "args": [], "kwargs": {}}


@pytest.mark.parametrize("returning_task", [answer, answer_async])
async def test_a_task_finished_receiver_that_raises_leaves_the_returned_value_as_the_result(
    runner, raising_receiver, caplog, returning_task
):
    # an earlier try: had the receiver's error failed the handler, the Worker would run it again
    result = await asyncio.wait_for(runner(payload(returning_task), job(attempts=1)), 10)
    assert result["returnValue"] == 42 and result["workerIds"] == ["here"]
    logged = [record for record in caplog.records if record.name == "django.dispatch"]
    assert [type(record.exc_info[1]) for record in logged] == [raising_receiver]


@pytest.mark.parametrize("failing_task", [fails, fails_async])
async def test_a_task_finished_receiver_that_raises_leaves_a_failed_run_to_be_retried_with_its_own_error(
    runner, raising_receiver, failing_task
):
    with pytest.raises(HandlerFailed) as failed:
        await asyncio.wait_for(runner(payload(failing_task), job(attempts=1)), 10)
    assert failed.value.details["type"] == "KeyError"
    assert "own error" in failed.value.details["message"]


async def test_a_task_finished_receiver_that_raises_leaves_a_last_failed_run_failed_with_its_own_error(
    runner, raising_receiver
):
    result = await asyncio.wait_for(runner(payload(fails), job(attempts=MAX_ATTEMPTS)), 10)
    assert result["error"]["type"] == "KeyError"


@task
def not_a_number():
    return {"score": float("nan")}


async def test_a_task_that_returns_nan_fails_for_good_on_an_earlier_try_too(runner):
    """Not JSON, as a set is not: another run would return the same, so it is not retried."""
    result = await asyncio.wait_for(runner(payload(not_a_number), job(attempts=1)), 10)
    assert result["error"]["type"] == "ValueError"


@pytest.fixture
def failing_start():
    def receiver(**kwargs):
        raise ValueError("a task_started receiver broke")

    task_started.connect(receiver)
    yield
    task_started.disconnect(receiver)


async def test_a_task_started_receiver_that_raises_fails_an_earlier_try_to_be_retried(runner, failing_start):
    with pytest.raises(HandlerFailed) as failed:
        await asyncio.wait_for(runner(payload(answer), job(attempts=1)), 10)
    assert failed.value.details["type"] == "ValueError"
    assert "a task_started receiver broke" in failed.value.details["message"]


async def test_a_task_started_receiver_that_raises_fails_a_last_try_for_good(runner, failing_start):
    result = await asyncio.wait_for(runner(payload(answer), job(attempts=MAX_ATTEMPTS)), 10)
    assert result["error"]["type"] == "ValueError" and "returnValue" not in result


@pytest.mark.parametrize("failing_task", [fails, fails_async])
async def test_the_task_finished_receivers_of_a_failed_run_find_its_error_being_handled(runner, failing_task):
    seen = []

    def receiver(**kwargs):
        seen.append(sys.exc_info())

    task_finished.connect(receiver)
    try:
        with pytest.raises(HandlerFailed) as failed:
            await asyncio.wait_for(runner(payload(failing_task), job(attempts=1)), 10)
    finally:
        task_finished.disconnect(receiver)
    [(kind, error, trace)] = seen
    assert kind is KeyError and "own error" in str(error)
    frames = [frame.name for frame in traceback.extract_tb(trace)]
    assert frames[-1] == failing_task.func.__name__ and "_failed_on_the_loop" not in frames
    assert "_failed_on_the_loop" not in failed.value.details["traceback"]  # the error as the task raised it


claimed_again = {"running": threading.Event(), "go_on": threading.Event()}


@task
def fails_after_its_item_is_claimed_again():
    claimed_again["running"].set()
    claimed_again["go_on"].wait(10)
    raise KeyError("failed on what became the last try")


async def test_a_task_whose_item_is_claimed_again_while_it_runs_counts_that_claim_when_it_fails(runner):
    """The worker's socket dropped mid-task and its next claim brought the item back, now on the
    backend's last try: the failure ends the task, not a give-back for a run more than allowed."""
    for event in claimed_again.values():
        event.clear()
    first = job(attempts=MAX_ATTEMPTS - 1)
    run = asyncio.ensure_future(runner(payload(fails_after_its_item_is_claimed_again), first))
    assert await asyncio.to_thread(claimed_again["running"].wait, 10)
    object.__setattr__(first, "attempts", MAX_ATTEMPTS)  # as the worker shows a new claim (taskhoster/leases.py)
    claimed_again["go_on"].set()
    result = await asyncio.wait_for(run, 10)
    assert result["error"]["type"] == "KeyError"
