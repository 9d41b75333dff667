"""`manage.py bench`: what it measures, in which order, on which servers.

First, the client library's own CPU per call (client_cpu.py), against stub servers in a process
of their own: no Taskhoster server is needed, so it is measured with `url` too. Then what users
see: Taskhoster driven through our own client (`taskhoster.Producer` posting, `taskhoster.Worker`
processes working), on the same workload as the peers (workload.py), plus concurrent producers
and batches (client.py). Beside it, the server alone (load.py): the same server driven by a lean
raw-socket producer, so the figures are the server's and not an HTTP library's, with its
end-to-end items posted in batches.

On its own servers (the default):
- the disk first: one small file made durable (write, fsync, directory fsync) in the bench's
  temporary directory (TMPDIR), where the data directories are (disk.py);
- per fsync mode, a fresh installation serves the client's and the server-alone measures: worked
  ones first (2 worker processes on one queue), then posts to a queue no worker works;
- one installation with a big queue (filled through the store before its servers start) is
  served once per mode: a fresh server's first claims on it, and its peak memory;
- the store alone (queues/bench/store_costs.py): a claim's cost per pending size, then one quiet
  sweep pass over the biggest queue (it writes nothing, so fsync plays no part).
With `peers`, last: each peer on its own Redis, in memory and durable (peers.py), on what of
client-end-to-end, client-round-trip and client-producers is selected, with its workers running
while ours do: during the workload, and no longer for the concurrent producers.

With `url`, only what goes through the API is measured, on queues that must exist there: the
disk and the memory of a server elsewhere are out of reach.
"""

import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

from taskhoster import Producer

from ..serving import DEFAULT_SERVER
from ..store import MAX_BATCH, NewItem, QueueConfig, Store
from . import client, client_cpu, disk, load, peers, report, store_costs, workload
from .lean_client import LeanProducer
from .profiling import cpu_seconds, find_py_spy, recording
from .servers import Deployment, ServerProcess
from .workers import WorkerPool

CLIENT_MEASURES = ("client-end-to-end", "client-round-trip", "client-producers", "client-batches", "client-keys")
SERVER_MEASURES = ("server-posts", "server-end-to-end", "server-round-trip")
API_MEASURES = CLIENT_MEASURES + SERVER_MEASURES
SERVERLESS_MEASURES = ("client-cpu",)  # against stub servers: measured with --url too
MEASURES = ("disk", "client-cpu", *API_MEASURES, "claim", "big-queue", "sweep", "scheduled", "keys")
# --only shorthands; posts, end-to-end and round-trip are the server-alone measures' names in
# earlier builds, so one command measures an earlier build and this one alike
GROUPS = {
    "client": ("client-cpu", *CLIENT_MEASURES),
    "server": SERVER_MEASURES,
    "posts": ("server-posts",),
    "end-to-end": ("server-end-to-end",),
    "round-trip": ("server-round-trip",),
}
WORKED = ("client-end-to-end", "client-round-trip", "client-batches", "server-end-to-end", "server-round-trip")
PEER_MEASURES = ("client-end-to-end", "client-round-trip", "client-producers")  # the peers' figures beside these
BYTES_PER_ITEM = 4096 + 512  # one small file: a block, plus its inode and directory entry
BIG_QUEUE = "bench-big"
URL_LABEL = "at url"  # the key of a server given by --url, in place of "fsync on"/"fsync off"

Say = Callable[[str], None]


class BadSettings(ValueError):
    """Settings the bench cannot run with; the message says which and why."""


