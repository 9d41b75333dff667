"""The /work socket, driven in-process through the real ASGI application, and the channel-layer
bridge that carries wake-ups between server processes."""

import asyncio
import json
import os
import shutil
import threading
from concurrent.futures import Future
from contextlib import asynccontextmanager

import pytest
from channels.layers import InMemoryChannelLayer
from channels.testing import WebsocketCommunicator

from queues import bridge as bridge_module
from queues import consumers, runtime
from queues.bridge import ChannelBridge, group_name
from queues.events import Hub, hub
from queues.models import ApiToken
from queues.protocol import MAX_DEPTH
from queues.runtime import get_registry, get_store, run
from queues.services import save_queue
from queues.store import NewItem, QueueConfig, Release, files, turn
from taskhoster_site.asgi import application
from storekit import finish, post_batch, release

pytestmark = pytest.mark.django_db(transaction=True)

TIMEOUT = 3
MISSING_ID = "0193a4b2-7c1e-7d3a-9f00-2b6c1d0e4f55"  # the form of an id, never posted


def make_token(*, queues=(), produce=True, work=True) -> str:
    token = ApiToken(name="t", can_produce=produce, can_work=work, queues=list(queues))
    raw = token.set_new_value()
    token.save()
    get_registry().invalidate()
    return raw


@pytest.fixture
def queues():
    for name in ("jobs", "other"):
        save_queue(name, lease_seconds=30)
    get_registry().invalidate()


@pytest.fixture
def token(queues) -> str:
    return make_token()


def auth(token: str) -> list:
    return [(b"authorization", f"Bearer {token}".encode())]


@asynccontextmanager
async def connected(token: str, *, headers=(), path="/work"):
    ws = WebsocketCommunicator(application, path, headers=[*auth(token), *headers])
    accepted, _ = await ws.connect()
    assert accepted
    try:
        yield ws
    finally:
        await ws.disconnect(timeout=TIMEOUT)


async def ask(ws, frame) -> dict:
    await ws.send_to(text_data=frame if isinstance(frame, str) else json.dumps(frame))
    return await ws.receive_json_from(timeout=TIMEOUT)


def post(queue: str, *payloads, wake: bool = True) -> list[str]:
    items = post_batch(get_store(), queue, list(payloads))
    if wake:
        hub.items_available(queue, len(items))
    return [item.id for item in items]


def status(queue: str, item_id: str) -> str:
    return get_store().read_item(queue=queue, item_id=item_id).status


def config(name: str) -> QueueConfig:
    return QueueConfig(name=name, lease_seconds=30)


# ---- claim, result, results, extend, release ---------------------------------------------


async def test_claim_hands_out_oldest_items_with_payload_and_echoes_ref(token):
    first, second, _ = post("jobs", {"n": 1}, {"n": 2}, {"n": 3})
    async with connected(token) as ws:
        answer = await ask(ws, {"op": "claim", "queue": "jobs", "max": 2, "ref": "c1"})
    assert answer["op"] == "items" and answer["ref"] == "c1"
    assert [item["id"] for item in answer["items"]] == [first, second]
    assert [item["payload"] for item in answer["items"]] == [{"n": 1}, {"n": 2}]
    assert all(item["status"] == "processing" and item["attempts"] == 1 for item in answer["items"])
    assert answer["items"][0]["leaseExpiresAt"] is not None


async def test_claim_without_items_or_wait_answers_an_empty_list_and_ref_null(token):
    async with connected(token) as ws:
        assert await ask(ws, {"op": "claim", "queue": "jobs"}) == {"op": "items", "ref": None, "items": []}


async def test_a_wait_over_before_the_claim_first_looks_answers_an_empty_list(token):
    async with connected(token) as ws:
        for wait in (1e-9, 5e-324):
            assert await ask(ws, {"op": "claim", "queue": "jobs", "wait": wait, "ref": 1}) == {"op": "items", "ref": 1, "items": []}


async def test_a_max_written_as_a_whole_float_is_that_integer(token):
    post("jobs", 1, 2, 3)
    async with connected(token) as ws:
        assert len((await ask(ws, '{"op": "claim", "queue": "jobs", "max": 2.0}'))["items"]) == 2


@pytest.mark.parametrize(("frame", "ref"), [
    ('{"op": "claim", "ref": 7, "queue": "jobs", "wait": 1e999}', 7),
    ('{"op": "claim", "queue": "jobs", "max": -1e400, "ref": "late"}', "late"),
    ('{"op": "result", "queue": "jobs", "id": "%s", "ref": [1, 2], "result": %s}' % (MISSING_ID, "9" * 5000), [1, 2]),
    ('{"op": "claim", "queue": "jobs", "ref": 1e999}', None),
])
async def test_a_number_out_of_range_is_invalid_request_answered_by_its_ref(token, frame, ref):
    [item_id] = post("jobs", 1)
    async with connected(token) as ws:
        answer = await ask(ws, frame)
        assert (answer["op"], answer["code"], answer["ref"]) == ("error", "invalid_request", ref)
        assert "out of range" in answer["message"]
        assert status("jobs", item_id) == "pending"


async def test_a_socket_s_re_queue_waiting_for_a_store_thread_runs_though_a_stop_cancels_its_close(token):
    """More items than run on the loop go back in a store thread; were both busy when a stop
    cancels the close, the re-queue must still run once one is free."""
    posted = post("jobs", *range(runtime.ITEMS_ON_LOOP + 1))
    free = threading.Event()

    def post_items(items):
        free.wait(TIMEOUT)  # as a flush that takes its time

    ws = WebsocketCommunicator(application, "/work", headers=auth(token))
    assert (await ws.connect())[0]
    claimed = await ask(ws, {"op": "claim", "queue": "jobs", "max": len(posted)})
    assert len(claimed["items"]) == len(posted)
    busy = asyncio.gather(*(run(post_items, items=[None] * (runtime.ITEMS_ON_LOOP + 1))
                            for _ in range(runtime.STORE_THREADS)))
    await ws.send_input({"type": "websocket.disconnect", "code": 1001})
    await asyncio.sleep(0.1)  # the close waits for a store thread
    ws.future.cancel()  # as a stopping server cancels what outlived its grace
    await asyncio.gather(ws.future, return_exceptions=True)
    free.set()
    await busy
    for _ in range(int(TIMEOUT / 0.01)):
        if all(status("jobs", item_id) == "pending" for item_id in posted):
            break
        await asyncio.sleep(0.01)
    assert [status("jobs", item_id) for item_id in posted] == ["pending"] * len(posted)


async def test_a_paused_queue_hands_out_nothing(token):
    post("jobs", 1)
    await asyncio.to_thread(save_queue, "jobs", paused=True)
    get_registry().invalidate()
    async with connected(token) as ws:
        assert (await ask(ws, {"op": "claim", "queue": "jobs", "max": 5}))["items"] == []


