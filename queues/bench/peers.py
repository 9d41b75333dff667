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

Their concurrent producers are measured as ours are (client.py): the same threads, seconds and
timing loop (workload.threaded_posts), single posts through the same calls as above, and with no
worker running, as ours post to a queue no worker works (the workers have stopped after the
workload, or never started without it). The threads are set up as each library's users set
them up in one process:

- Celery: every thread calls `task.delay` on the one app, which is how Celery is used (an app per
  process). Its calls take a connection from the app's broker pool (`broker_pool_limit`, 10 by
  default, left as it is): with more threads than that, a thread waits for a free one.
- RQ: every thread has its own `Queue` on its own `Redis` client, as ours have a `Producer` each.
  A `Queue` on one client shared by the threads is as normal (redis-py's pool lends each call a
  connection), but that pool refuses more than 100 connections by default, which would cap
  --producers.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from . import workload
from .redis_server import RedisServer, find_redis_server, redis_server_version
from .servers import PROJECT_DIR

PEERS = ("celery", "rq")
EXTRA_MODULES = ("celery", "rq", "redis")
WARM_UP_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
LONGEST_READ_SECONDS = 600.0  # a reply from Redis: longer than a result is waited for up to --items 57,000
RQ_QUEUE = "bench"
CELERY_WORKERS = "2 --pool solo processes"
PRODUCER_THREADS = "celery: the threads share one app; rq: a Queue and a Redis client per thread"

Say = Callable[[str], None]
Post = Callable[[], object]


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


def measure(name: str, *, durable: bool, directory: Path, workers: int, items: int | None,
            round_trips: int | None, producers: tuple[int, ...], post_seconds: float, say: Say) -> dict:
    """One peer on one Redis: the figures asked for, as ours are reported and in ours' order. The
    workload (`items`, `round_trips`; None for not measured) while `workers` worker processes run;
    then, the workers stopped as ours are, each of `producers` threads posting for `post_seconds`."""
    kind = {"celery": CelerySystem, "rq": RqSystem}[name]
    which = label(name, durable)
    figures = {}
    with RedisServer(directory / "redis", durable=durable) as redis_server:
        say(f"{which}: redis-server pid {redis_server.process.pid} at {redis_server.url}")
        with kind(redis_server.url) as system:
            if items or round_trips:
                with system.working(workers, log_dir=directory) as warm_ups:
                    say(f"{which}: {workers} worker processes warm after {warm_ups} warm-up tasks")
                    figures.update(_workload(system, which, items=items, round_trips=round_trips, say=say))
            if producers:
                figures["concurrentProducers"] = _concurrent_producers(
                    system, which, producers=producers, seconds=post_seconds, say=say
                )
    return figures


def _workload(system: "_PeerSystem", which: str, *, items: int | None, round_trips: int | None, say: Say) -> dict:
    figures = {}
    if items:
        say(f"{which}: {items:,} tasks, one call each, while the workers consume")
        figures.update(workload.enqueue_and_end_to_end(system, items=items))
    if round_trips:
        say(f"{which}: {round_trips} round trips")
        figures["roundTripMs"] = workload.round_trip_ms(system, count=round_trips)
    return figures


def _concurrent_producers(system: "_PeerSystem", which: str, *, producers: tuple[int, ...], seconds: float,
                          say: Say) -> dict:
    """{"N": {postsPerSecond, postMs}} as ours, with no worker running."""
    figures = {}
    for threads in producers:
        say(f"{which}: {threads} threads posting single tasks for {seconds:g} s, no worker running")
        with system.thread_posts(threads) as posts:
            figures[str(threads)] = workload.threaded_posts(posts, seconds=seconds)
    return figures