@dataclass(frozen=True)
class BenchSettings:
    items: int = 5000
    workers: int = 2
    batch: int = 100
    claim_batch: int = 100
    round_trips: int = 200
    producers: tuple[int, ...] = (1, 8, 64)
    pending_sizes: tuple[int, ...] = (10, 100_000, 1_000_000)
    scheduled_items: int = 1_000_000
    due_together: int = 100_000
    keyed_items: int = 1_000_000
    post_seconds: float = 5.0
    cpu_calls: int = 3000
    server_claims: int = 200
    flush_tries: int = 300
    fsync: tuple[bool, ...] = (True, False)
    measures: tuple[str, ...] = MEASURES
    peers: tuple[str, ...] = ()
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
        if "client-producers" in self.measures:
            described["producers"] = list(self.producers)
        if "client-cpu" in self.measures:
            described["cpuCalls"] = self.cpu_calls
        if self.peers:
            described["peers"] = list(self.peers)
            described["peerVersions"] = peers.versions(self.peers)
            described["celeryWorkers"] = peers.CELERY_WORKERS
            if "client-producers" in self.measures:
                described["peerProducers"] = peers.PRODUCER_THREADS
        if self.url:
            described["url"] = self.url
            return described
        described["fsync"] = ["on" if fsync else "off" for fsync in self.fsync]
        described["server"] = self.server or DEFAULT_SERVER  # which one was measured, always
        described["tmpdir"] = tempfile.gettempdir()  # where the data directories (and Redis' files) are
        if "disk" in self.measures:
            described["flushTries"] = self.flush_tries
        if {"claim", "big-queue", "sweep"} & set(self.measures):
            described["pendingSizes"] = list(self.pending_sizes)
        if "scheduled" in self.measures:
            described["scheduledItems"], described["dueTogether"] = self.scheduled_items, self.due_together
        if "keys" in self.measures:
            described["keyedItems"] = self.keyed_items
        return described


QUICK = BenchSettings(
    items=500, round_trips=50, producers=(1, 8), pending_sizes=(10, 2000), post_seconds=0.5, server_claims=20,
    flush_tries=50, scheduled_items=2000, due_together=1000, keyed_items=2000, cpu_calls=200,
)


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
    if settings.flush_tries < 2:
        raise BadSettings("--flush-tries must be at least 2, to give percentiles")
    if not settings.producers or min(settings.producers) < 1:
        raise BadSettings("--producers must be whole numbers of at least 1")
    if not settings.pending_sizes or min(settings.pending_sizes) < 1:
        raise BadSettings("--pending-sizes must be whole numbers of at least 1")
    if min(settings.scheduled_items, settings.due_together) < 1:
        raise BadSettings("--scheduled-items and --due-together must be at least 1")
    if settings.keyed_items < 10:
        raise BadSettings("--keyed-items must be at least 10 (a keyed post is measured beside 10 and beside them)")
    if settings.post_seconds <= 0:
        raise BadSettings("--post-seconds must be more than 0")
    if "client-cpu" in settings.measures and settings.cpu_calls < client_cpu.BATCH:
        raise BadSettings(f"--cpu-calls must be at least {client_cpu.BATCH} (a batched worker's items come "
                          f"{client_cpu.BATCH} a claim)")
    unknown = set(settings.measures) - set(MEASURES)
    if unknown or not settings.measures:
        raise BadSettings(f"--only takes some of: {', '.join((*MEASURES, *GROUPS))}")
    if settings.url:
        if not settings.token:
            raise BadSettings("--url needs --token (one that may produce and work on both bench queues)")
        if set(settings.measures) - set(API_MEASURES) - set(SERVERLESS_MEASURES):
            raise BadSettings(f"with --url only {', '.join((*SERVERLESS_MEASURES, *API_MEASURES))} can be "
                              f"measured (pass --only)")
        if settings.profile_dir:
            raise BadSettings("--profile samples the bench's own servers; it cannot be used with --url")
        if settings.server:
            raise BadSettings("--server chooses the bench's own servers; it cannot be used with --url")
    if settings.peers:
        if not set(PEER_MEASURES) & set(settings.measures):
            raise BadSettings(f"--peers measures the peers beside some of {', '.join(PEER_MEASURES)}: "
                              f"select one with --only")
        try:
            peers.check_peers(settings.peers)
        except RuntimeError as exc:
            raise BadSettings(str(exc)) from exc
    if settings.profile_dir:
        try:
            find_py_spy()
        except RuntimeError as exc:
            raise BadSettings(str(exc)) from exc
    if not settings.url:
        check_disk_space(Path(tempfile.gettempdir()), _most_files(settings))


