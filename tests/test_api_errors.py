"""Every error the API answers: the code, the status, the `{"error", "message"}` shape, and that
the data directory is exactly as it was before the call."""

import json

import pytest
from django.db import OperationalError

from api_support import api, bearer, disk_snapshot, queues, tokens  # noqa: F401  (fixtures)
from queues.registry import Registry
from queues.runtime import get_registry, get_store

pytestmark = pytest.mark.django_db(transaction=True)

ABSENT = "01939f4e-7c1e-7d3a-9f00-2b6c1d0e4f55"  # well-formed, never posted


@pytest.fixture
async def item_id(api, queues, tokens) -> str:
    """A pending item in `jobs`."""
    answer = await api.post("/api/queues/jobs/items", json={"payload": "x"}, headers=bearer(tokens["all"]))
    return answer.json()["id"]


@pytest.fixture
async def processing_id(api, item_id, tokens) -> str:
    await api.post("/api/queues/jobs/claim", json={}, headers=bearer(tokens["all"]))
    return item_id


@pytest.fixture
def untouchable_store(monkeypatch):
    """A store whose every call fails the test: proves an answer was given without the disk."""

    def touched(*args, **kwargs):
        raise AssertionError("the store was called")

    store = get_store()
    for name in (
        "read_item", "finish_items", "extend_lease", "post_items", "claim_items", "release_items", "count_items",
    ):
        monkeypatch.setattr(store, name, touched)


def assert_error(answer, status: int, code: str, before: list[str]) -> None:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    body = answer.json()
    assert set(body) == {"error", "message"}
    assert body["error"] == code and isinstance(body["message"], str) and body["message"]
    assert disk_snapshot() == before


# ---- invalid_json ----------------------------------------------------------------------------

def nested(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


# nesting too deep is one error whatever the depth: 129 levels, or so many the parser gives up
NOT_JSON = [b"", b"{", b'{"payload": }', b"NaN", b'{"payload": NaN}', b'{"payload": -Infinity}',
            b'{"payload": "\xff"}', b"[" * 100_000, b'{"payload": 1e999, ', b'{"payload": [1e999, NaN]}',
            b"{'payload': 1}", json.dumps({"payload": nested(128)}).encode(),
            json.dumps({"items": [{"payload": {"a": nested(127)}}]}).encode(), json.dumps(nested(129)).encode()]


# an empty claim body is not among them: it means the defaults
NOT_JSON_BODIES = [(path, raw) for path in ("items", "claim", "items/{id}/result", "items/{id}/extend")
                   for raw in NOT_JSON if (path, raw) != ("claim", b"")]


@pytest.mark.parametrize(("path", "raw"), NOT_JSON_BODIES, ids=[f"{p}-{n}" for n, (p, _) in enumerate(NOT_JSON_BODIES)])
async def test_a_body_that_is_not_json_is_invalid_json(api, item_id, tokens, path, raw):
    before = disk_snapshot()

    answer = await api.post(f"/api/queues/jobs/{path.format(id=item_id)}", content=raw, headers=bearer(tokens["all"]))

    assert_error(answer, 400, "invalid_json", before)


# ---- invalid_request -------------------------------------------------------------------------

# JSON, but numbers no value here can hold: beyond a double's range, or of thousands of digits
HUGE = b"1" * 5000
OUT_OF_RANGE = [("items", b'{"payload": 1e999}'), ("items", b'{"payload": [-1e400]}'), ("items", b'{"payload": ' + HUGE + b"}"),
                ("items", b'{"items": [{"payload": 1}, {"payload": {"n": 2e308}}]}'), ("claim", b'{"max": 1e999}'),
                ("claim", b'{"wait": ' + HUGE + b"}"), ("items/{id}/result", b'{"result": 1e999}'),
                ("items/{id}/extend", b'{"seconds": 1e999}')]


@pytest.mark.parametrize(("path", "raw"), OUT_OF_RANGE, ids=[f"{p}-{n}" for n, (p, _) in enumerate(OUT_OF_RANGE)])
async def test_a_number_out_of_range_is_invalid_request(api, processing_id, tokens, path, raw):
    before = disk_snapshot()

    answer = await api.post(f"/api/queues/jobs/{path.format(id=processing_id)}", content=raw,
                            headers=bearer(tokens["all"]))

    assert_error(answer, 400, "invalid_request", before)
    assert "out of range" in answer.json()["message"]


BAD_POSTS = [[], "x", 1, None, {}, {"payload": 1, "items": [{"payload": 1}]}, {"payload": 1, "extra": 2},
             {"items": {}}, {"items": "x"}, {"items": []}, {"items": [1]}, {"items": [{}]}, {"items": [None]},
             {"items": [{"payload": 1, "x": 2}]}, {"items": [{"payload": n} for n in range(1001)]},
             {"payload": "\ud800"}]
BAD_CLAIMS = [[], "x", {"max": 0}, {"max": 101}, {"max": True}, {"max": "1"}, {"max": 1.5}, {"max": None},
              {"wait": -1}, {"wait": 60.5}, {"wait": "1"}, {"wait": True}, {"wait": None}, {"other": 1}]
BAD_RESULTS = [[], {}, {"results": 1}, {"result": 1, "x": 1}, {"result": "\ud800"}]
BAD_EXTENDS = [[], {}, {"seconds": 0}, {"seconds": 86401}, {"seconds": True}, {"seconds": "5"},
               {"seconds": None}, {"seconds": 5, "x": 1}]
BAD_BODIES = ([("items", b) for b in BAD_POSTS] + [("claim", b) for b in BAD_CLAIMS]
              + [("items/{id}/result", b) for b in BAD_RESULTS] + [("items/{id}/extend", b) for b in BAD_EXTENDS])


@pytest.mark.parametrize(("path", "body"), BAD_BODIES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_BODIES)])
async def test_a_body_of_the_wrong_shape_is_invalid_request(api, processing_id, tokens, path, body):
    before = disk_snapshot()
    raw = json.dumps(body).encode()

    url = f"/api/queues/jobs/{path.format(id=processing_id)}"

    answer = await api.post(url, content=raw, headers=bearer(tokens["all"]))

    assert_error(answer, 400, "invalid_request", before)


