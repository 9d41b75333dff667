"""The server alone: measurements made against a running server through its API with a
LeanProducer (one keep-alive HTTP connection over a plain socket, no HTTP library), so the
figures are the server's. Each returns plain numbers."""

import statistics
import time

import httpx

from .lean_client import LeanProducer
from .workload import PAYLOAD, RESULT_TIMEOUT, percentiles

POLL_SECONDS = 0.01


def single_posts_per_second(producer: LeanProducer, queue: str, *, seconds: float) -> float:
    """One item per request, back to back for `seconds`."""

    def post_one() -> int:
        producer.post(queue, PAYLOAD)
        return 1

    return _rate(post_one, seconds)


def refused_posts_per_second(producer: LeanProducer, queue: str, *, seconds: float) -> float:
    """Posts refused for want of a token (401), back to back for `seconds`: the rate of a trivial
    request through the same server, which no post can beat."""

    def refused() -> int:
        producer.post_refused(queue)
        return 1

    return _rate(refused, seconds)


def batch_items_per_second(producer: LeanProducer, queue: str, *, seconds: float, batch: int) -> float:
    """Items per second, `batch` items per request, back to back for `seconds`."""
    payloads = [PAYLOAD] * batch
    return _rate(lambda: len(producer.post_many(queue, payloads)), seconds)


def _rate(post, seconds: float) -> float:
    """Items per second; `post()` makes one request and returns how many items it posted."""
    post()  # untimed: the first request opens the connection
    count, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        count += post()
    return count / elapsed


def end_to_end_items_per_second(producer: LeanProducer, queue: str, *, items: int, batch: int) -> float:
    """Post `items` in batches while the workers work them; from the first post until the
    producer sees the last result. The queue must be idle at the start."""
    ended_before = _ended(producer.stats(queue))
    started = time.perf_counter()
    for start in range(0, items, batch):
        posted = producer.post_many(queue, [PAYLOAD] * min(batch, items - start))
    # oldest first: the last item posted is among the last claimed, so wait for it (a held
    # request, no load), then poll the counts for the few that finish after it
    producer.wait(queue, posted[-1]["id"], timeout=RESULT_TIMEOUT + items / 100)
    deadline = time.perf_counter() + RESULT_TIMEOUT
    while True:
        stats = producer.stats(queue)
        counts = stats["counts"]
        if _ended(stats) >= ended_before + items and counts["pending"] == counts["processing"] == 0:
            return items / (time.perf_counter() - started)
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the workers did not finish {items} items: {counts}")
        time.sleep(POLL_SECONDS)


def _ended(stats: dict) -> int:
    return stats["counts"]["finished"] + stats["counts"]["failed"]


def round_trip_ms(producer: LeanProducer, queue: str, *, count: int) -> dict[str, float]:
    """`count` items one at a time, each from its post to its result seen through GET ?wait;
    the 50th, 95th and 99th percentiles in milliseconds."""
    took = []
    for _ in range(count):
        started = time.perf_counter()
        item = producer.post(queue, PAYLOAD)
        ended = producer.wait(queue, item["id"], timeout=RESULT_TIMEOUT)
        took.append((time.perf_counter() - started) * 1000)
        if ended["status"] != "finished":
            raise RuntimeError(f"a round-trip item ended {ended['status']}")
    return percentiles(took, 50, 95, 99)


def http_claims_ms(url: str, token: str, queue: str, *, claims: int) -> dict[str, float]:
    """The first one-item claim over HTTP (waiting, if it must, for the fresh server's first
    listing of the pending directory, which it starts in the background when it starts) and the
    mean of `claims` more, in milliseconds."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=300) as client:

        def claim(wait: float = 0) -> float:
            started = time.perf_counter()
            answer = client.post(f"/api/queues/{queue}/claim", json={"max": 1, "wait": wait})
            took = (time.perf_counter() - started) * 1000
            if answer.status_code != 200 or len(answer.json()["items"]) != 1:
                raise RuntimeError(f"a claim on {queue} answered {answer.status_code}: {answer.text[:200]}")
            return took

        client.get("/healthz")  # opens the connection, so the first claim times the claim only
        first = claim(wait=60)
        return {"firstClaimMs": first, "claimMs": statistics.fmean(claim() for _ in range(claims))}