async def test_first_result_wins_and_a_later_one_is_refused(token):
    [item_id] = post("jobs", "x")
    async with connected(token) as ws:
        await ask(ws, {"op": "claim", "queue": "jobs"})
        first = await ask(ws, {"op": "result", "queue": "jobs", "id": item_id, "result": {"ok": 1}, "ref": 7})
        second = await ask(ws, {"op": "result", "queue": "jobs", "id": item_id, "result": {"ok": 2}})
    assert first == {"op": "ack", "ref": 7, "id": item_id, "accepted": True}
    assert second == {"op": "ack", "ref": None, "id": item_id, "accepted": False}
    item = get_store().read_item(queue="jobs", item_id=item_id)
    assert (item.status, item.result) == ("finished", {"ok": 1})


async def test_a_result_is_accepted_for_a_pending_item_claimed_by_nobody(token):
    [item_id] = post("jobs", "x")
    async with connected(token) as ws:
        answer = await ask(ws, {"op": "result", "queue": "jobs", "id": item_id, "result": None})
    assert answer["accepted"] is True
    assert status("jobs", item_id) == "finished"


async def test_results_batch_acks_in_order_with_not_found_for_unknown_ids(token):
    first, second = post("jobs", 1, 2)
    [elsewhere] = post("other", 3)
    async with connected(token) as ws:
        await ask(ws, {"op": "claim", "queue": "jobs", "max": 2})
        answer = await ask(
            ws,
            {
                "op": "results",
                "ref": "b",
                "items": [
                    {"queue": "jobs", "id": second, "result": "two"},
                    {"queue": "jobs", "id": MISSING_ID, "result": 0},
                    {"queue": "other", "id": elsewhere, "result": "three"},
                    {"queue": "jobs", "id": "not-an-id", "result": 0},
                    {"queue": "jobs", "id": second, "result": "again"},
                    {"queue": "jobs", "id": first, "result": "one"},
                ],
            },
        )
    assert answer == {
        "op": "acks",
        "ref": "b",
        "items": [
            {"id": second, "accepted": True},
            {"id": MISSING_ID, "accepted": False, "error": "not_found"},
            {"id": elsewhere, "accepted": True},
            {"id": "not-an-id", "accepted": False, "error": "not_found"},
            {"id": second, "accepted": False},
            {"id": first, "accepted": True},
        ],
    }
    assert get_store().read_item(queue="jobs", item_id=second).result == "two"
    assert status("other", elsewhere) == "finished"


async def test_extend_sets_the_lease_from_now(token):
    [item_id] = post("jobs", 1)
    async with connected(token) as ws:
        await ask(ws, {"op": "claim", "queue": "jobs"})
        answer = await ask(ws, {"op": "extend", "queue": "jobs", "id": item_id, "seconds": 3600, "ref": "e"})
        item = get_store().read_item(queue="jobs", item_id=item_id)
    assert answer == {"op": "extended", "ref": "e", "id": item_id, "leaseExpiresAt": item.to_json()["leaseExpiresAt"]}
    assert item.lease_expires_at - item.claimed_at == pytest.approx(3600, abs=5)


async def test_release_puts_the_item_back_to_pending_at_once(token):
    [item_id] = post("jobs", 1)
    async with connected(token) as ws:
        await ask(ws, {"op": "claim", "queue": "jobs"})
        answer = await ask(ws, {"op": "release", "queue": "jobs", "id": item_id, "ref": "r"})
        assert answer == {"op": "released", "ref": "r", "id": item_id}
        assert status("jobs", item_id) == "pending"
        again = await ask(ws, {"op": "claim", "queue": "jobs"})
    assert again["items"][0]["id"] == item_id and again["items"][0]["attempts"] == 2


async def test_extend_or_release_of_an_item_not_held_is_not_held(token):
    finished, pending, theirs = post("jobs", 1, 2, 3)
    async with connected(token) as ws:
        await ask(ws, {"op": "result", "queue": "jobs", "id": finished, "result": 1})
        get_store().claim_items(config=config("jobs"), max_items=2)  # someone else holds pending, theirs
        release(get_store(), "jobs", pending)
        for item_id in (finished, pending, theirs):
            for frame in (
                {"op": "extend", "queue": "jobs", "id": item_id, "seconds": 10, "ref": item_id},
                {"op": "release", "queue": "jobs", "id": item_id, "ref": item_id},
            ):
                answer = await ask(ws, frame)
                assert (answer["op"], answer["code"], answer["ref"]) == ("error", "not_held", item_id)
    assert [status("jobs", i) for i in (finished, pending, theirs)] == ["finished", "pending", "processing"]


@pytest.mark.parametrize("op", ["result", "extend", "release"])
@pytest.mark.parametrize("item_id", [MISSING_ID, "../../etc/passwd", "0193A4B2-7C1E-7D3A-9F00-2B6C1D0E4F55"])
async def test_an_unknown_or_malformed_id_is_not_found(token, op, item_id):
    frame = {"op": op, "queue": "jobs", "id": item_id, "ref": 1}
    frame.update({"result": {"result": 1}, "extend": {"seconds": 5}, "release": {}}[op])
    async with connected(token) as ws:
        answer = await ask(ws, frame)
    assert (answer["op"], answer["code"], answer["ref"]) == ("error", "not_found", 1)
    assert answer["message"]


async def test_a_binary_frame_holding_json_is_answered_too(token):
    async with connected(token) as ws:
        await ws.send_to(bytes_data=json.dumps({"op": "claim", "queue": "jobs", "ref": "bin"}).encode())
        assert (await ws.receive_json_from(timeout=TIMEOUT))["ref"] == "bin"


# ---- errors: every one answered, nothing changed, the socket stays open -------------------

