"""`manage.py bench`: what it measures, in which order, on which servers.

On its own servers (the default), per fsync mode:
- a fresh installation serves the posts, the end-to-end run and the round trips: posts go to a
  queue no worker works, the rest to a queue the worker processes work;
- one installation with a big queue (filled through the store before its servers start) is
  served once per mode: a fresh server's first claims on it, and its peak memory;
- the store alone (queues/bench/store_costs.py): a claim's cost per pending size.
Then one quiet sweep pass over the biggest queue (it writes nothing, so fsync plays no part).

With `url`, only what goes through the API is measured (posts, end to end, round trips), on
queues that must exist there: the disk and the memory of a server elsewhere are out of reach.
"""

import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

from .lean_client import LeanProducer

from ..serving import DEFAULT_SERVER
from ..store import MAX_BATCH, NewItem, QueueConfig, Store
from . import load, store_costs
from .profiling import find_py_spy, recording
from .servers import Deployment, ServerProcess
from .workers import WorkerPool

MEASURES = ("posts", "end-to-end", "round-trip", "claim", "big-queue", "sweep")
API_MEASURES = ("posts", "end-to-end", "round-trip")
WORKED = ("end-to-end", "round-trip")
BYTES_PER_ITEM = 4096 + 512  # one small file: a block, plus its inode and directory entry
BIG_QUEUE = "bench-big"

Say = Callable[[str], None]


class BadSettings(ValueError):
    """Settings the bench cannot run with; the message says which and why."""


@dataclass(frozen=True)
class BenchSettings:
    items: int = 5000
    workers: int = 2
    batch: int = 100
    claim_batch: int = 100
    round_trips: int = 500
    pending_sizes: tuple[int, ...] = (10, 100_000, 1_000_000)
    post_seconds: float = 5.0
    server_claims: int = 200
    fsync: tuple[bool, ...] = (True, False)
    measures: tuple[str, ...] = MEASURES
    post_queue: str = "bench-posts"
    work_queue: str = "bench-work"
    url: str | None = None
    token: str | None = None
    profile_dir: Path | None = None
    server: str | None = None  # serve's --server for our own servers; None: serve's default

    @property
    def biggest(self) -> int:
        return max(self.pending_sizes)

    def describe(self) -> dict:
        """The settings as the JSON line shows them."""
        described = {
            "items": self.items, "workers": self.workers, "batch": self.batch, "claimBatch": self.claim_batch,
            "roundTrips": self.round_trips, "postSeconds": self.post_seconds, "measures": list(self.measures),
        }
        if self.url:
            described["url"] = self.url
            return described
        described["fsync"] = [_label(fsync) for fsync in self.fsync]
        described["server"] = self.server or DEFAULT_SERVER  # which one was measured, always
        if _disk_heavy(self):
            described["pendingSizes"] = list(self.pending_sizes)
        return described


QUICK = BenchSettings(items=500, round_trips=50, pending_sizes=(10, 2000), post_seconds=1.0, server_claims=20)


def check(settings: BenchSettings) -> None:
    """Refuse settings that cannot work, before anything starts."""
    if min(settings.items, settings.workers, settings.server_claims) < 1:
        raise BadSettings("--items, --workers and --server-claims must be at least 1")
    if not 1 <= settings.batch <= MAX_BATCH:
        raise BadSettings(f"--batch must be 1 to {MAX_BATCH} (the API's limit per post)")
    if not 1 <= settings.claim_batch <= 100:
        raise BadSettings("--claim-batch must be 1 to 100 (the API's limit per claim)")
    if settings.round_trips < 2:
        raise BadSettings("--round-trips must be at least 2, to give percentiles")
    if not settings.pending_sizes or min(settings.pending_sizes) < 1:
        raise BadSettings("--pending-sizes must be whole numbers of at least 1")
    if settings.post_seconds <= 0:
        raise BadSettings("--post-seconds must be more than 0")
    unknown = set(settings.measures) - set(MEASURES)
    if unknown or not settings.measures:
        raise BadSettings(f"--only takes some of: {', '.join(MEASURES)}")
    if settings.url:
        if not settings.token:
            raise BadSettings("--url needs --token (one that may produce and work on both bench queues)")
        if set(settings.measures) - set(API_MEASURES):
            raise BadSettings(f"with --url only {', '.join(API_MEASURES)} can be measured (pass --only)")
        if settings.profile_dir:
            raise BadSettings("--profile samples the bench's own servers; it cannot be used with --url")
        if settings.server:
            raise BadSettings("--server chooses the bench's own servers; it cannot be used with --url")
    if settings.profile_dir:
        try:
            find_py_spy()
        except RuntimeError as exc:
            raise BadSettings(str(exc)) from exc
    if _disk_heavy(settings):
        check_disk_space(Path(tempfile.gettempdir()), settings.biggest)


