"""The log: one line per HTTP request and per socket session, with its duration and outcome;
TASKHOSTER_LOG_FORMAT=json writes one JSON object per line, TASKHOSTER_LOG_LEVEL filters."""

import asyncio
import json
import logging
import subprocess
import sys

import httpx
import pytest
from channels.testing import WebsocketCommunicator

from api_support import api, bearer, queues, tokens  # noqa: F401  (fixtures)
from serverproc import MANAGE, PROJECT_DIR, Deployment
from queues.access import AccessLog
from queues.serving.stopping import AnswerWhenCut
from taskhoster_site.asgi import application
from taskhoster_site.logs import JsonFormatter, TextFormatter, logging_config

ACCESS = "taskhoster.access"


@pytest.fixture
def access(caplog):
    caplog.set_level(logging.INFO, logger=ACCESS)
    return lambda: [r for r in caplog.records if r.name == ACCESS]


@pytest.mark.django_db(transaction=True)
async def test_each_http_request_is_one_line_with_its_status_and_duration(api, queues, tokens, access):
    answer = await api.post("/api/queues/jobs/items", json={"payload": 1}, headers=bearer(tokens["producer"]))
    await api.get(f"/api/queues/jobs/items/{answer.json()['id']}?wait=0", headers=bearer(tokens["producer"]))
    await api.get("/api/queues/jobs", headers=bearer("th_" + "x" * 32))
    lines = access()
    assert [(r.fields["method"], r.fields["status"]) for r in lines] == [("POST", 201), ("GET", 200), ("GET", 401)]
    assert all(r.fields["durationMs"] >= 0 and r.fields["kind"] == "http" for r in lines)
    assert lines[1].fields["path"] == f"/api/queues/jobs/items/{answer.json()['id']}"  # no query string
    assert lines[0].getMessage().startswith("POST /api/queues/jobs/items 201 ")


@pytest.mark.django_db(transaction=True)
async def test_each_socket_session_is_one_line_when_it_ends_and_the_token_is_not_in_it(queues, tokens, access):
    token = tokens["worker"]
    ws = WebsocketCommunicator(application, f"/work?token={token}")
    assert (await ws.connect())[0]
    await ws.send_json_to({"op": "claim", "queue": "jobs"})
    await ws.receive_json_from(timeout=3)
    await ws.disconnect(code=1000)
    refused = WebsocketCommunicator(application, "/nowhere")
    assert not (await refused.connect())[0]
    await refused.disconnect()
    first, second = access()
    assert first.fields | {"durationMs": 0, "client": "-"} == {
        "kind": "websocket", "path": "/work", "outcome": "closed by the client (1000)", "accepted": True,
        "closedBy": "client", "code": 1000, "framesIn": 1, "framesOut": 1, "durationMs": 0, "client": "-",
    }
    assert second.fields["outcome"] == "refused"
    assert all(token not in r.getMessage() and token not in json.dumps(r.fields) for r in (first, second))


def test_the_json_format_is_one_object_per_line_with_the_record_fields():
    try:
        raise ValueError("two\nlines")
    except ValueError:
        record = logging.getLogger("x").makeRecord(
            "x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info(), extra={"fields": {"status": 500}}
        )
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert (entry["level"], entry["logger"], entry["message"], entry["status"]) == ("ERROR", "x", "failed here", 500)
    assert entry["time"].endswith("Z") and "ValueError: two\nlines" in entry["exception"]


def test_the_level_and_format_make_the_logging_setting():
    config = logging_config("WARNING", "json")
    assert config["root"]["level"] == "WARNING"
    assert config["formatters"]["chosen"]["()"].endswith("JsonFormatter")
    assert logging_config("INFO", "text")["formatters"]["chosen"]["()"].endswith("TextFormatter")


def test_a_text_line_has_the_utc_time_to_the_millisecond_the_level_and_the_logger():
    record = logging.getLogger("x").makeRecord("x", logging.INFO, __file__, 1, "hello %s", ("there",), None)
    formatter = TextFormatter()
    record.created = 1_796_000_000.25
    assert formatter.format(record) == "2026-11-30 00:53:20.250Z INFO x: hello there"
    record.created += 61.5  # another second: its own date and time, not the one made before
    assert formatter.format(record).startswith("2026-11-30 00:54:21.750Z ")


@pytest.mark.django_db(transaction=True)
async def test_a_path_with_control_characters_is_one_text_line_not_a_forged_second(api, access):
    """A path is logged as the server decoded it: %0A would otherwise start a line of the
    sender's own making."""
    await api.get("/x%0A2026-01-01 00:00:00.000Z INFO taskhoster.access: POST /admin/ 200%0D%09%1B")
    (line,) = [TextFormatter().format(record) for record in access()]
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line.endswith(" INFO taskhoster.access: GET /x\\n2026-01-01 00:00:00.000Z INFO taskhoster.access: "
                         "POST /admin/ 200\\r\\t\\x1b 404 " + line.split(" 404 ")[1])


