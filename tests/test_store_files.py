"""The file operations under the store: whole writes, shared directory flushes, directories made
again when removed, and owner-only modes."""

import errno
import os
import shutil
import stat
import threading
import time

import pytest

from queues.exceptions import StorageUnavailable
from queues.store import Store, files
from store_support import Q, claim_one, files_in, half_written, post, queue_dir
from storekit import finish, post_batch


def test_a_write_the_disk_cuts_short_is_carried_on(tmp_path, faults):
    data = os.urandom(100_000)
    faults.fail(at=1, calls={"write"}, short=1000)
    files.write_new(str(tmp_path / "f"), data)
    assert (tmp_path / "f").read_bytes() == data
    assert [call for call, _ in faults.calls].count("write") >= 2


def test_a_write_the_disk_takes_none_of_is_a_full_disk_and_leaves_no_file(tmp_path, faults):
    faults.fail(at=1, calls={"write"}, short=0)
    with pytest.raises(OSError) as raised:
        files.write_new(str(tmp_path / "f"), os.urandom(100_000))
    assert raised.value.errno == errno.ENOSPC
    assert not (tmp_path / "f").exists()


def test_concurrent_callers_share_a_directory_flush(tmp_path, monkeypatch):
    """Group commit: callers that ask while a flush runs are covered by one flush after it;
    each caller's flush starts after it asked."""
    directory = str(tmp_path)
    started, real_fsync = [], os.fsync

    def slow_fsync(fd):
        started.append(time.monotonic())
        time.sleep(0.05)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    asked, returned = {}, {}

    def caller(n):
        asked[n] = time.monotonic()
        files.flush_directory(directory)
        returned[n] = time.monotonic()

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(started) <= 3  # one running as they came, then one for all who waited
    for n in range(8):  # a flush that began after this caller asked ended before it returned
        assert any(asked[n] <= begun and begun + 0.05 <= returned[n] for begun in started)


def test_directories_flushed_are_remembered_within_a_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(files._DirectoryFlush, "MOST_KNOWN", 8)
    monkeypatch.setattr(files._DirectoryFlush, "_known", {})
    for n in range(30):  # as schedule slots come and go
        (tmp_path / str(n)).mkdir()
        files.flush_directory(str(tmp_path / str(n)))
    assert len(files._DirectoryFlush._known) <= 8
    assert str(tmp_path / "29") in files._DirectoryFlush._known


def test_a_failed_directory_flush_fails_the_callers_it_covered_and_no_later_ones(tmp_path, monkeypatch):
    calls, real_fsync = [], os.fsync

    def fsync_failing_first(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, "the disk failed")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_failing_first)
    with pytest.raises(OSError):
        files.flush_directory(str(tmp_path))
    files.flush_directory(str(tmp_path))  # the next flush is a new one


def test_callers_covered_by_a_flush_that_stopped_on_an_unexpected_error_fail_too(tmp_path, monkeypatch):
    """A flush that ends in something other than an OSError did not flush anything: a caller it
    covered fails with an error rather than returning as if its change were on the disk."""
    directory = str(tmp_path)
    first_running, waiters_in, real_fsync = threading.Event(), threading.Event(), os.fsync
    calls = []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 1:  # flush 1 runs while two callers come and wait for flush 2
            first_running.set()
            assert waiters_in.wait(10)
            real_fsync(fd)
        elif len(calls) == 2:  # flush 2, run by one of them for both
            raise RuntimeError("not an OSError")
        else:
            real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    outcomes = {}

    def caller(name):
        try:
            files.flush_directory(directory)
            outcomes[name] = "flushed"
        except BaseException as error:
            outcomes[name] = type(error).__name__

    first = threading.Thread(target=caller, args=("first",))
    first.start()
    assert first_running.wait(10)
    later = [threading.Thread(target=caller, args=(name,)) for name in ("a", "b")]
    for thread in later:
        thread.start()
    flush = files._DirectoryFlush.of(directory)
    for _ in range(1000):  # both wait on the flush's condition now
        if len(flush._lock._waiters) == 2:
            break
        time.sleep(0.01)
    waiters_in.set()
    for thread in [first, *later]:
        thread.join(10)

    assert outcomes["first"] == "flushed" and len(calls) == 2
    assert sorted([outcomes["a"], outcomes["b"]]) == ["OSError", "RuntimeError"]  # the one that ran it, the one it covered


