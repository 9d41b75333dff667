"""The Django admin for queues and tokens."""

import re

import pytest

from queues import ids
from queues.models import ApiToken, Queue, hash_token
from queues.runtime import get_registry, get_store
from queues.services import save_queue
from queues.store import NewItem, Store
from storekit import finish, post_batch

VALID_QUEUE = {
    "name": "thumbs",
    "lease_seconds": "60",
    "queue_seconds": "86400",
    "retain_seconds": "3600",
    "retain_from": "finished",
}


@pytest.fixture(autouse=True)
def _fast(settings):
    settings.TASKHOSTER_FSYNC = False
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # test users only


def cell(html: str, column: str) -> list[str]:
    """The text of every cell of a changelist column."""
    return re.findall(rf'<td class="field-{column}">(.*?)</td>', html)


def test_queue_list_shows_settings_and_live_counts_by_state(admin_client):
    thumbs = save_queue("thumbs", lease_seconds=90)
    save_queue("emails", paused=True, retain_from="fetched", queue_seconds=7200)
    store = get_store()
    post_batch(store, "thumbs", [1, 2, 3])
    [item] = store.claim_items(config=thumbs.config())
    finish(store, thumbs.config(), item.id, None)

    html = admin_client.get("/admin/queues/queue/").content.decode()

    # rows are ordered by name: emails, then thumbs
    assert cell(html, "pending") == ["0", "2"]
    assert cell(html, "processing") == ["0", "0"]
    assert cell(html, "finished") == ["0", "1"]
    assert cell(html, "failed") == ["0", "0"]
    assert cell(html, "oldest_pending")[0] == "–"
    assert cell(html, "state") == ["Paused", "Running"]
    assert cell(html, "lease") == ["1 min", "1 min 30 s"]
    assert cell(html, "lifetime") == ["2 h", "1 d"]
    assert cell(html, "retention") == ["1 h from first fetch", "1 h from end"]
    assert 'href="/queues/thumbs/"' in html


def test_adding_a_queue_makes_its_directories(admin_client, settings):
    response = admin_client.post("/admin/queues/queue/add/", VALID_QUEUE)
    assert response.status_code == 302
    assert Queue.objects.get(name="thumbs").lease_seconds == 60
    assert (settings.TASKHOSTER_DATA_DIR / "thumbs" / "pending").is_dir()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("name", "Thumbs!", "Use 1 to 64 characters: lowercase letters, digits"),
        ("name", "../etc", "Use 1 to 64 characters: lowercase letters, digits"),
        ("lease_seconds", "0", "greater than or equal to 1"),
        ("lease_seconds", "86401", "less than or equal to 86400"),
        ("queue_seconds", "2592001", "less than or equal to 2592000"),
        ("retain_seconds", "-1", "greater than or equal to 0"),
        ("retain_from", "never", "Select a valid choice"),
    ],
)
def test_bad_queue_settings_get_a_clear_message_and_save_nothing(admin_client, settings, field, value, message):
    response = admin_client.post("/admin/queues/queue/add/", {**VALID_QUEUE, field: value})
    assert response.status_code == 200
    assert message in response.content.decode()
    assert not Queue.objects.exists()
    assert not (settings.TASKHOSTER_DATA_DIR / value).exists()


def test_a_queue_name_cannot_be_changed_once_made(admin_client):
    queue = save_queue("thumbs")
    response = admin_client.post(f"/admin/queues/queue/{queue.pk}/change/", {**VALID_QUEUE, "name": "other", "lease_seconds": "30"})
    assert response.status_code == 302
    queue.refresh_from_db()
    assert (queue.name, queue.lease_seconds) == ("thumbs", 30)


def test_change_page_shows_the_items_now(admin_client):
    queue = save_queue("thumbs")
    post_batch(get_store(), "thumbs", [1, 2])
    html = admin_client.get(f"/admin/queues/queue/{queue.pk}/change/").content.decode()
    assert "2 pending, 0 processing, 0 finished, 0 failed" in html
    assert 'href="/queues/thumbs/"' in html


@pytest.mark.django_db(transaction=True)
def test_settings_saved_in_the_admin_reach_this_process_at_once(admin_client):
    queue = save_queue("thumbs")
    registry = get_registry()
    registry.refresh()
    admin_client.post(f"/admin/queues/queue/{queue.pk}/change/", {**VALID_QUEUE, "paused": "on"})
    registry.refresh()
    assert registry.queue("thumbs").paused is True


