"""What a worker writes on a task's item (outcomes), and the TaskResult get_result makes of the
item (results): the statuses, errors and runs, item by item."""

from datetime import datetime, timezone

import pytest
from django_tasks import task  # the test extra installs it

from taskhoster.django.framework import TaskResultStatus
from taskhoster.django.outcomes import raised, returned, runs_of
from taskhoster.django.results import task_result
from taskhoster.jobs import Job


@task
def resize(width):
    return width


def item(status: str, **fields) -> dict:
    return {"id": "0193a4b2-7c1e-7d3a-9f00-2b6c1d0e4f55", "queue": "default", "status": status, "attempts": 0,
            "postedAt": "2026-11-30T14:23:53.120Z", "claimedAt": None, "finishedAt": None, **fields}


def job(attempts: int, last_error=None) -> Job:
    return Job(id="x", queue="default", attempts=attempts, payload=None, claimed_at="2026-11-30T14:24:00.000Z",
               lease_expires_at="", lease_seconds=60, last_error=last_error)


def read(fields: dict):
    return task_result(fields, resize, backend="default", args=[3], kwargs={})


def failure(message: str, runs) -> dict:
    try:
        raise KeyError(message)
    except KeyError as exc:
        return {"error": raised(exc, runs)}


@pytest.mark.parametrize("status, expected", [("scheduled", TaskResultStatus.READY),
                                              ("pending", TaskResultStatus.READY),
                                              ("processing", TaskResultStatus.RUNNING)])
def test_an_item_not_ended_is_ready_or_running(status, expected):
    result = read(item(status, attempts=1 if status == "processing" else 0))
    assert result.status == expected and result.errors == []
    assert result.enqueued_at == datetime(2026, 11, 30, 14, 23, 53, 120000, tzinfo=timezone.utc)
    with pytest.raises(ValueError):
        result.return_value  # noqa: B018


def test_a_finished_item_with_what_the_task_returned_is_successful():
    runs = runs_of(job(1), "web-1:7")
    result = read(item("finished", attempts=1, claimedAt="2026-11-30T14:24:00.000Z",
                       finishedAt="2026-11-30T14:24:01.000Z", result=returned({"w": 3}, runs)))
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == {"w": 3}
    assert result.worker_ids == ["web-1:7"] and result.attempts == 1
    assert result.started_at == datetime(2026, 11, 30, 14, 24, tzinfo=timezone.utc)


def test_a_finished_item_whose_last_run_raised_is_failed_with_both_runs_errors():
    first = runs_of(job(1), "w:1")
    second = runs_of(job(2, last_error=failure("first", first)), "w:2")
    result = read(item("finished", attempts=2, lastError=failure("first", first), result=failure("second", second)))
    assert result.status == TaskResultStatus.FAILED
    assert [error.exception_class for error in result.errors] == [KeyError, KeyError]
    assert "KeyError: 'first'" in result.errors[0].traceback and "KeyError: 'second'" in result.errors[1].traceback
    assert result.worker_ids == ["w:1", "w:2"]


def test_an_item_the_server_ended_is_failed_with_why():
    runs = runs_of(job(1), "w:1")
    result = read(item("failed", attempts=2, error="max_attempts", lastError=failure("lost", runs)))
    assert result.status == TaskResultStatus.FAILED
    assert [error.exception_class_path for error in result.errors] == ["builtins.KeyError",
                                                                      "taskhoster.errors.ItemFailed"]
    assert "max_attempts" in result.errors[1].traceback
    assert result.worker_ids == ["w:1", "unknown"]  # the second run left no record


def test_runs_carry_the_earlier_workers_and_stand_in_for_runs_that_left_no_record():
    first = runs_of(job(1), "a:1")
    assert first.worker_ids == ["a:1"] and first.started_at == "2026-11-30T14:24:00.000Z"
    # run 2 died without a word; run 3 knows of run 1 from the lastError it wrote
    third = runs_of(job(3, last_error=failure("x", first)), "c:3")
    assert third.worker_ids == ["a:1", "unknown", "c:3"]
    assert third.started_at == first.started_at
