"""The dashboard's connected workers: each process's own sockets, and every process's through the
shared channel layer, live."""

import json
import re
import time
from contextlib import ExitStack

import httpx
from websockets.sync.client import connect

from queues.roster import STALE_SECONDS, Connection, Roster, per_queue
from serverproc import Deployment, redis_database

REDIS_DB = 11  # this module's own Redis database
PASSWORD = "a watcher's password"
DEADLINE = 20.0


def test_a_roster_lists_its_sockets_with_what_each_holds_and_forgets_a_silent_process():
    now = [1_796_000_000.0]
    roster = Roster(lambda: now[0])
    held = [("thumbs", "01a00000-0000-7000-8000-000000000002"), ("thumbs", "01a00000-0000-7000-8000-000000000001")]
    worker = Connection(name="ci", address="10.0.0.5:40000", connected_at=now[0] - 90, held=lambda: held,
                        queues={"mail"})
    roster.join(worker)
    roster.heard("process-2", [{"id": "x", "name": "other", "address": "10.0.0.6:1", "connectedAt":
                                "2026-11-30T00:00:00.000Z", "queues": ["thumbs"], "holding": 0, "held": []}])

    everyone = roster.everyone()
    assert [w["name"] for w in everyone] == ["other", "ci"]  # oldest connection first
    [mine] = roster.local()
    assert mine["queues"] == ["mail", "thumbs"] and mine["holding"] == 2
    assert [item["id"] for item in mine["held"]] == [item_id for _, item_id in sorted(held)]
    assert per_queue(everyone) == {"thumbs": 2, "mail": 1}

    now[0] += STALE_SECONDS + 1  # the other process stopped publishing
    assert [w["name"] for w in roster.everyone()] == ["ci"]
    roster.leave(worker)
    assert roster.everyone() == []


def test_a_worker_on_one_server_process_shows_on_the_dashboard_of_another(tmp_path):
    deployment = Deployment(tmp_path / "shared", redis_url=redis_database(REDIS_DB),
                            extra_env={"DJANGO_SUPERUSER_PASSWORD": PASSWORD})
    deployment.prepare(queues=["thumbs"])
    deployment.manage("createsuperuser", "--no-input", "--username", "watcher", "--email", "w@example.com")
    with ExitStack() as stack:
        first = stack.enter_context(deployment.server())
        second = stack.enter_context(deployment.server())
        headers = {"Authorization": f"Bearer {deployment.token}"}
        item_id = httpx.post(f"{first.url}/api/queues/thumbs/items", json={"payload": 1}, headers=headers).json()["id"]

        worker = stack.enter_context(connect(first.ws_url, additional_headers=headers))
        worker.send(json.dumps({"op": "claim", "queue": "thumbs"}))
        assert [item["id"] for item in json.loads(worker.recv())["items"]] == [item_id]

        cookie = log_in(second.url)
        live_url = second.url.replace("http://", "ws://") + "/dashboard/live"
        with connect(live_url, additional_headers={"Cookie": cookie, "Origin": second.url}) as dashboard:
            [shown] = next_snapshot(dashboard, lambda s: s["workers"])["workers"]
            assert shown["name"] == "everything" and shown["queues"] == ["thumbs"]
            assert shown["holding"] == 1 and shown["held"] == [{"queue": "thumbs", "id": item_id}]
            assert next_snapshot(dashboard, lambda s: True)["queues"][0]["workers"] == 1
            page = httpx.get(f"{second.url}/", headers={"Cookie": cookie}).text
            assert "everything" in page and item_id[-8:] in page  # the page itself, before the live updates

            worker.close()
            assert next_snapshot(dashboard, lambda s: not s["workers"])["queues"][0]["workers"] == 0


def log_in(url: str) -> str:
    """A staff session's cookie header."""
    with httpx.Client(base_url=url, timeout=30) as browser:
        form = browser.get("/admin/login/")
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
        answer = browser.post("/admin/login/", data={"csrfmiddlewaretoken": csrf, "username": "watcher",
                                                     "password": PASSWORD, "next": "/"})
        assert answer.status_code == 302, answer.text
        return "; ".join(f"{name}={value}" for name, value in browser.cookies.items())


def next_snapshot(dashboard, wanted) -> dict:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        snapshot = json.loads(dashboard.recv(timeout=DEADLINE))
        if wanted(snapshot):
            return snapshot
    raise AssertionError("no snapshot showed what was expected")
