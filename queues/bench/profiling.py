"""Profiles of a server process while one measurement runs, taken with py-spy (a sampling
profiler that sees every thread, the store's threads included; `pip install py-spy`).

Each recording is py-spy's raw collapsed stacks (`thread (tid): name;frame;frame... count`, for
flamegraph.pl or speedscope), taken two ways (wall clock, and GIL holder only), each with a
`.top.txt` beside it: the CPU time the process used meanwhile, where the samples went by thread,
and the functions that cost most, over the samples that were not idle waits.
"""

import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SAMPLES_PER_SECOND = 250
STOP_TIMEOUT = 30.0
TOP = 30
# leaf frames of a thread that waits for work: the event loop's select, a pool thread's queue,
# the sweep's pause. What is left is work, or waiting on the disk (an fsync shows as its caller).
IDLE_LEAVES = {"select", "_worker", "wait"}
_FRAME = re.compile(r"^(?P<function>.+?) \((?P<file>.+?)(?::\d+)?\)$")


def find_py_spy() -> str:
    found = shutil.which("py-spy")
    if found is None:
        raise RuntimeError("--profile needs py-spy on PATH (pip install py-spy)")
    return found


@contextmanager
def recording(py_spy: str, pid: int, path: Path) -> Iterator[None]:
    """Sample process `pid` until the block ends, two ways at once: every thread, idle ones too
    (`path`: wall clock, so disk waits show), and only the thread holding the GIL
    (`<path>.gil.txt`: where the Python CPU goes). Each gets a summary beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    paths = {path: ["--idle"], path.with_suffix(".gil.txt"): ["--gil"]}
    samplers = [
        subprocess.Popen(
            [py_spy, "record", "--pid", str(pid), "--format", "raw", "--output", str(output),
             "--rate", str(SAMPLES_PER_SECOND), "--threads", "--nonblocking", *how],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for output, how in paths.items()
    ]
    cpu_before, started = cpu_seconds(pid), time.monotonic()
    try:
        yield
    finally:
        cpu, wall = cpu_seconds(pid) - cpu_before, time.monotonic() - started
        for sampler in samplers:
            sampler.send_signal(signal.SIGINT)  # py-spy writes what it has on Ctrl-C
        for sampler in samplers:
            sampler.wait(STOP_TIMEOUT)
    used = f"process {pid}: {cpu:.2f} s of CPU in {wall:.2f} s ({cpu / wall:.0%} of one core)\n"
    for output in paths:
        if output.exists():
            output.with_suffix(".top.txt").write_text(used + summary(output.read_text()))


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time the process has used so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(raw: str, *, top: int = TOP) -> str:
    """Shares of the samples by thread, then the costliest functions over the busy samples:
    inclusive (the function or anything it called) and self (the function itself)."""
    by_thread: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        total += samples
        thread, *frames = stack.split(";")
        names = [_name(frame) for frame in frames]
        if not names or _function(names[-1]) in IDLE_LEAVES:
            continue
        by_thread[_thread_kind(thread)] += samples
        own[names[-1]] += samples
        for name in set(names):
            inclusive[name] += samples
    busy = sum(by_thread.values())
    lines = [f"{total} samples, {busy} busy ({busy / max(total, 1):.0%}); idle: leaf frame in {sorted(IDLE_LEAVES)}"]
    for title, counter in (("by thread", by_thread), ("inclusive", inclusive), ("self", own)):
        lines += ["", f"{title}, % of busy samples:"]
        lines += [f"  {n / max(busy, 1):6.1%}  {name}" for name, n in counter.most_common(top)]
    return "\n".join(lines) + "\n"


def _thread_kind(thread: str) -> str:
    """`thread (123): store_4` -> `store`: threads of one pool count together."""
    name = thread.partition(": ")[2] or thread
    return re.sub(r"[_-]?\d+$", "", name)


def _function(name: str) -> str:
    """`EpollSelector.select (selectors.py)` -> `select`."""
    return name.partition(" ")[0].rpartition(".")[2]


def _name(frame: str) -> str:
    """`post_items (queues/store.py:512)` -> `post_items (queues/store.py)`: lines of one
    function count together."""
    found = _FRAME.match(frame)
    if found is None:
        return frame
    return f"{found['function']} ({found['file']})"
