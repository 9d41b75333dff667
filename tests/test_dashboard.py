"""The staff dashboard: permissions, every page and action, and the live socket."""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from channels.layers import channel_layers
from channels.testing import WebsocketCommunicator
from django.contrib.sessions.models import Session
from django.db import DatabaseError, connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils.html import escape

from queues.dashboard import consumers as dashboard_consumers
from queues.dashboard import views
from queues.dashboard.consumers import from_own_page
from queues.exceptions import StorageUnavailable
from queues.dashboard.display import chart_columns, format_duration
from queues.dashboard.feed import SnapshotFeed
from queues.dashboard.snapshot import take_snapshot
from queues.events import hub
from queues.models import Queue
from queues.runtime import get_registry, get_store
from queues.services import save_queue
from queues.store import NewItem, QueueConfig, Store
from store_support import first_listing_done
from storekit import finish, post_batch, release
from taskhoster_site.asgi import application

PROJECT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _fast(settings):
    settings.TASKHOSTER_FSYNC = False
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # test users only


@pytest.fixture
def staff_client(django_user_model):
    user = django_user_model.objects.create_user("operator", password="pw", is_staff=True)
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def visitor_client(django_user_model):
    user = django_user_model.objects.create_user("visitor", password="pw")
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def queue(db):
    return save_queue("thumbs", lease_seconds=60)


@pytest.fixture
def clocked_store(settings, clock, monkeypatch):
    """The dashboard's store with a clock the test moves."""
    store = Store(settings.TASKHOSTER_DATA_DIR, fsync=False, clock=clock)
    monkeypatch.setattr(views, "get_store", lambda: store)
    return store


def post(queue_name: str, *payloads) -> list[str]:
    return [item.id for item in post_batch(get_store(), queue_name, list(payloads))]


def pages_of(queue_name: str, item_id: str) -> list[str]:
    return ["/", f"/queues/{queue_name}/", f"/queues/{queue_name}/?state=done", f"/queues/{queue_name}/items/{item_id}/"]


def actions_of(queue_name: str, item_id: str) -> list[str]:
    return [
        f"/queues/{queue_name}/pause",
        f"/queues/{queue_name}/resume",
        f"/queues/{queue_name}/items/{item_id}/requeue",
        f"/queues/{queue_name}/items/{item_id}/retry",
        f"/queues/{queue_name}/items/{item_id}/cancel",
    ]


# ---- permissions ---------------------------------------------------------------------------


def test_anonymous_visitors_are_sent_to_the_login_page(client, queue):
    [item_id] = post("thumbs", 1)
    for url in pages_of("thumbs", item_id) + actions_of("thumbs", item_id):
        response = client.post(url) if url in actions_of("thumbs", item_id) else client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/admin/login/?next="), url
    assert Queue.objects.get(name="thumbs").paused is False


def test_logged_in_users_who_are_not_staff_get_403(visitor_client, queue):
    [item_id] = post("thumbs", 1)
    get_store().claim_items(config=queue.config())
    for url in pages_of("thumbs", item_id):
        response = visitor_client.get(url)
        assert response.status_code == 403, url
        assert b"is not staff" in response.content
    for url in actions_of("thumbs", item_id):
        assert visitor_client.post(url).status_code == 403, url
    assert Queue.objects.get(name="thumbs").paused is False
    assert get_store().read_item(queue="thumbs", item_id=item_id).status == "processing"


def test_staff_see_every_page(staff_client, queue):
    [item_id] = post("thumbs", 1)
    for url in pages_of("thumbs", item_id):
        assert staff_client.get(url).status_code == 200, url


def test_actions_refuse_get_and_change_nothing(staff_client, queue):
    [item_id] = post("thumbs", 1)
    for url in actions_of("thumbs", item_id):
        assert staff_client.get(url).status_code == 405, url
    assert Queue.objects.get(name="thumbs").paused is False


def test_actions_need_the_csrf_token(django_user_model, queue):
    user = django_user_model.objects.create_user("strict", password="pw", is_staff=True)
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    assert client.post("/queues/thumbs/pause").status_code == 403
    assert Queue.objects.get(name="thumbs").paused is False


# ---- the dashboard page ----------------------------------------------------------------------


def test_dashboard_shows_every_queue_with_counts_by_state(staff_client, queue):
    save_queue("emails", paused=True)
    store = get_store()
    post("thumbs", 1, 2, 3, 4)
    [claimed] = store.claim_items(config=queue.config())
    finish(store, queue.config(), claimed.id, "ok")
    store.claim_items(config=queue.config())

    response = staff_client.get("/")

    rows = {row["name"]: row for row in response.context["rows"]}
    assert list(rows) == ["emails", "thumbs"]
    thumbs = {segment["state"]: segment for segment in rows["thumbs"]["segments"]}
    assert {state: segment["count"] for state, segment in thumbs.items()} == {
        "scheduled": 0,
        "pending": 2,
        "processing": 1,
        "finished": 1,
        "failed": 0,
    }
    assert thumbs["pending"]["percent"] == 50.0
    assert rows["emails"]["paused"] and not rows["thumbs"]["paused"]
    html = response.content.decode()
    assert '<b data-count="pending">2</b>' in html
    assert 'aria-label="0 scheduled, 2 pending, 1 processing, 1 finished, 0 failed"' in html
    assert html.count('data-field="paused">Paused') == 1  # shown for emails; hidden for thumbs
    assert 'data-queue="emails" class="th-is-paused"' in html


