"""`manage.py bench`: it runs end to end and reports every figure, and refuses settings it
cannot run with. No speed is asserted here: speed is what the bench reports, not what CI checks."""

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from django.core.management import CommandError, call_command

from queues.bench import peers
from queues.bench.harness import QUICK, BadSettings, check, check_disk_space, expand
from queues.bench.profiling import cpu_seconds
from queues.bench.profiling import summary as profile_summary
from queues.bench.report import floors, ratios, summary
from queues.bench.workload import threaded_posts
from serverproc import MANAGE, PROJECT_DIR, Deployment

CLIENT = {"enqueuePerSecond", "endToEndPerSecond", "roundTripMs", "concurrentProducers", "postManyItemsPerSecond",
          "endToEndInBatchesPerSecond", "keyed"}
SERVER_ALONE = {"refusedPostsPerSecond", "singlePostsPerSecond", "batchPostItemsPerSecond", "endToEndInBatchesPerSecond", "roundTripMs", "bigQueue"}
CLIENT_CPU = {"producerPostMs", "asyncProducerPostMs", "producerResultMs", "workerItemMs", "workerBatchedItemMs"}
FLOORS = {"flushMs", "trivialRequestMs", "postMs", "postsPerSecond", "roundTripMs"}
WORKLOAD = {"enqueuePerSecond", "endToEndPerSecond", "roundTripMs"}  # ours through the client, and each peer's
PEER_EXTRA = ("celery", "rq", "redis")
PEER_LABELS = {f"{peer} (redis {mode})" for peer in ("celery", "rq") for mode in ("in memory", "aof always")}


def run_bench(tmp_path, *args: str) -> tuple[dict, str]:
    """Run the command in its own process, as a user would; its JSON line and its stderr."""
    env = {**os.environ, "SECRET_KEY": "tests", "TASKHOSTER_DATA_DIR": str(tmp_path / "unused")}
    done = subprocess.run(
        [sys.executable, str(MANAGE), "bench", *args],
        cwd=PROJECT_DIR, env=env, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout  # one JSON line and nothing else on stdout
    return json.loads(lines[0]), done.stderr


def positive_numbers(value) -> list:
    """Every leaf of a JSON value, for checking they are all positive numbers."""
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in positive_numbers(item)]
    return [value]


def assert_all_positive(figures: dict) -> None:
    for leaf in positive_numbers(figures):
        assert isinstance(leaf, (int, float)) and not isinstance(leaf, bool) and leaf > 0, figures


def assert_percentiles(figures: dict, *cuts: str) -> None:
    assert list(figures) == list(cuts)
    assert [figures[cut] for cut in cuts] == sorted(figures[cut] for cut in cuts)


