"""The authorization matrix: every call without a token, with an unknown one, with a token that
lacks the call's right, and with a token scoped to another queue. No refused call changes the
data directory."""

import pytest
from asgiref.sync import sync_to_async

from api_support import api, bearer, disk_snapshot, make_token, queues, tokens  # noqa: F401  (fixtures)
from queues.models import ApiToken
from queues.runtime import get_registry, get_store

pytestmark = pytest.mark.django_db(transaction=True)

ITEM = "01939f4e-7c1e-7d3a-9f00-2b6c1d0e4f55"  # well-formed; its existence does not matter here
PRODUCER_CALLS = [
    ("POST", "/api/queues/{q}/items", {"payload": 1}),
    ("GET", "/api/queues/{q}/items/" + ITEM, None),
]
WATCHER_CALLS = [("GET", "/api/queues/{q}", None)]  # the queue stats take either right
WORKER_CALLS = [
    ("POST", "/api/queues/{q}/claim", {"max": 1}),
    ("POST", f"/api/queues/{{q}}/items/{ITEM}/result", {"result": 1}),
    ("POST", f"/api/queues/{{q}}/items/{ITEM}/extend", {"seconds": 5}),
]
QUEUE_CALLS = PRODUCER_CALLS + WATCHER_CALLS + WORKER_CALLS
EVERY_CALL = QUEUE_CALLS + [("GET", "/api/queues", None)]


def _ids(calls):
    return [f"{method} {path}" for method, path, _ in calls]


async def call(api, method, path, body, headers, queue="jobs"):
    return await api.request(method, path.format(q=queue), json=body, headers=headers)


@pytest.fixture
def snapshot(queues):
    return disk_snapshot()


def assert_refused(answer, status, code, before):
    assert answer.status_code == status, answer.text
    assert answer.json()["error"] == code
    assert isinstance(answer.json()["message"], str) and answer.json()["message"]
    assert disk_snapshot() == before


@pytest.mark.parametrize(("method", "path", "body"), EVERY_CALL, ids=_ids(EVERY_CALL))
async def test_a_call_without_a_token_is_unauthorized(api, tokens, snapshot, method, path, body):
    answer = await call(api, method, path, body, {})

    assert_refused(answer, 401, "unauthorized", snapshot)
    assert answer.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "header", ["Bearer th_unknownunknownunknownunknownunkn", "Bearer ", "Basic dXNlcjpwYXNz", "th_", "Bearer\x7f"]
)
@pytest.mark.parametrize(("method", "path", "body"), EVERY_CALL, ids=_ids(EVERY_CALL))
async def test_a_call_with_an_unknown_token_is_unauthorized(api, tokens, snapshot, method, path, body, header):
    answer = await call(api, method, path, body, {"Authorization": header})

    assert_refused(answer, 401, "unauthorized", snapshot)


@pytest.mark.parametrize(("method", "path", "body"), WORKER_CALLS, ids=_ids(WORKER_CALLS))
async def test_a_produce_only_token_may_not_work(api, tokens, snapshot, method, path, body):
    answer = await call(api, method, path, body, bearer(tokens["producer"]))

    assert_refused(answer, 403, "forbidden", snapshot)


@pytest.mark.parametrize(("method", "path", "body"), PRODUCER_CALLS, ids=_ids(PRODUCER_CALLS))
async def test_a_work_only_token_may_not_produce(api, tokens, snapshot, method, path, body):
    answer = await call(api, method, path, body, bearer(tokens["worker"]))

    assert_refused(answer, 403, "forbidden", snapshot)


@pytest.mark.parametrize("token", ["producer", "worker"])
async def test_either_right_may_read_queue_stats_and_the_list(api, tokens, queues, token):
    stats = await api.get("/api/queues/jobs", headers=bearer(tokens[token]))
    listing = await api.get("/api/queues", headers=bearer(tokens[token]))

    assert (stats.status_code, stats.json()["name"]) == (200, "jobs")
    assert (listing.status_code, len(listing.json()["queues"])) == (200, 2)


@pytest.mark.parametrize(("method", "path", "body"), QUEUE_CALLS, ids=_ids(QUEUE_CALLS))
@pytest.mark.parametrize("queue", ["jobs", "no-such-queue", "Bad..Name"])
async def test_a_token_scoped_to_another_queue_is_forbidden_whether_or_not_the_queue_exists(
    api, tokens, snapshot, method, path, body, queue
):
    answer = await call(api, method, path, body, bearer(tokens["other_only"]), queue=queue)

    assert_refused(answer, 403, "forbidden", snapshot)


@pytest.mark.parametrize(("method", "path", "body"), QUEUE_CALLS, ids=_ids(QUEUE_CALLS))
async def test_a_scoped_token_works_on_its_own_queue(api, tokens, queues, method, path, body):
    answer = await call(api, method, path, body, bearer(tokens["other_only"]), queue="other")

    assert answer.status_code in (200, 201, 404)  # 404: the made-up item id, not the queue
    assert answer.json().get("error") in (None, "not_found")


@pytest.mark.parametrize(("method", "path", "body"), QUEUE_CALLS, ids=_ids(QUEUE_CALLS))
@pytest.mark.parametrize("queue", ["no-such-queue", "UPPER", "a" * 65, "a.b", "-dash", "caf\u00e9"])
async def test_an_unknown_or_malformed_queue_is_unknown_queue_for_a_token_that_may_see_all(
    api, tokens, snapshot, method, path, body, queue
):
    answer = await call(api, method, path, body, bearer(tokens["all"]), queue=queue)

    assert_refused(answer, 404, "unknown_queue", snapshot)
    assert not (get_store().data_dir / queue).exists()


@pytest.mark.parametrize(("method", "path", "body"), QUEUE_CALLS, ids=_ids(QUEUE_CALLS))
@pytest.mark.parametrize("queue", ["jobs%2Fitems", "%2E%2E", "jobs%2F..%2Fother"])
async def test_an_encoded_queue_segment_is_unknown_queue_not_another_path(
    api, tokens, snapshot, method, path, body, queue
):
    """`%2F` stays inside its segment: the queue named `jobs/items` breaks the name rule, and is
    not read as the path /api/queues/jobs/items."""
    answer = await call(api, method, path, body, bearer(tokens["all"]), queue=queue)

    assert_refused(answer, 404, "unknown_queue", snapshot)


async def test_an_encoded_slash_in_an_item_id_is_not_found_not_another_call(api, tokens, queues):
    posted = await api.post("/api/queues/jobs/items", json={"payload": 1}, headers=bearer(tokens["all"]))
    await api.post("/api/queues/jobs/claim", json={}, headers=bearer(tokens["all"]))
    item_id = posted.json()["id"]
    snapshot = disk_snapshot()

    answer = await api.get(f"/api/queues/jobs/items/{item_id}%2Fresult", headers=bearer(tokens["all"]))

    assert_refused(answer, 404, "not_found", snapshot)


async def test_the_bearer_scheme_is_case_insensitive(api, tokens, queues):
    answer = await api.get("/api/queues", headers={"Authorization": f"bearer {tokens['all']}"})

    assert answer.status_code == 200


async def test_a_token_deleted_in_the_database_stops_working_after_a_reload(api, queues, transactional_db):
    raw = await sync_to_async(make_token)("short-lived")
    assert (await api.get("/api/queues", headers=bearer(raw))).status_code == 200

    await sync_to_async(ApiToken.objects.all().delete)()
    get_registry().invalidate()

    assert (await api.get("/api/queues", headers=bearer(raw))).status_code == 401