def test_dashboard_shows_oldest_pending_age_and_throughput(staff_client, queue, clocked_store, clock):
    config = queue.config()
    post_batch(clocked_store, "thumbs", [1, 2])
    clock.advance(125)
    [item] = clocked_store.claim_items(config=config)
    finish(clocked_store, config, item.id, None)

    response = staff_client.get("/")

    [row] = response.context["rows"]
    assert row["oldest"] == "2 min 5 s"
    assert len(row["chart"]) == 15
    assert row["chart"][-1]["finished"] == 100.0
    assert row["rate"] == "1 finished, 0 failed"
    assert "1 finished, 0 failed" in response.content.decode()


def test_dashboard_without_queues_says_how_to_make_one(staff_client, db):
    response = staff_client.get("/")
    assert response.status_code == 200
    assert b"No queues yet" in response.content


def test_dashboard_loads_its_script_and_styles_and_names_the_live_socket(staff_client, queue):
    html = staff_client.get("/").content.decode()
    assert "/static/queues/dashboard.js" in html
    assert "/static/queues/dashboard.css" in html
    assert 'data-live-url="/dashboard/live"' in html
    assert "Reload the page" in html


# ---- a queue's items ---------------------------------------------------------------------------


def test_queue_page_lists_pending_items_newest_first_in_pages(staff_client, queue):
    item_ids = post("thumbs", *range(120))
    newest_first = item_ids[::-1]

    first = staff_client.get("/queues/thumbs/")
    third = staff_client.get("/queues/thumbs/?state=pending&page=3")

    assert [row["id"] for row in first.context["items"]] == newest_first[:50]
    assert [row["id"] for row in third.context["items"]] == newest_first[100:]
    assert first.context["pages"] == 3
    assert "1–50 of 120 pending items" in first.content.decode()
    assert 'rel="next"' in first.content.decode() and 'rel="prev"' not in first.content.decode()
    assert 'rel="prev"' in third.content.decode() and 'rel="next"' not in third.content.decode()


def test_a_page_past_the_end_says_so(staff_client, queue):
    post("thumbs", 1)
    response = staff_client.get("/queues/thumbs/?page=9")
    assert response.status_code == 200
    assert b"Page 9 is past the end" in response.content


@pytest.mark.parametrize("query", ["page=abc", "page=0", "page=-1", "state=lost", "page=%C2%B2", "page=" + "9" * 5000])
def test_bad_list_parameters_get_a_clear_404(staff_client, queue, query):
    response = staff_client.get(f"/queues/thumbs/?{query}")
    assert response.status_code == 404
    assert b"No such" in response.content


def test_a_pause_the_disk_refuses_is_said_so_not_a_server_error(staff_client, queue, monkeypatch):
    def refused(*args, **kwargs):
        raise StorageUnavailable("the data directory cannot be written: No space left on device")

    monkeypatch.setattr(views, "save_queue", refused)
    response = staff_client.post("/queues/thumbs/pause", follow=True)
    assert response.status_code == 200
    assert b"was not paused: the data directory cannot be written" in response.content


def test_unknown_queue_gets_a_clear_404(staff_client, db):
    for url in ["/queues/nope/", "/queues/nope/items/0193a4b2-7c1e-7d3a-9f00-2b6c1d0e4f55/"]:
        response = staff_client.get(url)
        assert response.status_code == 404
        assert "There is no queue named “nope”" in response.content.decode()
    for url in ["/queues/nope/pause", "/queues/nope/items/0193a4b2-7c1e-7d3a-9f00-2b6c1d0e4f55/requeue"]:
        assert staff_client.post(url).status_code == 404


def test_processing_list_shows_attempts_and_lease_time_left(staff_client, queue, clocked_store, clock):
    config = queue.config()
    post_batch(clocked_store, "thumbs", [1])
    [item] = clocked_store.claim_items(config=config)
    release(clocked_store, "thumbs", item.id)
    clocked_store.claim_items(config=config)
    clock.advance(15)

    response = staff_client.get("/queues/thumbs/?state=processing")

    [row] = response.context["items"]
    assert row["attempts"] == 2
    assert row["lease_left"] == "45 s"
    assert row["age"] == "15 s"
    assert b"Re-queue now" in response.content
    clock.advance(50)
    [row] = staff_client.get("/queues/thumbs/?state=processing").context["items"]
    assert row["lease_left"] == "lapsed"