def test_quick_bench_reports_every_figure_for_both_fsync_modes(tmp_path):
    report, progress = run_bench(tmp_path, "--quick")

    settings = report["settings"]
    assert settings["items"] == 500 and settings["pendingSizes"] == [10, 2000] and settings["producers"] == [1, 8]
    assert settings["fsync"] == ["on", "off"] and "peers" not in settings
    assert set(report) == {"settings", "disk", "clientCpu", "taskhoster", "storeAlone", "ratios", "floors"}
    assert set(report["floors"]) == {"fsync on"} and set(report["floors"]["fsync on"]) == FLOORS
    assert_all_positive(report["floors"])
    assert_percentiles(report["disk"]["flushMs"], "p50", "p99")
    assert_percentiles(report["disk"]["createUs"], "p50", "p99")
    assert report["disk"]["createUs"]["p50"] > 0
    assert set(report["clientCpu"]) == CLIENT_CPU and settings["cpuCalls"] == 200
    assert_all_positive(report["clientCpu"])
    assert set(report["taskhoster"]) == {"fsync on", "fsync off"}
    for figures in report["taskhoster"].values():
        assert set(figures) == {"client", "serverAlone"}
        client, alone = figures["client"], figures["serverAlone"]
        assert set(client) == CLIENT | {"serverCpuMs"} and set(alone) == SERVER_ALONE
        assert set(client["serverCpuMs"]) == {"perItemEndToEnd", "perPost1Producers", "perPost8Producers"}
        assert_percentiles(client["roundTripMs"], "p50", "p95", "p99")
        assert_percentiles(alone["roundTripMs"], "p50", "p95", "p99")
        assert set(client["concurrentProducers"]) == {"1", "8"}
        for producers in client["concurrentProducers"].values():
            assert set(producers) == {"postsPerSecond", "postMs", "posts"}
            assert_percentiles(producers["postMs"], "p50", "p99")
        assert set(alone["bigQueue"]) == {"pending", "firstClaimMs", "claimMs", "serverPeakMemoryMB"}
        assert alone["bigQueue"]["pending"] == 2000
        for posts in client["keyed"].values():
            assert set(posts) == {"plain", "keyed"}
        assert set(client["keyed"]) == {"singlePostsPerSecond", "postManyItemsPerSecond"}
        assert_all_positive(figures)
    store_alone = report["storeAlone"]
    assert set(store_alone["claimMicroseconds"]) == {"fsync on", "fsync off"}
    assert all(set(costs) == {"10", "2000"} for costs in store_alone["claimMicroseconds"].values())
    assert set(store_alone["quietSweepSeconds"]) == {"2000"}
    scheduled = store_alone["scheduled"]
    assert scheduled["items"] == 2000 and scheduled["dueTogether"]["items"] == 1000
    for key in ("claimMicroseconds", "postMicroseconds", "quietSweepMs"):
        assert set(scheduled[key]) == {"without", "with"}
    assert set(scheduled["dueTogether"]["allPendingSeconds"]) == {"fsync on", "fsync off"}
    assert settings["scheduledItems"] == 2000 and settings["dueTogether"] == 1000
    keys = store_alone["keys"]
    assert keys["items"] == settings["keyedItems"] == 2000
    assert set(keys["newKeyMicroseconds"]) == set(keys["repeatMicroseconds"]) == {"10", "2000"}
    assert_all_positive(store_alone)
    # batches are set against our own single posts only; with no peers there is nothing else
    assert set(report["ratios"]) == {"batchesOverSingles"}
    assert all(set(ratio) == {"client", "serverAlone"} for ratio in report["ratios"]["batchesOverSingles"].values())
    assert_all_positive(report["ratios"])
    assert "serve pid" in progress and "Producer.post" in progress  # progress goes to stderr
    assert "no fsync-on post is answered faster" in progress  # so does the summary
    assert "disk: making that file p50 " in progress
    assert "floors, fsync on, this run: one producer's single post needs about" in progress
    assert "1,000 scheduled items due in the same second, all pending in" in progress
    assert "a keyed post beside 2,000 keyed items: new key" in progress
    assert "with a key per item (without)" in progress
    assert "end to end with Producer.post_many: " in progress


def test_bench_measures_a_server_given_by_url(tmp_path):
    deployment = Deployment(tmp_path / "target")
    deployment.migrate()
    deployment.create_queue("posts")
    deployment.create_queue("work")
    token = deployment.create_token("bench")
    with deployment.server() as server:
        report, _ = run_bench(
            tmp_path, "--url", server.url, "--token", token, "--post-queue", "posts", "--work-queue", "work",
            "--only", "client-round-trip,server-posts,server-round-trip", "--post-seconds", "0.3",
            "--round-trips", "5", "--workers", "1",
        )

    assert report["settings"]["url"] == server.url
    assert set(report["taskhoster"]) == {"at url"}
    figures = report["taskhoster"]["at url"]
    assert set(figures["client"]) == {"roundTripMs"}
    assert set(figures["serverAlone"]) == {"refusedPostsPerSecond", "singlePostsPerSecond", "batchPostItemsPerSecond", "roundTripMs"}
    assert_all_positive(figures)
    assert "disk" not in report  # a server elsewhere: its disk is out of reach


def test_ratios_read_above_one_when_taskhoster_is_better():
    ours = {"enqueuePerSecond": 200.0, "endToEndPerSecond": 100.0,
            "roundTripMs": {"p50": 2.0, "p95": 4.0, "p99": 8.0},
            "concurrentProducers": {"1": {"postsPerSecond": 50.0, "postMs": {"p50": 1.0, "p99": 2.0}}},
            "postManyItemsPerSecond": 1000.0}
    theirs = {"enqueuePerSecond": 100.0, "endToEndPerSecond": 400.0, "roundTripMs": {"p50": 4.0, "p95": 4.0, "p99": 2.0}}
    figures = {"settings": {"claimBatch": 1},
               "taskhoster": {"fsync on": {"client": ours, "serverAlone": {"singlePostsPerSecond": 10.0}}},
               "peers": {"celery (redis in memory)": theirs}}

    found = ratios(figures)

    assert found["taskhosterVsPeers"] == {"fsync on": {"celery (redis in memory)": {
        "enqueueOursOverTheirs": 2.0, "endToEndOursOverTheirs": 0.25,
        "roundTripP50TheirsOverOurs": 2.0, "roundTripP95TheirsOverOurs": 1.0, "roundTripP99TheirsOverOurs": 0.25,
    }}}
    # our batches against our one-producer single posts, never against a peer's figure
    assert found["batchesOverSingles"] == {"fsync on": {"client": 20.0}}
    assert any("above 1 = Taskhoster better" in line for line in summary({**figures, "ratios": found}))