BAD_QUERIES = ["wait=abc", "wait=-1", "wait=61", "wait=nan", "wait=inf", "wait=", "payload=yes", "payload=2",
               "wait=1&wait=2", "payload=1&payload=1"]


@pytest.mark.parametrize("query", BAD_QUERIES)
async def test_a_bad_query_parameter_is_invalid_request(api, item_id, tokens, query):
    before = disk_snapshot()

    answer = await api.get(f"/api/queues/jobs/items/{item_id}?{query}", headers=bearer(tokens["all"]))

    assert_error(answer, 400, "invalid_request", before)


# ---- not_found -------------------------------------------------------------------------------

HOSTILE_IDS = ["%2e%2e", "..%2F..%2Fetc%2Fpasswd", "%2e%2e%2f", "x" * 5000, "0" * 36, "%00",
               "01939f4e-7c1e-4d3a-9f00-2b6c1d0e4f55",  # a version-4 UUID
               "01939F4E-7C1E-7D3A-9F00-2B6C1D0E4F55", ABSENT + ".json", ABSENT + "%0a", " " + ABSENT]


@pytest.mark.parametrize("item", HOSTILE_IDS, ids=range(len(HOSTILE_IDS)))
@pytest.mark.parametrize(("method", "suffix", "body"),
                         [("GET", "", None), ("POST", "/result", {"result": 1}), ("POST", "/extend", {"seconds": 5})])
async def test_a_malformed_id_is_not_found_without_touching_the_disk(
    api, queues, tokens, untouchable_store, item, method, suffix, body
):
    before = disk_snapshot()

    url = f"/api/queues/jobs/items/{item}{suffix}"

    answer = await api.request(method, url, json=body, headers=bearer(tokens["all"]))

    assert_error(answer, 404, "not_found", before)


@pytest.mark.parametrize(("method", "suffix", "body"),
                         [("GET", "", None), ("POST", "/result", {"result": 1}), ("POST", "/extend", {"seconds": 5})])
async def test_an_id_never_posted_is_not_found(api, item_id, tokens, method, suffix, body):
    before = disk_snapshot()

    url = f"/api/queues/jobs/items/{ABSENT}{suffix}"

    answer = await api.request(method, url, json=body, headers=bearer(tokens["all"]))

    assert_error(answer, 404, "not_found", before)


async def test_an_item_of_another_queue_is_not_found(api, item_id, tokens):
    before = disk_snapshot()

    answer = await api.get(f"/api/queues/other/items/{item_id}", headers=bearer(tokens["all"]))

    assert_error(answer, 404, "not_found", before)


@pytest.mark.parametrize("path", ["/api/", "/api/nothing", "/api/queues/", "/api/queues/jobs/",
                                  f"/api/queues/jobs/items/{ABSENT}/cancel", "/api/queues/jobs/items/x/y/z",
                                  "/api/queues//items", "/healthzz"])
async def test_a_path_that_matches_no_call_is_not_found_in_json(api, queues, tokens, path):
    before = disk_snapshot()

    answer = await api.post(path, json={}, headers=bearer(tokens["all"]))

    assert_error(answer, 404, "not_found", before)


# ---- method_not_allowed ----------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "allow"), [
    ("DELETE", f"/api/queues/jobs/items/{ABSENT}", "GET"),
    ("PUT", "/api/queues/jobs/items", "POST"),
    ("GET", "/api/queues/jobs/claim", "POST"),
    ("GET", f"/api/queues/jobs/items/{ABSENT}/result", "POST"),
    ("POST", "/api/queues", "GET"),
    ("PATCH", "/api/queues/jobs", "GET"),
    ("POST", "/healthz", "GET"),
    ("POST", "/api/schema", "GET"),
])
async def test_a_known_path_with_another_method_is_method_not_allowed(api, queues, tokens, method, path, allow):
    before = disk_snapshot()

    answer = await api.request(method, path, headers=bearer(tokens["all"]))

    assert_error(answer, 405, "method_not_allowed", before)
    assert answer.headers["allow"] == allow