def test_done_list_shows_finished_and_failed_items(staff_client, db, clocked_store, clock):
    config = save_queue("thumbs", queue_seconds=60).config()
    post_batch(clocked_store, "thumbs", [1, 2])
    [item] = clocked_store.claim_items(config=config)
    finish(clocked_store, config, item.id, "ok")
    clock.advance(61)
    clocked_store.sweep_queue(config=config)

    response = staff_client.get("/queues/thumbs/?state=done")

    assert sorted(row["status"] for row in response.context["items"]) == ["failed", "finished"]
    tabs = {tab["state"]: tab["count"] for tab in response.context["tabs"]}
    assert tabs == {"scheduled": 0, "pending": 0, "processing": 0, "done": 2}


# ---- one item --------------------------------------------------------------------------------------


def test_the_dashboard_counts_error_results_apart_from_other_finished_items(staff_client, queue):
    store = get_store()
    post("thumbs", 1, 2)
    first, second = store.claim_items(config=queue.config(), max_items=2)
    finish(store, queue.config(), first.id, {"error": {"type": "ValueError", "message": "bad image"}})
    finish(store, queue.config(), second.id, "ok")
    response = staff_client.get("/")
    [row] = [row for row in response.context["rows"] if row["name"] == "thumbs"]
    assert row["errors"] == 1
    assert "of the finished, 1 with an error result" in response.content.decode()
    snapshot = take_snapshot(store, [queue.config()])
    assert snapshot["queues"][0]["errorResults"] == 1
    assert "errors" not in snapshot["queues"][0]["counts"]  # the API's counts stay as they are


def test_item_page_shows_payload_and_result_as_pretty_json(staff_client, queue):
    store = get_store()
    [item_id] = post("thumbs", {"image": "cat.png", "sizes": [64, 128]})
    store.claim_items(config=queue.config())
    finish(store, queue.config(), item_id, {"ok": True, "note": "<b>fine</b>"})

    response = staff_client.get(f"/queues/thumbs/items/{item_id}/")

    html = response.content.decode()
    assert escape('{\n  "image": "cat.png",\n  "sizes": [\n    64,\n    128\n  ]\n}') in html
    assert escape('{\n  "ok": true,\n  "note": "<b>fine</b>"\n}') in html
    assert "<b>fine</b>" not in html  # shown, never interpreted
    assert response.context["item"]["attempts"] == 1


def test_item_page_shows_the_idempotency_key_an_item_was_posted_with(staff_client, queue):
    [keyed] = get_store().post_items(config=queue.config(), items=[NewItem({"n": 1}, key="order <7>")])
    [plain] = post("thumbs", {"n": 2})
    html = staff_client.get(f"/queues/thumbs/items/{keyed.item.id}/").content.decode()
    assert "Idempotency key" in html and escape("order <7>") in html
    assert "Idempotency key" not in staff_client.get(f"/queues/thumbs/items/{plain}/").content.decode()


def test_item_page_of_a_failed_item_shows_the_error(staff_client, db, clocked_store, clock):
    config = save_queue("thumbs", queue_seconds=5).config()
    [item] = post_batch(clocked_store, "thumbs", [None])
    clock.advance(6)
    clocked_store.sweep_queue(config=config)

    response = staff_client.get(f"/queues/thumbs/items/{item.id}/")

    assert response.context["error"] == "timeout"
    assert b"No result: the server failed this item (timeout: it grew older than" in response.content
    assert b"(queueSeconds, 5 s) before it ended" in response.content  # which limit failed it


def test_viewing_an_item_is_not_a_fetch(staff_client, db):
    queue = save_queue("thumbs", retain_from="fetched", retain_seconds=0)
    store = get_store()
    [item_id] = post("thumbs", 1)
    store.claim_items(config=queue.config())
    finish(store, queue.config(), item_id, 1)

    assert staff_client.get(f"/queues/thumbs/items/{item_id}/").status_code == 200
    assert store.sweep_queue(config=queue.config()).deleted == []  # never fetched: kept

    store.read_item(queue="thumbs", item_id=item_id, fetch=True)
    assert store.sweep_queue(config=queue.config()).deleted == [item_id]


def test_an_item_deleted_while_someone_looks_at_it_is_a_gone_page(staff_client, db):
    queue = save_queue("thumbs", retain_seconds=0)
    store = get_store()
    [item_id] = post("thumbs", 1)
    assert staff_client.get(f"/queues/thumbs/items/{item_id}/").status_code == 200
    store.claim_items(config=queue.config())
    finish(store, queue.config(), item_id, 1)
    store.sweep_queue(config=queue.config())

    response = staff_client.get(f"/queues/thumbs/items/{item_id}/")

    assert response.status_code == 404
    assert "Item gone" in response.content.decode()
    assert f"Item {item_id} is not in queue thumbs" in response.content.decode()


@pytest.mark.parametrize("item_id", ["not-an-id", "0193a4b2-7c1e-7d3a-9f00-2b6c1d0e4f55", "0193A4B2-7C1E-7D3A-9F00-2B6C1D0E4F55", "..."])
def test_a_malformed_or_unknown_item_id_is_a_gone_page(staff_client, queue, item_id):
    response = staff_client.get(f"/queues/thumbs/items/{item_id}/")
    assert response.status_code == 404
    assert b"Item gone" in response.content