def test_end_to_end_is_set_against_the_peers_only_when_our_workers_claimed_one_item_at_a_time():
    ours, theirs = {"enqueuePerSecond": 200.0, "endToEndPerSecond": 100.0}, {"enqueuePerSecond": 100.0, "endToEndPerSecond": 50.0}
    figures = {"settings": {"claimBatch": 100}, "taskhoster": {"fsync on": {"client": ours}}, "peers": {"rq": theirs}}
    assert ratios(figures)["taskhosterVsPeers"] == {"fsync on": {"rq": {"enqueueOursOverTheirs": 2.0}}}


def test_ratios_set_our_concurrent_producers_against_theirs_per_thread_count():
    def producers(*rates: float) -> dict:
        return {threads: {"postsPerSecond": rate, "postMs": {"p50": 1.0, "p99": 2.0}}
                for threads, rate in zip(("1", "8"), rates)}

    figures = {"taskhoster": {"fsync on": {"client": {"concurrentProducers": producers(100.0, 600.0)}}},
               "peers": {"rq (redis in memory)": {"concurrentProducers": producers(400.0, 200.0)}}}

    found = ratios(figures)
    lines = summary({**figures, "ratios": found})

    assert found["taskhosterVsPeers"] == {"fsync on": {"rq (redis in memory)": {
        "concurrentProducersOursOverTheirs": {"1": 0.25, "8": 3.0},
    }}}
    assert "rq (redis in memory), concurrent producers (threads, single posts): 1: 400/s" in "\n".join(lines)
    assert "vs rq (redis in memory): concurrent producers (threads) 1: 0.25x, 8: 3.00x" in "\n".join(lines)
    assert not any("users workload" in line for line in lines)  # no workload measured, no table of it


def test_floors_add_the_disks_flush_and_a_trivial_request():
    figures = {"disk": {"flushMs": {"p50": 0.4, "p99": 0.6}},
               "clientCpu": {"producerPostMs": 0.05, "asyncProducerPostMs": 0.08, "producerResultMs": 0.05,
                             "workerItemMs": 0.15, "workerBatchedItemMs": 0.02},
               "taskhoster": {"fsync on": {"serverAlone": {"refusedPostsPerSecond": 10_000.0}}},
               "peers": {"celery (redis in memory)": {
                   "concurrentProducers": {"1": {"postsPerSecond": 2000.0, "postMs": {"p50": 0.5, "p99": 1.0}}},
                   "roundTripMs": {"p50": 1.5, "p95": 2.0, "p99": 3.0}}}}

    found = floors(figures)
    lines = "\n".join(summary({**figures, "floors": found}))

    assert found["fsync on"] == pytest.approx({"flushMs": 0.4, "trivialRequestMs": 0.1, "postMs": 0.5,
                                               "postsPerSecond": 2000.0, "roundTripMs": 1.0})
    assert "about 2,000 posts/s at most" in lines
    assert "to match celery (redis in memory): its 2,000 single posts/s from one thread leave 0.5 ms a post" in lines
    assert floors({"disk": figures["disk"], "clientCpu": figures["clientCpu"]}) == {}  # no trivial request measured


def skip_without_the_peers() -> None:
    """The --peers runs need redis-server and the bench extra; without them they skip, but once
    they are installed a failing run fails the test."""
    missing = [name for name in PEER_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"the bench extra is not installed (no {', '.join(missing)}): pip install -e '.[bench]'")
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server on PATH (Debian: apt-get install redis-server)")


def assert_concurrent_producers(producers: dict, threads: set[str]) -> None:
    assert set(producers) == threads
    for found in producers.values():
        assert set(found) == {"postsPerSecond", "postMs", "posts"}
        assert_percentiles(found["postMs"], "p50", "p99")
    assert_all_positive(producers)


