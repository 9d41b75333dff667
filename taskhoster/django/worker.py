"""The worker of a TaskhosterBackend: the client's Worker on the backend's queues, with a
TaskRunner as its handler."""

import os
import socket

from django.core.exceptions import ImproperlyConfigured

from ..worker import Worker
from .runner import TaskRunner


class DjangoWorker:
    """Runs the tasks enqueued through `backend` until stopped. `queues` (default: all of the
    backend's) and `concurrency` (default: the backend's option) narrow or widen one worker."""

    def __init__(self, backend, *, queues: list[str] | None = None, concurrency: int | None = None):
        options = backend.settings
        queues = list(queues or options.queues)
        strangers = sorted(set(queues) - set(options.queues))
        if strangers:
            raise ImproperlyConfigured(f"queues {strangers} are not in TASKS[{backend.alias!r}]['QUEUES'] "
                                       f"{list(options.queues)}")
        self.backend = backend
        self.concurrency = concurrency or options.concurrency
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self._worker = Worker(options.url, options.token, queues=queues, concurrency=self.concurrency,
                              on_error="retry", retry_base=options.retry_base, retry_cap=options.retry_cap)

    @property
    def queues(self) -> list[str]:
        return self._worker.queues

    def run(self) -> None:
        """Work until SIGTERM, SIGINT or SIGHUP: running tasks may finish within the grace
        period; one that outlasts it is left to end with the process."""
        runner = TaskRunner(self.backend, worker_id=self.worker_id)
        try:
            self._worker.run(runner)
        finally:
            runner.close()

    def stop(self, *, now: bool = False) -> None:
        self._worker.stop(now=now)