class WorkerProcesses:
    """The same worker command `count` times, each with its output in a log file."""

    def __init__(self, command: list[str], *, count: int, env: dict[str, str], log_dir: Path, name: str):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.logs = [log_dir / f"{name}-worker-{number}.log" for number in range(count)]
        self.processes = []
        try:
            for number, log in enumerate(self.logs):
                with open(log, "wb") as output:
                    self.processes.append(subprocess.Popen(
                        [part.replace("{n}", str(number)) for part in command],
                        cwd=PROJECT_DIR, env=env, stdout=output, stderr=subprocess.STDOUT,
                    ))
        except BaseException:
            self.stop()  # the ones started before the one that failed
            raise

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
    """What both peers share: worker processes started and stopped apart from the system (ours stop
    before the concurrent producers, and so do theirs), and a warm-up that waits until each has
    worked a task (one at a time, so idle workers take turns)."""

    workers: WorkerProcesses

    def _start_workers(self, count: int, log_dir: Path) -> WorkerProcesses:
        raise NotImplementedError

    def _warm_up_one(self) -> int:
        raise NotImplementedError

    def thread_posts(self, threads: int):
        """A context manager: a post function for each of `threads` threads, as the module's
        docstring says they are set up; whatever they opened is closed on leaving."""
        raise NotImplementedError

    @contextmanager
    def working(self, count: int, *, log_dir: Path) -> Iterator[int]:
        """`count` worker processes, warm (how many warm-up tasks that took), stopped on leaving."""
        self.workers = self._start_workers(count, log_dir)
        try:
            yield self.warm_up()
        finally:
            self.workers.stop()

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
        self.close()


class CelerySystem(_PeerSystem):
    def __init__(self, redis_url: str):
        from celery.result import ResultSet

        from .peer_tasks import CELERY_TASK, celery_app

        self._result_set = ResultSet
        self.redis_url = redis_url
        self.app = celery_app(redis_url)
        self.task = self.app.tasks[CELERY_TASK]

    def _start_workers(self, count: int, log_dir: Path) -> WorkerProcesses:
        from .peer_tasks import REDIS_URL_VARIABLE

        return WorkerProcesses(
            [sys.executable, "-m", "celery", "-A", "queues.bench.peer_tasks:app", "worker", "--pool", "solo",
             "--hostname", "bench{n}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat"],
            count=count, env={**os.environ, REDIS_URL_VARIABLE: self.redis_url}, log_dir=log_dir, name="celery",
        )

    def _warm_up_one(self) -> int:
        from .peer_tasks import WARM_UP

        return self.task.delay(WARM_UP).get(timeout=10)

    @contextmanager
    def thread_posts(self, threads: int) -> Iterator[list[Post]]:
        yield [self.post] * threads  # the one app, shared

    def begin(self) -> None:
        pass

    def post(self):
        return self.task.delay(workload.PAYLOAD)

    def result(self, handle, *, timeout: float = workload.RESULT_TIMEOUT) -> None:
        handle.get(timeout=timeout)  # raises the task's error, or TimeoutError

    def wait_all(self, handles: list, *, timeout: float) -> None:
        self._result_set(handles, app=self.app).join_native(timeout=timeout)

    def close(self) -> None:
        self.app.close()


class RqSystem(_PeerSystem):
    def __init__(self, redis_url: str):
        from rq import Queue

        self.redis_url = redis_url
        self.connection = self._connect()
        self.queue = Queue(RQ_QUEUE, connection=self.connection)
        self._finished_before = 0

    def _connect(self):
        from redis import Redis

        # redis-py 8 gives up on a read after 5 s; a result waited for may take longer (RQ blocks
        # on the job's result stream, for as long as the bench asks: Redis itself ends the block)
        return Redis.from_url(self.redis_url, socket_timeout=LONGEST_READ_SECONDS)

    def _start_workers(self, count: int, log_dir: Path) -> WorkerProcesses:
        return WorkerProcesses(
            [sys.executable, "-m", "rq.cli", "worker", "--worker-class", "rq.worker.SimpleWorker", "--url",
             self.redis_url, "--name", f"bench-{os.getpid()}-{{n}}", RQ_QUEUE],
            count=count, env=dict(os.environ), log_dir=log_dir, name="rq",
        )

    def _warm_up_one(self) -> int:
        from .peer_tasks import WARM_UP, noop

        return self._outcome(self.queue.enqueue(noop, WARM_UP), timeout=10)

    @contextmanager
    def thread_posts(self, threads: int) -> Iterator[list[Post]]:
        from rq import Queue

        from .peer_tasks import noop

        connections = [self._connect() for _ in range(threads)]
        try:
            yield [partial(Queue(RQ_QUEUE, connection=connection).enqueue, noop, workload.PAYLOAD)
                   for connection in connections]
        finally:
            for connection in connections:
                connection.close()

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

    def result(self, handle, *, timeout: float = workload.RESULT_TIMEOUT) -> None:
        self._outcome(handle, timeout=timeout)

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
