"""A pool of bench worker processes (queues/bench/worker.py), warmed up before any timing: each
has worked at least one item, so its socket is open and its claim is waiting."""

import os
import signal
import subprocess
import sys
import threading
import time

from .lean_client import LeanProducer

from .servers import PROJECT_DIR
from .worker import WARM_LINE, WARM_UP

WARM_UP_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0


class WorkerPool:
    def __init__(self, *, url: str, token: str, queue: str, count: int, claim_batch: int):
        self.queue = queue
        env = {**os.environ, "TASKHOSTER_URL": url, "TASKHOSTER_TOKEN": token, "PYTHONUNBUFFERED": "1"}
        self.processes = []
        try:
            for _ in range(count):
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", "queues.bench.worker", queue, str(claim_batch)],
                    cwd=PROJECT_DIR, env=env, stdout=subprocess.PIPE, text=True,
                ))
        except BaseException:
            self.stop()  # the ones started before the one that failed
            raise
        self._warm = [threading.Event() for _ in self.processes]
        for process, warm in zip(self.processes, self._warm):
            threading.Thread(target=_watch, args=(process, warm), daemon=True).start()

    def warm_up(self, producer: LeanProducer) -> int:
        """Post warm-up items one at a time, each waited for, until every worker has worked one
        (a waiting claim is woken oldest first, so they take turns). How many it took."""
        deadline = time.monotonic() + WARM_UP_TIMEOUT
        posted = 0
        while not all(warm.is_set() for warm in self._warm):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.processes):
                raise RuntimeError(f"the workers did not all start working within {WARM_UP_TIMEOUT:g} s")
            item = producer.post(self.queue, WARM_UP)
            producer.wait(self.queue, item["id"], timeout=10)
            posted += 1
        return posted

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _watch(process: subprocess.Popen, warm: threading.Event) -> None:
    for line in process.stdout:
        if line.strip() == WARM_LINE:
            warm.set()
