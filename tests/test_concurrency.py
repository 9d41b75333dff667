"""Four OS processes claim, finish (some twice, some late after a re-queue), release and sweep
2,000 items on one data directory at once. Each logs every claim and every accepted result; the
test then checks G1 (one state each), G2 (each claim numbered once), G3 (exactly one accepted
result, the one on disk) and G5 (attempts = claims) for every item.

The same file is the worker when run as a script (`python tests/test_concurrency.py DATA LOG N`).
"""

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from storekit import finish, post_batch

QUEUE = "jobs"
ITEMS = 2000
WORKERS = 4
DEADLINE_SECONDS = 50
PROJECT = Path(__file__).resolve().parent.parent


def worker(data_dir: str, log_path: str, number: int) -> None:
    from queues.store import QueueConfig, Release, Store

    config = QueueConfig(name=QUEUE, lease_seconds=60, queue_seconds=86400, retain_seconds=86400)
    store = Store(data_dir, fsync=False)
    # a sweeper two minutes ahead finds every lease lapsed: it re-queues items held right now
    sweeper = Store(data_dir, fsync=False, clock=lambda: time.time() + 120)
    rng = random.Random(number)
    done_dir = Path(data_dir) / QUEUE / "done"
    held = []  # claims kept to be finished late
    log = []
    sequence = 0

    def hand_in(item_id: str, *, late: bool = False) -> bool:
        nonlocal sequence
        sequence += 1
        result = {"worker": number, "seq": sequence, "late": late}
        outcome = finish(store, config, item_id, result)
        if outcome.accepted:
            log.append(["accepted", item_id, result])
        return outcome.accepted

    stop_at = time.monotonic() + DEADLINE_SECONDS
    while len(os.listdir(done_dir)) < ITEMS and time.monotonic() < stop_at:
        count = rng.randint(1, 5)
        claimed = store.claim_items(config=config, max_items=count)
        for item in claimed:
            log.append(["claim", item.id, item.attempts])
            roll = rng.random()
            if roll < 0.5:
                hand_in(item.id)
            elif roll < 0.6:
                if hand_in(item.id) and hand_in(item.id):
                    log.append(["finished twice", item.id, None])
            elif roll < 0.75:
                store.release_items(releases=[Release(config, item.id, item.claim_token)])
            else:
                held.append(item)
        if held and (not claimed or rng.random() < 0.3):
            hand_in(held.pop(0).id, late=True)  # it may have been re-queued, re-claimed or finished
        if rng.random() < 0.05:
            sweeper.sweep_queue(config=config)
    for item in held:
        hand_in(item.id, late=True)
    Path(log_path).write_text("\n".join(json.dumps(entry) for entry in log) + "\n")


def test_processes_racing_on_one_directory_keep_every_guarantee(tmp_path):
    from queues.store import Store

    data_dir = tmp_path / "data"
    store = Store(data_dir, fsync=False)
    posted = []
    for start in range(0, ITEMS, 500):
        posted += [i.id for i in post_batch(store, QUEUE, list(range(start, start + 500)))]

    logs = [tmp_path / f"worker-{n}.log" for n in range(WORKERS)]
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, str(data_dir), str(log), str(n)],
            cwd=PROJECT, env=env, stderr=subprocess.PIPE, text=True,
        )
        for n, log in enumerate(logs)
    ]
    for process in workers:
        _, errors = process.communicate(timeout=DEADLINE_SECONDS + 30)
        assert process.returncode == 0, errors

    claims, accepted = defaultdict(list), defaultdict(list)
    for log in logs:
        for line in log.read_text().splitlines():
            kind, item_id, detail = json.loads(line)
            assert kind != "finished twice", f"{item_id} was finished twice"
            (claims if kind == "claim" else accepted)[item_id].append(detail)

    queue_dir = data_dir / QUEUE
    names = {state: sorted(os.listdir(queue_dir / state)) for state in ("pending", "processing", "done")}
    assert names["pending"] == names["processing"] == []
    assert names["done"] == sorted(f"{i}.json" for i in posted), "an item was lost or doubled"
    assert os.listdir(queue_dir / "quarantine") == []
    assert [n for n in os.listdir(queue_dir / "tmp") if not n.endswith(".spare")] == []  # nothing half-written
    assert sum(len(c) for c in claims.values()) > ITEMS  # re-queues happened
    assert any(len(c) > 2 for c in claims.values())
    for item_id in posted:
        assert len(accepted[item_id]) == 1, f"{item_id}: {len(accepted[item_id])} accepted results"
        item = store.read_item(queue=QUEUE, item_id=item_id)
        assert item.status == "finished"
        assert item.result == accepted[item_id][0]
        assert item.attempts == len(claims[item_id])
        # each claim got its own attempt number: no two claimants ever held the same claim
        assert sorted(claims[item_id]) == list(range(1, item.attempts + 1))
    assert len(Counter(r["worker"] for results in accepted.values() for r in results)) == WORKERS
    late_wins = [i for i, results in accepted.items() if results[0]["late"] and len(claims[i]) > 1]
    assert late_wins, "no late result was accepted after a re-queue"


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