# ---- not_held --------------------------------------------------------------------------------

async def test_extending_a_pending_item_is_not_held(api, item_id, tokens):
    before = disk_snapshot()

    url = f"/api/queues/jobs/items/{item_id}/extend"

    answer = await api.post(url, json={"seconds": 5}, headers=bearer(tokens["all"]))

    assert_error(answer, 409, "not_held", before)


async def test_extending_a_finished_item_is_not_held(api, processing_id, tokens):
    url = f"/api/queues/jobs/items/{processing_id}"
    await api.post(f"{url}/result", json={"result": 1}, headers=bearer(tokens["all"]))
    before = disk_snapshot()

    answer = await api.post(f"{url}/extend", json={"seconds": 5}, headers=bearer(tokens["all"]))

    assert_error(answer, 409, "not_held", before)


# ---- payload_too_large -----------------------------------------------------------------------

@pytest.fixture
def small_limits(settings):
    settings.TASKHOSTER_MAX_BODY_BYTES = 2000
    settings.TASKHOSTER_MAX_PAYLOAD_BYTES = 100
    get_store.cache_clear()  # the store reads the payload limit when it is made


async def test_a_body_over_the_limit_is_payload_too_large(api, small_limits, processing_id, tokens):
    before = disk_snapshot()

    answer = await api.post("/api/queues/jobs/items", json={"payload": "x" * 3000}, headers=bearer(tokens["all"]))

    assert_error(answer, 413, "payload_too_large", before)


async def test_a_streamed_body_is_refused_as_soon_as_it_passes_the_limit(api, small_limits, queues, tokens):
    sent = []

    async def chunks():
        for n in range(100):
            sent.append(n)
            yield b" " * 500

    before = disk_snapshot()

    answer = await api.post("/api/queues/jobs/items", content=chunks(), headers=bearer(tokens["all"]))

    assert_error(answer, 413, "payload_too_large", before)
    assert len(sent) <= 5  # stopped after 2,000 bytes, not after all 50,000


async def test_a_declared_length_over_the_limit_is_refused_before_reading(api, small_limits, queues, tokens):
    before = disk_snapshot()
    headers = {**bearer(tokens["all"]), "Content-Length": "999999999"}

    answer = await api.post("/api/queues/jobs/items", content=b"{}", headers=headers)

    assert_error(answer, 413, "payload_too_large", before)


@pytest.mark.parametrize("body", [{"payload": "x" * 200}, {"items": [{"payload": 1}, {"payload": "x" * 200}]}])
async def test_a_payload_over_the_limit_is_payload_too_large_and_posts_nothing(
    api, small_limits, queues, tokens, body
):
    before = disk_snapshot()

    answer = await api.post("/api/queues/jobs/items", json=body, headers=bearer(tokens["all"]))

    assert_error(answer, 413, "payload_too_large", before)


async def test_a_result_over_the_limit_is_payload_too_large(api, small_limits, processing_id, tokens):
    before = disk_snapshot()

    answer = await api.post(
        f"/api/queues/jobs/items/{processing_id}/result", json={"result": "x" * 200}, headers=bearer(tokens["all"])
    )

    assert_error(answer, 413, "payload_too_large", before)


# ---- storage_unavailable ---------------------------------------------------------------------

async def test_a_post_that_cannot_be_written_is_storage_unavailable(api, queues, tokens):
    tmp = get_store().data_dir / "jobs" / "tmp"
    tmp.rmdir()
    tmp.write_text("")  # tmp/ is now a file: nothing can be written into it
    before = disk_snapshot()

    answer = await api.post("/api/queues/jobs/items", json={"payload": 1}, headers=bearer(tokens["all"]))

    assert_error(answer, 503, "storage_unavailable", before)


def refuse(registry):
    raise OperationalError("the database is down")


async def test_a_database_that_never_answered_is_storage_unavailable(api, queues, tokens, monkeypatch):
    monkeypatch.setattr(Registry, "load", refuse)
    get_registry.cache_clear()  # a fresh process: nothing loaded yet
    before = disk_snapshot()

    answer = await api.get("/api/queues", headers=bearer(tokens["all"]))

    assert_error(answer, 503, "storage_unavailable", before)


async def test_a_database_that_fails_after_a_first_load_leaves_the_api_serving(api, queues, tokens, monkeypatch):
    assert (await api.get("/api/queues", headers=bearer(tokens["all"]))).status_code == 200
    monkeypatch.setattr(Registry, "load", refuse)
    get_registry().invalidate()  # due for a reload, which fails

    answer = await api.post("/api/queues/jobs/items", json={"payload": 1}, headers=bearer(tokens["all"]))

    assert answer.status_code == 201