def _most_files(settings: BenchSettings) -> int:
    """The most item files one measurement makes: each is removed before the next begins."""
    most = settings.biggest if {"claim", "big-queue", "sweep"} & set(settings.measures) else 0
    if "scheduled" in settings.measures:
        most = max(most, 2 * settings.scheduled_items)  # an item and its mark each
    if "keys" in settings.measures:
        most = max(most, 2 * settings.keyed_items)  # an item and its key each
    return most


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
    """Every selected measurement; the figures as the JSON line shows them (report.py's KEYS
    says what each key means). Ends with a summary for a reader on `say`."""
    check(settings)
    figures: dict = {"settings": settings.describe()}
    if "client-cpu" in settings.measures:  # first, while nothing else of the bench runs
        figures["clientCpu"] = _client_cpu_figures(settings, say)
    with tempfile.TemporaryDirectory(prefix="taskhoster-bench-") as root:
        if settings.url:
            if set(API_MEASURES) & set(settings.measures):
                figures["taskhoster"] = {
                    URL_LABEL: _api_figures(settings, settings.url, settings.token, None, URL_LABEL, say)
                }
        else:
            _own_figures(settings, figures, Path(root), say)
        if settings.peers:
            figures["peers"] = _peer_figures(settings, Path(root) / "peers", say)
    figures["ratios"] = report.ratios(figures)
    floors = report.floors(figures)
    if floors:
        figures["floors"] = floors
    figures = _rounded(figures)
    for line in report.summary(figures):
        say(line)
    return figures


def _client_cpu_figures(settings: BenchSettings, say: Say) -> dict:
    say(f"the client library's own CPU: {settings.cpu_calls:,} calls of each kind (after "
        f"{client_cpu.warm_up_calls(settings.cpu_calls):,} untimed), against stub servers")
    return client_cpu.measure(calls=settings.cpu_calls)


def _own_figures(settings: BenchSettings, figures: dict, root: Path, say: Say) -> None:
    if "disk" in settings.measures:
        directory = root / "data"
        say(f"the disk: {settings.flush_tries} small files made durable in {directory}")
        measured = figures["disk"] = disk.measure(directory, tries=settings.flush_tries)
        say(f"the disk: flush p50 {measured['flushMs']['p50']:.3g} ms, p99 {measured['flushMs']['p99']:.3g} ms "
            f"(no post answered with fsync on can be faster); making a file p50 {measured['createUs']['p50']:,.0f} µs")
    ours = figures["taskhoster"] = {}
    if set(API_MEASURES) & set(settings.measures):
        for fsync in settings.fsync:
            ours[_label(fsync)] = _own_api_figures(settings, root / f"api-fsync-{'on' if fsync else 'off'}", fsync, say)
    if "big-queue" in settings.measures:
        for fsync, measured in _big_queue_figures(settings, root / "big", say).items():
            ours.setdefault(_label(fsync), {}).setdefault("serverAlone", {})["bigQueue"] = measured
    store_alone = {}
    if "claim" in settings.measures:
        store_alone["claimMicroseconds"] = {_label(fsync): _claim_costs(settings, fsync, say) for fsync in settings.fsync}
    if "sweep" in settings.measures:
        say(f"one quiet sweep pass over {settings.biggest:,} pending items (the store alone)")
        store_alone["quietSweepSeconds"] = {str(settings.biggest): store_costs.quiet_sweep_seconds(settings.biggest)}
    if "scheduled" in settings.measures:
        store_alone["scheduled"] = _scheduled_figures(settings, say)
    if "keys" in settings.measures:
        say(f"a keyed post, new and repeated, beside 10 keyed items and beside {settings.keyed_items:,} (the store alone)")
        store_alone["keys"] = {"items": settings.keyed_items, **store_costs.with_keyed(settings.keyed_items)}
    if store_alone:
        figures["storeAlone"] = store_alone
    if not ours:
        del figures["taskhoster"]


def _scheduled_figures(settings: BenchSettings, say: Say) -> dict:
    say(f"a claim, a post and a quiet sweep beside {settings.scheduled_items:,} scheduled items, and without "
        f"(the store alone)")
    figures = {"items": settings.scheduled_items, **store_costs.with_scheduled(settings.scheduled_items)}
    due = figures["dueTogether"] = {"items": settings.due_together, "allPendingSeconds": {}}
    for fsync in settings.fsync:
        say(f"{settings.due_together:,} scheduled items coming due in the same second ({_label(fsync)})")
        due["allPendingSeconds"][_label(fsync)] = store_costs.due_together_seconds(settings.due_together, fsync=fsync)
    return figures