def test_every_line_breaker_in_a_message_is_escaped():
    record = logging.getLogger("x").makeRecord("x", logging.INFO, __file__, 1, "%s", ("a\x85b\u2028c\u2029d\x0be",), None)
    line = TextFormatter().format(record)
    assert len(line.splitlines()) == 1 and line.endswith("a\\x85b\\u2028c\\u2029d\\x0be")


def test_a_traceback_keeps_its_lines_after_a_one_line_message():
    try:
        raise ValueError("broken")
    except ValueError:
        record = logging.getLogger("x").makeRecord("x", logging.ERROR, __file__, 1, "a\nb", (), sys.exc_info())
    text = TextFormatter().format(record)
    assert text.splitlines()[0].endswith("ERROR x: a\\nb") and text.splitlines()[-1] == "ValueError: broken"


@pytest.mark.parametrize(("name", "value"), [("TASKHOSTER_LOG_LEVEL", "LOUD"), ("TASKHOSTER_LOG_FORMAT", "xml")])
def test_a_bad_log_setting_stops_the_start_with_what_to_set(tmp_path, name, value):
    env = Deployment(tmp_path).environ() | {name: value}
    done = subprocess.run([sys.executable, str(MANAGE), "check"], cwd=PROJECT_DIR, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert name in done.stderr and value in done.stderr


def test_a_served_process_logs_json_lines_at_the_level_asked(tmp_path):
    deployment = Deployment(tmp_path, extra_env={"TASKHOSTER_LOG_FORMAT": "json"})
    deployment.prepare(queues=["jobs"])
    with deployment.server() as server:
        posted = httpx.post(f"{server.url}/api/queues/jobs/items", json={"payload": 1},
                            headers={"Authorization": f"Bearer {deployment.token}"})
        assert posted.status_code == 201
        assert server.stop() == 0
    entries = [json.loads(line) for line in server.output().splitlines() if line.startswith("{")]
    posts = [e for e in entries if e.get("kind") == "http" and e["method"] == "POST"]
    assert [(e["path"], e["status"], e["logger"], e["level"]) for e in posts] == [
        ("/api/queues/jobs/items", 201, ACCESS, "INFO")
    ]
    quiet = Deployment(tmp_path / "quiet", extra_env={"TASKHOSTER_LOG_LEVEL": "WARNING"})
    quiet.prepare(queues=["jobs"])
    with quiet.server() as server:
        httpx.get(f"{server.url}/api/queues/jobs", headers={"Authorization": f"Bearer {quiet.token}"})
        assert server.stop() == 0
    assert "taskhoster.access" not in server.output() and "/api/queues/jobs" not in server.output()


def _http_scope(path: str, query: bytes = b"", headers: dict[str, str] | None = None) -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
        "headers": [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
    }


async def _cut(app, scope: dict, receive) -> list[dict]:
    """Run a request until it waits, then cancel it as a stop does: what the server was sent."""
    sent = []

    async def send(message):
        sent.append(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    for _ in range(20):  # let it reach its wait: a cut before then is answered the same
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return sent


@pytest.mark.django_db(transaction=True)
async def test_a_request_cut_by_a_stop_is_answered_503_and_logged_with_it(api, queues, tokens, access):
    posted = await api.post("/api/queues/jobs/items", json={"payload": 1}, headers=bearer(tokens["producer"]))
    item_path = f"/api/queues/jobs/items/{posted.json()['id']}"
    asked = asyncio.Event()

    async def receive():
        if not asked.is_set():
            asked.set()
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client stays

    scope = _http_scope(item_path, b"wait=30", bearer(tokens["producer"]))
    sent = await _cut(application, scope, receive)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
    line = access()[-1]
    assert (line.fields["path"], line.fields["status"]) == (item_path, 503)


async def test_a_request_whose_client_left_is_not_answered_when_cut_and_logged_so(access):
    async def waits_on_after_the_client_left(scope, receive, send):
        while (await receive())["type"] != "http.disconnect":
            pass
        await asyncio.Event().wait()  # as a view that never looks again

    messages = iter([{"type": "http.request", "body": b"", "more_body": False}, {"type": "http.disconnect"}])

    async def receive():
        return next(messages)

    sent = await _cut(AccessLog(AnswerWhenCut(waits_on_after_the_client_left)), _http_scope("/api/queues"), receive)
    assert sent == []
    line = access()[-1]
    assert (line.fields["status"], line.getMessage().split()[2:4]) == (None, ["no", "answer"])
