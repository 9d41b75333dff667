"""What a worker writes on a task's item, and what get_result reads back from it.

    result, the task returned     {"returnValue": V, "workerIds": [...], "startedAt": T}
    result, its last try raised   {"error": ERROR}
    lastError, to be tried again  {"error": ERROR}

ERROR is the client's error shape (`type`, `message`, `traceback`, drawn as an error by the
dashboard) with what the framework's TaskResult needs besides: `exceptionClass` (the import path
of the exception's class), `workerIds` (one per run so far) and `startedAt` (the first run).
The item keeps only its latest lastError and its result, so each carries what came before.
"""

import traceback
from dataclasses import dataclass
from typing import Any

from ..jobs import MESSAGE_CHARS, TRACEBACK_TAIL_CHARS, Job

UNKNOWN_WORKER = "unknown"  # a run whose worker wrote nothing on the item (it was lost mid-task)


@dataclass(frozen=True)
class Runs:
    """Who ran a task so far, this run included, and when it first started."""

    worker_ids: list[str]
    started_at: str


def runs_of(job: Job, worker_id: str) -> Runs:
    """The runs of a claimed task: those its lastError recorded, a stand-in for each run that
    left no record, and this one."""
    earlier = _record(job.last_error)
    known = list(earlier.get("workerIds") or [])[: job.attempts - 1]
    missing = job.attempts - 1 - len(known)
    started_at = earlier.get("startedAt") if known else None
    return Runs(worker_ids=known + [UNKNOWN_WORKER] * missing + [worker_id],
                started_at=started_at or job.claimed_at)


def returned(value: Any, runs: Runs) -> dict:
    return {"returnValue": value, "workerIds": runs.worker_ids, "startedAt": runs.started_at}


def raised(exc: BaseException, runs: Runs) -> dict:
    """The ERROR of a run that raised."""
    kind = type(exc)
    return {"type": kind.__name__, "message": str(exc)[:MESSAGE_CHARS],
            "traceback": "".join(traceback.format_exception(exc))[-TRACEBACK_TAIL_CHARS:],
            "exceptionClass": f"{kind.__module__}.{kind.__qualname__}",
            "workerIds": runs.worker_ids, "startedAt": runs.started_at}


@dataclass(frozen=True)
class Outcome:
    """What an item says of its task's runs."""

    raised: bool  # the last run raised (as opposed to returned, or not yet over)
    return_value: Any
    errors: list[dict]  # ERRORs, oldest first
    worker_ids: list[str]
    started_at: str | None


def outcome_of(item: dict) -> Outcome:
    result = item.get("result") if item.get("status") == "finished" else None
    final, last = _record(result), _record(item.get("lastError"))
    errors = [error for error in (last, final) if error]
    if isinstance(result, dict) and "returnValue" in result:
        return Outcome(False, result["returnValue"], errors, _ids(result), result.get("startedAt"))
    newest = final or last
    return Outcome(bool(final), None, errors, _ids(newest), newest.get("startedAt"))


def _record(value: Any) -> dict:
    """The ERROR in a result or lastError of ours; {} for anything else."""
    error = value.get("error") if isinstance(value, dict) else None
    return error if isinstance(error, dict) else {}


def _ids(record: dict) -> list[str]:
    ids = record.get("workerIds")
    return [str(i) for i in ids] if isinstance(ids, list) else []