@pytest.mark.parametrize("how", ["admin", "save_queue"])
def test_a_lowered_queue_timeout_marks_the_scheduled_items_for_it(admin_client, how, django_capture_on_commit_callbacks):
    queue = save_queue("thumbs", queue_seconds=86400)
    store = get_store()
    (posted,) = store.post_items(config=queue.config(), items=[NewItem(1, run_at=store.clock() + 80000)])
    if how == "admin":
        with django_capture_on_commit_callbacks(execute=True):  # the test's transaction never commits
            admin_client.post(f"/admin/queues/queue/{queue.pk}/change/", {**VALID_QUEUE, "queue_seconds": "3600"})
    else:
        save_queue("thumbs", queue_seconds=3600)
    ages_out = f"{ids.id_millis(posted.item.id) + 3_600_000:013d}.{posted.item.id}.read"
    assert ages_out in {mark.name for mark in (store.data_dir / "thumbs" / "schedule").glob("*/*")}


def test_pause_and_resume_actions(admin_client):
    save_queue("thumbs")
    save_queue("emails")
    ids = [str(pk) for pk in Queue.objects.values_list("pk", flat=True)]

    response = admin_client.post("/admin/queues/queue/", {"action": "pause_queues", "_selected_action": ids}, follow=True)
    assert set(Queue.objects.values_list("paused", flat=True)) == {True}
    assert b"Paused: emails, thumbs." in response.content

    admin_client.post("/admin/queues/queue/", {"action": "resume_queues", "_selected_action": ids})
    assert set(Queue.objects.values_list("paused", flat=True)) == {False}


def test_a_pause_the_disk_refuses_says_what_was_paused_and_why_not_the_rest(admin_client, monkeypatch):
    from queues import admin as admin_module
    from queues.exceptions import StorageUnavailable

    save_queue("emails")
    save_queue("thumbs")
    real_save = admin_module.save_queue

    def save(name, **changes):
        if name == "thumbs":
            raise StorageUnavailable("the data directory cannot be written: No space left on device")
        return real_save(name, **changes)

    monkeypatch.setattr(admin_module, "save_queue", save)
    ids = [str(pk) for pk in Queue.objects.order_by("name").values_list("pk", flat=True)]
    response = admin_client.post("/admin/queues/queue/", {"action": "pause_queues", "_selected_action": ids}, follow=True)
    assert response.status_code == 200
    assert b"Paused: emails." in response.content and b"Not all were paused: the data directory" in response.content


def test_a_queue_the_disk_refuses_to_make_is_a_message_not_a_500_and_saves_nothing(admin_client, monkeypatch):
    from queues.exceptions import StorageUnavailable

    def refuse(name):
        raise StorageUnavailable("the data directory cannot be written: No space left on device")

    monkeypatch.setattr(get_store(), "create_queue", refuse)  # what adding a queue calls
    response = admin_client.post("/admin/queues/queue/add/", VALID_QUEUE, follow=True)
    assert response.status_code == 200
    assert b"The queue was not saved: the data directory cannot be written" in response.content
    assert not Queue.objects.exists()


def test_counts_the_disk_refuses_show_as_unknown_on_the_list_and_change_pages(admin_client, monkeypatch):
    from queues.exceptions import StorageUnavailable

    queue = save_queue("thumbs")

    def refuse(queue):
        raise StorageUnavailable("the data directory cannot be read: Permission denied")

    monkeypatch.setattr(get_store(), "count_items", refuse)
    listing = admin_client.get("/admin/queues/queue/")
    assert listing.status_code == 200 and cell(listing.content.decode(), "pending") == ["?"]
    change = admin_client.get(f"/admin/queues/queue/{queue.pk}/change/")
    assert change.status_code == 200 and b"not counted: the data directory cannot be read" in change.content


@pytest.mark.django_db(transaction=True)
def test_pausing_a_queue_deleted_since_the_list_was_shown_never_makes_it_again(admin_client, monkeypatch):
    from queues import admin as admin_module

    save_queue("thumbs")
    ids = [str(pk) for pk in Queue.objects.values_list("pk", flat=True)]
    real_save = admin_module.save_queue

    def deleted_first(name, **changes):
        Queue.objects.filter(name=name).delete()
        return real_save(name, **changes)

    monkeypatch.setattr(admin_module, "save_queue", deleted_first)
    admin_client.post("/admin/queues/queue/", {"action": "pause_queues", "_selected_action": ids})
    assert not Queue.objects.exists()


