"""The Python client's idempotency keys, against a real `serve`: post(key=), post_many(keys=),
the CLI's --key, and a Producer with post_retries that sends a post again after its answer was
lost on the way, so the item is made once."""

import asyncio
import subprocess
import sys

import httpx
import pytest

from client_support import client_env, live_server
from http_stub import Reply, StubServer
from taskhoster import ApiError, AsyncProducer, ConnectionFailed, Producer

QUEUES = {"keyed": {}, "lossy": {}, "lossy-async": {}, "cli-keyed": {}}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("keys"), QUEUES) as live:
        yield live


@pytest.fixture
def producer(live):
    with Producer(live.url, live.token) as producer:
        yield producer


def test_a_post_with_a_key_made_before_returns_that_item(producer):
    first = producer.post("keyed", {"to": "ann"}, key="welcome-ann")
    again = producer.post("keyed", {"to": "ann"}, key="welcome-ann")
    assert again["id"] == first["id"] and again["key"] == "welcome-ann"
    with pytest.raises(ApiError) as refused:
        producer.post("keyed", {"to": "bob"}, key="welcome-ann")
    assert (refused.value.code, refused.value.status) == ("key_conflict", 409)


def test_post_many_takes_one_key_per_payload_and_marks_duplicates(producer):
    [first] = producer.post_many("keyed", ["a"], keys=["many-a"])
    posted = producer.post_many("keyed", ["b", "a", "c"], keys=["many-b", "many-a", None])
    assert [item.get("duplicate", False) for item in posted] == [False, True, False]
    assert posted[1]["id"] == first["id"]
    assert "key" not in posted[2]
    with pytest.raises(ValueError, match="one key"):
        producer.post_many("keyed", ["x", "y"], keys=["only-one"])
    with pytest.raises(TypeError):
        producer.post("keyed", "x", key=5)


def test_async_producer_posts_with_keys(live):
    async def main():
        async with AsyncProducer(live.url, live.token) as producer:
            first = await producer.post("keyed", 1, key="async-1")
            again = await producer.post_many("keyed", [1, 2], keys=["async-1", "async-2"])
            return first, again

    first, again = asyncio.run(main())
    assert again[0]["id"] == first["id"] and again[0]["duplicate"] is True
    assert not again[1].get("duplicate")


def _losing_answers(live, *losing: int):
    """A stand-in for the network: passes each request to the live server, and for the POSTs
    numbered `losing` (from 1) drops the connection after the server answered, so the answer
    is lost."""
    lost, posts = [], []

    def forward(request):
        answer = httpx.request(request.method, live.url + request.target, content=request.body,
                               headers={"Authorization": request.headers["authorization"],
                                        "Content-Type": "application/json"})
        if request.method == "POST":
            posts.append(request)
            if len(posts) in losing:
                lost.append(answer.json())
                return None
        return Reply(answer.status_code, answer.json())

    return forward, lost


def test_a_producer_with_post_retries_sends_a_post_again_and_the_item_is_made_once(live, producer):
    forward, lost = _losing_answers(live, 1, 3)
    with StubServer(forward) as network, Producer(network.url, live.token, post_retries=2) as retrying:
        item = retrying.post("lossy", {"n": 1})
        [posted] = retrying.post_many("lossy", [{"n": 2}])
    assert item["id"] == lost[0]["id"]  # what the lost answer said: the server had made it
    assert posted["id"] == lost[1]["items"][0]["id"] and posted["duplicate"] is True
    assert item["key"] and posted["key"] and item["key"] != posted["key"]  # keys made for them
    assert producer.stats("lossy")["counts"]["pending"] == 2


def test_an_async_producer_with_post_retries_sends_a_post_again_and_the_item_is_made_once(live, producer):
    forward, lost = _losing_answers(live, 1, 3)

    async def main(url):
        async with AsyncProducer(url, live.token, post_retries=2) as retrying:
            item = await retrying.post("lossy-async", {"n": 1})
            [posted] = await retrying.post_many("lossy-async", [{"n": 2}])
            return item, posted

    with StubServer(forward) as network:
        item, posted = asyncio.run(main(network.url))
    assert item["id"] == lost[0]["id"]
    assert posted["id"] == lost[1]["items"][0]["id"] and posted["duplicate"] is True
    assert producer.stats("lossy-async")["counts"]["pending"] == 2


