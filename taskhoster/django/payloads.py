"""The payload of a task's item: which task to run and with what, `{"task": import path, "args":
[...], "kwargs": {...}}`, checked at enqueue to come back from JSON exactly as it went in."""

import json
from typing import Any

from django.utils.module_loading import import_string

from .framework import Task, normalize_json

# made once: json.dumps with any option makes a new encoder at every call
_encoder = json.JSONEncoder(allow_nan=False)


class ArgumentsNotJSON(TypeError):
    """A task's arguments would not come back from JSON as they are: the worker could not run it
    with them."""


def task_payload(task: Task, args: tuple | list, kwargs: dict) -> dict:
    """The item's payload; ArgumentsNotJSON if the arguments would not survive the trip."""
    payload = {"task": task.module_path, "args": list(args), "kwargs": dict(kwargs)}
    _check_round_trip(task, payload)
    return payload


def _check_round_trip(task: Task, payload: dict) -> None:
    # what the framework keeps of the arguments (tuples as lists, bytes as text) must be what the
    # worker reads back
    try:
        kept = normalize_json({"args": payload["args"], "kwargs": payload["kwargs"]})
        back = json.loads(_encoder.encode(kept))
    except (TypeError, ValueError) as exc:
        raise ArgumentsNotJSON(f"the arguments of task {task.module_path} must be JSON (str, int, float, bool, "
                               f"None, and lists and dicts of them): {exc}") from exc
    if back != kept:
        raise ArgumentsNotJSON(f"the arguments of task {task.module_path} would change on the way through JSON "
                               f"(dict keys must be strings): {payload['args']!r}, {payload['kwargs']!r}"[:1000])
    payload.update(kept)


def read_payload(payload: Any) -> tuple[str, list, dict]:
    """The task's import path, args and kwargs, from an item a backend posted."""
    if not (isinstance(payload, dict) and isinstance(payload.get("task"), str)
            and isinstance(payload.get("args"), list) and isinstance(payload.get("kwargs"), dict)):
        raise ValueError(f"not the payload of a task (no task, args and kwargs): {payload!r}"[:500])
    return payload["task"], payload["args"], payload["kwargs"]


def load_task(path: str, *, backend: str, queue_name: str) -> Task:
    """The task at `path`, as if enqueued through `backend` on `queue_name`."""
    found = import_string(path)
    if not isinstance(found, Task):
        raise TypeError(f"{path} is not a task (a function decorated with @task)")
    return found.using(backend=backend, queue_name=queue_name)
