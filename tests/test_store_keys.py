"""Idempotency keys in the store: one item per key per queue, a repeat answered with that item as
it is now, a repeat with another payload refused, batches all or nothing, the key freed with its
item, and SIGKILL at every step of a keyed post leaving either no item and a free key or one item
and its key. The same file is the child of the crash test (`python tests/test_store_keys.py ...`).
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from storekit import finish

from queues.exceptions import InvalidRequest, KeyConflict, StorageUnavailable
from queues.store import NewItem, QueueConfig, Store, files
from queues.store.keys import digest

Q = "jobs"
CONFIG = QueueConfig(name=Q, retain_seconds=60)
PROJECT = Path(__file__).resolve().parent.parent


def keyed(store: Store, *entries: tuple[object, str | None], config: QueueConfig = CONFIG):
    return store.post_items(config=config, items=[NewItem(payload, key=key) for payload, key in entries])


def claim_one(store: Store, config: QueueConfig):
    [item] = store.claim_items(config=config)
    return item


def items_on_disk(store: Store) -> list[str]:
    return sorted(
        name for state in ("scheduled", "pending", "processing", "done")
        for name in os.listdir(store.data_dir / Q / state)
    )


def key_files(store: Store) -> list[str]:
    return sorted(os.listdir(store.data_dir / Q / "keys"))


def test_a_repeat_with_the_same_key_and_payload_stores_nothing_and_answers_the_first_item(store):
    [first] = keyed(store, ({"to": "ann"}, "order-1"))
    [again] = keyed(store, ({"to": "ann"}, "order-1"))
    assert (first.duplicate, again.duplicate) == (False, True)
    assert again.item.id == first.item.id
    assert first.item.to_json()["key"] == "order-1"
    assert items_on_disk(store) == [f"{first.item.id}.json"]
    assert key_files(store) == [digest("order-1")]


def test_the_same_payload_is_the_same_json_whatever_the_order_of_its_members(store):
    [first] = keyed(store, ({"a": 1, "b": [1, {"c": 2, "d": 3}]}, "k"))
    [again] = keyed(store, ({"b": [1, {"d": 3, "c": 2}], "a": 1}, "k"))
    assert again.duplicate and again.item.id == first.item.id


def test_a_repeat_answers_the_item_as_it_is_now(store):
    [first] = keyed(store, ("p", "k"))
    claimed = claim_one(store, CONFIG)
    assert claimed.id == first.item.id
    finish(store, CONFIG, claimed.id, {"sent": True})
    keyed(store, ("another", None))  # writes a file where the finished item's old one might be reused
    [again] = keyed(store, ("p", "k"))
    assert again.duplicate
    assert (again.item.status, again.item.result, again.item.attempts) == ("finished", {"sent": True}, 1)


def test_a_repeat_with_another_payload_is_refused_and_stores_nothing(store):
    [first] = keyed(store, ("p", "k"))
    with pytest.raises(KeyConflict) as refused:
        keyed(store, ("q", "k"))
    assert first.item.id in str(refused.value)
    assert items_on_disk(store) == [f"{first.item.id}.json"]


def test_keys_are_per_queue_and_an_unkeyed_post_is_never_a_duplicate(store):
    [first] = keyed(store, ("p", "k"))
    [other_queue] = keyed(store, ("p", "k"), config=QueueConfig(name="other"))
    assert not other_queue.duplicate and other_queue.item.id != first.item.id
    plain = keyed(store, ("p", None), ("p", None))
    assert [posted.duplicate for posted in plain] == [False, False]
    assert plain[0].item.key is None


def test_a_batch_mixes_new_items_and_duplicates_in_its_order(store):
    [old] = keyed(store, ("p", "old"))
    posted = keyed(store, ("n1", "new-1"), ("p", "old"), ("n2", None), ("n3", "new-3"))
    assert [entry.duplicate for entry in posted] == [False, True, False, False]
    assert posted[1].item.id == old.item.id
    assert [entry.item.payload for entry in posted] == ["n1", "p", "n2", "n3"]
    assert len(items_on_disk(store)) == 4
    assert key_files(store) == sorted(digest(k) for k in ("old", "new-1", "new-3"))


def test_a_batch_with_one_conflicting_key_posts_nothing(store):
    keyed(store, ("p", "old"))
    before = (items_on_disk(store), key_files(store))
    with pytest.raises(KeyConflict):
        keyed(store, ("n1", "new-1"), ("other payload", "old"), ("n2", None))
    assert (items_on_disk(store), key_files(store)) == before
    assert os.listdir(store.data_dir / Q / "tmp") == []


def test_two_items_of_one_batch_with_the_same_key_are_refused(store):
    with pytest.raises(InvalidRequest, match="same key"):
        keyed(store, ("p", "k"), ("p", "k"))
    assert not (store.data_dir / Q).exists() or items_on_disk(store) == []


@pytest.mark.parametrize("key", ["", "x" * 201, "caf\u00e9", "tab\there", "new\nline", "del\x7f", 7, ["k"]])
def test_a_bad_key_is_refused_and_nothing_is_stored(store, key):
    with pytest.raises(InvalidRequest, match="idempotency key"):
        keyed(store, ("p", "fine"), ("p", key))
    assert not (store.data_dir / Q).exists() or (items_on_disk(store), key_files(store)) == ([], [])


def test_keys_of_every_allowed_character_and_length_are_taken(store):
    for key in (" ", "~" * 200, "".join(chr(c) for c in range(0x20, 0x7F)), "../../etc/passwd", "a/b"):
        [posted] = keyed(store, ("p", key))
        assert not posted.duplicate and posted.item.key == key
        assert keyed(store, ("p", key))[0].item.id == posted.item.id


def test_a_scheduled_keyed_item_is_found_while_scheduled_and_after_it_came_due(store, clock):
    [first] = store.post_items(config=CONFIG, items=[NewItem("p", run_at=clock.now + 30, key="k")])
    assert first.item.status == "scheduled"
    assert keyed(store, ("p", "k"))[0].item.id == first.item.id
    clock.advance(31)
    store.promote_due(config=CONFIG)
    [again] = keyed(store, ("p", "k"))
    assert (again.duplicate, again.item.id, again.item.status) == (True, first.item.id, "pending")


def test_retention_deletes_the_item_and_frees_its_key(store, clock):
    [first] = keyed(store, ("p", "k"))
    finish(store, CONFIG, claim_one(store, CONFIG).id, "done")
    keyed(store, ("other", "kept"))  # a key whose item is not deleted stays
    clock.advance(61)
    changes = store.sweep_queue(config=CONFIG)
    assert changes.deleted == [first.item.id]
    assert key_files(store) == [digest("kept")]
    [new] = keyed(store, ("a new payload is fine now", "k"))
    assert not new.duplicate and new.item.id != first.item.id


def test_a_retried_item_carries_no_key(store):
    [first] = keyed(store, ("p", "k"))
    finish(store, CONFIG, claim_one(store, CONFIG).id, "done")
    retried, _ = store.retry_item(config=CONFIG, item_id=first.item.id)
    assert retried.key is None
    assert keyed(store, ("p", "k"))[0].item.id == first.item.id


def test_a_key_whose_item_vanished_is_freed_by_the_next_post(store):
    [first] = keyed(store, ("p", "k"))
    os.unlink(store.data_dir / Q / "pending" / f"{first.item.id}.json")  # as if a crash lost it
    [new] = keyed(store, ("q", "k"))
    assert not new.duplicate and new.item.id != first.item.id


def test_a_failed_flush_of_a_keyed_post_leaves_the_key_free(tmp_path, faults):
    store = Store(tmp_path, fsync=True)
    faults.fail(calls={"fsync"}, where="/keys")
    with pytest.raises(Exception):
        keyed(store, ("p", "k"))
    faults.clear()
    assert (items_on_disk(store), key_files(store)) == ([], [])
    assert not keyed(store, ("p", "k"))[0].duplicate


# ---- racing processes -----------------------------------------------------------------------

RACER = """
import json, sys
from queues.store import NewItem, QueueConfig, Store
store = Store(sys.argv[1], fsync=False)
config = QueueConfig(name="jobs")
sys.stdin.readline()  # all start together
for n in range(int(sys.argv[2])):
    [posted] = store.post_items(config=config, items=[NewItem({"n": n}, key=f"key-{n}")])
    print(json.dumps([n, posted.item.id, posted.duplicate]), flush=True)
