"""Arbitrary methods, paths, ids, query strings, bodies and tokens thrown at every route: the
answer is never a 5xx, an error is always `{"error", "message"}` JSON, and no file appears in the
data directory unless the answer was 201."""

import asyncio
import json
import math
from urllib.parse import parse_qsl, quote

import httpx
import pytest
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as fuzz_settings
from hypothesis import strategies as st

from api_support import disk_snapshot, make_token
from queues.api.handlers import router
from queues.runtime import get_registry, get_store
from queues.services import save_queue
from taskhoster_site.asgi import application
from storekit import finish, post_batch

pytestmark = pytest.mark.django_db(transaction=True)

FIELDS = ["payload", "items", "result", "seconds", "max", "wait", "x"]
ABSENT = "01939f4e-7c1e-7d3a-9f00-2b6c1d0e4f55"  # well-formed, never posted
HOSTILE = ["..", ".", "%2e%2e", "../../etc/passwd", "..\\..", "\x00", "a" * 3000, "jobs/../other", "~", " "]
numbers = st.one_of(st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.booleans())
json_values = st.recursive(
    st.one_of(st.none(), numbers, st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
payload_lists = st.lists(st.fixed_dictionaries({"payload": json_values}), max_size=3)
shaped_bodies = st.dictionaries(st.sampled_from(FIELDS), st.one_of(json_values, payload_lists), max_size=3)


def _encode(value) -> bytes:
    return json.dumps(value).encode()  # NaN and Infinity too: the API must refuse them


def _mostly(usual, *unusual):
    """`usual` about four times in five: most calls get far enough to exercise the body."""
    return st.integers(0, 9).flatmap(lambda n: usual if n < 8 else st.one_of(*unusual))


# per route, a body of the right shape (its values still arbitrary)
SHAPED = {
    "/items": st.one_of(
        st.fixed_dictionaries({"payload": json_values}),
        st.fixed_dictionaries({"items": payload_lists}),
    ),
    "/claim": st.fixed_dictionaries({}, optional={"max": numbers, "wait": st.floats(0, 0.05)}),
    "/result": st.fixed_dictionaries({"result": json_values}),
    "/extend": st.fixed_dictionaries({"seconds": numbers}),
}
arbitrary_bodies = st.one_of(
    st.just(b""), st.binary(max_size=64), json_values.map(_encode), shaped_bodies.map(_encode)
)


def bodies_for(pattern: str):
    for suffix, shaped in SHAPED.items():
        if pattern.endswith(suffix):
            return _mostly(shaped.map(_encode), arbitrary_bodies)
    return arbitrary_bodies


queries = st.one_of(
    st.just(""),
    st.text(max_size=30).map(lambda t: quote(t, safe="=&")),
    st.dictionaries(
        st.sampled_from(["wait", "payload", "x"]), st.one_of(st.text(max_size=8), numbers.map(str)), max_size=3
    ).map(lambda d: "&".join(f"{k}={quote(v, safe='')}" for k, v in d.items())),
)


def _wants_to_wait(query: str, body: bytes) -> bool:
    """True if the call asks to wait longer than a moment: the fuzz must stay fast."""
    values = [v for k, v in parse_qsl(query) if k == "wait"]
    try:
        parsed = json.loads(body)
        if isinstance(parsed, dict) and "wait" in parsed:
            values.append(parsed["wait"])
    except ValueError:
        pass
    for value in values:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(seconds) and seconds > 0.05:
            return True
    return False


@pytest.fixture
def world(transactional_db, settings):
    """Two queues, tokens of every kind, and a finished item whose id the fuzz may use."""
    settings.TASKHOSTER_FSYNC = False  # durability is not what this test is about
    get_store.cache_clear()
    save_queue("jobs")
    save_queue("other")
    tokens = [make_token("all"), make_token("p", work=False), make_token("w", produce=False)]
    tokens.append(make_token("o", queues=["other"]))
    registry = get_registry()
    registry.invalidate()
    registry.refresh()
    store = get_store()
    done = post_batch(store, "jobs", [1])[0].id
    finish(store, registry.queue("jobs"), done, 1)
    loop = asyncio.new_event_loop()
    yield {"tokens": tokens, "done": done, "loop": loop}
    loop.close()


@st.composite
def calls(draw, world):
    route = draw(st.sampled_from(router.routes))
    method = draw(_mostly(st.just(route.method), st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"])))
    segments = []
    for segment in route.pattern.split("/"):
        if segment == "{queue}":
            known = st.sampled_from(["jobs", "other"])
            segment = draw(_mostly(known, st.just("nope"), st.text(max_size=70), st.sampled_from(HOSTILE)))
        elif segment == "{item_id}":
            segment = draw(
                _mostly(
                    st.just(world["done"]), st.just(ABSENT), st.uuids().map(str), st.text(max_size=50),
                    st.sampled_from(HOSTILE),
                )
            )
        elif segment not in ("", "api", "healthz"):  # stay under the API's prefixes
            segment = draw(_mostly(st.just(segment), st.text(max_size=5)))
        # dots encoded too, or the client would resolve ".." and leave the API's prefix
        segments.append(quote(segment, safe="").replace(".", "%2E"))
    garbage = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40)
    token = draw(_mostly(st.sampled_from(world["tokens"]), st.none(), garbage))
    return method, "/".join(segments), draw(queries), draw(bodies_for(route.pattern)), token


def test_no_request_yields_a_5xx_or_an_unanswered_file(world):
    async def send(method, path, query, body, token):
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.request(method, f"{path}?{query}" if query else path, content=body, headers=headers)

    @fuzz_settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(call=calls(world))
    def check(call):
        method, path, query, body, token = call
        assume(not _wants_to_wait(query, body))
        def names() -> set[str]:  # a file moved between states keeps its name; a new mark is new
            return {name.rsplit("/", 1)[-1] for name in disk_snapshot() if "/fetched/" not in name}

        before = names()

        answer = world["loop"].run_until_complete(send(method, path, query, body, token))

        assert answer.status_code < 500, (answer.status_code, answer.text)
        if answer.status_code >= 400:
            assert set(answer.json()) == {"error", "message"}
        new = names() - before
        assert not new or answer.status_code == 201, new

    check()