# ---- actions ---------------------------------------------------------------------------------


def test_requeue_puts_a_processing_item_back_to_pending_and_wakes_a_worker(staff_client, queue, monkeypatch):
    store = get_store()
    [item_id] = post("thumbs", 1)
    store.claim_items(config=queue.config())
    first_listing_done(store, "thumbs")
    woken = []
    monkeypatch.setattr(hub, "items_available", lambda name, count=1, **_: woken.append((name, count)))

    response = staff_client.post(f"/queues/thumbs/items/{item_id}/requeue", follow=True)

    assert store.read_item(queue="thumbs", item_id=item_id).status == "pending"
    assert woken == [("thumbs", 1)]
    assert response.redirect_chain[-1][0] == f"/queues/thumbs/items/{item_id}/"
    assert b"is pending again" in response.content
    [again] = store.claim_items(config=queue.config())
    assert again.id == item_id and again.attempts == 2


def test_requeue_of_an_item_at_its_last_try_says_it_ended_instead(staff_client, db):
    limited = save_queue("thumbs", max_attempts=1)
    store = get_store()
    [item_id] = post("thumbs", 1)
    store.claim_items(config=limited.config())

    response = staff_client.post(f"/queues/thumbs/items/{item_id}/requeue", follow=True)

    assert store.read_item(queue="thumbs", item_id=item_id).error == "max_attempts"
    assert b"was not re-queued: it ended failed (max_attempts)" in response.content
    assert b"is pending again" not in response.content


def test_requeue_returns_to_the_page_it_came_from(staff_client, queue):
    [item_id] = post("thumbs", 1)
    get_store().claim_items(config=queue.config())
    back = "/queues/thumbs/?state=processing"
    response = staff_client.post(f"/queues/thumbs/items/{item_id}/requeue", {"next": back})
    assert response["Location"] == back


def test_requeue_of_an_item_that_is_not_processing_changes_nothing(staff_client, queue, monkeypatch):
    store = get_store()
    [item_id] = post("thumbs", 1)
    first_listing_done(store, "thumbs")  # its wake-up, when it finds the item, is not the requeue's
    woken = []
    monkeypatch.setattr(hub, "items_available", lambda *args, **kwargs: woken.append(args))

    response = staff_client.post(f"/queues/thumbs/items/{item_id}/requeue", follow=True)

    assert b"is not processing any more" in response.content
    assert store.read_item(queue="thumbs", item_id=item_id).attempts == 0
    assert woken == []


def test_requeue_of_a_gone_item_is_a_gone_page(staff_client, queue):
    response = staff_client.post("/queues/thumbs/items/0193a4b2-7c1e-7d3a-9f00-2b6c1d0e4f55/requeue")
    assert response.status_code == 404
    assert b"Item gone" in response.content


@pytest.mark.django_db(transaction=True)
def test_pause_and_resume_reach_the_queue_settings_at_once(staff_client):
    save_queue("thumbs")
    registry = get_registry()
    registry.refresh()
    assert registry.queue("thumbs").paused is False

    response = staff_client.post("/queues/thumbs/pause", follow=True)
    assert Queue.objects.get(name="thumbs").paused is True
    registry.refresh()  # no waiting out the cache: the action invalidated it
    assert registry.queue("thumbs").paused is True
    assert b"Queue thumbs is paused" in response.content
    assert b"Resume queue" in response.content

    staff_client.post("/queues/thumbs/resume")
    registry.refresh()
    assert registry.queue("thumbs").paused is False


def test_pause_returns_only_to_a_page_of_this_site(staff_client, queue):
    response = staff_client.post("/queues/thumbs/pause", {"next": "https://elsewhere.example/"})
    assert response["Location"] == "/queues/thumbs/"
    response = staff_client.post("/queues/thumbs/resume", {"next": "/"})
    assert response["Location"] == "/"


# ---- display helpers (mirrored by dashboard.js) ------------------------------------------------


@pytest.mark.parametrize(
    "seconds, text",
    [(None, "–"), (-3, "0 s"), (0.4, "0 s"), (59, "59 s"), (60, "1 min"), (125, "2 min 5 s"),
     (3600, "1 h"), (7500, "2 h 5 min"), (86400 * 3 + 7200, "3 d 2 h")],
)
def test_durations_read_at_a_glance(seconds, text):
    assert format_duration(seconds) == text


def test_chart_columns_are_scaled_to_the_busiest_minute():
    columns = chart_columns(
        [{"minute": "2026-11-30T14:05:00.000Z", "finished": 3, "failed": 1},
         {"minute": "2026-11-30T14:06:00.000Z", "finished": 0, "failed": 0}]
    )
    assert columns[0] == {"label": "14:05 UTC: 3 finished, 1 failed", "finished": 75.0, "failed": 25.0}
    assert columns[1]["finished"] == columns[1]["failed"] == 0.0