def _disk_heavy(settings: BenchSettings) -> bool:
    return not settings.url and bool({"claim", "big-queue", "sweep"} & set(settings.measures))


def check_disk_space(directory: Path, items: int) -> None:
    """The biggest queue is built one at a time (each removed before the next): one must fit,
    in bytes and in files."""
    needed, free = items * BYTES_PER_ITEM * 1.1, shutil.disk_usage(directory).free
    files, free_files = items * 1.1, os.statvfs(directory).f_favail
    if free < needed or free_files < files:
        raise BadSettings(
            f"{items:,} pending items need about {needed / 1e9:.1f} GB and {files:,.0f} files in {directory}, "
            f"which has {free / 1e9:.1f} GB and {free_files:,} files free: pass smaller --pending-sizes, "
            f"or set TMPDIR to a bigger disk"
        )


def run(settings: BenchSettings, say: Say) -> dict:
    """Every selected measurement; the figures as the JSON line shows them."""
    check(settings)
    report: dict = {"settings": settings.describe()}
    if settings.url:
        report["server"] = _api_figures(settings, settings.url, settings.token, None, "server", say)
    else:
        _own_figures(settings, report, say)
    return _rounded(report)


def _own_figures(settings: BenchSettings, report: dict, say: Say) -> None:
    figures = report["fsync"] = {_label(fsync): {} for fsync in settings.fsync}
    with tempfile.TemporaryDirectory(prefix="taskhoster-bench-") as root:
        if set(API_MEASURES) & set(settings.measures):
            for fsync in settings.fsync:
                installation = Path(root) / f"api-{_label(fsync)}"
                figures[_label(fsync)].update(_own_api_figures(settings, installation, fsync, say))
        if "big-queue" in settings.measures:
            for fsync, measured in _big_queue_figures(settings, Path(root) / "big", say).items():
                figures[_label(fsync)]["bigQueue"] = measured
    if "claim" in settings.measures:
        for fsync in settings.fsync:
            figures[_label(fsync)]["claimMicroseconds"] = _claim_costs(settings, fsync, say)
    if "sweep" in settings.measures:
        say(f"one quiet sweep pass over {settings.biggest:,} pending items (the store alone)")
        report["quietSweepSeconds"] = {str(settings.biggest): store_costs.quiet_sweep_seconds(settings.biggest)}


