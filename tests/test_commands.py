"""`createqueue` and `sweep --once`, called as a user calls them."""

import json
import os
import subprocess
import sys
import time
from io import StringIO

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from queues.models import Queue
from queues.runtime import get_store
from serverproc import MANAGE, PROJECT_DIR, Deployment
from queues.services import save_queue
from queues.store import QueueConfig, Store
from storekit import finish, post_batch

pytestmark = pytest.mark.django_db

DAY = 86400


def run(*args) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def createqueue(*args) -> dict:
    return json.loads(run("createqueue", *args))


def queue_dirs() -> list[str]:
    data_dir = settings.TASKHOSTER_DATA_DIR
    return sorted(os.listdir(data_dir)) if data_dir.is_dir() else []


def test_createqueue_creates_a_queue_with_the_defaults_and_prints_it():
    shown = createqueue("thumbs")
    assert shown == {
        "name": "thumbs",
        "leaseSeconds": 60,
        "queueSeconds": DAY,
        "retainSeconds": 3600,
        "retainFrom": "finished",
        "paused": False,
        "maxAttempts": None,
        "counts": {"scheduled": 0, "pending": 0, "processing": 0, "finished": 0, "failed": 0},
        "oldestPendingAgeSeconds": None,
    }
    assert Queue.objects.get(name="thumbs").config() == QueueConfig(name="thumbs")
    assert queue_dirs() == ["thumbs"]


def test_createqueue_says_on_stderr_whether_it_created_or_updated():
    out, err = StringIO(), StringIO()
    call_command("createqueue", "thumbs", stdout=out, stderr=err)
    call_command("createqueue", "thumbs", "--lease-seconds", "5", stdout=out, stderr=err)

    assert err.getvalue().splitlines() == ["created queue thumbs", "updated queue thumbs"]
    assert [json.loads(line)["name"] for line in out.getvalue().splitlines()] == ["thumbs", "thumbs"]


def test_createqueue_sets_every_setting():
    shown = createqueue(
        "thumbs", "--lease-seconds", "5", "--queue-seconds", "600", "--retain-seconds", "0",
        "--retain-from", "fetched", "--paused",
    )
    assert (shown["leaseSeconds"], shown["queueSeconds"], shown["retainSeconds"]) == (5, 600, 0)
    assert (shown["retainFrom"], shown["paused"]) == ("fetched", True)
    assert Queue.objects.get(name="thumbs").config() == QueueConfig("thumbs", 5, 600, 0, "fetched", True)


def test_createqueue_changes_only_the_given_settings():
    createqueue("thumbs", "--lease-seconds", "10", "--retain-from", "fetched", "--paused")
    shown = createqueue("thumbs", "--unpaused")
    assert (shown["leaseSeconds"], shown["retainFrom"], shown["paused"]) == (10, "fetched", False)
    shown = createqueue("thumbs", "--queue-seconds", "7200")
    assert (shown["leaseSeconds"], shown["queueSeconds"], shown["paused"]) == (10, 7200, False)
    assert Queue.objects.count() == 1


def test_createqueue_shows_the_queue_counts():
    createqueue("thumbs")
    post_batch(get_store(), "thumbs", [1, 2])
    shown = createqueue("thumbs")
    assert shown["counts"] == {"scheduled": 0, "pending": 2, "processing": 0, "finished": 0, "failed": 0}
    assert 0 <= shown["oldestPendingAgeSeconds"] < 60


@pytest.mark.parametrize("name", ["..", "a/b", "Thumbs", "x" * 65, "_thumbs", "thumbs!", "a b", "é"])
def test_createqueue_refuses_a_bad_name_and_changes_nothing(name):
    with pytest.raises(CommandError, match="lowercase letters, digits") as error:
        run("createqueue", name)
    assert error.value.args[0].startswith("name:")
    assert not Queue.objects.exists()
    assert queue_dirs() == []


