"""Beyond the seed, raced by several OS processes on one data directory, and killed at random.

The race: four processes post scheduled and pending items, promote, claim, release with a delay
and an error, hand in results, cancel, retry ended items and sweep (a sweeper whose clock runs
ahead lapses leases held right now), on a queue with maxAttempts. Each logs what it was told.
Afterwards: every item is in exactly one state (G1); an item canceled (answered `canceled: true`)
never had a result accepted, and one with an accepted result was never canceled; each ended item
was retried as exactly one new item, whatever each process was answered; no item was handed out
more than maxAttempts times.

The crash: a child schedules, promotes, cancels and retries in a loop and is SIGKILLed 15 times
at random moments. Every acknowledged post is still there, every acknowledged cancel ended its
item canceled, and one sweep pass leaves every id in exactly one state.

The same file is the child when run as a script.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

QUEUE = "jobs"
PROCESSES = 4
SECONDS = 12
MAX_ATTEMPTS = 3
PROJECT = Path(__file__).resolve().parent.parent


def config():
    from queues.store import QueueConfig

    return QueueConfig(name=QUEUE, lease_seconds=30, queue_seconds=86400, retain_seconds=86400, max_attempts=MAX_ATTEMPTS)


def racer(data_dir: str, log_path: str, number: int) -> None:
    from queues.exceptions import TaskhosterError
    from queues.store import NewItem, Release, Store

    cfg = config()
    store = Store(data_dir, fsync=False)
    sweeper = Store(data_dir, fsync=False, clock=lambda: time.time() + 60)  # every lease has lapsed
    rng = random.Random(number)
    log = []
    known: list[str] = []
    stop_at = time.monotonic() + SECONDS
    while time.monotonic() < stop_at:
        roll = rng.random()
        if roll < 0.15:
            items = [NewItem(n, run_at=time.time() + rng.choice([0, 0.05, 0.2])) for n in range(rng.randint(1, 4))]
            posted = [entry.item for entry in store.post_items(config=cfg, items=items)]
            log += [["posted", item.id] for item in posted]
            known += [item.id for item in posted]
        elif roll < 0.25:
            store.promote_due(config=cfg)
        elif roll < 0.7:
            for item in store.claim_items(config=cfg, max_items=rng.randint(1, 3)):
                log.append(["claimed", item.id, item.attempts])
                then = rng.random()
                if then < 0.5:
                    (outcome,) = store.finish_items(results=[(cfg, item.id, number)])
                    if not isinstance(outcome, TaskhosterError) and outcome.accepted:
                        log.append(["accepted", item.id])
                elif then < 0.8:
                    delay = rng.choice([0, 0.05])
                    store.release_items(releases=[Release(cfg, item.id, item.claim_token, delay=delay, error=number)])
                # else: left held, for the sweeper or a late result
        elif roll < 0.8 and known:
            item_id = rng.choice(known)
            try:
                _, canceled = store.cancel_item(config=cfg, item_id=item_id)
            except TaskhosterError:
                continue
            if canceled:
                log.append(["canceled", item_id])
        elif roll < 0.9 and known:
            item_id = rng.choice(known)
            (outcome,) = store.finish_items(results=[(cfg, item_id, number)])  # late, or for one held elsewhere
            if not isinstance(outcome, TaskhosterError) and outcome.accepted:
                log.append(["accepted", item_id])
        elif roll < 0.95 and known:
            item_id = rng.choice(known)
            try:
                new, made = store.retry_item(config=cfg, item_id=item_id)
            except TaskhosterError:
                continue
            log.append(["retried", item_id, new.id, made])
        else:
            sweeper.sweep_queue(config=cfg)
    Path(log_path).write_text("\n".join(json.dumps(entry) for entry in log) + "\n")


def test_processes_racing_retries_cancels_and_schedules_keep_every_rule(tmp_path):
    from queues.store import Store

    data_dir = tmp_path / "data"
    logs = [tmp_path / f"racer-{n}.log" for n in range(PROCESSES)]
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    racers = [subprocess.Popen([sys.executable, __file__, "race", str(data_dir), str(log), str(n)],
                               cwd=PROJECT, env=env, stderr=subprocess.PIPE, text=True) for n, log in enumerate(logs)]
    for process in racers:
        _, errors = process.communicate(timeout=SECONDS + 60)
        assert process.returncode == 0, errors

    events = defaultdict(list)
    for log in logs:
        for line in log.read_text().splitlines():
            kind, item_id, *rest = json.loads(line)
            events[kind].append((item_id, *rest))
    store = Store(data_dir, fsync=False)
    cfg = config()
    time.sleep(0.3)
    store.sweep_queue(config=cfg)  # promotes the last due ones, settles what crashes left (none)

    queue_dir = data_dir / QUEUE
    where = defaultdict(list)
    for state in ("scheduled", "pending", "processing", "done"):
        for name in os.listdir(queue_dir / state):
            where[name.removesuffix(".json")].append(state)
    assert not {i: w for i, w in where.items() if len(w) != 1}, "an item in two states"
    posted = {item_id for item_id, in events["posted"]}
    retried_as = {new for _, new, _ in events["retried"]}
    assert posted | retried_as <= set(where), "an acknowledged item is gone"
    assert os.listdir(queue_dir / "quarantine") == []

    accepted = defaultdict(int)
    for item_id, in events["accepted"]:
        accepted[item_id] += 1
    assert max(accepted.values(), default=1) == 1, "an item finished twice"
    canceled = {item_id for item_id, in events["canceled"]}
    assert canceled and accepted, "the racers got real work done"
    assert not canceled & set(accepted), "an item both canceled and finished"
    for item_id in canceled:
        item = store.read_item(queue=QUEUE, item_id=item_id)
        assert (item.status, item.error) == ("failed", "canceled")
    for item_id in accepted:
        assert store.read_item(queue=QUEUE, item_id=item_id).status == "finished"

    answers = defaultdict(set)
    made = defaultdict(int)
    for old, new, was_made in events["retried"]:
        answers[old].add(new)
        made[old] += was_made
    assert answers, "no retries were made"
    for old, news in answers.items():
        assert len(news) == 1 and made[old] == 1, f"{old} retried as {news}, made {made[old]} times"
        assert store.read_item(queue=QUEUE, item_id=old).retried_as in news

    claims = defaultdict(list)
    for item_id, attempts in events["claimed"]:
        claims[item_id].append(attempts)
    assert max(max(attempts) for attempts in claims.values()) <= MAX_ATTEMPTS
    assert any(store.read_item(queue=QUEUE, item_id=i).error == "max_attempts" for i in claims), "no item met its limit"


def crasher(data_dir: str, log_path: str, seed: int) -> None:
    from queues.exceptions import TaskhosterError
    from queues.store import NewItem, Store

    cfg = config()
    store = Store(data_dir, fsync=True)
    rng = random.Random(seed)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    print("ready", flush=True)
    known = []
    while True:
        items = [NewItem(n, run_at=time.time() + rng.choice([0, 0.01, 0.05])) for n in range(rng.randint(1, 5))]
        posted = [entry.item for entry in store.post_items(config=cfg, items=items)]
        os.write(log, "".join(f"P {item.id}\n" for item in posted).encode())
        known += [item.id for item in posted]
        store.promote_due(config=cfg)
        item_id = rng.choice(known)
        try:
            _, canceled = store.cancel_item(config=cfg, item_id=item_id)
            if canceled:
                os.write(log, f"C {item_id}\n".encode())
            store.retry_item(config=cfg, item_id=rng.choice(known))
        except TaskhosterError:
            pass


def test_a_process_killed_while_it_promotes_cancels_and_retries_loses_nothing(tmp_path):
    from queues.store import Store

    data_dir, log_path = tmp_path / "data", tmp_path / "acknowledged.log"
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    rng = random.Random(7)
    for seed in range(15):
        process = subprocess.Popen([sys.executable, __file__, "crash", str(data_dir), str(log_path), str(seed)],
                                   cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert process.stdout.readline() == "ready\n", process.communicate()[1]
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(process.pid, signal.SIGKILL)
        _, errors = process.communicate()
        assert process.returncode == -signal.SIGKILL, errors

    posted, canceled = set(), set()
    for line in log_path.read_text().splitlines():
        kind, item_id = line.split()
        (posted if kind == "P" else canceled).add(item_id)
    assert len(posted) > 50 and canceled
    store = Store(data_dir, fsync=True)
    time.sleep(0.1)
    store.sweep_queue(config=config())
    queue_dir = data_dir / QUEUE
    where = defaultdict(list)
    for state in ("scheduled", "pending", "processing", "done"):
        for name in os.listdir(queue_dir / state):
            where[name.removesuffix(".json")].append(state)
    assert not posted - set(where), "an acknowledged post is gone"
    assert not {i: w for i, w in where.items() if len(w) != 1}, "an item in two states after the sweep"
    for item_id in canceled:
        item = store.read_item(queue=QUEUE, item_id=item_id)
        assert (item.status, item.error) == ("failed", "canceled")
    assert os.listdir(queue_dir / "quarantine") == []


if __name__ == "__main__":
    {"race": racer, "crash": crasher}[sys.argv[1]](sys.argv[2], sys.argv[3], int(sys.argv[4]))