def test_bench_runs_the_peers_on_their_own_redis(tmp_path):
    """A tiny --peers run, on the workload and with concurrent producers."""
    skip_without_the_peers()

    report, progress = run_bench(
        tmp_path, "--peers", "celery,rq", "--fsync", "on", "--only",
        "client-end-to-end,client-round-trip,client-producers", "--items", "20", "--round-trips", "5",
        "--producers", "1,3", "--post-seconds", "0.3",
    )

    assert set(report["peers"]) == PEER_LABELS
    for figures in report["peers"].values():
        assert set(figures) == WORKLOAD | {"concurrentProducers"}
        assert_percentiles(figures["roundTripMs"], "p50", "p95", "p99")
        assert_concurrent_producers(figures["concurrentProducers"], {"1", "3"})
    assert_all_positive(report["peers"])
    assert set(report["taskhoster"]["fsync on"]["client"]) == WORKLOAD | {"concurrentProducers", "serverCpuMs"}
    against = report["ratios"]["taskhosterVsPeers"]["fsync on"]
    assert set(against) == PEER_LABELS
    for ratio in against.values():
        assert set(ratio["concurrentProducersOursOverTheirs"]) == {"1", "3"}
        assert "endToEndOursOverTheirs" in ratio  # our workers claimed one at a time, as the peers take one
    assert report["settings"]["claimBatch"] == 1
    assert_all_positive(report["ratios"])
    assert set(report["settings"]["peerVersions"]) == {"celery", "rq", "redis-py", "redis-server"}
    assert report["settings"]["peerProducers"] == peers.PRODUCER_THREADS
    assert "Taskhoster better" in progress
    for label in PEER_LABELS:
        assert f"{label}, concurrent producers (threads, single posts): 1: " in progress
        assert f"vs {label}: enqueue " in progress and "concurrent producers (threads) 1: " in progress


def test_the_peers_concurrent_producers_run_with_no_worker_as_ours(tmp_path):
    """With only the concurrent producers selected, ours start no worker, and neither do theirs."""
    skip_without_the_peers()

    report, progress = run_bench(
        tmp_path, "--peers", "rq", "--fsync", "on", "--only", "client-producers", "--producers", "2",
        "--post-seconds", "0.3",
    )

    assert set(report["peers"]) == {"rq (redis in memory)", "rq (redis aof always)"}
    for figures in report["peers"].values():
        assert set(figures) == {"concurrentProducers"}
        assert_concurrent_producers(figures["concurrentProducers"], {"2"})
    assert "worker processes" not in progress and "no worker running" in progress
    for ratio in report["ratios"]["taskhosterVsPeers"]["fsync on"].values():
        assert set(ratio) == {"concurrentProducersOursOverTheirs"}


@pytest.mark.parametrize(
    "changes, complaint",
    [
        ({"batch": 1001}, "--batch"),
        ({"claim_batch": 0}, "--claim-batch"),
        ({"round_trips": 1}, "--round-trips"),
        ({"pending_sizes": (10, 0)}, "--pending-sizes"),
        ({"post_seconds": 0}, "--post-seconds"),
        ({"measures": ("posts", "speed")}, "--only"),
        ({"producers": (1, 0)}, "--producers"),
        ({"flush_tries": 1}, "--flush-tries"),
        ({"scheduled_items": 0}, "--scheduled-items"),
        ({"keyed_items": 9}, "--keyed-items"),
        ({"due_together": 0}, "--due-together"),
        ({"peers": ("celery", "sidekiq")}, "--peers"),
        ({"peers": ("rq",), "measures": ("server-posts", "disk")}, "--peers measures the peers beside"),
        ({"url": "http://127.0.0.1:9"}, "--token"),
        ({"url": "http://127.0.0.1:9", "token": "t", "measures": ("server-posts", "claim")}, "--only"),
        ({"url": "http://127.0.0.1:9", "token": "t", "measures": ("disk",)}, "--only"),
        ({"url": "http://127.0.0.1:9", "token": "t", "measures": ("server-posts",), "server": "daphne"}, "--server"),
    ],
)
def test_bench_refuses_settings_it_cannot_run_with(changes, complaint):
    with pytest.raises(BadSettings, match=complaint):
        check(replace(QUICK, **changes))


@pytest.mark.parametrize(
    "args, complaint",
    [
        (["--pending-sizes", "10,lots"], "--pending-sizes"),
        (["--only", "speed"], "--only"),
        (["--producers", "1,many"], "--producers"),
        (["--server", "nginx"], "--server"),
    ],
)
def test_bench_command_answers_bad_options_with_a_clear_error(args, complaint):
    with pytest.raises(CommandError, match=complaint):
        call_command("bench", *args)