BAD_FRAMES = [
    ("{not json", "invalid_json"),
    ('{"op": "claim", "queue": "jobs", "max": NaN}', "invalid_json"),
    ('{"op": "claim", "queue": "jobs", "max": Infinity}', "invalid_json"),
    # a number out of range in what is not JSON after all: too deep, NaN, cut short
    ('{"op": "claim", "max": 1e999, "x": ' + "[" * 5000 + "]" * 5000 + "}", "invalid_json"),
    ('{"op": "claim", "max": 1e999, "ref": Infinity}', "invalid_json"),
    ('{"op": "claim", "queue": "jobs", "max": 1e999, ', "invalid_json"),
    ("[" * 100_000, "invalid_json"),
    ("[1, 2]", "invalid_request"),
    ('"claim"', "invalid_request"),
    ({"ref": 1}, "invalid_request"),
    ({"op": "dance", "ref": 1}, "invalid_request"),
    ({"op": 5}, "invalid_request"),
    ({"op": "claim"}, "invalid_request"),
    ({"op": "claim", "queue": 5}, "invalid_request"),
    ({"op": "claim", "queue": "jobs", "max": 0}, "invalid_request"),
    ({"op": "claim", "queue": "jobs", "max": 101}, "invalid_request"),
    ({"op": "claim", "queue": "jobs", "max": "1"}, "invalid_request"),
    ({"op": "claim", "queue": "jobs", "max": True}, "invalid_request"),
    ({"op": "claim", "queue": "jobs", "max": 1.5}, "invalid_request"),
    ({"op": "claim", "queue": "jobs", "wait": -1}, "invalid_request"),
    ({"op": "claim", "queue": "jobs", "wait": 301}, "invalid_request"),
    ({"op": "claim", "queue": "jobs", "wait": "soon"}, "invalid_request"),
    ({"op": "claim", "queue": "jobs", "colour": "red"}, "invalid_request"),
    ({"op": "result", "queue": "jobs", "id": MISSING_ID}, "invalid_request"),
    ({"op": "result", "queue": "jobs", "id": 5, "result": 1}, "invalid_request"),
    ({"op": "result", "queue": "jobs", "result": 1}, "invalid_request"),
    ({"op": "result", "queue": "jobs", "id": MISSING_ID, "result": "\ud800", "ref": "\udfff"}, "invalid_request"),
    ({"op": "results", "items": []}, "invalid_request"),
    ({"op": "results", "items": {"queue": "jobs"}}, "invalid_request"),
    ({"op": "results", "items": [{"queue": "jobs", "id": MISSING_ID, "result": 1}] * 1001}, "invalid_request"),
    ({"op": "results", "items": ["x"]}, "invalid_request"),
    ({"op": "results", "items": [{"queue": "jobs", "id": MISSING_ID}]}, "invalid_request"),
    ({"op": "results", "items": [{"queue": "jobs", "id": MISSING_ID, "result": 1, "x": 1}]}, "invalid_request"),
    ({"op": "extend", "queue": "jobs", "id": MISSING_ID}, "invalid_request"),
    ({"op": "extend", "queue": "jobs", "id": MISSING_ID, "seconds": 0}, "invalid_request"),
    ({"op": "extend", "queue": "jobs", "id": MISSING_ID, "seconds": 86401}, "invalid_request"),
    ({"op": "release", "queue": "jobs"}, "invalid_request"),
    ({"op": "claim", "queue": "nope"}, "unknown_queue"),
    ({"op": "claim", "queue": "Bad Name!"}, "unknown_queue"),
    ({"op": "result", "queue": "nope", "id": MISSING_ID, "result": 1}, "unknown_queue"),
    ({"op": "results", "items": [{"queue": "nope", "id": MISSING_ID, "result": 1}]}, "unknown_queue"),
    ({"op": "extend", "queue": "nope", "id": MISSING_ID, "seconds": 5}, "unknown_queue"),
    ({"op": "release", "queue": "nope", "id": MISSING_ID}, "unknown_queue"),
]


@pytest.mark.parametrize("frame, code", BAD_FRAMES)
async def test_bad_frames_get_an_error_and_the_socket_stays_open(token, frame, code):
    [item_id] = post("jobs", 1)
    async with connected(token) as ws:
        answer = await ask(ws, frame)
        assert answer["op"] == "error" and answer["code"] == code and answer["message"]
        if isinstance(frame, dict) and "ref" in frame:
            assert answer["ref"] == frame["ref"]
        assert status("jobs", item_id) == "pending"  # nothing changed
        assert (await ask(ws, {"op": "claim", "queue": "jobs", "ref": "next"}))["items"][0]["id"] == item_id


async def test_a_queue_the_token_may_not_work_is_forbidden(queues):
    scoped = await asyncio.to_thread(make_token, queues=["other"])
    [item_id] = post("jobs", 1)
    async with connected(scoped) as ws:
        for frame in (
            {"op": "claim", "queue": "jobs", "ref": 1},
            {"op": "claim", "queue": "nope", "ref": 1},  # no telling whether a queue exists
            {"op": "result", "queue": "jobs", "id": item_id, "result": 1, "ref": 1},
            {"op": "results", "ref": 1, "items": [{"queue": "jobs", "id": item_id, "result": 1}]},
            {"op": "extend", "queue": "jobs", "id": item_id, "seconds": 5, "ref": 1},
            {"op": "release", "queue": "jobs", "id": item_id, "ref": 1},
        ):
            answer = await ask(ws, frame)
            assert (answer["op"], answer["code"], answer["ref"]) == ("error", "forbidden", 1)
        assert (await ask(ws, {"op": "claim", "queue": "other"}))["op"] == "items"
    assert status("jobs", item_id) == "pending"


async def test_a_token_deleted_while_connected_may_do_nothing_more(token):
    post("jobs", 1)
    async with connected(token) as ws:
        await asyncio.to_thread(ApiToken.objects.all().delete)
        get_registry().invalidate()
        answer = await ask(ws, {"op": "claim", "queue": "jobs"})
    assert answer["code"] == "forbidden"


async def test_frames_over_the_body_limit_are_too_large_and_answered_by_their_ref(token, settings):
    """Not read, the frame's ref is still found where clients put it: first or last."""
    settings.TASKHOSTER_MAX_BODY_BYTES = 1000
    async with connected(token) as ws:
        answer = await ask(ws, {"op": "claim", "queue": "jobs", "pad": "x" * 1000, "ref": 1})
        assert (answer["code"], answer["ref"]) == ("payload_too_large", 1)
        answer = await ask(ws, '{"ref": "first", "op": "claim", "pad": "' + "é" * 600 + '"}')  # over in bytes only
        assert (answer["code"], answer["ref"]) == ("payload_too_large", "first")
        answer = await ask(ws, {"op": "claim", "queue": "jobs", "pad": {"ref": 2, "more": "x" * 1000}})
        assert (answer["code"], answer["ref"]) == ("payload_too_large", None)  # a ref inside is not the frame's
        assert (await ask(ws, {"op": "claim", "queue": "jobs"}))["op"] == "items"


async def test_a_frame_too_deep_or_cut_short_is_answered_by_its_ref_where_clients_put_it(token):
    """JSON nested past the limit, or a frame cut off: not read, yet its answer names its ref, so
    a client waiting on that ref hears of it instead of giving up on the socket."""
    [item_id] = post("jobs", 1)
    deep = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    async with connected(token) as ws:
        answer = await ask(ws, '{"ref": "deep", "op": "result", "queue": "jobs", "id": "%s", "result": %s}'
                           % (item_id, deep))
        assert (answer["code"], answer["ref"]) == ("invalid_json", "deep")
        answer = await ask(ws, '{"op": "extend", "queue": "jobs", "id": "%s", "seconds": %s, "ref": 7}'
                           % (item_id, deep))
        assert (answer["code"], answer["ref"]) == ("invalid_json", 7)
        answer = await ask(ws, '{"ref": "cut", "op": "claim", "queue": "jobs", "max": ')
        assert (answer["code"], answer["ref"]) == ("invalid_json", "cut")
        assert status("jobs", item_id) == "pending"