@pytest.mark.parametrize(
    "option, value, bound",
    [
        ("--lease-seconds", "0", "greater than or equal to 1"),
        ("--lease-seconds", "86401", "less than or equal to 86400"),
        ("--queue-seconds", "0", "greater than or equal to 1"),
        ("--queue-seconds", str(30 * DAY + 1), f"less than or equal to {30 * DAY}"),
        ("--retain-seconds", "-1", "greater than or equal to 0"),
        ("--retain-seconds", str(30 * DAY + 1), f"less than or equal to {30 * DAY}"),
    ],
)
def test_createqueue_refuses_an_out_of_range_setting_and_changes_nothing(option, value, bound):
    with pytest.raises(CommandError, match=f"{option}: Ensure this value is {bound}"):
        run("createqueue", "thumbs", option, value)
    assert not Queue.objects.exists()
    assert queue_dirs() == []
    createqueue("thumbs", "--lease-seconds", "5")
    with pytest.raises(CommandError, match=option):
        run("createqueue", "thumbs", "--lease-seconds", "6", option, value)
    assert Queue.objects.get(name="thumbs").config() == QueueConfig(name="thumbs", lease_seconds=5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--retain-from", "read"], "invalid choice: 'read'"),
        (["--lease-seconds", "ten"], "invalid int value: 'ten'"),
        (["--paused", "--unpaused"], "not allowed with argument"),
    ],
)
def test_createqueue_refuses_unparsable_options_and_changes_nothing(args, message):
    with pytest.raises(CommandError, match=message):
        run("createqueue", "thumbs", *args)
    assert not Queue.objects.exists()
    assert queue_dirs() == []


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Deployment:
    deployment = Deployment(tmp_path_factory.mktemp("installed"))
    deployment.migrate()
    return deployment


@pytest.mark.parametrize("args", [["--retain-from", "read"], ["--lease-seconds", "ten"], ["--max-attempts", "x"],
                                  ["--paused", "--unpaused"], ["--bogus"], ["--lease-seconds", "0"]], ids=str)
def test_createqueue_on_the_command_line_tells_a_bad_value_in_one_line(installed, args):
    done = subprocess.run([sys.executable, str(MANAGE), "createqueue", "thumbs", *args], cwd=PROJECT_DIR,
                          env=installed.environ(), capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (1, "")
    [line] = done.stderr.splitlines()  # not argparse's usage as well
    assert line.startswith("CommandError: ")
    assert not (installed.data_dir / "thumbs").exists()


@pytest.mark.parametrize("args", [["createtoken"], ["createtoken", "ci", "--bogus"], ["revoketoken"]], ids=str)
def test_the_token_commands_on_the_command_line_tell_a_bad_argument_in_one_line(installed, args):
    done = subprocess.run([sys.executable, str(MANAGE), *args], cwd=PROJECT_DIR, env=installed.environ(),
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (1, "")
    [line] = done.stderr.splitlines()
    assert line.startswith("CommandError: ")


def test_createqueue_refuses_when_the_data_directory_cannot_be_written(settings, tmp_path):
    (tmp_path / "a-file").write_text("")
    settings.TASKHOSTER_DATA_DIR = tmp_path / "a-file" / "data"
    get_store.cache_clear()
    with pytest.raises(CommandError, match="the data directory cannot be written"):
        run("createqueue", "thumbs")
    assert not Queue.objects.exists()


def test_sweep_once_prints_what_changed():
    save_queue("thumbs", retain_seconds=0)
    save_queue("quiet")
    store = get_store()
    lapsed, finished = (i.id for i in post_batch(store, "thumbs", [1, 2]))
    # a claim made an hour ago (by another process whose lease ran out meanwhile)
    an_hour_ago = Store(store.data_dir, fsync=False, clock=lambda: time.time() - 3600)
    config = Queue.objects.get(name="thumbs").config()
    assert [i.id for i in an_hour_ago.claim_items(config=config)] == [lapsed]
    assert finish(store, config, finished, "r").accepted
    stale = store.data_dir / "thumbs" / "tmp" / "left-by-a-crash.json"
    stale.write_text("{}")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))

    assert json.loads(run("sweep", "--once")) == {
        "thumbs": {"promoted": 0, "repaired": 0, "failed": 0, "requeued": 1, "deleted": 1, "tmpRemoved": 1}
    }
    assert store.read_item(queue="thumbs", item_id=lapsed).status == "pending"
    assert json.loads(run("sweep", "--once")) == {}