def test_deleting_a_queue_deletes_its_items(admin_client, settings):
    queue = save_queue("thumbs")
    post_batch(get_store(), "thumbs", [1])
    response = admin_client.post(f"/admin/queues/queue/{queue.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302
    assert not Queue.objects.exists()
    assert sorted(p.name for p in (settings.TASKHOSTER_DATA_DIR / "thumbs").iterdir()) == ["deleted", "locks"]  # items gone


def test_a_deletion_the_disk_refuses_keeps_the_queue(db, monkeypatch):
    """Else its directory, left without the deletion's mark, would give its items to a queue made
    again under the name."""
    from queues.exceptions import StorageUnavailable
    from queues.services import delete_queue

    save_queue("thumbs")
    post_batch(get_store(), "thumbs", [1])

    def refuse(name):
        raise StorageUnavailable("the data directory cannot be written: No space left on device")

    monkeypatch.setattr(get_store(), "delete_queue", refuse)
    with pytest.raises(StorageUnavailable):
        delete_queue(Queue.objects.get(name="thumbs"))
    assert Queue.objects.filter(name="thumbs").exists()
    assert get_store().count_items(queue="thumbs").pending == 1


@pytest.mark.parametrize("made_again_by", ["save_queue", "the admin's form"])
def test_a_queue_made_again_after_its_deletion_starts_empty(admin_client, settings, made_again_by):
    """A post another server process took in the second before it heard of the deletion stays
    out of the queue made again under the name (by createqueue, the dashboard or the admin)."""
    queue = save_queue("thumbs")
    elsewhere = Store(settings.TASKHOSTER_DATA_DIR, fsync=False)
    post_batch(elsewhere, "thumbs", [1])
    admin_client.post(f"/admin/queues/queue/{queue.pk}/delete/", {"post": "yes"})
    post_batch(elsewhere, "thumbs", [2])  # not told yet
    if made_again_by == "save_queue":
        save_queue("thumbs")
    else:
        assert admin_client.post("/admin/queues/queue/add/", VALID_QUEUE).status_code == 302
    assert get_store().count_items(queue="thumbs").pending == 0
    assert not (settings.TASKHOSTER_DATA_DIR / "thumbs" / "deleted").exists()


def test_a_new_token_value_is_shown_once_and_only_its_hash_is_kept(admin_client):
    added = admin_client.post(
        "/admin/queues/apitoken/add/",
        {"name": "thumbnailer", "can_produce": "on", "can_work": "on", "queues": ""},
    )
    # not carried to the next page in a cookie (signed, not encrypted), as Django's default does
    assert added.status_code == 302 and "messages" not in added.cookies
    response = admin_client.get(added["Location"])
    [raw] = re.findall(r"th_[A-Za-z0-9_-]{32}", response.content.decode())
    token = ApiToken.objects.get(name="thumbnailer")
    assert token.token_hash == hash_token(raw)
    assert raw not in admin_client.get(f"/admin/queues/apitoken/{token.pk}/change/").content.decode()
    assert raw not in admin_client.get("/admin/queues/apitoken/").content.decode()


def test_a_token_without_any_right_is_refused(admin_client):
    response = admin_client.post("/admin/queues/apitoken/add/", {"name": "useless", "queues": ""})
    assert response.status_code == 200
    assert b"A token needs at least one right: to produce, to work or to read metrics." in response.content
    assert not ApiToken.objects.exists()


def test_the_admin_is_for_staff_only(client, django_user_model):
    assert client.get("/admin/queues/queue/")["Location"].startswith("/admin/login/")
    user = django_user_model.objects.create_user("visitor", password="pw")
    client.force_login(user)
    assert client.get("/admin/queues/queue/")["Location"].startswith("/admin/login/")


def test_the_admin_carries_the_taskhoster_name_and_a_dashboard_link(admin_client):
    html = admin_client.get("/admin/").content.decode()
    assert '<div id="site-name"><a href="/">Taskhoster</a></div>' in html
    assert '<a href="/">Dashboard</a>' in html


def test_the_admin_makes_a_token_that_only_reads_metrics(admin_client):
    response = admin_client.post(
        "/admin/queues/apitoken/add/", {"name": "scraper", "can_read_metrics": "on", "queues": ""}, follow=True
    )
    assert response.status_code == 200
    token = ApiToken.objects.get(name="scraper")
    assert (token.can_produce, token.can_work, token.can_read_metrics) == (False, False, True)