"""


def test_processes_racing_on_the_same_keys_make_exactly_one_item_per_key(tmp_path):
    keys, racers = 40, 8
    processes = [
        subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(keys)], cwd=PROJECT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(racers)
    ]
    for process in processes:
        process.stdin.write("go\n")
        process.stdin.flush()
    answers = [[json.loads(line) for line in process.communicate(timeout=120)[0].splitlines()] for process in processes]
    assert all(process.returncode == 0 for process in processes)
    for n in range(keys):
        of_key = [answer[n] for answer in answers]
        assert len({item_id for _, item_id, _ in of_key}) == 1
        assert sorted(duplicate for _, _, duplicate in of_key) == [False] + [True] * (racers - 1)
    pending = os.listdir(tmp_path / "jobs" / "pending")
    assert len(pending) == keys
    assert len(os.listdir(tmp_path / "jobs" / "keys")) == keys


# ---- SIGKILL at every step of a keyed post ----------------------------------------------------

KILLED = """
import os, signal, sys
from queues.store import NewItem, QueueConfig, Store, files
store = Store(sys.argv[1], fsync=True)
store.ensure_queue("jobs")
kill_at, seen = int(sys.argv[2]), []
def fault(call, path):
    seen.append(call)
    if len(seen) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
files.fault = fault
store.post_items(config=QueueConfig(name="jobs"), items=[NewItem({"n": n}, key=f"the-key-{n}") for n in range(int(sys.argv[3]))])
print(len(seen), flush=True)
"""


def _keyed_post_steps(tmp_path: Path, batch: int) -> int:
    """How many file-system calls a keyed post of `batch` items makes (a child that never dies)."""
    done = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path / "count"), "0", str(batch)],
                          cwd=PROJECT, capture_output=True, text=True, check=True)
    return int(done.stdout)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_keyed_post_killed_at_any_step_leaves_no_item_and_a_free_key_or_one_item_and_its_key(tmp_path, batch):
    steps = _keyed_post_steps(tmp_path, batch)
    assert steps >= 4 * batch  # write, link, flush, move at least
    keys = [f"the-key-{n}" for n in range(batch)]
    for step in range(1, steps + 1):
        data = tmp_path / f"step-{step}"
        killed = subprocess.run([sys.executable, "-c", KILLED, str(data), str(step), str(batch)], cwd=PROJECT)
        assert killed.returncode == -signal.SIGKILL
        store = Store(data, fsync=True)
        shown = {json.loads((data / Q / "pending" / name).read_text())["key"]: name[:-5]
                 for name in os.listdir(data / Q / "pending")}
        assert len(shown) <= batch
        # the dead poster's leftovers, an hour later: a key naming an item that never showed goes
        for name in os.listdir(data / Q / "tmp"):
            os.utime(data / Q / "tmp" / name, (0, 0))
        store.sweep_queue(config=CONFIG)
        assert sorted(key_files(store)) == sorted(digest(key) for key in shown)
        # the poster tries again: the items shown are answered, the others made, one per key
        again = store.post_items(config=CONFIG, items=[NewItem({"n": n}, key=key) for n, key in enumerate(keys)])
        for key, posted in zip(keys, again):
            assert posted.duplicate == (key in shown)
            if key in shown:
                assert posted.item.id == shown[key]
        assert len(items_on_disk(store)) == batch
        assert sorted(key_files(store)) == sorted(digest(key) for key in keys)


def test_a_stale_key_left_by_a_dead_poster_is_also_freed_by_the_next_post(tmp_path):
    steps = _keyed_post_steps(tmp_path, 1)
    for step in range(1, steps + 1):
        data = tmp_path / f"step-{step}"
        subprocess.run([sys.executable, "-c", KILLED, str(data), str(step), "1"], cwd=PROJECT)
        store = Store(data, fsync=True)
        [posted] = store.post_items(config=CONFIG, items=[NewItem({"n": 0}, key="the-key-0")])
        assert len(items_on_disk(store)) == 1
        assert items_on_disk(store) == [f"{posted.item.id}.json"]


def test_a_keyed_item_finished_elsewhere_while_its_post_failed_keeps_its_key(tmp_path):
    """Its flush failed, so the post is refused; but another process had claimed and finished the
    item meanwhile, and done wins: a retry of the post must find that item, not make a second."""
    store, other = Store(tmp_path, fsync=True), Store(tmp_path, fsync=False)

    def finish_elsewhere_then_fail(call, path):
        if call == "fsync" and path.endswith("/pending") and not finished:
            [claimed] = other.claim_items(config=CONFIG)
            finished.append(finish(other, CONFIG, claimed.id, "done elsewhere").accepted)
            raise OSError(5, "Input/output error", path)

    finished = []
    files.fault = finish_elsewhere_then_fail
    try:
        with pytest.raises(StorageUnavailable):
            keyed(store, ("p", "k"))
    finally:
        files.fault = None
    assert finished == [True]
    [again] = keyed(store, ("p", "k"))
    assert again.duplicate and (again.item.status, again.item.result) == ("finished", "done elsewhere")