def _rounded(value):
    """Four significant digits are more than these measurements can tell apart."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    return value


def _label(fsync: bool) -> str:
    return "on" if fsync else "off"


def _own_api_figures(settings: BenchSettings, root: Path, fsync: bool, say: Say) -> dict:
    label = f"fsync {_label(fsync)}"
    say(f"{label}: preparing an installation in {root}")
    deployment = Deployment(root)
    deployment.prepare(queues=[settings.post_queue, settings.work_queue])
    with deployment.server(fsync=fsync, server=settings.server) as server:
        say(f"{label}: serve pid {server.pid} at {server.url}")
        return _api_figures(settings, server.url, deployment.token, server, label, say)


def _api_figures(
    settings: BenchSettings, url: str, token: str, server: ServerProcess | None, label: str, say: Say
) -> dict:
    figures: dict = {}
    profile = _profiler(settings, server, label)
    with LeanProducer(url, token, timeout=120) as producer, ExitStack() as stack:
        if "posts" in settings.measures:
            say(f"{label}: single posts, then {settings.batch}-item batches, {settings.post_seconds:g} s each")
            with profile("posts-single"):
                figures["singlePostsPerSecond"] = load.single_posts_per_second(
                    producer, settings.post_queue, seconds=settings.post_seconds
                )
            with profile("posts-batch"):
                figures["batchItemsPerSecond"] = load.batch_items_per_second(
                    producer, settings.post_queue, seconds=settings.post_seconds, batch=settings.batch
                )
        if not set(WORKED) & set(settings.measures):
            return figures
        say(f"{label}: starting {settings.workers} worker processes, claiming up to {settings.claim_batch} each")
        pool = stack.enter_context(
            WorkerPool(
                url=url, token=token, queue=settings.work_queue, count=settings.workers,
                claim_batch=settings.claim_batch,
            )
        )
        say(f"{label}: the workers are warm after {pool.warm_up(producer)} warm-up items")
        if "end-to-end" in settings.measures:
            say(f"{label}: {settings.items:,} items end to end, posted {settings.batch} at a time")
            with profile("end-to-end"):
                figures["endToEndItemsPerSecond"] = load.end_to_end_items_per_second(
                    producer, settings.work_queue, items=settings.items, batch=settings.batch
                )
        if "round-trip" in settings.measures:
            say(f"{label}: {settings.round_trips} round trips")
            with profile("round-trip"):
                figures["roundTripMs"] = load.round_trip_ms(producer, settings.work_queue, count=settings.round_trips)
    return figures


def _profiler(settings: BenchSettings, server: ServerProcess | None, label: str):
    """A context manager factory: `profile(name)` records the server while the block runs
    (when --profile is given), else does nothing."""
    if settings.profile_dir is None or server is None:
        return lambda name: nullcontext()
    py_spy = find_py_spy()
    prefix = label.replace(" ", "-")
    return lambda name: recording(py_spy, server.pid, settings.profile_dir / f"{prefix}-{name}.txt")


def _big_queue_figures(settings: BenchSettings, root: Path, say: Say) -> dict[bool, dict]:
    """Fill one queue through the store (fsync off, 1,000 per batch) before any server starts,
    then per mode: a fresh server's first claim and mean claim on it, over HTTP, and the server's
    peak memory after them. The installation is removed at the end (it may be gigabytes)."""
    size = settings.biggest
    deployment = Deployment(root)
    deployment.prepare(queues=[BIG_QUEUE])
    say(f"filling {BIG_QUEUE} with {size:,} pending items")
    fill(deployment.data_dir, BIG_QUEUE, size, say)
    measured = {}
    try:
        for fsync in settings.fsync:
            label = f"fsync {_label(fsync)}"
            with deployment.server(fsync=fsync, server=settings.server) as server:
                say(f"{label}: serve pid {server.pid}: {settings.server_claims} claims on {size:,} pending items")
                with _profiler(settings, server, label)("big-queue"):
                    claims = load.http_claims_ms(server.url, deployment.token, BIG_QUEUE, claims=settings.server_claims)
                measured[fsync] = {"pending": size, **claims, "serverPeakMemoryMB": server.peak_memory_mb()}
    finally:
        say(f"removing the {size:,}-item installation")
        shutil.rmtree(root, ignore_errors=True)
    return measured


def fill(data_dir: Path, queue: str, count: int, say: Say) -> None:
    store = Store(data_dir, fsync=False)
    for start in range(0, count, MAX_BATCH):
        store.post_items(config=QueueConfig(name=queue), items=[NewItem(load.PAYLOAD)] * min(MAX_BATCH, count - start))
        if start and start % 100_000 == 0:
            say(f"  {start:,} written")


def _claim_costs(settings: BenchSettings, fsync: bool, say: Say) -> dict[str, float]:
    costs = {}
    for pending in settings.pending_sizes:
        say(f"fsync {_label(fsync)}: a claim's cost with {pending:,} pending items (the store alone)")
        costs[str(pending)] = store_costs.claim_cost(pending, fsync=fsync) * 1e6
    return costs


def settings_from(options: dict) -> BenchSettings:
    """Settings from the command's options: --quick's sizes, then whatever was given."""
    base = QUICK if options.get("quick") else BenchSettings()
    given = {name: value for name, value in options.items() if value is not None and name in _FIELDS}
    return replace(base, **given)


_FIELDS = set(BenchSettings.__dataclass_fields__)