def _peer_figures(settings: BenchSettings, root: Path, say: Say) -> dict:
    """Each peer on what of PEER_MEASURES is selected, with our sizes, threads and seconds."""
    measures = set(settings.measures)
    measured = {}
    for name in settings.peers:
        for durable in (False, True):
            measured[peers.label(name, durable)] = peers.measure(
                name, durable=durable, directory=root / f"{name}-{'aof' if durable else 'memory'}",
                workers=settings.workers,
                items=settings.items if "client-end-to-end" in measures else None,
                round_trips=settings.round_trips if "client-round-trip" in measures else None,
                producers=settings.producers if "client-producers" in measures else (),
                post_seconds=settings.post_seconds, say=say,
            )
    return measured


def _rounded(value):
    """Four significant digits are more than these measurements can tell apart."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    return value


def _label(fsync: bool) -> str:
    return f"fsync {'on' if fsync else 'off'}"


def _own_api_figures(settings: BenchSettings, root: Path, fsync: bool, say: Say) -> dict:
    label = _label(fsync)
    say(f"{label}: preparing an installation in {root}")
    deployment = Deployment(root)
    deployment.prepare(queues=[settings.post_queue, settings.work_queue])
    with deployment.server(fsync=fsync, server=settings.server) as server:
        say(f"{label}: serve pid {server.pid} at {server.url}")
        return _api_figures(settings, server.url, deployment.token, server, label, say)


def _api_figures(
    settings: BenchSettings, url: str, token: str, server: ServerProcess | None, label: str, say: Say
) -> dict:
    """The client's and the server-alone figures of one server: {"client": ..., "serverAlone": ...}
    with what was selected. Worked measures first, while the workers run, then the posts."""
    measures = set(settings.measures)
    mine, alone = {}, {}
    profile = _profiler(settings, server, label)
    with LeanProducer(url, token, timeout=120) as lean, Producer(url, token, timeout=60) as producer, \
            ExitStack() as stack:
        if set(WORKED) & measures:
            say(f"{label}: starting {settings.workers} worker processes, claiming up to {settings.claim_batch} each")
            pool = stack.enter_context(
                WorkerPool(
                    url=url, token=token, queue=settings.work_queue, count=settings.workers,
                    claim_batch=settings.claim_batch,
                )
            )
            say(f"{label}: the workers are warm after {pool.warm_up(lean)} warm-up items")
        users = client.TaskhosterSystem(producer, settings.work_queue)
        server_cpu = _ServerCpu(server)
        if "client-end-to-end" in measures:
            say(f"{label}: client: {settings.items:,} items, one Producer.post each, while the workers consume")
            with profile("client-end-to-end"):
                since = server_cpu.now()
                mine.update(workload.enqueue_and_end_to_end(users, items=settings.items))
                server_cpu.record("perItemEndToEnd", since, settings.items)
        if "client-batches" in measures:
            say(f"{label}: client: {settings.items:,} items, Producer.post_many with {settings.batch} a call, "
                f"while the workers consume")
            with profile("client-end-to-end-batches"):
                mine["endToEndInBatchesPerSecond"] = client.end_to_end_in_batches(
                    users, items=settings.items, batch=settings.batch
                )
        if "client-round-trip" in measures:
            say(f"{label}: client: {settings.round_trips} round trips, Producer.post then Producer.result")
            with profile("client-round-trip"):
                mine["roundTripMs"] = workload.round_trip_ms(users, count=settings.round_trips)
        if "server-end-to-end" in measures:
            say(f"{label}: server alone: {settings.items:,} items end to end, posted {settings.batch} at a time")
            with profile("server-end-to-end"):
                alone["endToEndInBatchesPerSecond"] = load.end_to_end_items_per_second(
                    lean, settings.work_queue, items=settings.items, batch=settings.batch
                )
        if "server-round-trip" in measures:
            say(f"{label}: server alone: {settings.round_trips} round trips")
            with profile("server-round-trip"):
                alone["roundTripMs"] = load.round_trip_ms(lean, settings.work_queue, count=settings.round_trips)
        stack.close()  # the workers stop: what follows posts to a queue nobody works
        if "client-producers" in measures:
            mine["concurrentProducers"] = {}
            for threads in settings.producers:
                say(f"{label}: client: {threads} threads, a Producer each, posting single items for "
                    f"{settings.post_seconds:g} s")
                with profile(f"client-producers-{threads}"):
                    since = server_cpu.now()
                    found = client.concurrent_posts(
                        url, token, settings.post_queue, threads=threads, seconds=settings.post_seconds
                    )
                    server_cpu.record(f"perPost{threads}Producers", since, found["posts"])
                mine["concurrentProducers"][str(threads)] = found
        if "client-batches" in measures:
            say(f"{label}: client: Producer.post_many, {settings.batch} items a call, {settings.post_seconds:g} s")
            with profile("client-batches"):
                mine["postManyItemsPerSecond"] = client.batch_items_per_second(
                    producer, settings.post_queue, seconds=settings.post_seconds, batch=settings.batch
                )
        if "client-keys" in measures:
            say(f"{label}: client: Producer.post and post_many ({settings.batch} a call), with a key per item and "
                f"without, taking turns, {settings.post_seconds:g} s each")
            with profile("client-keys"):
                mine["keyed"] = client.keyed_and_plain_posts(
                    producer, settings.post_queue, seconds=settings.post_seconds, batch=settings.batch
                )
        if "server-posts" in measures:
            say(f"{label}: server alone: posts refused for want of a token, single posts, then "
                f"{settings.batch}-item batches, {settings.post_seconds:g} s each")
            with profile("server-posts-refused"):
                alone["refusedPostsPerSecond"] = load.refused_posts_per_second(
                    lean, settings.post_queue, seconds=settings.post_seconds
                )
            with profile("server-posts-single"):
                alone["singlePostsPerSecond"] = load.single_posts_per_second(
                    lean, settings.post_queue, seconds=settings.post_seconds
                )
            with profile("server-posts-batch"):
                alone["batchPostItemsPerSecond"] = load.batch_items_per_second(
                    lean, settings.post_queue, seconds=settings.post_seconds, batch=settings.batch
                )
    if server_cpu.ms:
        mine["serverCpuMs"] = server_cpu.ms
    return {name: part for name, part in (("client", mine), ("serverAlone", alone)) if part}


class _ServerCpu:
    """The server's CPU (user and system, all its threads) per item of a measure, where the bench
    started the server itself: what each post or item costs the one process that serves them."""

    def __init__(self, server: ServerProcess | None):
        self.server = server
        self.ms: dict[str, float] = {}

    def now(self) -> float:
        return cpu_seconds(self.server.pid) if self.server is not None else 0.0

    def record(self, name: str, since: float, items: float) -> None:
        if self.server is not None and items > 0:
            self.ms[name] = round(1000 * (self.now() - since) / items, 3)


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
            label = _label(fsync)
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
        store.post_items(config=QueueConfig(name=queue), items=[NewItem(workload.PAYLOAD)] * min(MAX_BATCH, count - start))
        if start and start % 100_000 == 0:
            say(f"  {start:,} written")


def _claim_costs(settings: BenchSettings, fsync: bool, say: Say) -> dict[str, float]:
    costs = {}
    for pending in settings.pending_sizes:
        say(f"{_label(fsync)}: a claim's cost with {pending:,} pending items (the store alone)")
        costs[str(pending)] = store_costs.claim_cost(pending, fsync=fsync) * 1e6
    return costs


def expand(measures: list[str]) -> tuple[str, ...]:
    """--only's names with the shorthands (client, server) spelled out, in MEASURES' order
    when they are all known."""
    named = {measure for name in measures for measure in GROUPS.get(name, (name,))}
    known = [measure for measure in MEASURES if measure in named]
    return tuple(known) if len(known) == len(named) else tuple(named)


def settings_from(options: dict) -> BenchSettings:
    """Settings from the command's options: --quick's sizes, then whatever was given."""
    base = QUICK if options.get("quick") else BenchSettings()
    given = {name: value for name, value in options.items() if value is not None and name in _FIELDS}
    return replace(base, **given)


_FIELDS = set(BenchSettings.__dataclass_fields__)