@pytest.mark.parametrize("removed", ["pending", "tmp", "done", "processing"])
def test_a_state_directory_removed_while_running_is_made_again(store, config, removed):
    (held,) = post(store, "held")
    claim = claim_one(store, config)
    if removed != "processing":
        shutil.rmtree(queue_dir(store) / removed)
    (item_id,) = post(store, "after")
    assert finish(store, config, held if removed != "processing" else item_id, "r").accepted
    assert store.read_item(queue=Q, item_id=item_id).status in ("pending", "finished")
    assert stat.S_IMODE(os.stat(queue_dir(store) / removed).st_mode) == 0o700
    assert claim.id == held


def test_a_new_file_whose_directory_is_removed_again_as_it_is_made_is_written_all_the_same(tmp_path, monkeypatch):
    """A schedule slot's directory, empty, may be removed by another process's look for due items
    the moment a post makes it again for its item's mark."""
    real_make_directory = files.make_directory
    removed = []

    def made_then_removed(path):
        real_make_directory(path)
        if not removed:
            removed.append(path)
            os.rmdir(path)

    monkeypatch.setattr(files, "make_directory", made_then_removed)
    path = str(tmp_path / "slot" / "mark")
    files.write_new(path, b"")
    assert removed == [str(tmp_path / "slot")] and os.path.exists(path)


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_everything_the_store_makes_is_owner_only_whatever_the_umask(tmp_path, config, umask):
    old = os.umask(umask)
    try:
        store = Store(tmp_path / "deep" / "data", fsync=True)
        first, second, third = post(store, 1, 2, 3)
        claim_one(store, config)
        finish(store, config, first, "r")
        store.read_item(queue=Q, item_id=first, fetch=True)
        store.sweep_queue(config=config)
        store.check_health()
    finally:
        os.umask(old)
    made = [tmp_path / "deep", *(tmp_path / "deep").rglob("*")]
    modes = {str(path.relative_to(tmp_path)): stat.S_IMODE(path.stat().st_mode) for path in made}
    assert {mode for path, mode in modes.items() if os.path.isdir(tmp_path / path)} == {0o700}, modes
    assert {mode for path, mode in modes.items() if not os.path.isdir(tmp_path / path)} == {0o600}, modes
    assert files_in(store, "fetched") == [first]


def test_posts_stop_at_the_free_space_reserve_while_results_go_on(tmp_path, config):
    free, _ = files.free_and_total_bytes(str(tmp_path))
    store = Store(tmp_path / "data", fsync=False, min_free_bytes=0)
    (item_id,) = post(store, 1)
    claim_one(store, config)
    full = Store(tmp_path / "data", fsync=False, min_free_bytes=free * 2)  # as if nearly full
    with pytest.raises(StorageUnavailable, match="nearly full"):
        post_batch(full, Q, [2])
    assert finish(full, config, item_id, "r").accepted
    assert not full.check_health().ok and store.check_health().ok
    assert files_in(store, "pending") == []
    with pytest.raises(StorageUnavailable, match="nearly full"):  # a retry posts a new item too
        full.retry_item(config=config, item_id=item_id)
    assert files_in(store, "pending") == [] and store.read_item(queue=Q, item_id=item_id).retried_as is None