def test_threaded_posts_times_every_threads_posts_and_raises_a_threads_failure():
    calls = [0, 0, 0]

    def poster(number: int):
        def post() -> None:
            calls[number] += 1
            time.sleep(0.001)
        return post

    found = threaded_posts([poster(number) for number in range(3)], seconds=0.1)

    assert set(found) == {"postsPerSecond", "postMs", "posts"}
    assert all(made > 1 for made in calls)  # each thread's untimed first post, then timed ones
    assert found["posts"] == sum(calls)
    timed = sum(calls) - 3
    assert 0 < found["postsPerSecond"] <= timed / 0.1  # over at least the seconds asked for

    def refused() -> None:
        raise ConnectionRefusedError

    with pytest.raises(RuntimeError, match="a producer thread failed: ConnectionRefusedError"):
        threaded_posts([poster(0), refused], seconds=0.1)


def test_disk_check_refuses_a_queue_that_does_not_fit(tmp_path):
    with pytest.raises(BadSettings, match="pending-sizes"):
        check_disk_space(tmp_path, 10**12)
    check_disk_space(tmp_path, 10)


def test_profile_summary_counts_busy_samples_and_merges_pool_threads():
    raw = "\n".join([
        "thread (1): MainThread;BaseEventLoop._run_once (asyncio/base_events.py:1898);"
        "EpollSelector.select (selectors.py:468) 50",
        "thread (2): store_0;_worker (concurrent/futures/thread.py:81) 20",
        "thread (2): store_0;_worker (concurrent/futures/thread.py:83);Store.post_items (queues/store.py:512);"
        "Store._write_tmp (queues/store.py:480) 20",
        "thread (3): store_1;_worker (concurrent/futures/thread.py:83);Store.post_items (queues/store.py:515) 10",
        "thread (4): sweep;Sweeper.run (queues/sweep.py:70);Event.wait (threading.py:629);"
        "Condition.wait (threading.py:331) 40",
    ])

    text = profile_summary(raw)

    assert text.startswith("140 samples, 30 busy (21%)")
    by_thread, inclusive, own = text.split("% of busy samples:")[1:]
    assert "100.0%  store" in by_thread and "MainThread" not in by_thread  # idle threads cost nothing
    assert "100.0%  Store.post_items (queues/store.py)" in inclusive  # its two lines counted together
    assert "66.7%  Store._write_tmp (queues/store.py)" in own and "33.3%  Store.post_items (queues/store.py)" in own
    assert "select" not in text.split("by thread")[1] and "Sweeper" not in text  # idle waits are no costs


def test_cpu_seconds_reads_what_a_process_has_used():
    before = cpu_seconds(os.getpid())
    burn_until = time.process_time() + 0.05
    while time.process_time() < burn_until:
        pass
    assert cpu_seconds(os.getpid()) >= before + 0.03


def test_the_lean_producer_asks_again_on_a_new_connection_when_the_server_closed_an_idle_one():
    """The bench's own HTTP client: answers with Content-Length on a kept-alive connection, and a
    server that closed the connection between two requests (its keep-alive ran out)."""
    import socket
    import threading

    from queues.bench.lean_client import LeanProducer

    listener = socket.create_server(("127.0.0.1", 0))
    answers = [b'{"n":1}', b'{"n":2}', b'{"n":3}']
    requests = []

    def serve() -> None:
        for per_connection in (2, 1):  # the first connection closes after two answers
            connection, _ = listener.accept()
            with connection:
                for _ in range(per_connection):
                    data = b""
                    while b"\r\n\r\n" not in data:
                        data += connection.recv(65536)
                    requests.append(data.split(b"\r\n", 1)[0])
                    body = answers.pop(0)
                    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with LeanProducer(f"http://127.0.0.1:{listener.getsockname()[1]}", "th_x", timeout=5) as producer:
        assert [producer.stats("jobs")["n"] for _ in range(3)] == [1, 2, 3]
    thread.join(5)
    listener.close()
    assert requests == [b"GET /api/queues/jobs HTTP/1.1"] * 3


def test_peers_need_redis_server_on_path_and_say_so(monkeypatch):
    from queues.bench import redis_server

    monkeypatch.setattr(redis_server.shutil, "which", lambda name: None)
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: object())  # as if the extra were there
    with pytest.raises(BadSettings, match="redis-server on PATH"):
        check(replace(QUICK, peers=("rq",)))