# ---- figures from the disk, across processes ---------------------------------------------------

OTHER_PROCESS = """
import sys, time
from queues.store import NewItem, QueueConfig, Store
config = QueueConfig(name="thumbs", queue_seconds=60)
server = Store(sys.argv[1], fsync=False)
items = server.post_items(config=config, items=[NewItem(n) for n in [1, 2, 3, 4, 5]])
for item in server.claim_items(config=config, max_items=2):
    server.finish_items(results=[(config, item.id, "ok")])
server.claim_items(config=config)
sweeper = Store(sys.argv[1], fsync=False, clock=lambda: time.time() + 61)
sweeper.sweep_queue(config=config)
"""


def test_snapshot_counts_what_other_processes_and_sweepers_did(tmp_path):
    """A snapshot reads the disk, so items posted, finished and failed by another server process
    and a sweeper are counted, throughput included."""
    data_dir = tmp_path / "shared"
    dashboard_store = Store(data_dir, fsync=False, clock=lambda: time.time() + 61)  # after the sweep
    subprocess.run([sys.executable, "-c", OTHER_PROCESS, str(data_dir)], cwd=PROJECT, check=True, timeout=60)

    snapshot = take_snapshot(dashboard_store, [QueueConfig(name="thumbs")])

    [queue] = snapshot["queues"]
    assert queue["counts"] == {"scheduled": 0, "pending": 0, "processing": 0, "finished": 2, "failed": 3}
    assert sum(minute["finished"] for minute in queue["throughput"]) == 2
    assert sum(minute["failed"] for minute in queue["throughput"]) == 3


# ---- the live socket ---------------------------------------------------------------------------


OWN_PAGE = [(b"host", b"localhost:8000"), (b"origin", b"http://localhost:8000")]


def session_headers(user) -> list[tuple[bytes, bytes]]:
    client = Client()
    client.force_login(user)
    return [(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()), *OWN_PAGE]


@pytest.fixture
def staff_headers(transactional_db, django_user_model):
    return session_headers(django_user_model.objects.create_user("live", password="pw", is_staff=True))


@pytest.mark.django_db(transaction=True)
async def test_live_socket_sends_staff_a_snapshot_and_then_the_changes(staff_headers):
    queue = await asyncio.to_thread(save_queue, "thumbs")
    post("thumbs", 1, 2)
    communicator = WebsocketCommunicator(application, "/dashboard/live", headers=staff_headers)
    connected, _ = await communicator.connect()
    assert connected
    try:
        first = await communicator.receive_json_from(timeout=5)
        assert first["type"] == "snapshot"
        [thumbs] = first["queues"]
        assert thumbs["name"] == "thumbs" and thumbs["paused"] is False
        assert thumbs["counts"] == {"scheduled": 0, "pending": 2, "processing": 0, "finished": 0, "failed": 0}
        assert len(thumbs["throughput"]) == 15

        get_store().claim_items(config=queue.config())
        second = await communicator.receive_json_from(timeout=5)
        assert second["queues"][0]["counts"]["processing"] == 1
    finally:
        await communicator.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_live_socket_refuses_anonymous_visitors():
    communicator = WebsocketCommunicator(application, "/dashboard/live", headers=OWN_PAGE)
    connected, code = await communicator.connect()
    assert not connected and code == 4401


@pytest.mark.django_db(transaction=True)
async def test_live_socket_refuses_users_who_are_not_staff(django_user_model):
    user = await django_user_model.objects.acreate(username="visitor")
    headers = await asyncio.to_thread(session_headers, user)
    communicator = WebsocketCommunicator(application, "/dashboard/live", headers=headers)
    connected, code = await communicator.connect()
    assert not connected and code == 4403


@pytest.mark.django_db(transaction=True)
async def test_live_socket_refuses_pages_of_other_sites(staff_headers):
    headers = [header for header in staff_headers if header[0] != b"origin"] + [(b"origin", b"https://evil.example")]
    communicator = WebsocketCommunicator(application, "/dashboard/live", headers=headers)
    connected, _ = await communicator.connect()
    assert not connected


@pytest.mark.parametrize("origin", [b"http://localhost:3000", b"http://localhost", b"http://127.0.0.1:8000"])
@pytest.mark.django_db(transaction=True)
async def test_live_socket_refuses_pages_of_the_same_site_on_another_port_or_host(staff_headers, origin):
    headers = [header for header in staff_headers if header[0] != b"origin"] + [(b"origin", origin)]
    communicator = WebsocketCommunicator(application, "/dashboard/live", headers=headers)
    connected, code = await communicator.connect()
    assert not connected and code == 4403


@pytest.mark.parametrize("host, origin", [
    (b"localhost", b"http://localhost"),
    (b"localhost:80", b"http://localhost"),
    (b"LOCALHOST", b"http://localhost:80"),
])
@pytest.mark.django_db(transaction=True)
async def test_live_socket_takes_its_own_origin_with_or_without_the_default_port(staff_headers, host, origin):
    assert await live_socket_opens(staff_headers, host, origin)


