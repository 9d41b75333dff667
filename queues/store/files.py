"""Every call the store makes to the file system, each with its outcome checked.

- A file is written whole or not at all (`write_new`): a write the disk cuts short is carried on,
  one that writes nothing means the disk is full, and on any failure the file is removed.
- A file no longer needed is `retire`d: moved aside into the directory where files are made
  (tmp/), where the next file made takes it over instead of a new one. Ext4 without a journal
  does not reuse an inode removed in the last minutes: making a file scans past every such
  inode, so a store that removes a file for each it makes pays more per file the faster it goes.
- Files and directories reach the disk through `flush_files` (or `flush_open`) and
  `flush_directory`, made together with the other transitions on the event loop that ask in the
  same turn of it (group commit, turn.together): every file sent on its way before any is waited
  for, each directory flushed once. Threads share a directory's flush too: each waits for the
  first flush of the directory that starts after it asked, and one of them runs it for all.
- A directory that is missing where a file is made, moved or linked is made again (0700).
- Everything made is readable and writable by the server's user only (files 0600, directories
  0700), whatever the umask.

`fault` is the seam through which tests make any of these calls fail: when set, it is called
before each call with the call's name and path, and may raise an OSError (or, for "write", return
how many bytes to write at most, to cut a write short).
"""

import errno
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from . import turn

FILE_MODE = 0o600
DIRECTORY_MODE = 0o700
NO_XATTRS = (errno.ENOTSUP, errno.EOPNOTSUPP)
_START_WRITEBACK = hasattr(os, "posix_fadvise")  # not on macOS
_READ_SIZE = 1 << 16

MOST_SPARES = 256  # retired files kept for reuse, per directory; the rest are removed
LARGEST_SPARE = 4096  # bytes: a larger file is removed, not kept holding its blocks
DIRECTORY_REMADE_TIMES = 8  # a new file's missing directory is made again at most this often

fault: Callable[[str, str], int | None] | None = None
_spares: dict[str, list[str]] = {}  # directory -> the retired files in it this process may reuse

log = logging.getLogger(__name__)


def _before(call: str, path: str) -> int | None:
    return fault(call, path) if fault is not None else None


# ---- writing -------------------------------------------------------------------------------


def write_new(path: str, data: bytes, *, mtime: float | None = None) -> None:
    """Make the file `path` (it must not exist) holding `data`, with `mtime` if given."""
    fd = _written(path, data, mtime)
    try:
        _close(fd, path)
    except BaseException:
        remove_quietly(path)
        raise


@contextmanager
def new_file(path: str, data: bytes) -> Iterator[int]:
    """`write_new`, the file kept open for the block: its descriptor, to flush it through after
    it was moved (no second open). A failed close raises at the block's end, where the caller
    undoes what it did, as for any failure inside it."""
    fd = _written(path, data, None)
    try:
        yield fd
    finally:
        _close(fd, path)


def _close(fd: int, path: str) -> None:
    try:
        _before("close", path)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)


def _written(path: str, data: bytes, mtime: float | None) -> int:
    """The descriptor of a new file holding `data`; on any failure the file is removed."""
    fd, reused = _open_new(path)
    try:
        _write_all(fd, path, data)
        if reused:  # cut what is left of the old content
            _before("truncate", path)
            os.ftruncate(fd, len(data))
        if mtime is not None:
            _before("utime", path)
            os.utime(fd, (mtime, mtime))
    except BaseException:
        try:
            os.close(fd)
        finally:
            remove_quietly(path)
        raise
    return fd


def _open_new(path: str) -> tuple[int, bool]:
    """A descriptor of the file `path`, new or a retired file taken over (True: its old bytes
    are still there to be written over and cut). Files are retired into tmp/ only, where every
    name is new, so a rename onto `path` replaces nothing."""
    directory, name = os.path.split(path)
    spares = _spares.get(directory)
    while spares:
        try:
            spare = spares.pop()
        except IndexError:  # another thread took the last one
            break
        if os.path.basename(spare).partition(".")[0] == name.partition(".")[0]:
            # never the same item's older file (names in tmp/ begin with the item's id): after a
            # power cut, a name of it a state directory kept could share the inode with the new one
            spares.append(spare)
            break
        try:
            _before("utime", spare)
            os.utime(spare)  # first: the sweep never finds it under the new name looking old
            _before("rename", path)
            os.rename(spare, path)
        except FileNotFoundError:  # removed meanwhile: by the sweep, or with its queue
            continue
        except OSError:
            remove_quietly(spare)
            break
        try:
            _before("open", path)
            return os.open(path, os.O_WRONLY | os.O_CLOEXEC), True
        except BaseException:
            remove_quietly(path)
            raise
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    _before("create", path)
    for _ in range(DIRECTORY_REMADE_TIMES):
        try:
            return os.open(path, flags, FILE_MODE), False
        except FileNotFoundError:
            # made here, unless a removal of empty directories (a schedule slot that came and went)
            # takes it away again before the file is in it
            make_directory(os.path.dirname(path))
    return os.open(path, flags, FILE_MODE), False


