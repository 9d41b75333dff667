"""TaskhosterBackend against a live server, through the tasks of this project and its worker
(`manage.py taskhoster_worker`). tests/test_django_tasks.py runs these with a server of its own,
under the django-tasks package and under Django 6's django.tasks."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import django
import pytest

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")
django.setup()

from django.utils import timezone  # noqa: E402
from shop import tasks  # noqa: E402

from taskhoster import Producer, UnknownQueue  # noqa: E402
from taskhoster.django import ArgumentsNotJSON  # noqa: E402
from taskhoster.django.framework import InvalidTask, TaskResultDoesNotExist, TaskResultStatus  # noqa: E402

PROJECT = Path(__file__).resolve().parent
MILLISECOND = timedelta(milliseconds=1)
NEVER_POSTED = "01890000-0000-7000-8000-000000000000"  # a well-formed item id no server made


@pytest.fixture(scope="session")
def signal_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("signals") / "log"


@pytest.fixture(scope="session", autouse=True)
def worker(signal_log, tmp_path_factory):
    """The project's worker on its "default" queue, two tasks at once."""
    env = {**os.environ, "SIGNAL_LOG": str(signal_log), "SHOP_DB": str(tmp_path_factory.mktemp("db") / "shop.sqlite3")}
    process = subprocess.Popen([sys.executable, "manage.py", "taskhoster_worker", "--queue-name", "default",
                                "--concurrency", "2"], cwd=PROJECT, env=env)
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode == 0, f"the worker ended with {process.returncode}"


@pytest.fixture
def producer():
    with Producer() as producer:
        yield producer


def until(result, *statuses):
    """The result, refreshed until its status is one of these (or the wait is hopeless)."""
    deadline = time.monotonic() + 60
    while result.status not in statuses:
        assert time.monotonic() < deadline, f"{result.id} still {result.status}, not {statuses}"
        time.sleep(0.02)
        result.refresh()
    return result


def ended(result):
    return until(result, TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED)


def test_a_sync_task_runs_and_what_it_returns_is_its_return_value():
    result = tasks.add.enqueue(2, 3)
    assert result.status == TaskResultStatus.READY
    assert result.args == [2, 3] and result.kwargs == {}
    ended(result)
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 5
    read = tasks.add.get_result(result.id)
    assert (read.status, read.return_value, read.args) == (TaskResultStatus.SUCCESSFUL, 5, [2, 3])
    assert read.enqueued_at <= read.started_at == read.last_attempted_at <= read.finished_at
    assert read.attempts == 1 and len(read.worker_ids) == 1 and read.errors == []


def test_event_loops_in_two_threads_enqueue_at_once_each_with_a_producer_of_its_own():
    from concurrent.futures import ThreadPoolExecutor

    from taskhoster.django.framework import task_backends

    async def enqueue_and_name_the_producer():
        backend = task_backends["default"]
        result = await tasks.greet.aenqueue("bo")
        assert backend.async_producer is backend.async_producer  # shared within a loop
        return result, backend.async_producer

    with ThreadPoolExecutor(2) as threads:
        runs = list(threads.map(lambda _: asyncio.run(enqueue_and_name_the_producer()), range(2)))

    (_, first), (_, second) = runs
    assert first is not second
    assert all(ended(result).status == TaskResultStatus.SUCCESSFUL for result, _ in runs)


def test_a_closed_event_loops_producers_are_let_go_of():
    import gc
    import weakref

    loops = []

    async def enqueue():
        loops.append(weakref.ref(asyncio.get_running_loop()))
        return await tasks.greet.aenqueue("cy")

    results = [asyncio.run(enqueue()) for _ in range(3)]  # a new loop each, as async_to_sync makes
    gc.collect()
    assert [loop() is None for loop in loops[:-1]] == [True, True]  # let go of by the next loop's enqueue
    assert all(ended(result).status == TaskResultStatus.SUCCESSFUL for result in results)


def test_an_async_task_runs_enqueued_and_read_from_async_code():
    async def enqueue_and_wait():
        result = await tasks.greet.aenqueue("ana", punctuation="?")
        while not result.is_finished:
            await asyncio.sleep(0.02)
            await result.arefresh()
        return result, await tasks.greet.aget_result(result.id)

    result, read = asyncio.run(enqueue_and_wait())
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert read.return_value == result.return_value == {"greeting": "hello ana?"}
    assert read.kwargs == {"punctuation": "?"}


def test_a_task_that_takes_context_gets_its_result_id_and_attempt():
    result = ended(tasks.whoami.enqueue())
    assert result.return_value == {"id": result.id, "attempt": 1, "worker_ids": result.worker_ids}
    assert result.worker_ids[0].rsplit(":", 1)[1].isdigit()  # host:pid


def test_a_task_that_raises_is_retried_then_failed_with_every_traceback():
    result = ended(tasks.always_fails.enqueue("out of stock"))
    assert result.status == TaskResultStatus.FAILED
    assert result.attempts == 2 and len(result.worker_ids) == 2  # max_attempts in settings
    assert len(result.errors) == 2
    for error in result.errors:
        assert error.exception_class is ValueError
        assert "Traceback (most recent call last)" in error.traceback
        assert "in always_fails" in error.traceback and "ValueError: refused: out of stock" in error.traceback
    with pytest.raises(ValueError):
        result.return_value  # noqa: B018