def test_posts_that_share_a_failed_flush_all_fail_and_leave_nothing(tmp_path, monkeypatch):
    """Group commit: posts from many threads that arrive while pending/ is being flushed share the
    next flush of it; when that one fails, every post it covered fails (none is answered) and
    none of their items is left."""
    store = Store(tmp_path / "data", fsync=True)
    store.ensure_queue(Q)
    real_fsync, gate, pending_flushes = os.fsync, threading.Event(), []

    def second_pending_flush_fails(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/pending"):
            pending_flushes.append(fd)
            if len(pending_flushes) == 1:
                gate.wait(5)  # the other posts arrive meanwhile and wait for the next flush
            elif len(pending_flushes) == 2:
                raise OSError(errno.EIO, "the disk failed")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", second_pending_flush_fails)
    outcomes = {}

    def post_one(n):
        try:
            outcomes[n] = post_batch(store, Q, [n])[0].id
        except StorageUnavailable:
            outcomes[n] = None

    first = threading.Thread(target=post_one, args=(0,))
    first.start()
    while not pending_flushes:
        time.sleep(0.001)
    others = [threading.Thread(target=post_one, args=(n,)) for n in range(1, 9)]
    for thread in others:
        thread.start()
    time.sleep(0.3)
    gate.set()
    for thread in [first, *others]:
        thread.join()
    assert len(pending_flushes) == 2  # one flush for the first post, one shared by the eight others
    assert outcomes[0] is not None
    assert [outcomes[n] for n in range(1, 9)] == [None] * 8
    assert files_in(store, "pending") == [f"{outcomes[0]}.json"]
    assert half_written(store) == []


def test_a_write_that_fails_leaves_nothing(tmp_path, faults):
    directory = tmp_path / "tmp"
    directory.mkdir()
    faults.fail(calls={"write"}, error=errno.ENOSPC)
    with pytest.raises(OSError):
        files.write_new(str(directory / "new.json"), b"data")
    assert os.listdir(directory) == []


# ---- spare files: an old file retired is taken over by the next write -------------------------


def _old_file(directory, name: str, data: bytes) -> str:
    """An item's file as the store leaves it: owner-only, a claim record in an xattr."""
    directory.mkdir(exist_ok=True)
    path = directory / name
    path.write_bytes(data)
    path.chmod(0o600)
    os.setxattr(path, "user.taskhoster", b"1 2 3 claim")
    return str(path)


@pytest.mark.parametrize("size", [3000, 5])
def test_a_retired_file_is_taken_over_by_the_next_write_whole_and_bare(tmp_path, size):
    old = _old_file(tmp_path / "processing", "a.json", b"x" * size)
    inode = os.stat(old).st_ino
    files.retire(old, str(tmp_path / "tmp" / "a.1.spare"))
    assert os.listdir(tmp_path / "tmp") == ["a.1.spare"] and not os.path.exists(old)

    files.write_new(str(tmp_path / "tmp" / "b.2.json"), b"new content")

    new = tmp_path / "tmp" / "b.2.json"
    assert os.listdir(tmp_path / "tmp") == ["b.2.json"]
    assert os.stat(new).st_ino == inode
    assert new.read_bytes() == b"new content"  # nothing of the old bytes, shorter or longer
    assert os.listxattr(new) == []  # no claim record carried over to another item
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o600


def test_a_file_other_names_link_is_removed_not_reused(tmp_path):
    """An item's first file is linked by its idempotency key: reused, the key would name
    another item's content."""
    old = _old_file(tmp_path / "processing", "a.json", b"the keyed item")
    (tmp_path / "keys").mkdir()
    os.link(old, tmp_path / "keys" / "k")
    files.retire(old, str(tmp_path / "tmp" / "a.1.spare"))
    assert os.listdir(tmp_path / "tmp") == []

    files.write_new(str(tmp_path / "tmp" / "b.2.json"), b"new content")

    assert (tmp_path / "keys" / "k").read_bytes() == b"the keyed item"
    assert os.stat(tmp_path / "tmp" / "b.2.json").st_ino != os.stat(tmp_path / "keys" / "k").st_ino


@pytest.mark.parametrize("mode", [0o644, 0o700])
def test_a_file_not_as_the_store_makes_them_is_removed_not_reused(tmp_path, mode):
    old = _old_file(tmp_path / "processing", "a.json", b"someone's file")
    os.chmod(old, mode)
    files.retire(old, str(tmp_path / "tmp" / "a.1.spare"))
    assert os.listdir(tmp_path / "tmp") == []


def test_a_spare_removed_meanwhile_is_passed_over(tmp_path):
    for n in range(2):
        files.retire(_old_file(tmp_path / "processing", f"{n}.json", b"old"), str(tmp_path / "tmp" / f"{n}.spare"))
    os.unlink(tmp_path / "tmp" / "1.spare")  # the sweep, say
    files.write_new(str(tmp_path / "tmp" / "b.json"), b"new")
    files.write_new(str(tmp_path / "tmp" / "c.json"), b"new too")
    assert sorted(os.listdir(tmp_path / "tmp")) == ["b.json", "c.json"]
    assert (tmp_path / "tmp" / "c.json").read_bytes() == b"new too"


def test_spares_kept_are_bounded_the_rest_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MOST_SPARES", 2)
    for n in range(4):
        files.retire(_old_file(tmp_path / "processing", f"{n}.json", b"old"), str(tmp_path / "tmp" / f"{n}.spare"))
    assert sorted(os.listdir(tmp_path / "tmp")) == ["0.spare", "1.spare"]


def test_a_large_file_is_removed_not_kept_holding_its_blocks(tmp_path):
    files.retire(_old_file(tmp_path / "processing", "a.json", b"x" * 5000), str(tmp_path / "tmp" / "a.spare"))
    files.retire(_old_file(tmp_path / "processing", "b.json", b"x" * 4096), str(tmp_path / "tmp" / "b.spare"))
    assert os.listdir(tmp_path / "tmp") == ["b.spare"]


@pytest.mark.parametrize("fault", [dict(calls={"write"}, short=0), dict(calls={"truncate"}, error=errno.EIO)])
def test_a_write_into_a_spare_that_fails_leaves_nothing(tmp_path, faults, fault):
    """Never a file of the new name holding part of the old bytes (or zeros past the new ones)."""
    files.retire(_old_file(tmp_path / "processing", "a.json", b"x" * 3000), str(tmp_path / "tmp" / "a.spare"))
    faults.fail(at=1, **fault)
    with pytest.raises(OSError):
        files.write_new(str(tmp_path / "tmp" / "b.json"), b"new content")
    assert os.listdir(tmp_path / "tmp") == []


def test_the_old_file_of_an_item_that_ended_makes_the_next_post(store, config):
    """What a result frees, the next post takes: no file removed and made per item. The new item
    shows nothing of the old one (its claim record least of all)."""
    [first] = post(store, {"n": 1})
    claim_one(store, config)
    old_inode = os.stat(queue_dir(store) / "processing" / f"{first}.json").st_ino
    assert finish(store, config, first, "done").accepted
    assert [name.endswith(".spare") for name in files_in(store, "tmp")] == [True]

    [second] = post(store, {"n": 2})

    assert files_in(store, "tmp") == []
    assert os.stat(queue_dir(store) / "pending" / f"{second}.json").st_ino == old_inode
    item = store.read_item(queue=Q, item_id=second)
    assert (item.status, item.payload, item.claimed_at, item.claim_token, item.attempts) == ("pending", {"n": 2}, None, None, 0)
    assert store.read_item(queue=Q, item_id=first).result == "done"


def test_spares_a_stopped_server_left_are_removed_by_the_sweep_an_hour_later(store, config):
    [item_id] = post(store, {"n": 1})
    claim_one(store, config)
    finish(store, config, item_id, "done")
    [spare] = files_in(store, "tmp")
    store.sweep_queue(config=config)
    assert files_in(store, "tmp") == [spare]  # just kept: left alone
    os.utime(queue_dir(store) / "tmp" / spare, (0, 0))  # an hour and more later
    store.sweep_queue(config=config)
    assert files_in(store, "tmp") == []
    post(store, {"n": 2})  # the spare this process remembers is gone: a new file is made
    assert len(files_in(store, "pending")) == 1


def test_a_spare_of_the_same_item_is_not_taken_over(tmp_path):
    """After a power cut, a name of the item's old file that a state directory kept could share
    the inode with its new one."""
    files.retire(_old_file(tmp_path / "pending", "a.json", b"old"), str(tmp_path / "tmp" / "a.1.spare"))
    files.write_new(str(tmp_path / "tmp" / "a.2.json"), b"the same item again")
    assert sorted(os.listdir(tmp_path / "tmp")) == ["a.1.spare", "a.2.json"]
    files.write_new(str(tmp_path / "tmp" / "b.3.json"), b"another item")
    assert sorted(os.listdir(tmp_path / "tmp")) == ["a.2.json", "b.3.json"]


def test_a_spare_looks_new_before_it_takes_the_new_name(tmp_path, monkeypatch):
    """The sweep removes tmp/ files that look an hour old: never the file just being written."""
    spare = tmp_path / "tmp" / "a.spare"
    files.retire(_old_file(tmp_path / "pending", "a.json", b"old"), str(spare))
    os.utime(spare, (0, 0))
    seen = []

    def at(call, path):
        if call == "rename":
            seen.append(os.stat(spare).st_mtime)

    monkeypatch.setattr(files, "fault", at)
    files.write_new(str(tmp_path / "tmp" / "b.json"), b"new")
    assert seen and seen[0] > time.time() - 60


def test_a_spare_that_cannot_be_taken_over_is_removed_and_a_new_file_made(tmp_path, faults):
    files.retire(_old_file(tmp_path / "pending", "a.json", b"x" * 3000), str(tmp_path / "tmp" / "a.spare"))
    faults.fail(at=1, calls={"utime"})
    files.write_new(str(tmp_path / "tmp" / "b.json"), b"new")
    assert os.listdir(tmp_path / "tmp") == ["b.json"]
    assert (tmp_path / "tmp" / "b.json").read_bytes() == b"new"


def test_retiring_the_file_of_a_deleted_queue_makes_nothing_again(tmp_path):
    with pytest.raises(FileNotFoundError):
        files.retire(str(tmp_path / "gone" / "pending" / "a.json"), str(tmp_path / "gone" / "tmp" / "a.spare"))
    assert not (tmp_path / "gone").exists()


def test_only_the_stores_own_attributes_are_removed(tmp_path, monkeypatch):
    """A system's attribute (SELinux labels every file) cannot be removed and must not stop reuse."""
    removed = []

    def remove(path, name):
        if not name.startswith("user."):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        removed.append(name)

    monkeypatch.setattr(os, "listxattr", lambda path: ["security.selinux", "user.taskhoster"])
    monkeypatch.setattr(os, "removexattr", remove)
    files.retire(_old_file(tmp_path / "pending", "a.json", b"old"), str(tmp_path / "tmp" / "a.spare"))
    assert removed == ["user.taskhoster"] and os.listdir(tmp_path / "tmp") == ["a.spare"]


def test_without_xattr_calls_a_file_is_kept_all_the_same(tmp_path, monkeypatch):
    old = _old_file(tmp_path / "pending", "a.json", b"old")
    monkeypatch.delattr(os, "listxattr")  # as on macOS
    files.retire(old, str(tmp_path / "tmp" / "a.spare"))
    assert os.listdir(tmp_path / "tmp") == ["a.spare"]


def test_a_reader_that_read_a_file_taken_over_meanwhile_looks_again_before_quarantining(store, monkeypatch):
    """Without the item's lock, a reader may open a file that is then set aside and written over
    for another item: what it reads is not the item, but the item is fine."""
    [item_id] = post(store, {"n": 1})
    real_read, reads = files.read, []

    def read(path, **options):
        if "/pending/" in path:
            reads.append(path)
            if len(reads) == 1:
                return b'{"id": "another item"}', None
        return real_read(path, **options)

    monkeypatch.setattr(files, "read", read)
    assert store.read_item(queue=Q, item_id=item_id).payload == {"n": 1}
    assert len(reads) == 2 and files_in(store, "quarantine") == []


def test_threads_retiring_and_writing_at_once_never_share_a_file(tmp_path):
    """Each thread ends its own items (retiring their files) and writes new ones in one tmp/:
    every new file is its own inode holding exactly its bytes, whichever spare it took over."""
    (tmp_path / "tmp").mkdir()
    written: dict[str, bytes] = {}
    errors = []

    def work(thread: int):
        try:
            for n in range(200):
                old = _old_file(tmp_path / f"processing{thread}", f"o{thread}-{n}.json", b"o" * (n % 50 + 1))
                files.retire(old, str(tmp_path / "tmp" / f"o{thread}-{n}.x.spare"))
                name = str(tmp_path / "tmp" / f"n{thread}-{n}.x.json")
                data = f"thread {thread} file {n}".encode() * (n % 3 + 1)
                files.write_new(name, data)
                written[name] = data
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert errors == [] and len(written) == 800
    assert {name: open(name, "rb").read() for name in written} == written
    assert len({os.stat(name).st_ino for name in written}) == 800
    assert all(os.listxattr(name) == [] for name in written)
