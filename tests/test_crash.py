"""G9: a child process loops over every transition with fsync on and is SIGKILLed at random
moments, 25 times, on one data directory. It logs each acknowledged post and each accepted
result only after the store call returned. Afterwards every acknowledged post is still on disk,
every accepted result is in done with that result, and one sweep pass leaves every id in exactly
one state.

The same file is the child when run as a script (`python tests/test_crash.py DATA LOG SEED`).
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
from storekit import finish, post_batch, release

QUEUE = "jobs"
KILLS = 25
PROJECT = Path(__file__).resolve().parent.parent


def child(data_dir: str, log_path: str, seed: int) -> None:
    from queues.store import QueueConfig, Store
    from queues.sweep import Sweeper

    # short lease and queue timeout, so items left by a killed child are re-queued or failed
    config = QueueConfig(name=QUEUE, lease_seconds=1, queue_seconds=8, retain_seconds=30 * 86400)
    store = Store(data_dir, fsync=True)
    sweeper = Sweeper(store, lambda: [config])
    rng = random.Random(seed)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def record(lines: list[str]) -> None:
        os.write(log, "".join(line + "\n" for line in lines).encode())  # one write: never torn

    def hand_in(item_id: str) -> None:
        result = {"seed": seed, "nonce": rng.random()}
        if finish(store, config, item_id, result).accepted:
            record([f"A {item_id} {json.dumps(result)}"])

    held = []
    print("ready", flush=True)
    while True:
        posted = post_batch(store, QUEUE, [{"seed": seed}] * rng.randint(1, 8))
        record([f"P {item.id}" for item in posted])
        for item in store.claim_items(config=config, max_items=rng.randint(1, 4)):
            roll = rng.random()
            if roll < 0.55:
                hand_in(item.id)
            elif roll < 0.75:
                release(store, QUEUE, item.id, item.claim_token)
            else:
                held.append(item.id)  # finished late, or left to lapse
        if held and rng.random() < 0.3:
            hand_in(held.pop(rng.randrange(len(held))))
        if rng.random() < 0.1:
            sweeper.sweep_once()


def test_nothing_acknowledged_is_lost_when_a_process_is_killed_at_any_instant(tmp_path):
    from queues.store import QueueConfig, Store
    from queues.sweep import Sweeper

    data_dir, log_path = tmp_path / "data", tmp_path / "acknowledged.log"
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    rng = random.Random(2)
    for seed in range(KILLS):
        process = subprocess.Popen(
            [sys.executable, __file__, str(data_dir), str(log_path), str(seed)],
            cwd=PROJECT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert process.stdout.readline() == "ready\n", process.communicate()[1]
        time.sleep(rng.uniform(0.02, 0.5))
        os.kill(process.pid, signal.SIGKILL)
        _, errors = process.communicate()
        assert process.returncode == -signal.SIGKILL, errors

    posted, accepted = set(), defaultdict(list)
    for line in log_path.read_text().splitlines():
        kind, item_id, *result = line.split(" ", 2)
        if kind == "P":
            posted.add(item_id)
        else:
            accepted[item_id].append(json.loads(result[0]))
    assert len(posted) > 100 and len(accepted) > 20  # the children got real work done

    queue_dir = data_dir / QUEUE

    def states() -> dict[str, list[str]]:
        found = defaultdict(list)
        for state in ("pending", "processing", "done"):
            for name in os.listdir(queue_dir / state):
                found[name.removesuffix(".json")].append(state)
        return found

    store = Store(data_dir, fsync=True)

    def check_acknowledged() -> None:
        found = states()
        lost = posted - set(found)
        assert not lost, f"{len(lost)} acknowledged posts are gone"
        for item_id, results in accepted.items():
            assert len(results) == 1, f"{item_id} was accepted {len(results)} times"
            assert "done" in found[item_id]
            item = store.read_item(queue=QUEUE, item_id=item_id)
            assert (item.status, item.result) == ("finished", results[0])

    check_acknowledged()
    assert os.listdir(queue_dir / "quarantine") == []  # no file was ever seen half-written
    config = QueueConfig(name=QUEUE, lease_seconds=1, queue_seconds=8, retain_seconds=30 * 86400)
    Sweeper(store, lambda: [config]).sweep_once()
    check_acknowledged()
    doubled = {item_id: where for item_id, where in states().items() if len(where) != 1}
    assert not doubled, f"ids in more than one state after the sweep: {doubled}"


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