@pytest.mark.django_db(transaction=True)
async def test_live_socket_takes_a_trusted_origin_behind_a_proxy(staff_headers, settings):
    settings.CSRF_TRUSTED_ORIGINS = ["https://localhost:8443"]
    assert await live_socket_opens(staff_headers, b"127.0.0.1:8000", b"https://localhost:8443")


async def live_socket_opens(staff_headers, host: bytes, origin: bytes) -> bool:
    headers = [h for h in staff_headers if h[0] not in (b"host", b"origin")] + [(b"host", host), (b"origin", origin)]
    communicator = WebsocketCommunicator(application, "/dashboard/live", headers=headers)
    connected, _ = await communicator.connect()
    if connected:
        await communicator.disconnect()
    return connected


@pytest.mark.parametrize("socket_scheme, origin, taken", [
    ("ws", "http://example.com", True),
    ("wss", "https://example.com", True),
    ("wss", "https://example.com:443", True),
    ("wss", "http://example.com", False),  # a page on port 80 reading the dashboard on 443
    ("ws", "https://example.com", False),
])
def test_the_default_port_of_the_host_is_that_of_the_scheme_the_socket_came_by(settings, socket_scheme, origin,
                                                                                taken):
    settings.ALLOWED_HOSTS = ["example.com"]
    scope = {"scheme": socket_scheme, "headers": [(b"host", b"example.com"), (b"origin", origin.encode())]}
    assert from_own_page(scope) is taken


def test_with_debug_on_and_no_allowed_hosts_the_local_names_are_allowed_as_on_the_pages(settings):
    settings.DEBUG, settings.ALLOWED_HOSTS = True, []
    scope = {"headers": [(b"host", b"localhost:8000"), (b"origin", b"http://localhost:8000")]}
    assert from_own_page(scope) is True


def test_a_page_of_a_host_not_allowed_is_refused_though_it_names_the_host_it_reached():
    """A name of the attacker's that resolves to this server (DNS rebinding)."""
    scope = {"headers": [(b"host", b"evil.example:8000"), (b"origin", b"http://evil.example:8000")]}
    assert from_own_page(scope) is False


