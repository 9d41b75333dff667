"""The `taskhoster` command, run as a process against a real `serve`: every subcommand's output
and exit status, and the errors a user meets (wrong token, no server, unknown queue, bad JSON).

It is run as `python -m taskhoster.cli`, which works whether or not the console script is
installed; one test checks the installed `taskhoster` script itself."""

import asyncio
import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest

from client_support import client_env, live_server
from serverproc import PROJECT_DIR
from taskhoster import Producer
from taskhoster.jobs import HandlerFailed, Job
from taskhoster.program import ProgramHandler

BAD_TOKEN = "th_" + "x" * 32
NO_SERVER = "http://127.0.0.1:9"
MISSING_ID = "01a00000-0000-7000-8000-000000000000"

ECHO_SCRIPT = """#!/bin/sh
# the payload comes on stdin; the result goes to stdout
read payload
echo "{\\"got\\": $payload, \\"id\\": \\"$TASKHOSTER_ITEM_ID\\", \\"attempts\\": $TASKHOSTER_ATTEMPTS}"
"""

FAILING_SCRIPT = """#!/bin/sh
cat > /dev/null
echo "cannot convert this one" >&2
exit 3
"""


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    queues = {name: {} for name in ("cli", "stdin", "badlines", "reads", "work", "terminal", "failing", "notjson",
                                    "later", "ended", "unusable")}
    queues["tries"] = {"max_attempts": 3}
    with live_server(tmp_path_factory.mktemp("cli"), queues) as live:
        yield live


@pytest.fixture
def producer(live):
    with Producer(live.url, live.token) as producer:
        yield producer


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "taskhoster.cli", *args]


def run_cli(live, *args: str, stdin: str | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cli_command(*args), cwd=PROJECT_DIR, env=client_env(live, **env), input=stdin,
                          capture_output=True, text=True, timeout=60)


def assert_one_line_error(done: subprocess.CompletedProcess, status: int, *fragments: str) -> None:
    assert done.returncode == status, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("taskhoster: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def finish_pending(live, queue: str, result) -> None:
    headers = {"Authorization": f"Bearer {live.token}"}
    for item in httpx.post(f"{live.url}/api/queues/{queue}/claim", json={"max": 100}, headers=headers).json()["items"]:
        httpx.post(f"{live.url}/api/queues/{queue}/items/{item['id']}/result", json={"result": result}, headers=headers)


def script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o755)
    return path


# ---- post, get, stats ---------------------------------------------------------------------------


def test_post_prints_the_id_of_the_new_item(live, producer):
    done = run_cli(live, "post", "cli", '{"image": "cat.png"}')
    assert done.returncode == 0 and done.stderr == ""
    item_id = done.stdout.strip()
    assert producer.get("cli", item_id, payload=True)["payload"] == {"image": "cat.png"}


def test_post_reads_one_json_per_line_from_stdin_and_prints_the_ids_in_order(live, producer):
    lines = [json.dumps({"n": n}) for n in range(2100)]
    lines.insert(5, "   ")  # blank lines are skipped
    done = run_cli(live, "post", "stdin", stdin="\n".join(lines) + "\n")
    assert done.returncode == 0, done.stderr
    ids = done.stdout.split()
    assert len(ids) == 2100 and ids == sorted(ids)  # ids grow in posting order
    assert producer.get("stdin", ids[2099], payload=True)["payload"] == {"n": 2099}
    assert producer.stats("stdin")["counts"]["pending"] == 2100


def test_a_bad_line_on_stdin_posts_nothing(live, producer):
    done = run_cli(live, "post", "badlines", stdin='{"n": 1}\n{"n": 2}\n{"n": oops}\n')
    assert_one_line_error(done, 2, "line 3 of stdin is not valid JSON")
    assert producer.stats("badlines")["counts"]["pending"] == 0


@pytest.mark.parametrize("argument", ["{bad", "NaN", "'single quotes'"])
def test_a_bad_json_argument_is_one_line_and_posts_nothing(live, producer, argument):
    before = producer.stats("cli")["counts"]["pending"]
    done = run_cli(live, "post", "cli", argument)
    assert_one_line_error(done, 2, "the payload is not valid JSON", "taskhoster post QUEUE '\"hello\"'")
    assert producer.stats("cli")["counts"]["pending"] == before


