"""Idempotency keys over HTTP: the `Idempotency-Key` header and `"key"` fields, a repeat answered
200 with the item as it is now, a repeat with another payload 409 `key_conflict`, batches all or
nothing with `"duplicate": true` in place, and every bad key 400 with nothing stored."""

import pytest

from api_support import api, bearer, disk_snapshot, queues, tokens  # noqa: F401  (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)


async def post(api, token, body, *, status, key=None):
    headers = bearer(token) | ({"Idempotency-Key": key} if key is not None else {})
    answer = await api.post("/api/queues/jobs/items", json=body, headers=headers)
    assert answer.status_code == status, answer.text
    return answer.json()


async def test_a_repeat_by_header_answers_200_with_the_same_item(api, queues, tokens):
    first = await post(api, tokens["all"], {"payload": {"to": "ann"}}, key="order-1", status=201)
    again = await post(api, tokens["all"], {"payload": {"to": "ann"}}, key="order-1", status=200)
    assert again["id"] == first["id"]
    assert first["key"] == again["key"] == "order-1"
    assert "duplicate" not in again
    listed = await api.get(f"/api/queues/jobs/items/{first['id']}", headers=bearer(tokens["all"]))
    assert listed.json()["key"] == "order-1"


async def test_the_header_and_the_field_name_one_key(api, queues, tokens):
    first = await post(api, tokens["all"], {"payload": 1, "key": "k"}, status=201)
    assert (await post(api, tokens["all"], {"payload": 1}, key="k", status=200))["id"] == first["id"]
    assert (await post(api, tokens["all"], {"payload": 1, "key": "k"}, key="k", status=200))["id"] == first["id"]
    before = disk_snapshot()
    answer = await post(api, tokens["all"], {"payload": 1, "key": "k"}, key="other", status=400)
    assert answer["error"] == "invalid_request"
    assert disk_snapshot() == before


async def test_a_repeat_shows_the_item_as_it_is_now(api, queues, tokens):
    first = await post(api, tokens["all"], {"payload": 1}, key="k", status=201)
    [claimed] = (await api.post("/api/queues/jobs/claim", json={}, headers=bearer(tokens["all"]))).json()["items"]
    await api.post(f"/api/queues/jobs/items/{claimed['id']}/result", json={"result": "sent"}, headers=bearer(tokens["all"]))
    again = await post(api, tokens["all"], {"payload": 1}, key="k", status=200)
    assert (again["id"], again["status"], again["result"]) == (first["id"], "finished", "sent")


async def test_a_repeat_with_another_payload_is_409_and_stores_nothing(api, queues, tokens):
    await post(api, tokens["all"], {"payload": 1}, key="k", status=201)
    before = disk_snapshot()
    answer = await post(api, tokens["all"], {"payload": 2}, key="k", status=409)
    assert answer["error"] == "key_conflict"
    assert disk_snapshot() == before


async def test_a_batch_marks_its_duplicates_and_answers_201_even_when_all_are(api, queues, tokens):
    first = await post(api, tokens["all"], {"payload": "a", "key": "a"}, status=201)
    answer = await post(api, tokens["all"], {"items": [
        {"payload": "b", "key": "b"}, {"payload": "a", "key": "a"}, {"payload": "c"},
    ]}, status=201)
    items = answer["items"]
    assert [item.get("duplicate", False) for item in items] == [False, True, False]
    assert items[1]["id"] == first["id"]
    again = await post(api, tokens["all"], {"items": [{"payload": "b", "key": "b"}, {"payload": "a", "key": "a"}]}, status=201)
    assert [item["duplicate"] for item in again["items"]] == [True, True]
    assert [item["id"] for item in again["items"]] == [items[0]["id"], first["id"]]


async def test_a_batch_with_a_conflict_posts_nothing(api, queues, tokens):
    await post(api, tokens["all"], {"payload": "a", "key": "a"}, status=201)
    before = disk_snapshot()
    answer = await post(api, tokens["all"], {"items": [{"payload": "new", "key": "n"}, {"payload": "changed", "key": "a"}]}, status=409)
    assert answer["error"] == "key_conflict"
    assert disk_snapshot() == before


@pytest.mark.parametrize("body, header", [
    ({"items": [{"payload": 1, "key": "same"}, {"payload": 2, "key": "same"}]}, None),
    ({"items": [{"payload": 1}]}, "a header on a batch"),
    ({"payload": 1, "key": ""}, None),
    ({"payload": 1, "key": "x" * 201}, None),
    ({"payload": 1, "key": "caf\u00e9"}, None),
    ({"payload": 1, "key": "line\nbreak"}, None),
    ({"payload": 1, "key": "tab\there"}, None),
    ({"payload": 1, "key": 12}, None),
    ({"payload": 1, "key": None}, None),
    ({"payload": 1}, "x" * 201),
])
async def test_bad_keys_are_400_with_nothing_stored(api, queues, tokens, body, header):
    before = disk_snapshot()
    answer = await post(api, tokens["all"], body, key=header, status=400)
    assert answer["error"] == "invalid_request"
    assert disk_snapshot() == before


async def test_a_header_key_with_bytes_beyond_ascii_is_400(api, queues, tokens):
    before = disk_snapshot()
    answer = await api.post("/api/queues/jobs/items", json={"payload": 1},
                            headers=bearer(tokens["all"]) | {"Idempotency-Key": "caf\u00e9".encode()})
    assert answer.status_code == 400, answer.text
    assert disk_snapshot() == before


async def test_keys_are_per_queue(api, queues, tokens):
    first = await post(api, tokens["all"], {"payload": 1}, key="k", status=201)
    other = await api.post("/api/queues/other/items", json={"payload": 1}, headers=bearer(tokens["all"]) | {"Idempotency-Key": "k"})
    assert other.status_code == 201 and other.json()["id"] != first["id"]
