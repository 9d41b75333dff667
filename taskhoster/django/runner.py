"""Runs the task of one claimed item: the client Worker's handler for a TaskhosterBackend.

It imports the task by its path, calls it (a plain function in a thread of its own, a coroutine
on the event loop, with a TaskContext first if it takes one), fires the framework's task_started
and task_finished signals, and closes the database connections that have grown old around each
task, as Django does around each request. What the task returns is the item's result; what it
raises is retried while the backend's max_attempts allows, and else is the item's result too.
A task_finished receiver that raises is logged, and changes neither the result nor whether the
task runs again: the run is over by then.
"""

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from inspect import iscoroutinefunction
from typing import Any

from asgiref.sync import sync_to_async
from django.db import close_old_connections
from django.utils import timezone

from ..jobs import HandlerFailed, HandlerThreads, Job
from .framework import TaskContext, TaskError, TaskResult, TaskResultStatus, normalize_json, task_finished, task_started
from .outcomes import Runs, raised, returned, runs_of
from .payloads import load_task, read_payload
from .results import moment, task_result

log = logging.getLogger("taskhoster.django")


@dataclass(frozen=True)
class Started:
    """A task under way: what it runs, and the TaskResult its signals and context show."""

    job: Job
    runs: Runs
    result: TaskResult

    @property
    def arguments(self) -> tuple[list, dict]:
        args = list(self.result.args)
        if self.result.task.takes_context:
            args.insert(0, TaskContext(task_result=self.result))
        return args, self.result.kwargs