async def test_a_frame_over_the_limit_is_refused_at_once_while_other_frames_fill_the_budget(token, settings, monkeypatch):
    """It is never read, so it takes no share of what the process may receive at once, nor waits
    for one: a frame far over a small limit is answered however busy the server is."""
    settings.TASKHOSTER_MAX_BODY_BYTES = 1000
    monkeypatch.setattr(consumers.receiving, "taken", 10 * 1000)  # others' frames fill the budget
    async with connected(token) as ws:
        answer = await ask(ws, {"op": "claim", "queue": "jobs", "pad": "x" * 5000})
        assert answer["code"] == "payload_too_large"
        assert consumers.receiving.taken == 10 * 1000


async def test_a_result_over_the_payload_limit_is_too_large_and_changes_nothing(token, settings):
    settings.TASKHOSTER_MAX_PAYLOAD_BYTES = 100
    get_store.cache_clear()
    [item_id] = post("jobs", 1)
    async with connected(token) as ws:
        await ask(ws, {"op": "claim", "queue": "jobs"})
        answer = await ask(ws, {"op": "result", "queue": "jobs", "id": item_id, "result": "x" * 200, "ref": 2})
        assert (answer["code"], answer["ref"]) == ("payload_too_large", 2)
        batch = await ask(ws, {"op": "results", "items": [{"queue": "jobs", "id": item_id, "result": "x" * 200}]})
        assert batch["items"] == [{"id": item_id, "accepted": False, "error": "payload_too_large"}]
        assert status("jobs", item_id) == "processing"
        assert (await ask(ws, {"op": "result", "queue": "jobs", "id": item_id, "result": "ok"}))["accepted"]


async def test_a_results_frame_whose_one_queue_cannot_store_still_hands_in_the_others(token, faults):
    [mine] = post("jobs", 1)
    [theirs] = post("other", 2)
    store = get_store()
    async with connected(token) as ws:
        await ask(ws, {"op": "claim", "queue": "jobs"})
        await ask(ws, {"op": "claim", "queue": "other"})
        faults.fail(calls={"link"}, where="/jobs/")
        answer = await ask(ws, {"op": "results", "items": [
            {"queue": "jobs", "id": mine, "result": 1}, {"queue": "other", "id": theirs, "result": 2},
        ]})
    assert answer["items"] == [
        {"id": mine, "accepted": False, "error": "storage_unavailable"},
        {"id": theirs, "accepted": True},
    ]
    assert (status("jobs", mine), status("other", theirs)) == ("pending", "finished")  # re-queued at close
    assert not os.listdir(store.data_dir / "jobs" / "tmp")


async def test_a_data_directory_that_cannot_be_written_is_storage_unavailable(token, settings):
    [item_id] = post("jobs", 1)
    async with connected(token) as ws:
        await ask(ws, {"op": "claim", "queue": "jobs"})
        tmp = settings.TASKHOSTER_DATA_DIR / "jobs" / "tmp"
        shutil.rmtree(tmp)
        tmp.write_text("not a directory")  # every write goes through tmp/ first
        answer = await ask(ws, {"op": "result", "queue": "jobs", "id": item_id, "result": 1, "ref": 3})
        assert (answer["code"], answer["ref"]) == ("storage_unavailable", 3)
        assert status("jobs", item_id) == "processing"
        tmp.unlink()
        tmp.mkdir()
        assert (await ask(ws, {"op": "result", "queue": "jobs", "id": item_id, "result": 1}))["accepted"]


# ---- handshake ---------------------------------------------------------------------------


async def refused_with(headers, path="/work") -> tuple[bool, int | None]:
    """(accepted, close code that followed)."""
    ws = WebsocketCommunicator(application, path, headers=headers)
    accepted, code = await ws.connect()
    if accepted:
        message = await ws.receive_output(timeout=TIMEOUT)
        code = message["code"] if message["type"] == "websocket.close" else None
    await ws.disconnect(timeout=TIMEOUT)
    return accepted, code


async def test_a_handshake_without_a_valid_token_with_the_right_to_work_is_closed_4401(queues):
    producer = await asyncio.to_thread(make_token, work=False)
    assert await refused_with([]) == (True, 4401)
    assert await refused_with(auth("th_not-a-real-token")) == (True, 4401)
    assert await refused_with([(b"authorization", b"Basic dXNlcjpwYXNz")]) == (True, 4401)
    assert await refused_with(auth(producer)) == (True, 4401)


async def test_the_token_may_come_in_the_query_string(token):
    ws = WebsocketCommunicator(application, f"/work?token={token}")
    assert (await ws.connect())[0]
    assert (await ask(ws, {"op": "claim", "queue": "jobs"}))["op"] == "items"
    await ws.disconnect()


async def test_a_handshake_without_origin_is_accepted_and_a_matching_origin_too(token):
    for headers in ([], [(b"origin", b"http://localhost:8000")], [(b"origin", b"https://127.0.0.1")]):
        async with connected(token, headers=headers) as ws:
            assert (await ask(ws, {"op": "claim", "queue": "jobs"}))["op"] == "items"


@pytest.mark.parametrize("origin", [b"http://evil.example", b"null", b"http://localhost.evil.example:8000", b"garbage"])
async def test_a_handshake_from_a_foreign_origin_is_refused(token, origin):
    ws = WebsocketCommunicator(application, "/work", headers=[*auth(token), (b"origin", origin)])
    accepted, _ = await ws.connect()
    assert not accepted  # refused before the handshake completes: HTTP 403
    await ws.disconnect(timeout=TIMEOUT)


# ---- waiting claims ----------------------------------------------------------------------


@pytest.fixture
def no_recheck(monkeypatch):
    """Waiting claims rely on wake-ups alone (the periodic re-check is pushed far out)."""
    monkeypatch.setattr(consumers, "RECHECK_SECONDS", 60)


async def test_several_claims_wait_at_once_while_other_frames_flow(token, no_recheck):
    [held] = post("jobs", "held")
    async with connected(token) as ws:
        await ask(ws, {"op": "claim", "queue": "jobs"})
        for ref, queue in (("a", "jobs"), ("b", "other"), ("c", "jobs")):
            await ws.send_json_to({"op": "claim", "queue": queue, "wait": 60, "ref": ref})
        extended = await ask(ws, {"op": "extend", "queue": "jobs", "id": held, "seconds": 99, "ref": "x"})
        assert extended["op"] == "extended"
        assert (await ask(ws, {"op": "result", "queue": "jobs", "id": held, "result": 1}))["accepted"]
        [other_id] = post("other", "o")
        answer = await ws.receive_json_from(timeout=TIMEOUT)
        assert (answer["ref"], [i["id"] for i in answer["items"]]) == ("b", [other_id])
        first, second = post("jobs", 1, 2)
        answers = {a["ref"]: a for a in [await ws.receive_json_from(timeout=TIMEOUT) for _ in range(2)]}
        assert {answers["a"]["items"][0]["id"], answers["c"]["items"][0]["id"]} == {first, second}


