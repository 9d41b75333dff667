"""A state file that is not an item object (truncated, not JSON, or JSON that is not an item:
null, a list, a string, an object missing fields or with fields of the wrong type) is
unreadable wherever it is read: quarantined, answered as no item, left out of listings, and never
a 500 or a closed socket."""

import json
import os

import pytest
from channels.testing import WebsocketCommunicator
from django.test import Client

from api_support import api, bearer, queues, tokens  # noqa: F401  (fixtures)
from queues import ids
from queues.runtime import get_registry, get_store
from queues.store.items import CLAIM_XATTR
from store_support import files_in
from taskhoster_site.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)

BAD_ID = ids.IdMaker().new_ids(1, 1_796_000_000)[0]
BAD = {
    "null": b"null",
    "list": b"[1, 2]",
    "string": b'"an item"',
    "number": b"7",
    "empty object": b"{}",
    "no queue": json.dumps({"id": BAD_ID, "status": "finished"}).encode(),
    "other item": json.dumps({"id": ids.IdMaker().new_ids(1, 0)[0], "queue": "jobs", "status": "finished"}).encode(),
    "bad attempts": json.dumps({"id": BAD_ID, "queue": "jobs", "status": "finished", "attempts": "two"}).encode(),
    "bad time": json.dumps({"id": BAD_ID, "queue": "jobs", "status": "failed", "claimedAt": 5}).encode(),
    "no status": json.dumps({"id": BAD_ID, "queue": "jobs"}).encode(),
    "truncated": b'{"id": "' + BAD_ID[:10].encode(),
    "binary": b"\x00\xff\x00garbage",
}
# "no status" is a good scheduled, pending or processing record: a file's directory is its state
CASES = [(state, name) for state in ("scheduled", "pending", "processing", "done") for name in BAD
         if not (name == "no status" and state != "done")]


@pytest.fixture
def bad_file(request, queues):
    state, name = request.param
    store = get_store()
    store.ensure_queue("jobs")
    (store.data_dir / "jobs" / state / f"{BAD_ID}.json").write_bytes(BAD[name])
    return state


def cases(test):
    return pytest.mark.parametrize("bad_file", CASES, indirect=True, ids=[f"{s}-{n}" for s, n in CASES])(test)


@cases
async def test_a_read_answers_not_found_and_quarantines_it(api, tokens, bad_file):
    answer = await api.get(f"/api/queues/jobs/items/{BAD_ID}", headers=bearer(tokens["all"]))
    assert (answer.status_code, answer.json()["error"]) == (404, "not_found")
    assert files_in(get_store(), "quarantine") == [f"{bad_file}-{BAD_ID}.json"]


@cases
async def test_a_result_answers_not_found(api, tokens, bad_file):
    answer = await api.post(f"/api/queues/jobs/items/{BAD_ID}/result", json={"result": 1}, headers=bearer(tokens["all"]))
    assert (answer.status_code, answer.json()["error"]) == (404, "not_found")
    extend = await api.post(f"/api/queues/jobs/items/{BAD_ID}/extend", json={"seconds": 5}, headers=bearer(tokens["all"]))
    assert extend.status_code == 404


@cases
async def test_queue_figures_and_claims_go_on(api, tokens, bad_file):
    good = (await api.post("/api/queues/jobs/items", json={"payload": "good"}, headers=bearer(tokens["all"]))).json()
    for path in ("/api/queues", "/api/queues/jobs"):
        assert (await api.get(path, headers=bearer(tokens["all"]))).status_code == 200
    counts = (await api.get("/api/queues/jobs", headers=bearer(tokens["all"]))).json()["counts"]
    assert counts == {"scheduled": 0, "pending": 1, "processing": 0, "finished": 0, "failed": 0}
    claimed = (await api.post("/api/queues/jobs/claim", json={"max": 5}, headers=bearer(tokens["all"]))).json()
    assert [item["id"] for item in claimed["items"]] == [good["id"]]


@cases
async def test_a_result_over_the_socket_is_not_found_and_the_socket_stays_open(tokens, bad_file):
    ws = WebsocketCommunicator(application, "/work", headers=[(b"authorization", f"Bearer {tokens['all']}".encode())])
    assert (await ws.connect())[0]
    await ws.send_json_to({"op": "result", "queue": "jobs", "id": BAD_ID, "result": 1, "ref": 1})
    answer = await ws.receive_json_from(timeout=10)
    assert (answer["op"], answer["code"]) == ("error", "not_found")
    await ws.send_json_to({"op": "results", "items": [{"queue": "jobs", "id": BAD_ID, "result": 1}], "ref": 2})
    assert (await ws.receive_json_from(timeout=10))["items"] == [{"id": BAD_ID, "accepted": False, "error": "not_found"}]
    await ws.disconnect()


@cases
def test_the_dashboard_and_the_admin_show_the_queue_without_it(bad_file, django_user_model):
    client = Client()
    client.force_login(django_user_model.objects.create_user("operator", password="pw", is_staff=True, is_superuser=True))
    get_registry().invalidate()
    listing = "done" if bad_file == "done" else bad_file
    for path in ("/", f"/queues/jobs/?state={listing}", "/admin/queues/queue/", f"/queues/jobs/items/{BAD_ID}/"):
        response = client.get(path)
        assert response.status_code in (200, 404), (path, response.status_code)
    page = client.get(f"/queues/jobs/?state={listing}")
    assert BAD_ID not in page.content.decode()


@pytest.mark.parametrize("record", [b"garbage", b"1 2 3", b"x 1.0 2.0 token", b"1 1.0 later token"])
async def test_a_processing_file_with_a_bad_claim_record_is_quarantined(api, tokens, queues, record):
    """The claim record (an xattr beside the file) overrides what the file says: one that is not
    `attempts claimedAt leaseExpiresAt token` makes the file unreadable, as bad bytes would."""
    headers = bearer(tokens["all"])
    posted = (await api.post("/api/queues/jobs/items", json={"payload": 1}, headers=headers)).json()
    assert [item["id"] for item in (await api.post("/api/queues/jobs/claim", json={}, headers=headers)).json()["items"]] == [posted["id"]]
    os.setxattr(get_store().data_dir / "jobs" / "processing" / f"{posted['id']}.json", CLAIM_XATTR, record)
    answer = await api.get(f"/api/queues/jobs/items/{posted['id']}", headers=headers)
    assert (answer.status_code, answer.json()["error"]) == (404, "not_found")
    assert files_in(get_store(), "quarantine") == [f"processing-{posted['id']}.json"]


async def test_a_processing_file_with_a_bad_field_is_quarantined_though_its_claim_record_is_good(api, tokens, queues):
    headers = bearer(tokens["all"])
    posted = (await api.post("/api/queues/jobs/items", json={"payload": 1}, headers=headers)).json()
    assert [item["id"] for item in (await api.post("/api/queues/jobs/claim", json={}, headers=headers)).json()["items"]] == [posted["id"]]
    path = get_store().data_dir / "jobs" / "processing" / f"{posted['id']}.json"
    record = json.loads(path.read_bytes())
    with open(path, "r+b") as file:  # the same file, so its claim record stays beside it
        file.write(json.dumps({**record, "claimedAt": 5}).encode())
        file.truncate()
    assert os.getxattr(path, CLAIM_XATTR)
    answer = await api.get(f"/api/queues/jobs/items/{posted['id']}", headers=headers)
    assert (answer.status_code, answer.json()["error"]) == (404, "not_found")
    assert files_in(get_store(), "quarantine") == [f"processing-{posted['id']}.json"]