def test_get_prints_the_item_as_json(live, producer):
    item = producer.post("reads", {"size": 3})
    done = run_cli(live, "get", "reads", item["id"])
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["id"] == item["id"] and shown["status"] == "pending" and "payload" not in shown
    with_payload = json.loads(run_cli(live, "get", "reads", item["id"], "--payload").stdout)
    assert with_payload["payload"] == {"size": 3}


def test_get_with_wait_answers_once_the_item_is_finished(live, producer):
    item = producer.post("reads", "slow")
    waiting = subprocess.Popen(cli_command("get", "reads", item["id"], "--wait", "30"), cwd=PROJECT_DIR,
                               env=client_env(live), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # let the read wait on the server
    assert waiting.poll() is None
    finish_pending(live, "reads", {"done": True})
    stdout, stderr = waiting.communicate(timeout=30)
    assert waiting.returncode == 0, stderr
    shown = json.loads(stdout)
    assert shown["status"] == "finished" and shown["result"] == {"done": True}


def test_get_with_wait_prints_the_item_as_it_is_when_the_wait_runs_out(live, producer):
    item = producer.post("reads", "nobody works it")
    done = run_cli(live, "get", "reads", item["id"], "--wait", "0.3")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "pending"


def test_get_of_an_unknown_item_is_one_line_not_found(live):
    assert_one_line_error(run_cli(live, "get", "reads", MISSING_ID), 1, "not_found")


def test_stats_prints_one_queue_or_every_queue_one_per_line(live, producer):
    producer.post("cli", 1)
    one = run_cli(live, "stats", "cli")
    assert one.returncode == 0, one.stderr
    shown = json.loads(one.stdout)
    assert shown["name"] == "cli" and shown["counts"]["pending"] >= 1

    every = run_cli(live, "stats")
    assert every.returncode == 0, every.stderr
    names = [json.loads(line)["name"] for line in every.stdout.splitlines()]
    assert {"cli", "stdin", "work"} <= set(names)


def test_url_and_token_options_win_over_the_environment(live):
    done = run_cli(live, "stats", "cli", "--url", live.url, "--token", live.token,
                   TASKHOSTER_URL=NO_SERVER, TASKHOSTER_TOKEN=BAD_TOKEN)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["name"] == "cli"
    before_subcommand = run_cli(live, "--url", live.url, "stats", "cli", TASKHOSTER_URL=NO_SERVER)
    assert before_subcommand.returncode == 0, before_subcommand.stderr


# ---- the errors a user meets --------------------------------------------------------------------

SUBCOMMANDS = [
    ("post", "cli", "1"),
    ("get", "cli", MISSING_ID),
    ("stats",),
    ("work", "work", "--", "cat"),
]


@pytest.mark.parametrize("args", SUBCOMMANDS, ids=lambda args: args[0])
def test_a_wrong_token_is_one_line_and_exit_status_1(live, args):
    done = run_cli(live, *args, TASKHOSTER_TOKEN=BAD_TOKEN)
    assert_one_line_error(done, 1, "unauthorized")


def test_work_with_a_token_without_the_work_right_says_the_servers_reason(live):
    produce_only = live.deployment.create_token("produce-only", "--produce")
    done = run_cli(live, "work", "work", "--", "cat", TASKHOSTER_TOKEN=produce_only)
    assert_one_line_error(done, 1, "unauthorized: a valid API token with the right to work is required")


def test_version_prints_the_clients_version():
    done = subprocess.run(cli_command("--version"), cwd=PROJECT_DIR, env=client_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0
    assert done.stdout.strip() == f"taskhoster {importlib.metadata.version('taskhoster')}"


def test_work_help_says_the_payload_comes_on_stdin_and_the_result_goes_to_stdout():
    done = subprocess.run(cli_command("work", "--help"), cwd=PROJECT_DIR, env=client_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0
    assert "stdin   the item's payload" in done.stdout and "stdout  the item's result" in done.stdout


@pytest.mark.parametrize("args", SUBCOMMANDS, ids=lambda args: args[0])
def test_an_unreachable_server_is_one_line_and_exit_status_1(live, args):
    done = run_cli(live, *args, TASKHOSTER_URL=NO_SERVER)
    assert_one_line_error(done, 1, "cannot reach", "127.0.0.1:9")


@pytest.mark.parametrize("args", [("post", "nope", "1"), ("stats", "nope"), ("work", "nope", "--", "cat")],
                         ids=lambda args: args[0])
def test_an_unknown_queue_is_one_line_and_exit_status_1(live, args):
    assert_one_line_error(run_cli(live, *args), 1, "unknown_queue")


def test_no_token_at_all_is_one_line_that_says_how_to_make_one(live):
    done = subprocess.run(cli_command("stats"), cwd=PROJECT_DIR, env=client_env(), capture_output=True, text=True,
                          timeout=60)
    assert_one_line_error(done, 1, "no token", "TASKHOSTER_TOKEN", "createtoken")


@pytest.mark.parametrize(
    ("args", "message"),
    [((), "required: subcommand"), (("work", "work"), "give the command to run after --"),
     (("work", "work", "--", "no-such-program-here"), "command not found: no-such-program-here"),
     (("work", "work", "--", "./pyproject.toml"), "./pyproject.toml is not executable (chmod +x it)"),
     (("get", "cli", MISSING_ID, "--wait", "-1"), "argument --wait: expected seconds, 0 or more"),
     (("get", "cli", MISSING_ID, "--wait", "nan"), "argument --wait: expected seconds, 0 or more"),
     (("work", "work", "--concurrency", "0", "--", "cat"), "argument --concurrency: expected a whole number"),
     (("work", "work", "--retry", "--retry-base", "5", "--retry-cap", "1", "--", "cat"), "retry_base <= retry_cap"),
     (("frobnicate",), "invalid choice")],
)
def test_a_mistake_in_the_command_line_is_one_line_and_exit_status_2(live, args, message):
    assert_one_line_error(run_cli(live, *args), 2, message)


# ---- work -----------------------------------------------------------------------------------------


def test_work_runs_a_shell_script_per_item_with_the_payload_on_stdin(live, producer, tmp_path):
    echo = script(tmp_path, "echo.sh", ECHO_SCRIPT)
    worker = subprocess.Popen(cli_command("work", "work", "--concurrency", "3", "--", str(echo)), cwd=PROJECT_DIR,
                              env=client_env(live), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        items = producer.post_many("work", [{"n": n} for n in range(6)])
        results = [producer.result("work", item["id"], timeout=30) for item in items]
    finally:
        worker.send_signal(signal.SIGTERM)
        stdout, stderr = worker.communicate(timeout=30)
    assert worker.returncode == 0, stderr
    assert results == [{"got": {"n": n}, "id": item["id"], "attempts": 1} for n, item in enumerate(items)]
    assert stdout == "" and "Traceback" not in stderr


def test_work_turns_a_non_zero_exit_or_output_that_is_not_json_into_error_results(live, producer, tmp_path):
    failing = script(tmp_path, "failing.sh", FAILING_SCRIPT)
    workers = [
        subprocess.Popen(cli_command("work", queue, "--", *command), cwd=PROJECT_DIR, env=client_env(live),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for queue, command in (("failing", [str(failing)]), ("notjson", ["echo", "plain words"]))
    ]
    try:
        failed = producer.result("failing", producer.post("failing", {"n": 1})["id"], timeout=30)
        not_json = producer.result("notjson", producer.post("notjson", {"n": 2})["id"], timeout=30)
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        exits = [worker.wait(30) for worker in workers]
    assert exits == [0, 0]
    assert failed == {"error": {"type": "ExitStatus", "message": f"{failing} exited with status 3",
                                "exitCode": 3, "stderr": "cannot convert this one\n"}}
    assert not_json["error"]["type"] == "InvalidOutput"
    assert not_json["error"]["stdout"] == "plain words\n"
    assert "is not JSON" in not_json["error"]["message"]


@pytest.mark.parametrize("printed", ["NaN", "-Infinity", "[1, Infinity]", "[1e999]"])
async def test_a_program_that_prints_what_python_alone_reads_as_json_gives_invalid_output(printed):
    handler = ProgramHandler(["printf", "%s", printed])
    job = Job(id="x", queue="q", attempts=1, payload=None, claimed_at="", lease_expires_at="", lease_seconds=30)
    with pytest.raises(HandlerFailed) as failed:
        await handler(None, job)
    assert (failed.value.details["type"], failed.value.details["stdout"]) == ("InvalidOutput", printed)


def test_work_whose_command_cannot_be_started_stops_with_exit_1_and_fails_no_item(live, producer, tmp_path):
    """An executable file with no #! line: the kernel will not run it, for this item or any
    other. The worker says so and stops; the item goes back to its queue, not to an error result."""
    no_interpreter = script(tmp_path, "no-interpreter.sh", "echo '\"x\"'\n")
    items = [producer.post("unusable", n) for n in range(3)]
    done = subprocess.run(cli_command("work", "unusable", "--", str(no_interpreter)), cwd=PROJECT_DIR,
                          env=client_env(live), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert f"taskhoster: cannot run {no_interpreter}: Exec format error" in done.stderr
    assert "Traceback" not in done.stderr
    deadline = time.monotonic() + 30  # the socket's close gives the claimed item back
    while (statuses := [producer.get("unusable", item["id"])["status"] for item in items]) != ["pending"] * 3:
        assert time.monotonic() < deadline, statuses
        time.sleep(0.1)
    # one item was tried; the stop came before the slot it freed could claim another
    assert sorted(producer.get("unusable", item["id"])["attempts"] for item in items) == [0, 0, 1]


LEAVES_A_CHILD_SCRIPT = """#!/bin/sh
cat > /dev/null
{start} sleep 60 &
echo $! > {pid_file}
echo '"done, a child left running"'
"""


@pytest.mark.parametrize("start", ["", "setsid"], ids=["in its group", "in a session of its own"])
async def test_a_program_that_leaves_a_child_holding_its_output_ends_with_what_it_printed(tmp_path, start):
    """The child keeps the program's stdout and stderr open, in the program's process group or
    out of it: the item must not wait for the child, nor a worker slot with it."""
    pid_file = tmp_path / "child.pid"
    handler = ProgramHandler([str(script(tmp_path, "leaves-a-child.sh",
                                         LEAVES_A_CHILD_SCRIPT.format(start=start, pid_file=pid_file)))])
    job = Job(id="x", queue="q", attempts=1, payload=None, claimed_at="", lease_expires_at="", lease_seconds=30)
    try:
        assert await asyncio.wait_for(handler(None, job), 30) == "done, a child left running"
    finally:
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


FAILS_TWICE_SCRIPT = """#!/bin/sh
cat > /dev/null
if [ "$TASKHOSTER_ATTEMPTS" -lt 3 ]; then
    echo "try $TASKHOSTER_ATTEMPTS of $TASKHOSTER_MAX_ATTEMPTS failed" >&2
    exit 1
fi
echo '{"done on": '$TASKHOSTER_ATTEMPTS'}'
"""


def test_work_with_retry_gives_a_failing_item_back_until_its_command_succeeds(live, producer, tmp_path):
    fails_twice = script(tmp_path, "fails-twice.sh", FAILS_TWICE_SCRIPT)
    worker = subprocess.Popen(
        cli_command("work", "tries", "--retry", "--retry-base", "0.05", "--retry-cap", "0.1", "--", str(fails_twice)),
        cwd=PROJECT_DIR, env=client_env(live), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        item = producer.post("tries", {"n": 1})
        assert producer.result("tries", item["id"], timeout=30) == {"done on": 3}
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    last_error = producer.get("tries", item["id"])["lastError"]["error"]
    assert last_error["type"] == "ExitStatus" and last_error["exitCode"] == 1
    assert last_error["stderr"] == "try 2 of 3 failed\n"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "hang-up"])
def test_work_lets_a_running_command_finish_on_a_ctrl_c_or_hang_up_at_its_terminal(live, producer, tmp_path, signum):
    """A Ctrl-C or a hang-up reaches every process of the terminal's foreground group: the
    worker's, not the command's, which runs on and hands in its result before the worker exits."""
    slow = script(tmp_path, "slow.sh", "#!/bin/sh\ntouch \"$1\"\nsleep 1\necho '\"finished\"'\n")
    started = tmp_path / "started"
    worker = subprocess.Popen(cli_command("work", "terminal", "--", str(slow), str(started)), cwd=PROJECT_DIR,
                              env=client_env(live), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)  # a group of its own, as a terminal's job
    try:
        item = producer.post("terminal", 1)
        wait_for_file(started, "the command never started")
        os.killpg(worker.pid, signum)  # as the terminal does
        assert worker.wait(30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.communicate()
    assert producer.get("terminal", item["id"])["result"] == "finished"


def wait_for_file(path: Path, what: str) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_work_kills_a_canceled_item_s_command_and_what_it_started(live, producer, tmp_path):
    starts = script(tmp_path, "starts.sh", "#!/bin/sh\nsleep 60 &\necho $! > \"$1.tmp\"\nmv \"$1.tmp\" \"$1\"\nwait\n")
    started = tmp_path / "grandchild"
    worker = subprocess.Popen(cli_command("work", "terminal", "--", str(starts), str(started)), cwd=PROJECT_DIR,
                              env=client_env(live), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        item = producer.post("terminal", 1)
        wait_for_file(started, "the command never started its own child")
        grandchild = int(started.read_text())
        producer.cancel("terminal", item["id"])
        deadline = time.monotonic() + 30
        while _running(grandchild):
            assert time.monotonic() < deadline, "the command's own child outlived the cancel"
            time.sleep(0.02)
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
        worker.communicate()
    assert producer.get("terminal", item["id"])["error"] == "canceled"


def test_post_with_delay_or_run_at_schedules_the_items(live, producer):
    in_an_hour = (datetime.now(timezone.utc) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S")
    delayed = run_cli(live, "post", "later", "1", "--delay", "3600")
    at = run_cli(live, "post", "later", "--run-at", in_an_hour + "+00:00", stdin="2\n3\n")
    assert delayed.returncode == 0 and at.returncode == 0, delayed.stderr + at.stderr
    ids = delayed.stdout.split() + at.stdout.split()
    items = [producer.get("later", item_id) for item_id in ids]
    assert [item["status"] for item in items] == ["scheduled"] * 3
    assert [item["runAt"] for item in items[1:]] == [in_an_hour + ".000Z"] * 2


def test_post_refuses_delay_and_run_at_together_and_a_time_without_an_offset(live, producer):
    before = producer.stats("later")["counts"]
    both = run_cli(live, "post", "later", "1", "--delay", "5", "--run-at", "2099-12-01T23:59:59Z")
    assert_one_line_error(both, 2, "not allowed with argument")
    no_offset = run_cli(live, "post", "later", "1", "--run-at", "2099-12-01T23:59:59")
    assert_one_line_error(no_offset, 1, "invalid_request")
    assert producer.stats("later")["counts"] == before


def test_cancel_and_retry_print_the_item(live, producer):
    item = producer.post("ended", {"n": 1})
    canceled = run_cli(live, "cancel", "ended", item["id"])
    assert canceled.returncode == 0, canceled.stderr
    shown = json.loads(canceled.stdout)
    assert (shown["status"], shown["error"], shown["canceled"]) == ("failed", "canceled", True)

    retried = run_cli(live, "retry", "ended", item["id"])
    assert retried.returncode == 0, retried.stderr
    again = json.loads(retried.stdout)
    assert again["retryOf"] == item["id"] and again["status"] == "pending"
    assert_one_line_error(run_cli(live, "retry", "ended", again["id"]), 1, "not_ended")
    assert_one_line_error(run_cli(live, "cancel", "ended", MISSING_ID), 1, "not_found")


def test_the_installed_console_script_runs_the_cli():
    # pyproject.toml's [project.scripts]: taskhoster = "taskhoster.cli:main", made by `pip install`
    installed = Path(sys.executable).parent / "taskhoster"
    assert installed.exists(), "no console script: declare it in pyproject.toml, then pip install -e ."
    done = subprocess.run([str(installed), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "usage: taskhoster" in done.stdout and "post" in done.stdout and "work" in done.stdout