async def test_a_waiting_claim_is_woken_by_a_post(token, no_recheck):
    async with connected(token) as ws:
        await ws.send_json_to({"op": "claim", "queue": "jobs", "wait": 60, "max": 10, "ref": "w"})
        assert (await ask(ws, {"op": "nothing", "ref": "sync"}))["ref"] == "sync"  # the claim waits
        ids = post("jobs", 1, 2, 3)
        answer = await ws.receive_json_from(timeout=TIMEOUT)
    assert answer["ref"] == "w" and [item["id"] for item in answer["items"]] == ids


async def test_a_woken_claim_sends_its_item_before_the_post_that_woke_it_is_flushed(token, no_recheck, monkeypatch):
    """So the worker works while the disk flushes the post; the post is answered once flushed."""
    monkeypatch.setattr(get_registry(), "max_age", 3600)  # no reload of settings on the way, however slow the run
    store = get_store()
    await run(store.post_items, config=config("jobs"), items=[NewItem("alone")])  # flushed alone
    async with connected(token) as ws:
        sent_at_flush = []
        flush_file = files._flush_file

        def watched(fd, path):
            sent_at_flush.append(ws.output_queue.qsize())  # frames the socket has sent by then
            flush_file(fd, path)

        monkeypatch.setattr(files, "_flush_file", watched)
        await ask(ws, {"op": "claim", "queue": "jobs"})  # takes "alone"
        await ws.send_json_to({"op": "claim", "queue": "jobs", "wait": 60, "ref": "w"})
        await ask(ws, {"op": "nothing"})  # the claim waits
        [posted] = await run(store.post_items, config=config("jobs"), items=[NewItem("second")])
        answer = await ws.receive_json_from(timeout=TIMEOUT)
    assert sent_at_flush == [1]
    assert (answer["ref"], [item["id"] for item in answer["items"]]) == ("w", [posted.item.id])


async def test_a_post_that_lands_while_the_claim_looks_at_the_disk_still_wakes_it(
    token, no_recheck, post_lands_mid_claim
):
    async with connected(token) as ws:
        await ws.send_json_to({"op": "claim", "queue": "jobs", "wait": 60, "ref": "w"})
        answer = await ws.receive_json_from(timeout=TIMEOUT)
    assert [item["id"] for item in answer["items"]] == post_lands_mid_claim


async def test_a_waiting_claim_rechecks_the_disk_without_a_wake_up(token):
    async with connected(token) as ws:
        await ws.send_json_to({"op": "claim", "queue": "jobs", "wait": 60, "ref": "w"})
        await ask(ws, {"op": "nothing"})
        [item_id] = post("jobs", 1, wake=False)  # as if posted by another process, wake-up lost
        answer = await ws.receive_json_from(timeout=consumers.RECHECK_SECONDS + TIMEOUT)
    assert answer["items"][0]["id"] == item_id


async def test_a_waiting_claim_answers_empty_when_its_wait_is_over(token):
    async with connected(token) as ws:
        await ws.send_json_to({"op": "claim", "queue": "jobs", "wait": 0.2, "ref": "w"})
        assert await ws.receive_json_from(timeout=TIMEOUT) == {"op": "items", "ref": "w", "items": []}


async def test_a_woken_claim_that_finds_nothing_waits_again(token, no_recheck):
    async with connected(token) as ws:
        await ws.send_json_to({"op": "claim", "queue": "jobs", "wait": 60, "ref": "w"})
        await ask(ws, {"op": "nothing"})
        post("jobs", "taken", wake=False)
        get_store().claim_items(config=config("jobs"), max_items=1)  # another worker was first
        hub.items_available("jobs", 1)
        await asyncio.sleep(0.2)
        assert await ws.receive_nothing(timeout=0.1)
        [item_id] = post("jobs", "second")
        answer = await ws.receive_json_from(timeout=TIMEOUT)
    assert answer["items"][0]["id"] == item_id


# ---- closing the socket re-queues what it holds (G8) -------------------------------------


async def test_disconnect_requeues_held_items_and_wakes_a_waiting_claim(token, no_recheck):
    finished, held, released = post("jobs", 1, 2, 3)
    async with connected(token) as other:
        async with connected(token) as ws:
            await ask(ws, {"op": "claim", "queue": "jobs", "max": 3})
            await ask(ws, {"op": "result", "queue": "jobs", "id": finished, "result": 1})
            await ask(ws, {"op": "release", "queue": "jobs", "id": released})
            await ask(other, {"op": "claim", "queue": "jobs"})  # takes `released` back
            await other.send_json_to({"op": "claim", "queue": "jobs", "wait": 60, "ref": "w"})
            await ask(other, {"op": "nothing"})
        answer = await other.receive_json_from(timeout=TIMEOUT)
        assert [item["id"] for item in answer["items"]] == [held]
        assert answer["items"][0]["attempts"] == 2
    assert status("jobs", finished) == "finished"


async def test_disconnect_leaves_alone_items_finished_or_claimed_since_by_someone_else(token):
    finished_elsewhere, reclaimed, held = post("jobs", 1, 2, 3)
    async with connected(token) as ws:
        await ask(ws, {"op": "claim", "queue": "jobs", "max": 3})
        store = get_store()
        finish(store, config("jobs"), finished_elsewhere, "theirs")
        release(store, "jobs", reclaimed)  # as the sweep does when a lease lapses
        [theirs] = store.claim_items(config=config("jobs"), max_items=1)
    assert theirs.id == reclaimed
    assert status("jobs", finished_elsewhere) == "finished"
    assert store.read_item(queue="jobs", item_id=reclaimed).claim_token == theirs.claim_token
    assert status("jobs", held) == "pending"


