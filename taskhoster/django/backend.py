"""TaskhosterBackend: the tasks of a Django project as items of Taskhoster queues.

    TASKS = {"default": {"BACKEND": "taskhoster.django.TaskhosterBackend", "QUEUES": ["default"],
                         "OPTIONS": {"url": "http://127.0.0.1:8000", "token": "th_..."}}}

A task's queue_name is the Taskhoster queue its items go to; the result id is the item's id.
"""

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import cached_property
from threading import Lock

from asgiref.sync import sync_to_async
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from ..errors import ItemNotFound, UnknownQueue
from ..producer import AsyncProducer, Producer
from .framework import (
    DEFAULT_TASK_PRIORITY,
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskResult,
    TaskResultDoesNotExist,
    task_enqueued,
)
from .options import QUEUE_NAME, Options
from .payloads import load_task, read_payload, task_payload
from .results import moment, task_result


class TaskhosterBackend(BaseTaskBackend):
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = False  # a queue hands out its items oldest first

    @cached_property
    def settings(self) -> Options:
        """Read at first use, so that importing the tasks needs no server."""
        return Options.read(self.alias, self.options, self.queues)

    def validate_task(self, task: Task) -> None:
        if task.priority != DEFAULT_TASK_PRIORITY:
            raise InvalidTask(f"{task.module_path}: the Taskhoster backend has no priorities (a queue hands out its "
                              f"items oldest first); leave priority at {DEFAULT_TASK_PRIORITY}, or give urgent tasks "
                              f"a queue_name of their own and a worker for it")
        super().validate_task(task)
        if not QUEUE_NAME.fullmatch(task.queue_name):
            raise InvalidTask(f"{task.module_path}: queue_name {task.queue_name!r} is not a Taskhoster queue name "
                              f"(lowercase letters, digits, - and _)")

    def enqueue(self, task: Task, args, kwargs) -> TaskResult:
        self.validate_task(task)
        payload = task_payload(task, args, kwargs)
        with _made_on_the_server(task.queue_name, self.settings.url):
            item = self.producer.post(task.queue_name, payload, run_at=_run_at(task))
        result = self._result(item, task, payload)
        task_enqueued.send(type(self), task_result=result)
        return result

    async def aenqueue(self, task: Task, args, kwargs) -> TaskResult:
        self.validate_task(task)
        payload = task_payload(task, args, kwargs)
        with _made_on_the_server(task.queue_name, self.settings.url):
            item = await self.async_producer.post(task.queue_name, payload, run_at=_run_at(task))
        result = self._result(item, task, payload)
        await sync_to_async(task_enqueued.send)(type(self), task_result=result)  # receivers may use the ORM
        return result

    def get_result(self, result_id: str) -> TaskResult:
        for queue in self.settings.queues:
            try:
                item = self.producer.get(queue, result_id, payload=True)
            except (ItemNotFound, UnknownQueue):
                continue
            return self._read(item)
        raise TaskResultDoesNotExist(f"no item {result_id!r} in the Taskhoster queues {list(self.settings.queues)}")

    async def aget_result(self, result_id: str) -> TaskResult:
        for queue in self.settings.queues:
            try:
                item = await self.async_producer.get(queue, result_id, payload=True)
            except (ItemNotFound, UnknownQueue):
                continue
            return await sync_to_async(self._read)(item)  # it imports the task's module
        raise TaskResultDoesNotExist(f"no item {result_id!r} in the Taskhoster queues {list(self.settings.queues)}")

    def check(self, **kwargs):
        try:
            self.settings
        except ImproperlyConfigured as exc:
            return [checks.Error(str(exc), id="taskhoster.E001")]
        return []

    @property
    def producer(self) -> Producer:
        return _shared(Producer, self.settings)

    @property
    def async_producer(self) -> AsyncProducer:
        return _shared(AsyncProducer, self.settings)

    def _read(self, item: dict) -> TaskResult:
        path, args, kwargs = read_payload(item.get("payload"))
        task = load_task(path, backend=self.alias, queue_name=item["queue"])
        if item.get("runAt"):
            task = task.using(run_after=moment(item["runAt"]))
        return task_result(item, task, backend=self.alias, args=args, kwargs=kwargs)

    def _result(self, item: dict, task: Task, payload: dict) -> TaskResult:
        return task_result(item, task, backend=self.alias, args=payload["args"], kwargs=payload["kwargs"])


# The framework makes a backend for each thread, and under ASGI for each request: the producers,
# and the connections they keep open, are shared by every backend with the same server and token.
# An AsyncProducer's connections belong to the event loop that opened them, so each loop (one per
# thread that runs asyncio.run, say) has producers of its own, dropped once it is closed.
_producers: dict[tuple, Producer] = {}
_async_producers: dict[asyncio.AbstractEventLoop, dict[tuple, AsyncProducer]] = {}
_producers_lock = Lock()


def _shared(kind: type, options: Options):
    key = (options.url, options.token, options.timeout)
    with _producers_lock:
        for loop in [loop for loop in _async_producers if loop.is_closed()]:
            del _async_producers[loop]
        made = _async_producers.setdefault(asyncio.get_running_loop(), {}) if kind is AsyncProducer else _producers
        if key not in made:
            made[key] = kind(options.url, options.token, timeout=options.timeout)
        return made[key]


@contextmanager
def _made_on_the_server(queue: str, url: str) -> Iterator[None]:
    """A queue of QUEUES the server does not have: say how to make it."""
    try:
        yield
    except UnknownQueue as exc:
        raise UnknownQueue(exc.code, f"the server at {url} has no queue {queue!r}: make it there with "
                                     f"`manage.py createqueue {queue}`", exc.status) from exc


def _run_at(task: Task) -> datetime | None:
    """run_after for the server, which takes only a moment with its time zone: a naive one (as
    Django keeps times without USE_TZ) is in the current time zone."""
    if task.run_after is None or timezone.is_aware(task.run_after):
        return task.run_after
    return timezone.make_aware(task.run_after)