def test_without_post_retries_a_lost_answer_is_an_error_and_no_key_is_made(live, producer):
    forward, lost = _losing_answers(live, 1)
    with StubServer(forward) as network, Producer(network.url, live.token) as plain:
        with pytest.raises(ConnectionFailed):
            plain.post("lossy", {"n": 3})
        assert "key" not in lost[0]
        with pytest.raises(ValueError):
            Producer(network.url, live.token, post_retries=-1)


def test_a_post_retried_until_its_retries_run_out_raises(live):
    forward, lost = _losing_answers(live, 1, 2, 3)
    with StubServer(forward) as network, Producer(network.url, live.token, post_retries=2) as retrying:
        with pytest.raises(ConnectionFailed):
            retrying.post("lossy", {"n": 4})
    assert len({answer["id"] for answer in lost}) == 1  # three sends, one item


@pytest.mark.parametrize("last", [(503, "busy"), (500, "internal_error")])
def test_a_post_whose_answer_was_lost_and_then_refused_says_it_may_be_done_and_gives_its_key(live, producer, last):
    """The first try reached the server, its answer did not come back; the server then refuses the
    next tries (for now, or for good): the error must not say "nothing changed"."""
    lost, posts = [], []

    def forward(request):
        posts.append(request)
        if len(posts) == 1:
            lost.append(httpx.post(live.url + request.target, content=request.body,
                                   headers={"Authorization": request.headers["authorization"],
                                            "Content-Type": "application/json"}).json())
            return None
        return Reply(last[0], {"error": last[1], "message": "refused"})

    with StubServer(forward) as network, Producer(network.url, live.token, post_retries=2) as retrying:
        with pytest.raises(ConnectionFailed) as failed:
            retrying.post("lossy", {"n": 5})
    assert len(posts) == (3 if last[0] == 503 else 2) and failed.value.maybe_done
    assert "may have been carried out" in str(failed.value) and last[1] in str(failed.value)
    [key] = failed.value.keys
    again = producer.post("lossy", {"n": 5}, key=key)
    assert again["id"] == lost[0]["id"]  # the one item the first try made


def test_a_post_the_server_refuses_for_now_is_sent_again_within_post_retries(live, producer):
    posts = []

    def forward(request):
        posts.append(request)
        if len(posts) == 1:
            return Reply(503, {"error": "storage_unavailable", "message": "the disk is full"})
        answer = httpx.post(live.url + request.target, content=request.body,
                            headers={"Authorization": request.headers["authorization"],
                                     "Content-Type": "application/json"})
        return Reply(answer.status_code, answer.json())

    with StubServer(forward) as network, Producer(network.url, live.token, post_retries=1) as retrying:
        item = retrying.post("lossy", {"n": 6})
    assert len(posts) == 2 and producer.get("lossy", item["id"])["status"] == "pending"


def test_the_cli_posts_with_a_key(live, producer):
    def post(*args, stdin=""):
        return subprocess.run([sys.executable, "-m", "taskhoster.cli", "post", "cli-keyed", *args], input=stdin,
                              env=client_env(live), capture_output=True, text=True)

    first, again = post('{"n": 1}', "--key", "cli-1"), post('{"n": 1}', "--key", "cli-1")
    assert first.returncode == again.returncode == 0, first.stderr + again.stderr
    assert first.stdout == again.stdout and producer.stats("cli-keyed")["counts"]["pending"] == 1
    conflict = post('{"n": 2}', "--key", "cli-1")
    assert conflict.returncode == 1 and "key_conflict" in conflict.stderr
    several = post("--key", "cli-2", stdin="1\n2\n")
    assert several.returncode == 2 and "--key" in several.stderr
