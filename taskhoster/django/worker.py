"""The worker of a TaskhosterBackend: the client's Worker on the backend's queues, with a
TaskRunner as its handler and a thread for each task it may run at once."""

import os
import socket
from concurrent.futures import ThreadPoolExecutor

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
        """Work until SIGTERM or SIGINT: running tasks may finish within the grace period."""
        threads = ThreadPoolExecutor(self.concurrency, thread_name_prefix="taskhoster-task")
        try:
            self._worker.run(TaskRunner(self.backend, worker_id=self.worker_id, threads=threads))
        finally:
            threads.shutdown(wait=False, cancel_futures=True)

    def stop(self, *, now: bool = False) -> None:
        self._worker.stop(now=now)
