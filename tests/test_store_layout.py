"""Names: no queue name, state or id that breaks its rule ever reaches the file system."""

import builtins
import os

import pytest

from queues import ids
from queues.exceptions import InvalidRequest, ItemNotFound, UnknownQueue, UnsafePath
from queues.store import QueueConfig, Release
from queues.store.layout import Layout
from store_support import Q, post


@pytest.mark.parametrize("name", ["..", ".", "../etc", "a/b", "/tmp", "Jobs", "x" * 65, "", "-x", "a\x00"])
def test_an_unsafe_queue_name_never_reaches_the_disk(store, name):
    post(store)  # the data directory holds something to lose
    before = sorted(p for p in store.data_dir.rglob("*"))
    for call in (
        lambda: store.count_items(queue=name),
        lambda: store.list_items(queue=name, state="pending"),
        lambda: store.sweep_queue(config=QueueConfig(name=name)),
        lambda: store.delete_queue(name),
        lambda: store.claim_items(config=QueueConfig(name=name)),
        lambda: store.ensure_queue(name),
    ):
        with pytest.raises((UnsafePath, InvalidRequest)):
            call()
    (outcome,) = store.finish_items(results=[(QueueConfig(name=name), ids.IdMaker().new_ids(1, 0)[0], 1)])
    assert isinstance(outcome, UnknownQueue)
    assert sorted(p for p in store.data_dir.rglob("*")) == before


def test_the_path_builder_refuses_unsafe_pieces(tmp_path):
    layout = Layout(tmp_path)
    (item_id,) = ids.IdMaker().new_ids(1, 0)
    for queue, state, piece in [
        ("..", "pending", item_id),
        (Q, "../..", item_id),
        (Q, "pending", "../../x"),
        (Q, "pending", item_id.upper()),
        (Q, "lost+found", item_id),
        (Q, "tmp", item_id),  # tmp/ holds files being written, never an item's own name
    ]:
        with pytest.raises(UnsafePath):
            layout.item(queue, state, piece)
    for mark, piece in [("done", item_id), ("failed", "../x")]:
        with pytest.raises(UnsafePath):
            layout.mark(Q, mark, piece)
    with pytest.raises(UnsafePath):
        layout.quarantined(Q, "pending", "../../etc")


@pytest.fixture
def no_disk(monkeypatch):
    """Fail the test if anything opens, stats, lists or moves a file."""

    def tripwire(*args, **kwargs):
        raise AssertionError(f"touched the disk: {args!r}")

    for name in ("open", "stat", "lstat", "listdir", "scandir", "rename", "replace", "link", "unlink", "mkdir"):
        monkeypatch.setattr(os, name, tripwire)
    monkeypatch.setattr(builtins, "open", tripwire)


@pytest.mark.parametrize(
    "bad_id",
    ["", "nope", "../../../etc/passwd", "0193A4B2-7C1E-7D3A-9F00-2B6C1D0E4F55", "0193a4b2-7c1e-4d3a-9f00-2b6c1d0e4f55",
     "0193a4b2-7c1e-7d3a-9f00-2b6c1d0e4f55/..", None, 7],
)
def test_a_malformed_id_is_not_found_without_touching_the_disk(store, config, bad_id, no_disk):
    for call in (
        lambda: store.read_item(queue=Q, item_id=bad_id, fetch=True),
        lambda: store.extend_lease(queue=Q, item_id=bad_id, seconds=10),
    ):
        with pytest.raises(ItemNotFound):
            call()
    (finished,) = store.finish_items(results=[(config, bad_id, 1)])
    (released,) = store.release_items(releases=[Release(config, bad_id, "t")])
    assert isinstance(finished, ItemNotFound) and isinstance(released, ItemNotFound)
