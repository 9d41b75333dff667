"""The peers on the users' workload (workload.py), each through its library's normal API, with a
Redis the bench starts itself (redis_server.py), once in memory and once durable (AOF,
`appendfsync always`):

- Celery: `task.delay(payload)`, `AsyncResult.get()`; Redis as broker and result backend. Its
  workers are 2 `--pool solo` worker processes, not one `--concurrency 2` prefork worker: our
  bench runs 2 worker processes and RQ 2 SimpleWorkers, each taking work from the server or
  Redis itself; prefork adds a third process that takes the messages and hands them to its
  children through a pipe, on a machine of 2 cores.
- RQ: `queue.enqueue(noop, payload)`, `job.latest_result(timeout=...)` (which blocks on the
  job's result stream); 2 `rq worker --worker-class rq.worker.SimpleWorker` processes (the job
  runs in the worker's own process, as ours does; RQ's default worker forks for every job).

The libraries come with the bench extra (`pip install -e '.[bench]'`), imported only here and in
peer_tasks.py, and only when peers are asked for.
"""

import importlib.metadata
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import workload
from .redis_server import RedisServer, find_redis_server, redis_server_version
from .servers import PROJECT_DIR

PEERS = ("celery", "rq")
EXTRA_MODULES = ("celery", "rq", "redis")
WARM_UP_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
RQ_QUEUE = "bench"
CELERY_WORKERS = "2 --pool solo processes"

Say = Callable[[str], None]


class PeersUnavailable(RuntimeError):
    """What --peers needs is missing; the message says what to install."""


def check_peers(names: tuple[str, ...]) -> None:
    unknown = set(names) - set(PEERS)
    if unknown or not names:
        raise PeersUnavailable(f"--peers takes some of: {', '.join(PEERS)}")
    missing = [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise PeersUnavailable(
            f"--peers needs {', '.join(missing)}, from the bench extra: pip install -e '.[bench]'"
        )
    find_redis_server()  # raises RedisUnavailable (a RuntimeError) with what to install


def versions(names: tuple[str, ...]) -> dict[str, str]:
    found = {name: importlib.metadata.version(name) for name in names}
    found["redis-py"] = importlib.metadata.version("redis")
    found["redis-server"] = redis_server_version()
    return found


def label(name: str, durable: bool) -> str:
    return f"{name} (redis {'aof always' if durable else 'in memory'})"


def measure(name: str, *, durable: bool, directory: Path, workers: int, items: int, round_trips: int,
            say: Say) -> dict:
    """One peer on one Redis: the workload's figures, as ours are reported."""
    kind = {"celery": CelerySystem, "rq": RqSystem}[name]
    which = label(name, durable)
    with RedisServer(directory / "redis", durable=durable) as redis_server:
        say(f"{which}: redis-server pid {redis_server.process.pid} at {redis_server.url}")
        with kind(redis_server.url, workers=workers, log_dir=directory) as system:
            say(f"{which}: {workers} worker processes warm after {system.warm_up()} warm-up tasks")
            say(f"{which}: {items:,} tasks, one call each, while the workers consume")
            figures = workload.enqueue_and_end_to_end(system, items=items)
            say(f"{which}: {round_trips} round trips")
            figures["roundTripMs"] = workload.round_trip_ms(system, count=round_trips)
    return figures


class WorkerProcesses:
    """The same worker command `count` times, each with its output in a log file."""

    def __init__(self, command: list[str], *, count: int, env: dict[str, str], log_dir: Path, name: str):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.logs = [log_dir / f"{name}-worker-{number}.log" for number in range(count)]
        self.processes = []
        for number, log in enumerate(self.logs):
            with open(log, "wb") as output:
                self.processes.append(subprocess.Popen(
                    [part.replace("{n}", str(number)) for part in command],
                    cwd=PROJECT_DIR, env=env, stdout=output, stderr=subprocess.STDOUT,
                ))

    def check_alive(self) -> None:
        for process, log in zip(self.processes, self.logs):
            if process.poll() is not None:
                raise RuntimeError(f"a worker exited ({process.returncode}); its log:\n{log.read_text()[-3000:]}")

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


class _PeerSystem:
    """What both peers share: worker processes, and a warm-up that waits until each has worked a
    task (one at a time, so idle workers take turns)."""

    workers: WorkerProcesses

    def _warm_up_one(self) -> int:
        raise NotImplementedError

    def warm_up(self) -> int:
        deadline = time.monotonic() + WARM_UP_TIMEOUT
        seen, sent = set(), 0
        while len(seen) < len(self.workers.processes):
            self.workers.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(seen)} workers worked a task within {WARM_UP_TIMEOUT:g} s")
            seen.add(self._warm_up_one())
            sent += 1
        return sent

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            self.workers.stop()