async def test_an_item_claimed_for_a_socket_that_closed_meanwhile_goes_back_to_pending(token, no_recheck, monkeypatch):
    """A woken claim still waiting (on the loop, as for another's lock) when its socket closes
    goes on after the socket's tasks are cancelled; what it takes is re-queued."""
    store = get_store()
    real_claim, gate = store.claim_items, Future()
    claims = []

    def claim_items(**kwargs):  # the woken claim waits on the loop, as for another's lock
        claims.append(kwargs)
        if len(claims) == 2:
            turn.wait_for(gate)
        return real_claim(**kwargs)

    monkeypatch.setattr(store, "claim_items", claim_items)
    ws = WebsocketCommunicator(application, "/work", headers=auth(token))
    await ws.connect()
    await ws.send_json_to({"op": "claim", "queue": "jobs", "wait": 60})
    await ask(ws, {"op": "nothing"})
    [item_id] = post("jobs", 1)
    while len(claims) < 2:
        await asyncio.sleep(0.01)
    asyncio.get_running_loop().call_later(0.1, gate.set_result, None)
    await ws.disconnect(timeout=TIMEOUT)
    item = store.read_item(queue="jobs", item_id=item_id)
    assert (item.status, item.attempts) == ("pending", 1)


async def test_letting_go_cancelled_while_it_waits_for_a_claim_leaves_the_claim_to_end():
    """Its items are recorded when it ends, for the next let_go (the socket's own, at its end)."""
    consumer = consumers.WorkConsumer()
    claiming = asyncio.get_running_loop().create_future()
    consumer.claiming.add(claiming)
    letting_go = asyncio.ensure_future(consumer.let_go(reason="socket"))
    await asyncio.sleep(0)
    letting_go.cancel()
    with pytest.raises(asyncio.CancelledError):
        await letting_go
    assert not claiming.cancelled()


async def test_disconnect_cancels_waiting_claims(token):
    async with connected(token) as ws:
        await ws.send_json_to({"op": "claim", "queue": "jobs", "wait": 60})
        await ask(ws, {"op": "nothing"})
    [item_id] = post("jobs", 1)
    await asyncio.sleep(0.1)
    assert status("jobs", item_id) == "pending"


# ---- the bridge between server processes --------------------------------------------------


@asynccontextmanager
async def bridged_hubs(count: int = 2):
    """`count` hubs, each with its own bridge on one shared layer, as in `count` processes."""
    layer = InMemoryChannelLayer()
    hubs = [Hub() for _ in range(count)]

    async def names():
        return ["jobs"]

    bridges = [ChannelBridge(layer, hub=h, queue_names=names) for h in hubs]
    tasks = [asyncio.create_task(b.run()) for b in bridges]
    while len(layer.groups.get(group_name("jobs"), {})) < count:
        await asyncio.sleep(0.01)
    try:
        yield hubs
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert all(h.bridge is None for h in hubs)


class LayerDownAtFirst(InMemoryChannelLayer):
    """A channel layer whose server cannot be reached for its first `misses` channels."""

    def __init__(self, misses: int):
        super().__init__()
        self.misses = misses

    async def new_channel(self, prefix="specific."):
        if self.misses:
            self.misses -= 1
            raise ConnectionError("the channel layer's server is down")
        return await super().new_channel(prefix)


async def test_a_bridge_started_while_the_layer_is_down_joins_once_it_is_up(monkeypatch):
    monkeypatch.setattr(bridge_module, "RETRY_SECONDS", 0.01)
    layer, hub_ = LayerDownAtFirst(misses=3), Hub()

    async def names():
        return ["jobs"]

    running = asyncio.create_task(ChannelBridge(layer, hub=hub_, queue_names=names).run())
    try:
        while hub_.bridge is None:
            assert not running.done(), running.exception()
            await asyncio.sleep(0.01)
        assert layer.misses == 0
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


async def test_the_bridge_wakes_claims_waiting_in_another_process_as_many_as_items():
    async with bridged_hubs() as (here, there):
        waiters = [asyncio.create_task(there.wait_available("jobs", 1.0)) for _ in range(3)]
        await asyncio.sleep(0.05)
        here.items_available("jobs", 2)
        assert sorted(await asyncio.gather(*waiters)) == [False, True, True]


async def test_the_bridge_wakes_reads_waiting_in_another_process():
    async with bridged_hubs() as (here, there):
        waiter = asyncio.create_task(there.wait_terminal("jobs", MISSING_ID, TIMEOUT))
        await asyncio.sleep(0.05)
        here.items_terminal("jobs", [MISSING_ID])
        assert await waiter


async def test_the_bridge_carries_notifications_made_on_another_thread():
    async with bridged_hubs() as (here, there):
        waiter = asyncio.create_task(there.wait_available("jobs", TIMEOUT))
        await asyncio.sleep(0.05)
        threading.Thread(target=here.items_available, args=("jobs", 1)).start()  # as the sweep does
        assert await waiter


async def test_the_bridge_ignores_its_own_messages():
    async with bridged_hubs() as (here, there):
        local = [asyncio.create_task(here.wait_available("jobs", 1.0)) for _ in range(2)]
        remote = asyncio.create_task(there.wait_available("jobs", TIMEOUT))
        await asyncio.sleep(0.05)
        here.items_available("jobs", 1)
        assert await remote  # the message went round
        assert sorted(await asyncio.gather(*local)) == [False, True]  # and woke only one here


@pytest.mark.parametrize(
    ("fault", "code"),
    [(OSError(5, "the disk went away in an unforeseen way"), "storage_unavailable"), (KeyError("a bug"), "internal_error")],
)
async def test_an_unexpected_error_is_an_error_frame_and_the_socket_stays_open(token, monkeypatch, caplog, fault, code):
    """G10: a well-formed frame never closes the socket; G8 still holds when it closes later."""
    [item_id] = post("jobs", 1)
    async with connected(token) as ws:
        await ask(ws, {"op": "claim", "queue": "jobs"})

        def broken(**kwargs):
            raise fault

        monkeypatch.setattr(get_store(), "extend_lease", broken)
        answer = await ask(ws, {"op": "extend", "queue": "jobs", "id": item_id, "seconds": 5, "ref": 7})
        assert (answer["op"], answer["ref"], answer["code"]) == ("error", 7, code)
        assert "Traceback" in caplog.text  # logged with its traceback
        monkeypatch.undo()
        assert (await ask(ws, {"op": "extend", "queue": "jobs", "id": item_id, "seconds": 5}))["op"] == "extended"
    assert status("jobs", item_id) == "pending"


async def test_a_failing_waiting_claim_answers_an_error_and_the_socket_goes_on(token, monkeypatch):
    [held] = post("jobs", 1)
    async with connected(token) as ws:
        await ask(ws, {"op": "claim", "queue": "jobs"})
        await ws.send_json_to({"op": "claim", "queue": "jobs", "wait": 60, "ref": "waiting"})
        await ask(ws, {"op": "nothing"})
        real_claim = get_store().claim_items

        def broken(**kwargs):
            raise OSError(5, "the disk went away in an unforeseen way")

        monkeypatch.setattr(get_store(), "claim_items", broken)
        [later] = post("jobs", 2)
        answer = await ws.receive_json_from(timeout=TIMEOUT)
        assert (answer["op"], answer["ref"], answer["code"]) == ("error", "waiting", "storage_unavailable")
        monkeypatch.setattr(get_store(), "claim_items", real_claim)
        assert [item["id"] for item in (await ask(ws, {"op": "claim", "queue": "jobs"}))["items"]] == [later]
    assert status("jobs", held) == status("jobs", later) == "pending"


