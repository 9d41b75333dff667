"""API tokens: made with `createtoken` or in the admin, kept only as a hash, shown once, and
their last use recorded."""

import re
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse

from queues.models import ApiToken, hash_token
from queues.runtime import get_registry

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = re.compile(r"th_[A-Za-z0-9_-]{32}")


def createtoken(*args) -> str:
    out = StringIO()
    call_command("createtoken", *args, stdout=out)
    return out.getvalue()


def test_createtoken_prints_only_the_token_and_keeps_only_its_hash():
    printed = createtoken("deploy")

    raw = printed.strip()
    assert printed == raw + "\n" and TOKEN.fullmatch(raw)
    token = ApiToken.objects.get()
    assert token.token_hash == hash_token(raw) != raw
    assert raw not in str(ApiToken.objects.values().get())
    assert (token.name, token.can_produce, token.can_work, token.queues) == ("deploy", True, True, [])


@pytest.mark.parametrize(("flags", "produce", "work"), [
    ([], True, True), (["--produce"], True, False), (["--work"], False, True), (["--produce", "--work"], True, True),
])
def test_createtoken_gives_the_rights_asked_for_and_both_when_none_is(flags, produce, work):
    raw = createtoken("t", *flags).strip()

    grant = get_registry()
    grant.refresh()
    found = grant.authenticate(raw)
    assert (found.can_produce, found.can_work) == (produce, work)


def test_createtoken_limits_the_token_to_the_queues_named():
    for name in ("thumbs", "mail"):
        call_command("createqueue", name, stdout=StringIO(), stderr=StringIO())
    raw = createtoken("t", "--queues", "thumbs, mail,").strip()

    registry = get_registry()
    registry.refresh()
    grant = registry.authenticate(raw)
    assert grant.queues == {"thumbs", "mail"}
    assert grant.may("produce", "thumbs") and not grant.may("produce", "video")


@pytest.mark.parametrize("queues", ["thumbs,Bad", "../etc", "a" * 65, "ok,-x"])
def test_createtoken_refuses_a_bad_queue_name_and_saves_nothing(queues):
    with pytest.raises(CommandError, match="queue name"):
        createtoken("t", "--queues", queues)

    assert not ApiToken.objects.exists()


def test_createtoken_makes_a_token_for_a_queue_not_made_yet_and_says_so():
    out, err = StringIO(), StringIO()

    call_command("createtoken", "t", "--queues", "later", stdout=out, stderr=err)

    raw = out.getvalue().strip()
    assert TOKEN.fullmatch(raw)
    registry = get_registry()
    registry.refresh()
    assert registry.authenticate(raw).queues == {"later"}
    assert "no queue named 'later' yet; the token may use it once it is made" in err.getvalue()


def test_createtoken_under_a_name_taken_already_makes_a_second_token_and_keeps_the_first():
    first = createtoken("deploy").strip()
    out, err = StringIO(), StringIO()

    call_command("createtoken", "deploy", stdout=out, stderr=err)

    second = out.getvalue().strip()
    assert TOKEN.fullmatch(second) and second != first
    assert sorted(ApiToken.objects.values_list("token_hash", flat=True)) == sorted([hash_token(first), hash_token(second)])
    registry = get_registry()
    registry.refresh()
    assert registry.authenticate(first) and registry.authenticate(second)
    assert "the token named 'deploy' made before stays valid too" in err.getvalue()


def test_createtoken_replace_revokes_the_old_token_and_says_so():
    first = createtoken("deploy").strip()
    out, err = StringIO(), StringIO()

    call_command("createtoken", "deploy", "--replace", stdout=out, stderr=err)

    second = out.getvalue().strip()
    assert TOKEN.fullmatch(second) and second != first
    assert list(ApiToken.objects.values_list("token_hash", flat=True)) == [hash_token(second)]
    assert "revoked the old token 'deploy'" in err.getvalue()


