"""The producers' HTTP connections (taskhoster/wire.py) against a stub server that counts what
reaches it: keep-alive, a server that closes idle connections, what is sent again and what never
is, answers framed every way HTTP/1.1 allows, TLS, timeouts, threads. Each test runs with
Producer and AsyncProducer alike. Nothing here is timed for speed."""

import asyncio
import datetime
import ipaddress
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest

from http_stub import Reply, Request, StubServer
from taskhoster import AsyncProducer, ConnectionFailed, Producer, TaskhosterError
from taskhoster.pools import AsyncConnection, Connection

ITEM = {"id": "01a23252-c304-712d-850a-991c3ae0d82e", "queue": "jobs", "status": "pending"}


def item_back(request: Request) -> Reply:
    return Reply(201 if request.method == "POST" else 200, ITEM)


class Blocking:
    """An AsyncProducer called like a Producer: each call runs to its end on one event loop, which
    runs only during calls, as the loop of a program that awaits one call at a time would."""

    def __init__(self, producer: AsyncProducer, loop: asyncio.AbstractEventLoop):
        self._producer = producer
        self._loop = loop

    def __getattr__(self, name):
        method = getattr(self._producer, name)
        return lambda *args, **kwargs: self._loop.run_until_complete(method(*args, **kwargs))

    def close(self) -> None:
        self._loop.run_until_complete(self._producer.aclose())


@pytest.fixture(params=["Producer", "AsyncProducer"])
def make_producer(request):
    """make_producer(url, timeout=...): a Producer, or an AsyncProducer called as one."""
    loop = asyncio.new_event_loop()
    made = []

    def make(url: str, **kwargs):
        if request.param == "Producer":
            producer = Producer(url, "th_test", **kwargs)
        else:
            producer = Blocking(AsyncProducer(url, "th_test", **kwargs), loop)
        made.append(producer)
        return producer

    yield make
    for producer in made:
        producer.close()
    loop.close()


@pytest.fixture
def request_crosses_the_close(monkeypatch):
    """Let the client send on an idle connection without first looking whether the server closed
    it: as when the server's close is still on its way while the request goes out."""
    monkeypatch.setattr(Connection, "usable", lambda self, now: True)
    monkeypatch.setattr(AsyncConnection, "usable", lambda self, now, loop: True)


def posts(stub: StubServer) -> list[Request]:
    return [request for request in stub.requests if request.method == "POST"]


# ---- keep-alive ---------------------------------------------------------------------------------


def test_many_calls_share_one_kept_alive_connection(make_producer):
    with StubServer(item_back) as stub:
        producer = make_producer(stub.url)
        for _ in range(50):
            assert producer.post("jobs", {"n": 1}) == ITEM
            assert producer.get("jobs", ITEM["id"]) == ITEM
    assert len(stub.requests) == 100
    assert stub.connections == 1


def test_requests_carry_the_token_and_go_under_the_url_s_path(make_producer):
    with StubServer(item_back) as stub:
        producer = make_producer(stub.url + "/taskhoster/")
        producer.post("jobs", {"n": 1})
        producer.get("jobs", "a b", wait=1.5, payload=True)
    post, get = stub.requests
    assert (post.method, post.target) == ("POST", "/taskhoster/api/queues/jobs/items")
    assert post.headers["authorization"] == "Bearer th_test"
    assert post.headers["content-type"] == "application/json"
    assert post.body == b'{"payload":{"n":1}}'
    assert (get.method, get.target) == ("GET", "/taskhoster/api/queues/jobs/items/a%20b?wait=1.5&payload=1")
    assert get.headers["host"] == f"127.0.0.1:{stub.port}" and "content-length" not in get.headers