async def test_stopping_the_server_requeues_what_sockets_hold(token):
    [item_id] = post("jobs", 1)
    ws = WebsocketCommunicator(application, "/work", headers=auth(token))
    await ws.connect()
    await ask(ws, {"op": "claim", "queue": "jobs"})
    ws.future.cancel()  # what daphne does to every application when it stops: no disconnect()
    with pytest.raises(asyncio.CancelledError):
        await ws.future
    assert status("jobs", item_id) == "pending"


@pytest.mark.parametrize("path", ["/work/", "/nowhere", "/api/queues"])
async def test_a_handshake_to_any_other_path_is_refused_not_an_error(token, path):
    ws = WebsocketCommunicator(application, path, headers=auth(token))
    accepted, _ = await ws.connect()
    assert accepted is False


# ---- beyond the seed: release with delay and error, canceled, maxAttempts ------------------------


async def test_a_release_with_a_delay_and_an_error_schedules_the_item_and_keeps_the_error(token):
    [item_id] = post("jobs", 1)
    async with connected(token) as ws:
        claimed = (await ask(ws, {"op": "claim", "queue": "jobs"}))["items"][0]
        assert claimed["maxAttempts"] is None
        answer = await ask(ws, {"op": "release", "queue": "jobs", "id": item_id, "delay": 60, "error": "later", "ref": 1})
        assert (answer["op"], answer["id"]) == ("released", item_id)
        bad = await ask(ws, {"op": "release", "queue": "jobs", "id": item_id, "delay": -1})
        assert bad["code"] == "invalid_request"
    item = get_store().read_item(queue="jobs", item_id=item_id)
    assert (item.status, item.last_error, item.attempts) == ("scheduled", "later", 1)


async def test_a_canceled_item_is_told_to_the_socket_holding_it_which_holds_it_no_more(token):
    [item_id] = post("jobs", 1)
    async with connected(token) as ws:
        await ask(ws, {"op": "claim", "queue": "jobs"})
        get_store().cancel_item(config=config("jobs"), item_id=item_id)
        told = await ws.receive_json_from(timeout=TIMEOUT)
        assert told == {"op": "canceled", "queue": "jobs", "id": item_id}  # no ref: it answers nothing
        answer = await ask(ws, {"op": "extend", "queue": "jobs", "id": item_id, "seconds": 5})
        assert answer["code"] == "not_held"
    item = get_store().read_item(queue="jobs", item_id=item_id)
    assert (item.status, item.error) == ("failed", "canceled")  # closing the socket changed nothing


async def test_a_cancel_whose_notice_was_lost_is_told_when_the_socket_next_extends_the_item(token, monkeypatch):
    """Made in another server process, a cancel reaches this socket over the channel layer, which
    drops it while Redis is down: the worker's next lease renewal tells it."""
    [item_id] = post("jobs", 1)
    async with connected(token) as ws:
        await ask(ws, {"op": "claim", "queue": "jobs"})
        monkeypatch.setattr(hub, "item_canceled", lambda *args, **kwargs: None)  # the notice is lost
        get_store().cancel_item(config=config("jobs"), item_id=item_id)
        assert await ws.receive_nothing(timeout=0.2)
        await ws.send_json_to({"op": "extend", "queue": "jobs", "id": item_id, "seconds": 5, "ref": "renew"})
        told = await ws.receive_json_from(timeout=TIMEOUT)
        assert told == {"op": "canceled", "queue": "jobs", "id": item_id}
        answer = await ws.receive_json_from(timeout=TIMEOUT)
        assert (answer["ref"], answer["code"]) == ("renew", "not_held")
        answer = await ask(ws, {"op": "extend", "queue": "jobs", "id": item_id, "seconds": 5})
        assert answer["code"] == "not_held"  # told once: the socket holds it no more
        assert await ws.receive_nothing(timeout=0.2)


async def test_an_item_canceled_while_the_socket_s_claim_is_under_way_is_not_handed_out(token, monkeypatch):
    """The cancel comes after the claim took the item and before the socket holds it (a claim of
    many items holds them all once the last is claimed): the claim's answer leaves it out."""
    first, second = post("jobs", 1, 2)
    store = get_store()
    real_claim = store.claim_items

    def claim_then_cancel(**kwargs):
        items = real_claim(**kwargs)
        store.cancel_item(config=config("jobs"), item_id=first)
        return items

    monkeypatch.setattr(store, "claim_items", claim_then_cancel)
    async with connected(token) as ws:
        claimed = await ask(ws, {"op": "claim", "queue": "jobs", "max": 5})
        assert [item["id"] for item in claimed["items"]] == [second]
        assert await ws.receive_nothing(timeout=0.2)  # nor told of it
        answer = await ask(ws, {"op": "result", "queue": "jobs", "id": first, "result": "late"})
        assert answer["accepted"] is False
    item = store.read_item(queue="jobs", item_id=first)
    assert (item.status, item.error) == ("failed", "canceled")


async def test_an_item_canceled_while_this_socket_claims_it_again_is_left_out_though_it_held_it_before(
        token, monkeypatch):
    """The socket held the item by an earlier claim, which staff took back; its next claim brings
    the item again and a cancel comes before the socket holds it: the earlier hold does not count."""
    [item_id] = post("jobs", 1)
    store = get_store()
    real_claim = store.claim_items
    async with connected(token) as ws:
        await ask(ws, {"op": "claim", "queue": "jobs"})
        store.release_items(releases=[Release(config("jobs"), item_id, reason="staff")])

        def claim_then_cancel(**kwargs):
            items = real_claim(**kwargs)
            store.cancel_item(config=config("jobs"), item_id=item_id)
            return items

        monkeypatch.setattr(store, "claim_items", claim_then_cancel)
        claimed = await ask(ws, {"op": "claim", "queue": "jobs"})
        assert claimed["items"] == []
        answer = await ask(ws, {"op": "extend", "queue": "jobs", "id": item_id, "seconds": 5})
        assert answer["code"] == "not_held"


async def test_a_cancel_is_told_to_the_socket_that_claimed_the_item_again_after_another_lost_it(token):
    """Staff re-queue the item a first socket holds, a second claims it, the first closes: a
    cancel still reaches the second, which holds it now."""
    [item_id] = post("jobs", 1)
    async with connected(token) as second:
        async with connected(token) as first:
            await ask(first, {"op": "claim", "queue": "jobs"})
            get_store().release_items(releases=[Release(config("jobs"), item_id, reason="staff")])
            claimed = await ask(second, {"op": "claim", "queue": "jobs"})
            assert [item["id"] for item in claimed["items"]] == [item_id]
        get_store().cancel_item(config=config("jobs"), item_id=item_id)
        told = await second.receive_json_from(timeout=TIMEOUT)
        assert told == {"op": "canceled", "queue": "jobs", "id": item_id}