class TaskRunner:
    """The handler: `await runner(payload, job)`. Blocking parts (imports, signals, the plain
    tasks themselves) run in threads of its own, the Worker's kind (jobs.HandlerThreads): kept
    between tasks, with their database connections, and daemons, so a task still running when the
    worker gives up on it neither keeps the process alive nor holds up the next task. close() once
    the worker has stopped."""

    def __init__(self, backend, *, worker_id: str):
        self._backend = backend
        self._worker_id = worker_id
        self._threads: HandlerThreads | None = None  # made on the worker's loop, at the first task
        self._max_attempts = backend.settings.max_attempts

    def close(self) -> None:
        if self._threads is not None:
            self._threads.close()

    async def __call__(self, payload: Any, job: Job) -> Any:
        runs = runs_of(job, self._worker_id)
        try:
            started = await self._in_thread(self._start, payload, job, runs)
        except Exception as exc:  # no such task, not a task's payload, a task_started receiver raised
            return self._give_up_or_retry(job, raised(exc, runs), exc, final=self._is_final(job))
        if not iscoroutinefunction(started.result.task.func):
            return await self._in_thread(self._call_plain, started)
        await sync_to_async(close_old_connections)()  # where the task's own ORM calls go
        try:
            args, kwargs = started.arguments
            value = await started.result.task.func(*args, **kwargs)
        except Exception as exc:
            return await self._in_thread(self._failed_on_the_loop, started, exc)
        finally:
            await sync_to_async(close_old_connections)()
        return await self._in_thread(self._returned, started, value)

    def _in_thread(self, call: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        """`call(*args)` in one of the task threads. A StopIteration from it (a task module's
        import, a task_started receiver) comes back as a RuntimeError: an asyncio future refuses
        it as an exception (set_exception raises), and the item would wait forever."""
        if self._threads is None:
            self._threads = HandlerThreads()
        answer = asyncio.get_running_loop().create_future()

        def done(value: Any, exc: BaseException | None) -> None:
            if answer.done():  # the task waiting for it was cancelled
                return
            if exc is None:
                answer.set_result(value)
            else:
                answer.set_exception(exc)

        self._threads.run(_stop_iteration_as_error, (call, *args), done)
        return answer

    # -- in a thread ---------------------------------------------------------------------------

    def _start(self, payload: Any, job: Job, runs: Runs) -> Started:
        close_old_connections()
        path, args, kwargs = read_payload(payload)
        task = load_task(path, backend=self._backend.alias, queue_name=job.queue)
        item = {"id": job.id, "status": "processing", "attempts": job.attempts, "postedAt": job.posted_at,
                "claimedAt": job.claimed_at, "lastError": job.last_error}
        result = task_result(item, task, backend=self._backend.alias, args=args, kwargs=kwargs)
        self._set(result, worker_ids=runs.worker_ids, started_at=moment(runs.started_at))
        task_started.send(type(self._backend), task_result=result)
        return Started(job, runs, result)

    def _call_plain(self, started: Started) -> Any:
        try:
            args, kwargs = started.arguments
            value = started.result.task.func(*args, **kwargs)
        except Exception as exc:
            return self._failed(started, exc)
        return self._returned(started, value)

    def _returned(self, started: Started, value: Any) -> Any:
        """A run that returned. A value that is not JSON fails the task for good: the task ran,
        and another try would return the same, so it is not run again."""
        try:
            value = normalize_json(value)
            json.dumps(value, allow_nan=False)  # NaN and the infinities pass the above, and are no JSON
        except Exception as exc:
            return self._failed(started, exc, final=True)
        self._set(started.result, status=TaskResultStatus.SUCCESSFUL, finished_at=timezone.now(),
                  _return_value=value)
        _tell_finished(self._backend, started.result)
        close_old_connections()
        return returned(value, started.runs)

    def _failed(self, started: Started, exc: Exception, *, final: bool = False) -> Any:
        """A run raised `exc` (`final`: the task is not to be tried again). Called from an except
        clause, so the receivers of task_finished find it in sys.exc_info() there, as with the
        framework's own backends."""
        error = raised(exc, started.runs)
        final = final or self._is_final(started.job)  # decided once: the framework and the Worker hear the same
        started.result.errors.append(TaskError(exception_class_path=error["exceptionClass"],
                                               traceback=error["traceback"]))
        if final:
            self._set(started.result, status=TaskResultStatus.FAILED, finished_at=timezone.now())
        else:  # as get_result shows it until the next try
            self._set(started.result, status=TaskResultStatus.READY)
        _tell_finished(self._backend, started.result)
        close_old_connections()
        return self._give_up_or_retry(started.job, error, exc, final=final)

    def _failed_on_the_loop(self, started: Started, exc: Exception) -> Any:
        """`_failed` for a coroutine task, whose error was caught on the event loop: raised again
        here, its traceback kept, so the receivers of task_finished find it in sys.exc_info()."""
        traceback = exc.__traceback__
        try:
            raise exc
        except Exception:
            exc.__traceback__ = traceback  # not this frame on top of the task's
            return self._failed(started, exc)

    # -- either side -----------------------------------------------------------------------------

    def _give_up_or_retry(self, job: Job, error: dict, exc: Exception, *, final: bool) -> Any:
        """The result of a last try that raised; on an earlier try, HandlerFailed: the Worker gives
        the item back, after a backoff, with the error as its lastError."""
        if final:
            log.warning("%s %s failed on its last try (%d): %r", job.queue, job.id, job.attempts, exc)
            return {"error": error}
        raise HandlerFailed(error)

    def _is_final(self, job: Job) -> bool:
        return job.attempts >= self._max_attempts or job.is_last_try

    @staticmethod
    def _set(result: TaskResult, **changes: Any) -> None:
        for name, value in changes.items():  # TaskResult is frozen: its own backends change it so too
            object.__setattr__(result, name, value)


def _tell_finished(backend, result: TaskResult) -> None:
    """Send task_finished, robustly: a receiver that raises (Django logs it) must not turn a run
    that is over into a handler failure, which the Worker would answer by running the task again."""
    task_finished.send_robust(type(backend), task_result=result)


def _stop_iteration_as_error(call: Callable[..., Any], *args: Any) -> Any:
    try:
        return call(*args)
    except StopIteration as exc:
        raise RuntimeError(f"a call in a task thread raised {exc!r}") from exc