@pytest.mark.django_db(transaction=True)
async def test_the_live_socket_and_a_refused_one_need_no_redis(staff_headers, settings):
    """With Redis down, staff still get the live feed and a socket to nowhere is still a 403."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": ["redis://127.0.0.1:1"]}}}
    channel_layers.backends.clear()
    try:
        live = WebsocketCommunicator(application, "/dashboard/live", headers=staff_headers)
        connected, _ = await live.connect()
        assert connected
        await live.disconnect()
        nowhere = WebsocketCommunicator(application, "/nowhere", headers=staff_headers)
        connected, _ = await nowhere.connect()
        assert not connected
    finally:
        channel_layers.backends.clear()


@pytest.mark.parametrize("trusted, origin, taken", [
    ("https://*.example.com", "https://ops.example.com", True),
    ("https://*.example.com", "https://example.com", True),
    ("https://*.example.com", "http://ops.example.com", False),
    ("https://*.example.com", "https://ops.example.com.evil.test", False),
    ("https://ops.example.com", "https://OPS.example.com", True),
])
def test_a_trusted_origin_is_matched_as_djangos_csrf_check_matches_it(settings, trusted, origin, taken):
    settings.CSRF_TRUSTED_ORIGINS = [trusted]
    scope = {"headers": [(b"host", b"127.0.0.1:8000"), (b"origin", origin.encode())]}
    assert from_own_page(scope) is taken


@pytest.mark.django_db(transaction=True)
async def test_a_login_that_cannot_be_looked_at_again_keeps_the_feed_going(staff_headers, monkeypatch):
    monkeypatch.setattr(dashboard_consumers, "RECHECK_SECONDS", 0)

    async def database_down(consumer):
        raise DatabaseError("the database is down")

    monkeypatch.setattr(dashboard_consumers.DashboardConsumer, "_login_lost", database_down)
    communicator = WebsocketCommunicator(application, "/dashboard/live", headers=staff_headers)
    connected, _ = await communicator.connect()
    assert connected
    try:
        for _ in range(2):
            assert "queues" in await communicator.receive_json_from(timeout=5)
    finally:
        await communicator.disconnect()


@pytest.mark.parametrize("change, code", [
    ({"is_staff": False}, 4403),
    ({"is_active": False}, 4401),
    ("log out", 4401),
])
@pytest.mark.django_db(transaction=True)
async def test_live_socket_ends_once_its_login_no_longer_holds(django_user_model, monkeypatch, change, code):
    monkeypatch.setattr(dashboard_consumers, "RECHECK_SECONDS", 0)
    user = await django_user_model.objects.acreate(username="on-duty", is_staff=True)
    headers = await asyncio.to_thread(session_headers, user)
    communicator = WebsocketCommunicator(application, "/dashboard/live", headers=headers)
    connected, _ = await communicator.connect()
    assert connected
    assert (await communicator.receive_json_from(timeout=5))["type"] == "snapshot"  # looked, still staff
    if change == "log out":
        await Session.objects.all().adelete()
    else:
        await django_user_model.objects.filter(pk=user.pk).aupdate(**change)
    assert await communicator.receive_output(timeout=5) == {"type": "websocket.close", "code": code}


# ---- one snapshot per tick, shared -------------------------------------------------------------


class CountingSnapshots:
    def __init__(self):
        self.taken = 0

    async def __call__(self) -> str:
        self.taken += 1
        return json.dumps({"tick": self.taken})


async def test_every_dashboard_gets_the_same_snapshot_computed_once_per_tick():
    compute = CountingSnapshots()
    feed = SnapshotFeed(compute, interval=60)
    boxes = [feed.subscribe() for _ in range(3)]
    received = [await asyncio.wait_for(box.get(), 5) for box in boxes]
    assert received == ['{"tick": 1}'] * 3
    assert compute.taken == 1
    for box in boxes:
        feed.unsubscribe(box)


async def test_a_slow_dashboard_gets_only_the_newest_snapshot():
    compute = CountingSnapshots()
    feed = SnapshotFeed(compute, interval=0.01)
    box = feed.subscribe()
    while compute.taken < 5:
        await asyncio.sleep(0.01)
    newest = await box.get()
    assert json.loads(newest)["tick"] >= 4
    assert box.empty()
    feed.unsubscribe(box)


async def test_the_feed_stops_computing_when_the_last_dashboard_leaves():
    compute = CountingSnapshots()
    feed = SnapshotFeed(compute, interval=0.01)
    box = feed.subscribe()
    await box.get()
    feed.unsubscribe(box)
    taken = compute.taken
    await asyncio.sleep(0.05)
    assert compute.taken == taken


# ---- beyond the seed: scheduled items, failures told apart, retry and cancel ----------------------


def test_the_scheduled_tab_lists_items_with_when_they_are_due(staff_client, queue, clock, clocked_store):
    [posted] = clocked_store.post_items(config=queue.config(), items=[NewItem(1, run_at=clock.now + 125)])
    item = posted.item
    response = staff_client.get("/queues/thumbs/?state=scheduled")
    [row] = response.context["items"]
    assert (row["id"], row["due_in"]) == (item.id, "2 min 5 s")
    assert {tab["state"]: tab["count"] for tab in response.context["tabs"]}["scheduled"] == 1
    assert "Scheduled" in response.content.decode()


def test_failed_items_say_what_failed_them_and_error_results_are_errors(staff_client, db, clocked_store, clock):
    config = save_queue("thumbs", queue_seconds=60).config()
    aged, canceled, raised, fine = (i.id for i in post_batch(clocked_store, "thumbs", [1, 2, 3, 4]))
    clocked_store.cancel_item(config=config, item_id=canceled)
    error = {"error": {"type": "ValueError", "message": "no such image", "traceback": "Traceback (most recent call last):\n  line 1\nValueError: no such image"}}
    finish(clocked_store, config, raised, error)
    finish(clocked_store, config, fine, {"ok": True})
    clock.advance(61)
    clocked_store.sweep_queue(config=config)

    rows = {row["id"]: row for row in staff_client.get("/queues/thumbs/?state=done").context["items"]}
    assert {item_id: rows[item_id]["outcome"] for item_id in (aged, canceled, raised, fine)} == {
        aged: "timeout", canceled: "canceled", raised: "error", fine: None,
    }
    page = staff_client.get(f"/queues/thumbs/items/{raised}/").content.decode()
    assert "ValueError" in page and "no such image" in page
    assert "Traceback (most recent call last):\n  line 1" in page  # readable lines, not a JSON string
    assert "th-traceback" in page


def test_an_item_page_shows_its_last_error_and_links_a_retry_both_ways(staff_client, queue):
    store = get_store()
    [item_id] = post("thumbs", 1)
    claim = store.claim_items(config=queue.config())[0]
    release(store, queue.config(), item_id, claim.claim_token, error={"error": {"type": "Busy", "message": "later"}})
    store.claim_items(config=queue.config())
    finish(store, queue.config(), item_id, "done")
    page = staff_client.get(f"/queues/thumbs/items/{item_id}/").content.decode()
    assert "Last error" in page and "Busy" in page and "later" in page

    response = staff_client.post(f"/queues/thumbs/items/{item_id}/retry")
    new_id = store.read_item(queue="thumbs", item_id=item_id).retried_as
    assert response["Location"] == f"/queues/thumbs/items/{new_id}/"
    new_page = staff_client.get(response["Location"]).content.decode()
    assert f'href="/queues/thumbs/items/{item_id}/"' in new_page  # retry of
    assert f'href="/queues/thumbs/items/{new_id}/"' in staff_client.get(f"/queues/thumbs/items/{item_id}/").content.decode()
    staff_client.post(f"/queues/thumbs/items/{item_id}/retry")
    assert store.read_item(queue="thumbs", item_id=item_id).retried_as == new_id  # once


def test_cancel_ends_an_item_from_the_dashboard_and_an_ended_one_is_left_alone(staff_client, queue):
    store = get_store()
    [item_id] = post("thumbs", 1)
    assert "Cancel" in staff_client.get(f"/queues/thumbs/items/{item_id}/").content.decode()
    response = staff_client.post(f"/queues/thumbs/items/{item_id}/cancel", follow=True)
    item = store.read_item(queue="thumbs", item_id=item_id)
    assert (item.status, item.error) == ("failed", "canceled")
    assert b"is canceled" in response.content
    response = staff_client.post(f"/queues/thumbs/items/{item_id}/cancel", follow=True)
    assert b"had ended already" in response.content
    assert b">Retry<" in staff_client.get(f"/queues/thumbs/items/{item_id}/").content


# ---- first-hour additions: filters, previews, limits, new queues, last 60 s, workers ----------------


def test_the_done_tab_filters_finished_and_failed_and_says_which_limit_failed_an_item(staff_client, db, clocked_store,
                                                                                       clock):
    config = save_queue("thumbs", queue_seconds=60, max_attempts=1).config()
    aged, tried, fine = (item.id for item in post_batch(clocked_store, "thumbs", [{"n": 1}, {"n": 2}, {"n": 3}]))
    claimed = {item.id: item for item in clocked_store.claim_items(config=config, max_items=3)}
    release(clocked_store, config, tried, claimed[tried].claim_token)  # its one try is used up
    finish(clocked_store, config, fine, "ok")
    clock.advance(61)
    clocked_store.sweep_queue(config=config)

    failed = staff_client.get("/queues/thumbs/?state=done&status=failed")
    finished = staff_client.get("/queues/thumbs/?state=done&status=finished")

    assert sorted(row["id"] for row in failed.context["items"]) == sorted([aged, tried])
    assert [row["id"] for row in finished.context["items"]] == [fine]
    why = {row["id"]: row["why"] for row in failed.context["items"]}
    assert "queueSeconds, 1 min" in why[aged] and "maxAttempts, 1" in why[tried]
    assert {f["status"]: f["count"] for f in failed.context["filters"]} == {"": 3, "finished": 1, "failed": 2}
    assert b"maxAttempts, 1" in failed.content


def test_item_lists_show_a_preview_of_each_payload(staff_client, queue):
    post("thumbs", {"image": "cat.png"}, "x" * 500)

    rows = staff_client.get("/queues/thumbs/").context["items"]

    assert [row["preview"] for row in rows] == ["\"" + "x" * 78 + "…", '{"image":"cat.png"}']


def test_staff_make_a_queue_from_the_dashboard(django_user_model, db):
    admin = django_user_model.objects.create_superuser("boss", password="pw")
    client = Client()
    client.force_login(admin)

    made = client.post("/new-queue", {"name": "mail", "lease_seconds": "30", "max_attempts": "5",
                                      "queue_seconds": "", "retain_seconds": ""}, follow=True)
    again = client.post("/new-queue", {"name": "mail"}, follow=True)
    bad = client.post("/new-queue", {"name": "Bad Name"}, follow=True)

    assert made.redirect_chain[-1][0] == "/queues/mail/"
    queue = Queue.objects.get()
    assert (queue.name, queue.lease_seconds, queue.max_attempts, queue.queue_seconds) == ("mail", 30, 5, 86400)
    assert "There is a queue named mail already" in again.content.decode()
    assert "The queue was not made: Name:" in bad.content.decode()
    assert Queue.objects.count() == 1


def test_a_queue_name_with_a_nul_byte_is_no_such_queue_and_never_reaches_the_database(django_user_model, db):
    """PostgreSQL refuses NUL in text: such a name must be answered before any query takes it."""
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("boss", password="pw"))
    with CaptureQueriesContext(connection) as queries:
        page = client.get("/queues/a%00b/")
        pause = client.post("/queues/a%00b/pause")
        made = client.post("/new-queue", {"name": "a\x00b"}, follow=True)
    assert (page.status_code, pause.status_code) == (404, 404)
    assert "The queue was not made: Name:" in made.content.decode()
    assert not [query for query in queries.captured_queries if '"queues_queue"."name" =' in query["sql"]]
    assert not Queue.objects.exists()


def test_pausing_a_queue_deleted_meanwhile_never_makes_it_again(staff_client, queue, monkeypatch):
    real_save = views.save_queue

    def deleted_first(name, **changes):
        Queue.objects.filter(name=name).delete()
        return real_save(name, **changes)

    monkeypatch.setattr(views, "save_queue", deleted_first)
    assert staff_client.post("/queues/thumbs/pause").status_code == 404
    assert not Queue.objects.exists()


def test_staff_without_the_permission_cannot_make_a_queue(staff_client, db):
    page = staff_client.get("/")
    answer = staff_client.post("/new-queue", {"name": "mail"}, follow=True)

    assert b"New queue" not in page.content
    assert "You may not make queues" in answer.content.decode()
    assert not Queue.objects.exists()