class CelerySystem(_PeerSystem):
    def __init__(self, redis_url: str, *, workers: int, log_dir: Path):
        from celery.result import ResultSet

        from .peer_tasks import CELERY_TASK, REDIS_URL_VARIABLE, celery_app

        self._result_set = ResultSet
        self.app = celery_app(redis_url)
        self.task = self.app.tasks[CELERY_TASK]
        self.workers = WorkerProcesses(
            [sys.executable, "-m", "celery", "-A", "queues.bench.peer_tasks:app", "worker", "--pool", "solo",
             "--hostname", "bench{n}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat"],
            count=workers, env={**os.environ, REDIS_URL_VARIABLE: redis_url}, log_dir=log_dir, name="celery",
        )

    def _warm_up_one(self) -> int:
        from .peer_tasks import WARM_UP

        return self.task.delay(WARM_UP).get(timeout=10)

    def begin(self) -> None:
        pass

    def post(self):
        return self.task.delay(workload.PAYLOAD)

    def result(self, handle) -> None:
        handle.get(timeout=workload.RESULT_TIMEOUT)  # raises the task's error, or TimeoutError

    def wait_all(self, handles: list, *, timeout: float) -> None:
        self._result_set(handles, app=self.app).join_native(timeout=timeout)

    def close(self) -> None:
        self.app.close()


class RqSystem(_PeerSystem):
    def __init__(self, redis_url: str, *, workers: int, log_dir: Path):
        from redis import Redis
        from rq import Queue

        # redis-py 8 gives up on a read after 5 s; a result waited for may take longer (RQ blocks
        # on the job's result stream)
        self.connection = Redis.from_url(redis_url, socket_timeout=workload.RESULT_TIMEOUT + 10)
        self.queue = Queue(RQ_QUEUE, connection=self.connection)
        self._finished_before = 0
        self.workers = WorkerProcesses(
            [sys.executable, "-m", "rq.cli", "worker", "--worker-class", "rq.worker.SimpleWorker", "--url",
             redis_url, "--name", f"bench-{os.getpid()}-{{n}}", RQ_QUEUE],
            count=workers, env=dict(os.environ), log_dir=log_dir, name="rq",
        )

    def _warm_up_one(self) -> int:
        from .peer_tasks import WARM_UP, noop

        return self._outcome(self.queue.enqueue(noop, WARM_UP), timeout=10)

    def _outcome(self, job, *, timeout: float):
        from rq.results import Result

        result = job.latest_result(timeout=max(1, round(timeout)))
        if result is None:
            raise RuntimeError(f"no result for RQ job {job.id} within {timeout:g} s")
        if result.type != Result.Type.SUCCESSFUL:
            raise RuntimeError(f"RQ job {job.id} ended {result.type.name}: {result.exc_string}")
        return result.return_value

    def begin(self) -> None:
        self._finished_before = self.queue.finished_job_registry.count

    def post(self):
        from .peer_tasks import noop

        return self.queue.enqueue(noop, workload.PAYLOAD)

    def result(self, handle) -> None:
        self._outcome(handle, timeout=workload.RESULT_TIMEOUT)

    def wait_all(self, handles: list, *, timeout: float) -> None:
        """The finished registry's count (one call each) until every job is in it."""
        deadline = time.monotonic() + timeout
        registry = self.queue.finished_job_registry
        while registry.count < self._finished_before + len(handles):
            if time.monotonic() > deadline:
                raise RuntimeError(f"RQ's workers did not finish {len(handles)} jobs within {timeout:g} s")
            time.sleep(0.01)

    def close(self) -> None:
        self.connection.close()
