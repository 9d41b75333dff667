"""A task's item as the framework's TaskResult: its status, return value, errors, timestamps and
runs, as far as the item has them."""

from datetime import datetime

from django.conf import settings
from django.utils import timezone

from .framework import Task, TaskError, TaskResult, TaskResultStatus
from .outcomes import UNKNOWN_WORKER, outcome_of

STATUSES = {
    "scheduled": TaskResultStatus.READY,
    "pending": TaskResultStatus.READY,
    "processing": TaskResultStatus.RUNNING,
    "finished": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
}
# the class of the error of an item the server ended (timeout, max_attempts, canceled)
SERVER_ENDED = "taskhoster.errors.ItemFailed"
SOME_EXCEPTION = "builtins.Exception"  # an error written by some other worker, which gave no class


def task_result(item: dict, task: Task, *, backend: str, args: list, kwargs: dict) -> TaskResult:
    outcome = outcome_of(item)
    status = STATUSES[item["status"]]
    if status == TaskResultStatus.SUCCESSFUL and outcome.raised:
        status = TaskResultStatus.FAILED
    errors = [TaskError(exception_class_path=str(error.get("exceptionClass") or SOME_EXCEPTION),
                        traceback=str(error.get("traceback") or error.get("message") or ""))
              for error in outcome.errors]
    if item["status"] == "failed":
        errors.append(TaskError(exception_class_path=SERVER_ENDED,
                                traceback=f"Taskhoster ended the item: {item.get('error')}"))
    runs = item.get("attempts") or 0
    worker_ids = outcome.worker_ids[:runs] + [UNKNOWN_WORKER] * (runs - len(outcome.worker_ids))
    result = TaskResult(
        task=task, id=item["id"], status=status, backend=backend, args=args, kwargs=kwargs,
        enqueued_at=moment(item.get("postedAt")),
        started_at=moment(outcome.started_at or item.get("claimedAt")),
        last_attempted_at=moment(item.get("claimedAt")),
        finished_at=moment(item.get("finishedAt")),
        errors=errors, worker_ids=worker_ids,
    )
    if status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", outcome.return_value)  # as the framework's own backends do
    return result


def moment(text: str | None) -> datetime | None:
    """A server timestamp as Django keeps times: aware in UTC, or naive local time without USE_TZ."""
    if not text:
        return None
    when = datetime.fromisoformat(text)
    return when if settings.USE_TZ else timezone.make_naive(when)
