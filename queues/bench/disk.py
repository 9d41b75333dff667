"""What the disk under the data directory takes to make one small file durable: write it, fsync
it, fsync its directory. A post answered with fsync on does at least that, so no such post can be
answered faster than this flush (and one producer posting one item at a time gets at most
1000 / p50 posts per second).

And what making the file alone took: every post and every result makes one, and on ext4 without
a journal it grows with the files deleted in the last minutes (their inodes are passed over one
by one), so it tells whether the disk was rested (docs/performance.md)."""

import os
import time
from pathlib import Path

from .workload import percentiles

FILE_BYTES = 200  # about one small item's file


def measure(directory: Path, *, tries: int) -> dict[str, dict[str, float]]:
    """`tries` new files of FILE_BYTES in `directory` (made if missing), each written, fsynced
    and its directory fsynced: that flush's p50 and p99 in milliseconds (flushMs), and those of
    making the file alone in microseconds (createUs). The files are left for the caller's clean-up."""
    directory.mkdir(parents=True, exist_ok=True)
    data = b"x" * FILE_BYTES
    took, made = [], []
    folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for number in range(tries):
            path = directory / f"flush-{number}"
            started = time.perf_counter()
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            made.append((time.perf_counter() - started) * 1e6)
            try:
                os.write(descriptor, data)
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
            os.fsync(folder)
            took.append((time.perf_counter() - started) * 1000)
    finally:
        os.close(folder)
    return {"flushMs": percentiles(took, 50, 99), "createUs": percentiles(made, 50, 99)}