def test_threads_sharing_a_producer_each_get_their_own_connection():
    with StubServer(item_back) as stub, Producer(stub.url, "th_test") as producer:
        def post_many():
            for n in range(50):
                assert producer.post("jobs", n) == ITEM

        threads = [threading.Thread(target=post_many) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert sorted(request.json()["payload"] for request in stub.requests) == sorted(list(range(50)) * 8)
    assert 1 <= stub.connections <= 8


# ---- a server's close, and what is sent again --------------------------------------------------


@pytest.mark.parametrize("method", ["POST", "GET"])
@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_a_call_after_the_server_closed_the_idle_connection_goes_out_once_on_a_new_one(make_producer, method,
                                                                                        reset):
    with StubServer(item_back) as stub:
        producer = make_producer(stub.url)
        producer.post("jobs", 1)
        assert stub.close_idle(reset=reset) == 1  # the server's keep-alive limit, between two calls
        call = (lambda: producer.post("jobs", 2)) if method == "POST" else (lambda: producer.get("jobs", ITEM["id"]))
        assert call() == ITEM
    assert [request.method for request in stub.requests] == ["POST", method]
    assert stub.connections == 2


def test_a_post_the_server_read_and_then_closed_on_is_never_sent_again(make_producer):
    def read_then_close(request: Request) -> Reply | None:
        return None if request.method == "POST" else item_back(request)

    with StubServer(read_then_close) as stub:
        producer = make_producer(stub.url)
        with pytest.raises(ConnectionFailed, match="closed the connection without answering.*not sent again"):
            producer.post("jobs", "fresh connection")
        producer.get("jobs", ITEM["id"])
        with pytest.raises(ConnectionFailed, match="not sent again"):
            producer.post("jobs", "reused connection")  # reused: still not sent again
    assert [request.json()["payload"] for request in posts(stub)] == ["fresh connection", "reused connection"]


def test_a_post_whose_writing_failed_is_sent_once_more_on_a_new_connection(make_producer, request_crosses_the_close):
    with StubServer(item_back) as stub:
        producer = make_producer(stub.url)
        producer.post("jobs", 1)
        stub.close_idle(reset=True)  # the request then meets a reset connection: writing it fails
        assert producer.post("jobs", 2) == ITEM
    assert [request.json()["payload"] for request in posts(stub)] == [1, 2]
    assert stub.connections == 2


def test_a_post_written_in_full_before_the_close_showed_is_not_sent_again(make_producer, request_crosses_the_close):
    # The server never read it here, but the client cannot tell this from a server that read it
    # and closed: it does not send it again, and says so.
    with StubServer(item_back) as stub:
        producer = make_producer(stub.url)
        producer.post("jobs", 1)
        stub.close_idle()
        with pytest.raises(ConnectionFailed, match="may have been carried out"):
            producer.post("jobs", 2)
        assert producer.post("jobs", 3) == ITEM  # the next call opens a new connection
    assert [request.json()["payload"] for request in posts(stub)] == [1, 3]


def test_a_get_cut_off_before_its_answer_on_a_reused_connection_is_asked_once_more(make_producer,
                                                                                   request_crosses_the_close):
    with StubServer(item_back) as stub:
        producer = make_producer(stub.url)
        producer.post("jobs", 1)
        stub.close_idle()
        assert producer.get("jobs", ITEM["id"]) == ITEM
    assert [request.method for request in stub.requests] == ["POST", "GET"]
    assert stub.connections == 2


def test_a_get_is_asked_again_at_most_once(make_producer):
    def close_on_gets(request: Request) -> Reply | None:
        return None if request.method == "GET" else item_back(request)

    with StubServer(close_on_gets) as stub:
        producer = make_producer(stub.url)
        producer.post("jobs", 1)
        with pytest.raises(ConnectionFailed, match="closed the connection without answering"):
            producer.get("jobs", ITEM["id"])
    assert [request.method for request in stub.requests] == ["POST", "GET", "GET"]


# ---- how an answer ends ------------------------------------------------------------------------


def answer(head: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + head + b"\r\n" + body


CHUNKED = answer(b"Transfer-Encoding: chunked\r\n", b"5\r\n{\"id\"\r\n3\r\n:\"a\r\n2\r\n\"}\r\n0\r\n\r\n")
EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + answer(b"Content-Length: 10\r\n", b'{"id":"a"}')
UNTIL_CLOSE = answer(b"Connection: close\r\n", b'{"id":"a"}')
SAYS_CLOSE = answer(b"Connection: close\r\nContent-Length: 10\r\n", b'{"id":"a"}')


@pytest.mark.parametrize(("raw", "close", "connections"), [
    (CHUNKED, False, 1),
    (EARLY_HINTS, False, 1),
    (UNTIL_CLOSE, True, 3),
    (SAYS_CLOSE, True, 3),
], ids=["chunked", "interim answer first", "body until the close", "Connection: close"])
def test_answers_framed_every_way_http_allows(make_producer, raw, close, connections):
    with StubServer(lambda request: Reply(raw=raw, close=close)) as stub:
        producer = make_producer(stub.url)
        for _ in range(3):
            assert producer.get("jobs", "a") == {"id": "a"}
    assert stub.connections == connections


def test_an_answer_cut_off_in_its_middle_is_a_connection_failure(make_producer):
    cut = answer(b"Content-Length: 100\r\n", b'{"id":')
    with StubServer(lambda request: Reply(raw=cut, close=True)) as stub:
        producer = make_producer(stub.url)
        with pytest.raises(ConnectionFailed, match="in the middle of its answer.*not sent again"):
            producer.post("jobs", 1)
    assert len(stub.requests) == 1


def test_an_answer_that_is_not_http_is_a_connection_failure(make_producer):
    with StubServer(lambda request: Reply(raw=b"SSH-2.0-OpenSSH_9.6\r\n", close=True)) as stub:
        producer = make_producer(stub.url)
        with pytest.raises(ConnectionFailed, match="did not answer in HTTP/1.1"):
            producer.get("jobs", "a")


# ---- TLS ---------------------------------------------------------------------------------------


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key: made with the cryptography package,
    or with the openssl command where that is missing."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert),
                        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                    x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(private.public_key()), critical=False)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return cert, key


@pytest.fixture
def tls_stub(tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    with StubServer(item_back, tls=context) as stub:
        yield stub, cert


def test_https_keeps_its_connection_alive_too(make_producer, tls_stub, monkeypatch):
    stub, cert = tls_stub
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the client trusts the system's CAs, and this
    producer = make_producer(stub.url)
    for n in range(5):
        assert producer.post("jobs", n) == ITEM
    stub.close_idle()
    assert producer.get("jobs", ITEM["id"]) == ITEM
    assert [request.method for request in stub.requests] == ["POST"] * 5 + ["GET"]
    assert stub.connections == 2


def test_https_to_a_server_whose_certificate_is_not_trusted_fails_clearly(make_producer, tls_stub, monkeypatch):
    stub, _ = tls_stub
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    producer = make_producer(stub.url)
    with pytest.raises(ConnectionFailed, match=f"cannot reach {stub.url}: .*certificate verify failed"):
        producer.post("jobs", 1)
    assert stub.requests == []


# ---- timeouts, the end ------------------------------------------------------------------------


def test_a_server_that_does_not_answer_in_time_fails_the_call(make_producer):
    def slow(request: Request) -> Reply:
        time.sleep(1.0)
        return item_back(request)

    with StubServer(slow) as stub:
        producer = make_producer(stub.url, timeout=0.2)
        with pytest.raises(ConnectionFailed, match="did not answer the POST within 0.2 s"):
            producer.post("jobs", 1)
    assert len(stub.requests) == 1


def test_a_long_poll_gets_its_wait_on_top_of_the_timeout(make_producer):
    def held(request: Request) -> Reply:
        time.sleep(0.6)  # as the server holds a GET ?wait until the item ends
        return item_back(request)

    with StubServer(held) as stub:
        producer = make_producer(stub.url, timeout=0.2)
        assert producer.get("jobs", ITEM["id"], wait=1) == ITEM
    assert stub.requests[0].target.endswith("?wait=1")


def test_a_closed_producer_refuses_calls(make_producer):
    with StubServer(item_back) as stub:
        producer = make_producer(stub.url)
        producer.post("jobs", 1)
        producer.close()
        with pytest.raises(TaskhosterError, match="closed"):
            producer.post("jobs", 2)
    assert len(stub.requests) == 1