def test_a_task_that_fails_once_succeeds_on_its_retry():
    result = ended(tasks.fails_once.enqueue())
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 2 and result.attempts == 2
    assert [error.exception_class for error in result.errors] == [RuntimeError]


def test_a_return_value_that_is_not_json_fails_the_task():
    result = ended(tasks.returns_no_json.enqueue())
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[-1].exception_class is TypeError
    assert result.attempts == 1  # it ran: another try would return the same, so none is made


def test_the_worker_closes_old_database_connections_between_tasks():
    # three runs one after another on two threads: at least two share a thread, and its connection
    for _ in range(3):
        assert ended(tasks.finds_the_database_connection_closed.enqueue()).return_value is True


def test_a_running_task_reads_running(tmp_path):
    gate = tmp_path / "go"
    result = until(tasks.wait_for.enqueue(str(gate)), TaskResultStatus.RUNNING)
    assert result.started_at is not None and result.finished_at is None
    assert len(result.worker_ids) == 1
    with pytest.raises(ValueError):
        result.return_value  # noqa: B018
    gate.touch()
    assert ended(result).return_value is True


def test_a_worker_stopped_at_once_exits_though_a_plain_task_runs_on(tmp_path, producer):
    """A second SIGTERM skips the grace: the task still running goes back to its queue, and must
    not keep the worker's process alive (its thread is the worker's, not one Python waits for)."""
    result = tasks.wait_for.using(queue_name="idle").enqueue(str(tmp_path / "never"))
    env = {**os.environ, "SHOP_DB": str(tmp_path / "shop.sqlite3")}
    process = subprocess.Popen([sys.executable, "manage.py", "taskhoster_worker", "--queue-name", "idle"],
                               cwd=PROJECT, env=env)
    try:
        until(result, TaskResultStatus.RUNNING)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # the first is taken before the second comes
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
        assert producer.get("idle", result.id)["status"] == "pending"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        producer.cancel("idle", result.id)


def test_a_task_nobody_works_reads_ready_then_failed_once_canceled(producer):
    result = tasks.add.using(queue_name="idle").enqueue(1, 1)
    read = tasks.add.get_result(result.id)
    assert read.status == TaskResultStatus.READY
    assert (read.started_at, read.finished_at, read.worker_ids, read.errors) == (None, None, [], [])
    assert read.task.queue_name == "idle"
    producer.cancel("idle", result.id)
    read.refresh()
    assert read.status == TaskResultStatus.FAILED
    assert read.errors[0].exception_class_path == "taskhoster.errors.ItemFailed"
    assert "canceled" in read.errors[0].traceback


def test_a_deferred_task_is_ready_and_scheduled_until_its_run_after(producer):
    later = timezone.now() + timedelta(hours=1)
    result = tasks.add.using(queue_name="idle", run_after=later).enqueue(1, 2)
    assert producer.get("idle", result.id)["status"] == "scheduled"
    read = tasks.add.get_result(result.id)
    assert read.status == TaskResultStatus.READY
    assert abs(read.task.run_after - later) < MILLISECOND  # the server keeps milliseconds
    producer.cancel("idle", result.id)


def test_a_deferred_task_runs_after_its_run_after():
    soon = timezone.now() + timedelta(seconds=1)
    result = ended(tasks.add.using(run_after=soon).enqueue(4, 4))
    assert result.return_value == 8
    assert result.started_at > soon - MILLISECOND


def test_an_unknown_id_does_not_exist():
    for unknown in (NEVER_POSTED, "not-an-id"):
        with pytest.raises(TaskResultDoesNotExist):
            tasks.add.get_result(unknown)


def test_arguments_that_are_not_json_are_refused_before_anything_is_posted(producer):
    before = producer.stats("idle")["counts"]
    idle = tasks.add.using(queue_name="idle")
    for args, kwargs in (((object(),), {}), ((), {"a": {1: "x"}}), ((float("nan"),), {})):
        with pytest.raises(ArgumentsNotJSON, match="arguments of task shop.tasks.add"):
            idle.enqueue(*args, **kwargs)
    assert producer.stats("idle")["counts"] == before


def test_priority_is_refused_as_unsupported():
    with pytest.raises(InvalidTask, match="no priorities"):
        tasks.add.using(priority=10)


def test_the_worker_fires_task_started_and_task_finished(signal_log):
    ok = ended(tasks.add.enqueue(1, 1))
    failed = ended(tasks.always_fails.enqueue("signals"))
    lines = signal_log.read_text().splitlines()
    assert [line for line in lines if ok.id in line] == [f"started {ok.id} RUNNING 0", f"finished {ok.id} SUCCESSFUL 0"]
    assert [line for line in lines if failed.id in line] == [
        f"started {failed.id} RUNNING 0", f"finished {failed.id} READY 1",
        f"started {failed.id} RUNNING 1", f"finished {failed.id} FAILED 2",
    ]


def test_a_queue_the_server_lacks_is_named_with_how_to_make_it():
    with pytest.raises(UnknownQueue, match="no queue 'missing': make it there with `manage.py createqueue missing`"):
        tasks.add.using(queue_name="missing").enqueue(1, 1)