def _write_all(fd: int, path: str, data: bytes) -> None:
    view = memoryview(data)
    while view:
        limit = _before("write", path)
        written = os.write(fd, view if limit is None else view[:limit])
        if written == 0:
            raise OSError(errno.ENOSPC, "no space left: the disk took none of the write", path)
        view = view[written:]


def append(fd: int, path: str, data: bytes) -> None:
    """Append to a file opened by `open_append` (one write: appends are atomic)."""
    limit = _before("write", path)
    if limit is not None and limit < len(data):
        raise OSError(errno.ENOSPC, "no space left", path)
    if os.write(fd, data) != len(data):
        raise OSError(errno.ENOSPC, "no space left: the append was cut short", path)


def open_append(path: str) -> int:
    _before("create", path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    try:
        return os.open(path, flags, FILE_MODE)
    except FileNotFoundError:
        make_directory(os.path.dirname(path))
        return os.open(path, flags, FILE_MODE)


def make_directory(path: str) -> None:
    """Make a directory and any missing parents, each 0700 (os.makedirs gives parents 0777)."""
    _before("mkdir", path)
    try:
        os.mkdir(path, DIRECTORY_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
    except FileNotFoundError:
        parent = os.path.dirname(path)
        if parent == path:
            raise
        make_directory(parent)
        try:
            os.mkdir(path, DIRECTORY_MODE)
        except FileExistsError:
            pass


def set_mtime(path: str, mtime: float) -> None:
    _before("utime", path)
    os.utime(path, (mtime, mtime))


def set_xattr(path: str, name: str, value: bytes) -> bool:
    """Set an extended attribute; False where the file system has none."""
    _before("setxattr", path)
    try:
        os.setxattr(path, name, value)
        return True
    except OSError as exc:
        if exc.errno in NO_XATTRS:
            return False
        raise


# ---- moving --------------------------------------------------------------------------------


def move(source: str, target: str) -> None:
    """Rename; FileNotFoundError if `source` is gone (someone else moved it first)."""
    _before("rename", target)
    try:
        os.rename(source, target)
    except FileNotFoundError:
        if not _remade_parent(target, source):
            raise
        os.rename(source, target)


def link(source: str, target: str) -> None:
    """Hard-link; FileExistsError if `target` exists, FileNotFoundError if `source` is gone."""
    _before("link", target)
    try:
        os.link(source, target)
    except FileNotFoundError:
        if not _remade_parent(target, source):
            raise
        os.link(source, target)


def _remade_parent(path: str, source: str) -> bool:
    """Make the directory `path` goes in if it is missing while `source` is still there (gone,
    perhaps with its deleted queue, it makes nothing again); True if it was made."""
    parent = os.path.dirname(path)
    if os.path.isdir(parent) or not os.path.lexists(source):
        return False
    make_directory(parent)
    return True


def remove(path: str) -> bool:
    """Remove a file; False if it was not there."""
    _before("unlink", path)
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def retire(path: str, aside: str) -> None:
    """Be done with the file at `path` (FileNotFoundError if it is gone): move it to `aside`, a
    new name in the directory where files are made, for the next file made there to take over,
    its extended attributes removed. One that other names link, one not as the store makes
    files (a plain file, owner-only), a large one, or one too many, is removed."""
    move(path, aside)
    spares = _spares.setdefault(os.path.dirname(aside), [])
    try:
        if len(spares) < MOST_SPARES and _reusable(os.lstat(aside)):
            _remove_xattrs(aside)
            _before("utime", aside)
            os.utime(aside)  # now: the sweep removes a spare only once it was left for an hour
            spares.append(aside)
            return
    except OSError:
        log.warning("could not keep %s for reuse", aside, exc_info=True)
    remove_quietly(aside)


def _reusable(info: os.stat_result) -> bool:
    return info.st_nlink == 1 and info.st_mode == stat.S_IFREG | FILE_MODE and info.st_size <= LARGEST_SPARE


def _remove_xattrs(path: str) -> None:
    """Remove the file's `user.` attributes, the store's own (others, such as SELinux's label,
    belong to the system)."""
    if not hasattr(os, "listxattr"):  # not on macOS
        return
    try:
        names = os.listxattr(path)
    except OSError as exc:
        if exc.errno in NO_XATTRS:
            return
        raise
    for name in names:
        if name.startswith("user."):
            _before("removexattr", path)
            os.removexattr(path, name)


def remove_tree(path: str) -> None:
    """Remove a directory and everything in it, or a file; nothing if it is missing."""
    _before("unlink", path)
    try:
        shutil.rmtree(path)
    except NotADirectoryError:
        remove(path)
    except FileNotFoundError:
        pass


def remove_directory(path: str) -> bool:
    """Remove an empty directory; False if it is missing or not empty."""
    _before("unlink", path)
    try:
        os.rmdir(path)
        return True
    except (FileNotFoundError, OSError) as exc:
        if isinstance(exc, FileNotFoundError) or exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise


def remove_quietly(path: str) -> None:
    """Remove a file as a clean-up after a failure, which is what gets raised: a clean-up that
    fails too is only logged (the sweep removes what is left in tmp/ after an hour)."""
    try:
        remove(path)
    except OSError:
        log.warning("could not remove %s", path, exc_info=True)


# ---- flushing ------------------------------------------------------------------------------


def flush_files(paths: list[str]) -> None:
    """Flush files to disk: several (with those other transitions on the loop ask for in the
    same turn, see turn.together) are all sent on their way first, then each is waited for."""
    turn.together(_flush_files, [(None, path) for path in paths])


def flush_open(fd: int, path: str) -> None:
    """Flush a file through a descriptor opened before it was moved (`path`: where it is now);
    the descriptor stays open until this returns, and the flush is done by then."""
    turn.together(_flush_files, [(fd, path)])


def _flush_files(requests: list[list[tuple[int | None, str]]]) -> list[BaseException | None]:
    """Flush the files of every request (each file its descriptor, or None to open it by its
    path), all sent on their way before any is waited for. Each request's outcome: None, or
    what its first failing file raised (its other files are not waited for)."""
    if sum(len(request) for request in requests) > 1 and _START_WRITEBACK:
        for request in requests:
            for fd, path in request:
                _start_writeback(fd, path)
    outcomes: list[BaseException | None] = []
    for request in requests:
        try:
            for fd, path in request:
                _flush_file(fd, path)
        except BaseException as error:
            outcomes.append(error)
        else:
            outcomes.append(None)
    return outcomes


def _start_writeback(fd: int | None, path: str) -> None:
    """Start writing the file out, without waiting (pages being written stay cached). Only a
    hint: if it fails, the file's own flush after it says whether the file reached the disk."""
    try:
        if fd is not None:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return
        fd = _open_to_read(path)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError:
        pass


def _open_to_read(path: str) -> int:
    _before("open", path)
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def _flush_file(fd: int | None, path: str) -> None:
    """Flush one file through its descriptor, or None to open it by its path."""
    if fd is None:
        _fsync(path)
    else:
        _before("fsync", path)
        os.fsync(fd)


def _fsync(path: str) -> None:
    """Flush one file or directory, by its path."""
    fd = _open_to_read(path)
    try:
        _before("fsync", path)
        os.fsync(fd)
    finally:
        os.close(fd)


def flush_directory(path: str) -> None:
    """Flush a directory's entries to disk, sharing the flush with concurrent callers."""
    # whole, out of the turn: the turn is never waited for holding the flush's lock
    turn.together(_DirectoryFlush.of(path).flush_for, path)


class _DirectoryFlush:
    """Flushes of one directory in this process. A caller's change is covered by the first flush
    that starts after it asked; while one flush runs, the callers that come meanwhile wait, and
    the next flush covers them all. A flush that fails fails every caller it covered."""

    _known: dict[str, "_DirectoryFlush"] = {}
    _known_lock = threading.Lock()
    _KEEP_ERRORS = 64  # a waiter learns its flush's outcome long before 64 more flushes end
    # directories remembered (schedule slots come and go); forgetting one is safe, for a new
    # flush of it covers all that asked after it started: only a chance to share is lost
    MOST_KNOWN = 4096

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Condition()
        self._started = 0
        self._ended = 0
        self._running = False
        self._errors: dict[int, OSError] = {}

    @classmethod
    def of(cls, path: str) -> "_DirectoryFlush":
        flush = cls._known.get(path)
        if flush is None:
            with cls._known_lock:
                if len(cls._known) >= cls.MOST_KNOWN:
                    for oldest in list(cls._known)[: cls.MOST_KNOWN // 2]:
                        del cls._known[oldest]
                flush = cls._known.setdefault(path, cls(path))
        return flush

    @classmethod
    def forget_below(cls, prefix: str) -> None:
        with cls._known_lock:
            for path in [p for p in cls._known if p.startswith(prefix)]:
                del cls._known[path]

    def flush_for(self, callers: list) -> list[OSError | None]:
        """One flush for all `callers` (transitions that asked together): each one's outcome."""
        try:
            self.flush()
        except OSError as error:
            return [error] * len(callers)
        return [None] * len(callers)

    def flush(self) -> None:
        with self._lock:
            wanted = self._started + 1  # a flush already running may have begun before our change
            while self._ended < wanted:
                if self._running:
                    self._lock.wait()
                else:
                    self._run_one()
            error = self._errors.get(wanted)
        if error is not None:
            raise OSError(error.errno, error.strerror, self.path)

    def _run_one(self) -> None:
        """Run the next flush, the lock released meanwhile. Call holding the lock."""
        self._running = True
        self._started += 1
        number = self._started
        self._lock.release()
        error = None
        try:
            _fsync(self.path)
        except OSError as exc:
            error = exc
        except BaseException as exc:  # the callers it covered were not flushed either
            error = OSError(errno.EIO, f"the flush did not finish: {exc!r}")
            raise
        finally:
            self._lock.acquire()
            self._running = False
            self._ended = number
            if error is not None:
                self._errors[number] = error
            self._errors.pop(number - self._KEEP_ERRORS, None)
            self._lock.notify_all()


def forget_directories(prefix: str) -> None:
    """Drop what is kept about directories below `prefix` (a queue being deleted)."""
    _DirectoryFlush.forget_below(prefix)
    for directory in [d for d in list(_spares) if d.startswith(prefix)]:
        _spares.pop(directory, None)


# ---- reading -------------------------------------------------------------------------------


def read(path: str, *, xattr: str | None = None) -> tuple[bytes, bytes | None]:
    """A file's bytes, and the extended attribute `xattr` if asked for and present (None where
    the file has none, or the file system has no xattrs)."""
    _before("open", path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # not open(): a buffered file costs more calls
    try:
        chunk = os.read(fd, _READ_SIZE)
        if len(chunk) == _READ_SIZE:
            chunks = [chunk]
            while chunk := os.read(fd, _READ_SIZE):
                chunks.append(chunk)
            chunk = b"".join(chunks)
        return chunk, _get_xattr(fd, xattr) if xattr else None
    finally:
        os.close(fd)


def _get_xattr(fd: int, name: str) -> bytes | None:
    try:
        return os.getxattr(fd, name)
    except OSError as exc:
        if exc.errno == errno.ENODATA or exc.errno in NO_XATTRS:
            return None
        raise


def names(directory: str) -> list[str]:
    """The names in a directory; none if it is missing."""
    _before("listdir", directory)
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


@contextmanager
def scan(directory: str) -> Iterator[Iterator[str]]:
    """The names in a directory, one at a time (a directory may hold a million); none if it is
    missing."""
    _before("listdir", directory)
    try:
        entries = os.scandir(directory)
    except FileNotFoundError:
        yield iter(())
        return
    with entries:
        yield (entry.name for entry in entries)


def any_entry(directory: str) -> bool:
    """Whether a directory has any entry; reads only the first of however many."""
    _before("scandir", directory)
    try:
        with os.scandir(directory) as entries:
            return next(entries, None) is not None
    except FileNotFoundError:
        return False


def status(path: str) -> os.stat_result | None:
    """The file's stat; None if it is not there."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def exists(path: str) -> bool:
    return status(path) is not None


def free_and_total_bytes(path: str) -> tuple[int, int]:
    """Free bytes (for the server's user) and the size of the file system holding `path`."""
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize, info.f_blocks * info.f_frsize


def identity(path: str) -> tuple[int, int, int]:
    """What changes whenever a transition replaces the file at `path` or records a claim on it:
    a rewrite is a new inode, and a claim or an extension also moves the mtime (the lease) and
    the ctime (its record)."""
    info = os.stat(path)
    return info.st_ino, info.st_ctime_ns, info.st_mtime_ns
