"""A backend's settings, read once from its `TASKS` entry: where the server is, and how the worker
retries a task that raised."""

import re
from dataclasses import dataclass

from django.core.exceptions import ImproperlyConfigured

from ..config import server_settings
from ..errors import TaskhosterError
from ..worker import MAX_RETRY_DELAY_SECONDS

QUEUE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")  # the server's rule: a queue names a directory
DEFAULTS = {
    "url": None,  # else TASKHOSTER_URL
    "token": None,  # else TASKHOSTER_TOKEN
    "max_attempts": 1,  # runs of a task that raises, the first included: 1 is no retry
    "retry_base": 1.0,  # seconds; the backoff doubles from here at each retry, with full jitter
    "retry_cap": 600.0,  # seconds; the longest backoff
    "concurrency": 1,  # tasks one worker process runs at once
    "timeout": 30.0,  # seconds; each HTTP call of enqueue and get_result
}


@dataclass(frozen=True)
class Options:
    url: str
    token: str
    queues: tuple[str, ...]
    max_attempts: int
    retry_base: float
    retry_cap: float
    concurrency: int
    timeout: float

    @classmethod
    def read(cls, alias: str, options: dict, queues: set[str]) -> "Options":
        """The options of backend `alias`; ImproperlyConfigured says what to set if one is wrong."""
        where = f'TASKS["{alias}"]'
        unknown = sorted(set(options) - set(DEFAULTS))
        if unknown:
            raise ImproperlyConfigured(f"{where}['OPTIONS'] has unknown keys {unknown}; known: {sorted(DEFAULTS)}")
        values = {**DEFAULTS, **options}
        try:
            url, token = server_settings(values["url"], values["token"])
        except TaskhosterError as exc:
            raise ImproperlyConfigured(f"{where}['OPTIONS']: {exc} (OPTIONS 'url' and 'token')") from None
        read = cls(url=url, token=token, queues=_queues(where, queues),
                   max_attempts=_whole(where, "max_attempts", values["max_attempts"]),
                   retry_base=_seconds(where, "retry_base", values["retry_base"]),
                   retry_cap=_seconds(where, "retry_cap", values["retry_cap"]),
                   concurrency=_whole(where, "concurrency", values["concurrency"]),
                   timeout=_seconds(where, "timeout", values["timeout"]))
        if read.retry_cap < read.retry_base:
            raise ImproperlyConfigured(f"{where}['OPTIONS']['retry_cap'] must be at least retry_base")
        return read


def _queues(where: str, queues: set[str]) -> tuple[str, ...]:
    # the worker claims from these and get_result looks in them: "any queue" cannot be worked
    if not queues:
        raise ImproperlyConfigured(f"{where}['QUEUES'] must name the Taskhoster queues the tasks go to, "
                                   f"e.g. ['default']")
    for name in queues:
        if not isinstance(name, str) or not QUEUE_NAME.fullmatch(name):
            raise ImproperlyConfigured(f"{where}['QUEUES']: {name!r} is not a Taskhoster queue name "
                                       f"(lowercase letters, digits, - and _, at most 64, not starting with - or _)")
    return tuple(sorted(queues))


def _whole(where: str, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ImproperlyConfigured(f"{where}['OPTIONS']['{key}'] must be a whole number of at least 1, not {value!r}")
    return value


def _seconds(where: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_RETRY_DELAY_SECONDS:
        raise ImproperlyConfigured(f"{where}['OPTIONS']['{key}'] must be seconds, more than 0 and at most "
                                   f"{MAX_RETRY_DELAY_SECONDS}, not {value!r}")
    return float(value)