async def test_the_bridge_tells_the_process_whose_socket_holds_a_canceled_item():
    async with bridged_hubs() as (here, there):
        told = asyncio.get_running_loop().create_future()
        there.hold("jobs", MISSING_ID, "a-claim", lambda queue, item_id: told.set_result((queue, item_id)))
        here.item_canceled("jobs", MISSING_ID, "a-claim")  # no socket here holds it
        assert await asyncio.wait_for(told, TIMEOUT) == ("jobs", MISSING_ID)


async def test_a_cancel_from_another_process_that_comes_before_the_claim_holds_its_item_is_kept_for_it():
    async with bridged_hubs() as (here, there):
        here.item_canceled("jobs", MISSING_ID, "a-claim")  # no socket holds it yet, anywhere
        await asyncio.sleep(0.05)  # sent: a wake-up published with it would go first
        mark = there.available_mark("jobs")
        here.items_available("jobs", 1)  # after the cancel, on the same channel
        assert await there.wait_available("jobs", TIMEOUT, since=mark)
        assert there.hold("jobs", MISSING_ID, "a-claim", lambda queue, item_id: None) is False
        assert there.hold("jobs", MISSING_ID, "another-claim", lambda queue, item_id: None) is True


async def test_a_cancel_passes_over_a_socket_here_whose_claim_lapsed_for_the_one_elsewhere_holding_it():
    """A socket here held the item by a claim that lapsed; a socket in another process claimed it
    since: the cancel of that later claim is told there, not here."""
    async with bridged_hubs() as (here, there):
        loop = asyncio.get_running_loop()
        told_here, told_there = loop.create_future(), loop.create_future()
        here.hold("jobs", MISSING_ID, "first-claim", lambda queue, item_id: told_here.set_result(item_id))
        there.hold("jobs", MISSING_ID, "second-claim", lambda queue, item_id: told_there.set_result(item_id))
        here.item_canceled("jobs", MISSING_ID, "second-claim")
        assert await asyncio.wait_for(told_there, TIMEOUT) == MISSING_ID
        assert not told_here.done()


async def test_claims_waiting_on_one_socket_are_capped_and_the_socket_goes_on(token, monkeypatch):
    """Each waiting claim costs the event loop a look a second: a socket that sends thousands
    must not take the loop from everyone else."""
    monkeypatch.setattr(consumers, "MAX_WAITING_CLAIMS", 2)
    async with connected(token) as ws:
        for ref in (1, 2):
            await ws.send_json_to({"op": "claim", "queue": "jobs", "wait": 30, "ref": ref})
        over = await ask(ws, {"op": "claim", "queue": "jobs", "wait": 30, "ref": 3})
        assert (over["op"], over["ref"], over["code"]) == ("error", 3, "invalid_request")
        assert (await ask(ws, {"op": "claim", "queue": "jobs", "ref": 4}))["items"] == []  # no wait: served
        [item_id] = post("jobs", 1)
        answer = await ws.receive_json_from(timeout=TIMEOUT)  # a waiting one takes it, and ends
        assert answer["op"] == "items" and [item["id"] for item in answer["items"]] == [item_id]
        again = await ask(ws, {"op": "claim", "queue": "jobs", "wait": 0.1, "ref": 5})  # room again
        assert (again["op"], again["ref"], again["items"]) == ("items", 5, [])


@pytest.fixture
def one_try(queues):
    """`jobs` hands an item out once at most."""
    save_queue("jobs", max_attempts=1)
    get_registry().invalidate()


async def test_a_socket_drop_at_the_last_try_ends_the_item_max_attempts(one_try, token):
    [item_id] = post("jobs", 1)
    async with connected(token) as ws:
        claimed = (await ask(ws, {"op": "claim", "queue": "jobs"}))["items"][0]
        assert claimed["maxAttempts"] == 1
    item = get_store().read_item(queue="jobs", item_id=item_id)
    assert (item.status, item.error) == ("failed", "max_attempts")


@pytest.fixture
def server_stopping():
    """This process's server has begun to stop, as serve's uvicorn or daphne tells it."""
    runtime.server_stopping.set()
    yield
    runtime.server_stopping.clear()


async def _close_holding_one(token, close: str) -> str:
    """Claim the one item posted, then end the socket as `close` says; the item's id."""
    [item_id] = post("jobs", 1)
    ws = WebsocketCommunicator(application, "/work", headers=auth(token))
    await ws.connect()
    await ask(ws, {"op": "claim", "queue": "jobs"})
    if close == "cancel":  # as daphne ends every socket when it stops
        ws.future.cancel()
        with pytest.raises(asyncio.CancelledError):
            await ws.future
    else:  # code 1012 ("service restart") is what uvicorn closes every socket with when it stops
        await ws.send_input({"type": "websocket.disconnect", "code": 1012})
        await ws.wait(timeout=TIMEOUT)
    return item_id


@pytest.mark.parametrize("close", ["1012", "cancel"])
async def test_a_server_that_stops_gives_items_back_without_counting_the_try(one_try, token, server_stopping, close):
    item_id = await _close_holding_one(token, close)
    assert status("jobs", item_id) == "pending"


async def test_a_socket_ended_by_a_fault_while_the_server_stops_gives_back_without_counting_the_try(
        one_try, token, server_stopping, monkeypatch):
    """The socket's last clean-up (a handler that failed, or a second cancel after the grace)
    tells a stop from a worker's close as its first does."""
    [item_id] = post("jobs", 1)
    ws = WebsocketCommunicator(application, "/work", headers=auth(token))
    await ws.connect()
    await ask(ws, {"op": "claim", "queue": "jobs"})

    async def broken(consumer, text_data=None, bytes_data=None):
        raise RuntimeError("a fault while handling a frame")

    monkeypatch.setattr(consumers.WorkConsumer, "receive", broken)
    await ws.send_to(text_data="{}")
    with pytest.raises(RuntimeError):
        await ws.wait(timeout=TIMEOUT)
    assert status("jobs", item_id) == "pending"


@pytest.mark.parametrize("close", ["1012", "cancel"])
async def test_a_socket_ended_so_while_the_server_runs_counts_the_try(one_try, token, close):
    """A worker may close with 1012 too: that is no way around maxAttempts."""
    item_id = await _close_holding_one(token, close)
    item = get_store().read_item(queue="jobs", item_id=item_id)
    assert (item.status, item.error) == ("failed", "max_attempts")