def test_peers_need_the_bench_extra_and_say_so(monkeypatch):
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None if name == "rq" else object())
    with pytest.raises(BadSettings, match=r"rq, from the bench extra: pip install -e '\.\[bench\]'"):
        check(replace(QUICK, peers=("celery", "rq")))


def test_the_measures_names_of_earlier_builds_are_the_server_alone_ones():
    """So one command (`--only posts,end-to-end,round-trip`) measures an earlier build and this."""
    assert expand(["posts", "end-to-end", "round-trip"]) == ("server-posts", "server-end-to-end", "server-round-trip")


def test_client_cpu_is_measured_against_stub_servers_without_a_server_of_ours(tmp_path):
    report, progress = run_bench(tmp_path, "--quick", "--only", "client-cpu")

    assert set(report) == {"settings", "clientCpu", "ratios"}  # no server started, no disk measured
    assert report["settings"]["cpuCalls"] == 200 and report["settings"]["measures"] == ["client-cpu"]
    assert set(report["clientCpu"]) == CLIENT_CPU
    assert_all_positive(report["clientCpu"])
    assert "serve pid" not in progress
    assert "client library CPU per call (against stub servers): Producer.post " in progress


def test_client_cpu_runs_with_a_url_as_it_needs_no_server(tmp_path):
    """Nothing listens at the URL: client-cpu alone never calls it."""
    report, _ = run_bench(tmp_path, "--url", "http://127.0.0.1:9", "--token", "t", "--only", "client-cpu",
                          "--cpu-calls", "100")

    assert report["settings"]["url"] == "http://127.0.0.1:9" and report["settings"]["cpuCalls"] == 100
    assert set(report) == {"settings", "clientCpu", "ratios"}
    assert set(report["clientCpu"]) == CLIENT_CPU
    assert_all_positive(report["clientCpu"])


def test_the_client_shorthand_takes_in_the_client_cpu_measure():
    assert expand(["client"]) == ("client-cpu", "client-end-to-end", "client-round-trip", "client-producers",
                                  "client-batches", "client-keys")


def test_client_cpu_needs_enough_calls_for_a_batched_worker():
    with pytest.raises(BadSettings, match="--cpu-calls"):
        check(replace(QUICK, cpu_calls=99, measures=("client-cpu",)))


async def test_the_http_stub_answers_a_producer_as_the_server_does():
    from queues.bench.stubs import HttpStub
    from taskhoster import AsyncProducer, Producer

    server = await asyncio.get_running_loop().create_server(HttpStub, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with AsyncProducer(url, "th_stub") as producer:
            posted = [await producer.post("jobs", {"n": n}) for n in range(3)]
        with Producer(url, "th_stub") as producer:  # blocking: in a thread, while the loop serves
            item_id = (await asyncio.to_thread(producer.post, "jobs", 1))["id"]
            result = await asyncio.to_thread(producer.result, "jobs", item_id, timeout=5)
    finally:
        server.close()
        await server.wait_closed()

    assert [item["status"] for item in posted] == ["pending"] * 3
    assert len({item["id"] for item in posted} | {item_id}) == 4  # a new id each post
    assert result is None


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_the_work_stub_speaks_the_socket_protocol_to_a_real_worker(concurrency):
    """A real Worker claims the stub's items, runs its handler on each and hands every result in
    (one `result` frame each, or `results` several at a time); the stub then holds its claim, as
    a server on an empty queue does, until the worker stops."""
    from queues.bench.stubs import WorkStub, start_work_stub
    from taskhoster import Worker

    stub = WorkStub(items=10)
    server = await start_work_stub(stub)
    handled = []

    def handle(payload, job):
        handled.append(job.id)
        return {"n": len(handled)}

    worker = Worker(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "th_stub", queues=["jobs"],
                    concurrency=concurrency, grace=1)
    working = asyncio.create_task(worker.run_async(handle))
    try:
        async with asyncio.timeout(20):
            while len(stub.acked) < 10:
                await asyncio.sleep(0.01)
        worker.stop()
        async with asyncio.timeout(20):
            await working
    finally:
        working.cancel()
        server.close()
        await server.wait_closed()

    assert stub.handed_out == 10
    assert sorted(stub.acked) == sorted(handled) and len(set(handled)) == 10
