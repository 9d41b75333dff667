"""Another process holding every item lock of a queue, for tests of waits on other processes'
locks. Run as a script, this module is that process."""

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

HERE = Path(__file__).resolve()
PROJECT = HERE.parent.parent
HANG_SECONDS = 120


@contextmanager
def item_locks_held_elsewhere(data_dir: Path, queue: str) -> Iterator[Callable[[], None]]:
    """From the start of the block another process holds every item lock of `queue`; what the
    block is given lets them go (its end does too)."""
    ready, release = data_dir.parent / "holder-ready", data_dir.parent / "holder-release"
    holder = subprocess.Popen(
        [sys.executable, str(HERE), str(data_dir), queue, str(ready), str(release)],
        cwd=PROJECT, env={**os.environ, "PYTHONPATH": str(PROJECT)},
    )
    try:
        deadline = time.monotonic() + HANG_SECONDS
        while not ready.exists():
            assert holder.poll() is None, "the lock holder died"
            assert time.monotonic() < deadline, "the lock holder never took the locks"
            time.sleep(0.01)
        yield lambda: release.write_text("go")
    finally:
        release.write_text("go")
        holder.wait(HANG_SECONDS)


def _hold(data_dir: str, queue: str, ready: str, release: str) -> None:
    from queues.store import Store
    from queues.store.locks import ITEM_STRIPES, QueueLocks

    Store(data_dir, fsync=False).ensure_queue(queue)
    locks = QueueLocks.for_file(f"{data_dir}/{queue}/locks/items")
    with ExitStack() as stack:
        for stripe in range(ITEM_STRIPES):
            stack.enter_context(locks.hold(f"{stripe:02x}"))
        Path(ready).write_text("held")
        deadline = time.monotonic() + HANG_SECONDS  # a test stuck waiting on them then fails
        while not Path(release).exists() and time.monotonic() < deadline:
            time.sleep(0.01)


if __name__ == "__main__":
    _hold(*sys.argv[1:])
