"""The client library's own CPU per call (`bench --only client-cpu`): `Producer.post`,
`AsyncProducer.post` (awaited one at a time), `Producer.result` and a `Worker`'s items, each
against a stub server (stubs.py) that answers at once from a process of its own. No Taskhoster
server is needed.

What is counted: `time.process_time()` (user and system CPU, every thread) of a process that
holds the client and nothing else (`python -m queues.bench.client_cpu`: no Django, no bench
threads, as a user's producer or worker process), over the timed calls after untimed warm-up
ones: building each request, the system calls that send and receive it (on loopback the kernel
does part of the delivery to the stub on the sender's time, as it would to a server on the same
machine), parsing the answer; for a worker, its WebSocket frames, claims, the handler's thread
hop (a plain handler) and the results, with a no-op handler. Not counted: the stub's CPU, and
the time spent waiting for its answers.

A worker is timed from its handler's call on the first timed item to its call on the first
item after them: that many items' claims, handlers, results and acks, whole. Two ways:
`workerItemMs` as `Worker(...)` runs by default (a plain handler, one item at a time: a claim
and a result frame each), `workerBatchedItemMs` as the bench's worker processes run
(queues/bench/worker.py: an async handler, up to 100 items a claim, results handed in together).

    python -m queues.bench.client_cpu HTTP_URL WORK_URL CALLS   prints the figures as JSON
"""

import asyncio
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial

from taskhoster import AsyncProducer, Producer, Worker

from .servers import PROJECT_DIR
from .stubs import StubServers
from .workload import PAYLOAD

TOKEN = "th_stub"  # the stubs take any
QUEUE = "bench"
BATCH = 100  # the batched worker's concurrency: the most one claim brings
WORKER_TIMEOUT = 60.0  # a worker that has not handled its items by then is stopped, and it fails
RUN_TIMEOUT = 300.0  # the measuring process in all


def warm_up_calls(calls: int) -> int:
    """Untimed calls first: connections open, caches and the handler threads warm."""
    return max(BATCH, calls // 10)


def measure(*, calls: int) -> dict[str, float]:
    """Start the stub servers, then the measuring process, `calls` timed calls of each kind
    (after warm_up_calls more): the mean CPU milliseconds per call, by key (report.KEYS)."""
    with StubServers() as stubs:
        done = subprocess.run(
            [sys.executable, "-m", "queues.bench.client_cpu", stubs.http_url, stubs.work_url, str(calls)],
            cwd=PROJECT_DIR, capture_output=True, text=True, timeout=RUN_TIMEOUT,
        )
    if done.returncode != 0:
        raise RuntimeError(f"measuring the client's CPU failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def measure_here(http_url: str, work_url: str, *, calls: int) -> dict[str, float]:
    warm_up = warm_up_calls(calls)
    return {
        "producerPostMs": producer_post_ms(http_url, calls=calls, warm_up=warm_up),
        "asyncProducerPostMs": asyncio.run(async_producer_post_ms(http_url, calls=calls, warm_up=warm_up)),
        "producerResultMs": producer_result_ms(http_url, calls=calls, warm_up=warm_up),
        "workerItemMs": worker_item_ms(work_url, items=calls, warm_up=warm_up, concurrency=1, plain=True),
        "workerBatchedItemMs": worker_item_ms(work_url, items=calls, warm_up=warm_up, concurrency=BATCH,
                                              plain=False),
    }


def _cpu_ms_per_call(call: Callable[[], object], *, calls: int, warm_up: int) -> float:
    for _ in range(warm_up):
        call()
    started = time.process_time()
    for _ in range(calls):
        call()
    return (time.process_time() - started) * 1000 / calls


def producer_post_ms(url: str, *, calls: int, warm_up: int) -> float:
    with Producer(url, TOKEN) as producer:
        return _cpu_ms_per_call(partial(producer.post, QUEUE, PAYLOAD), calls=calls, warm_up=warm_up)


def producer_result_ms(url: str, *, calls: int, warm_up: int) -> float:
    """`Producer.result` of an item that has ended: one GET, answered at once."""
    with Producer(url, TOKEN) as producer:
        item_id = producer.post(QUEUE, PAYLOAD)["id"]
        return _cpu_ms_per_call(partial(producer.result, QUEUE, item_id), calls=calls, warm_up=warm_up)


async def async_producer_post_ms(url: str, *, calls: int, warm_up: int) -> float:
    async with AsyncProducer(url, TOKEN) as producer:
        for _ in range(warm_up):
            await producer.post(QUEUE, PAYLOAD)
        started = time.process_time()
        for _ in range(calls):
            await producer.post(QUEUE, PAYLOAD)
        return (time.process_time() - started) * 1000 / calls


def worker_item_ms(url: str, *, items: int, warm_up: int, concurrency: int, plain: bool) -> float:
    """A Worker with a no-op handler (`plain`: a function, run in the worker's threads; else an
    async one) against a work socket that never runs out: CPU per item over `items` items after
    `warm_up` (see the module docstring for the window)."""
    worker = Worker(url, TOKEN, queues=[QUEUE], concurrency=concurrency, grace=0)
    handled = itertools.count(1)  # next() on it is atomic: the handler threads share it
    clock: dict[str, float] = {}

    def seen() -> None:
        number = next(handled)
        if number == warm_up + 1:
            clock["started"] = time.process_time()
        elif number == warm_up + items + 1:
            clock["ended"] = time.process_time()
            worker.stop(now=True)

    def handle(payload, job) -> None:
        seen()

    async def handle_async(payload, job) -> None:
        seen()

    asyncio.run(_work_for_a_while(worker, handle if plain else handle_async))
    if "ended" not in clock:
        raise RuntimeError(f"the worker handled {next(handled) - 1} items of {warm_up + items + 1} in "
                           f"{WORKER_TIMEOUT:g} s")
    return (clock["ended"] - clock["started"]) * 1000 / items


async def _work_for_a_while(worker: Worker, handler) -> None:
    guard = asyncio.get_running_loop().call_later(WORKER_TIMEOUT, partial(worker.stop, now=True))
    try:
        await worker.run_async(handler)
    finally:
        guard.cancel()


if __name__ == "__main__":
    http, work, count = sys.argv[1:]
    print(json.dumps(measure_here(http, work, calls=int(count))))