def test_listtokens_shows_names_rights_and_queues_but_never_a_value():
    call_command("createqueue", "thumbs", stdout=StringIO(), stderr=StringIO())
    raw = createtoken("ci", "--work", "--queues", "thumbs").strip()
    createtoken("admin")
    out = StringIO()

    call_command("listtokens", stdout=out)

    lines = out.getvalue().splitlines()
    assert [line.split("\t")[:3] for line in lines] == [["admin", "produce+work", "every queue"],
                                                         ["ci", "work", "thumbs"]]
    assert all(line.endswith("last used never") for line in lines)
    assert raw not in out.getvalue()


def test_listtokens_shows_the_metrics_right():
    createtoken("prometheus", "--metrics")
    createtoken("ops", "--produce", "--metrics")
    out = StringIO()

    call_command("listtokens", stdout=out)

    assert [line.split("\t")[:2] for line in out.getvalue().splitlines()] == [["ops", "produce+metrics"],
                                                                              ["prometheus", "metrics"]]


def test_revoketoken_deletes_the_named_token_and_the_server_refuses_it():
    raw = createtoken("old").strip()
    createtoken("kept")
    err = StringIO()

    call_command("revoketoken", "old", stderr=err)

    assert list(ApiToken.objects.values_list("name", flat=True)) == ["kept"]
    assert "revoked 1 token named 'old'" in err.getvalue()
    registry = get_registry()
    registry.refresh()
    assert registry.authenticate(raw) is None


def test_revoketoken_of_an_unknown_name_is_an_error():
    with pytest.raises(CommandError, match="no token named 'nosuch'"):
        call_command("revoketoken", "nosuch")


def test_createtoken_refuses_an_empty_name_and_saves_nothing():
    with pytest.raises(CommandError):
        createtoken("")

    assert not ApiToken.objects.exists()


def test_the_admin_shows_a_new_tokens_value_once_and_keeps_only_its_hash(admin_client):
    answer = admin_client.post(
        reverse("admin:queues_apitoken_add"),
        {"name": "ci", "can_produce": "on", "queues": "jobs, thumbs"},
        follow=True,
    )

    shown = TOKEN.findall(answer.content.decode())
    assert len(shown) == 1
    token = ApiToken.objects.get()
    assert token.token_hash == hash_token(shown[0])
    assert (token.can_produce, token.can_work, token.queues) == (True, False, ["jobs", "thumbs"])
    later = admin_client.get(reverse("admin:queues_apitoken_change", args=[token.id])).content.decode()
    assert 'value="jobs, thumbs"' in later  # the list is edited as names, not as JSON
    assert shown[0] not in later and not TOKEN.search(later)


def test_the_admin_refuses_a_bad_queue_name(admin_client):
    form = {"name": "ci", "can_work": "on", "queues": "jobs, Bad/Name"}

    answer = admin_client.post(reverse("admin:queues_apitoken_add"), form)

    assert answer.status_code == 200  # the form again, with the error
    assert "is not a valid queue name" in answer.content.decode()
    assert not ApiToken.objects.exists()


def test_a_tokens_last_use_is_recorded_and_shown_in_the_admin(admin_client):
    raw = createtoken("used").strip()
    createtoken("unused")
    registry = get_registry()
    registry.refresh()
    assert registry.authenticate(raw) is not None  # what every API call does

    registry.invalidate()
    registry.refresh()  # the next reload writes the last use

    used, unused = ApiToken.objects.get(name="used"), ApiToken.objects.get(name="unused")
    assert used.last_used_at is not None and unused.last_used_at is None
    listing = admin_client.get(reverse("admin:queues_apitoken_changelist")).content.decode()
    shown = dict(re.findall(r'>(used|unused)</a></th>.*?class="field-last_used_at[^"]*">([^<]*)<', listing))
    assert shown["unused"] == "-"
    assert str(used.last_used_at.year) in shown["used"]
