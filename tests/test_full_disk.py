"""A real full disk: a `serve` process whose data directory is a 2 MiB tmpfs, filled by posts
and then by results, over HTTP and the socket. Every post answered 201 and every result accepted
stays readable, nothing is answered 500, posts stop at the free-space reserve while results go
on, and once retention frees room posts are taken again. (Mounting needs root, as CI runs.)"""

import contextlib
import json
import os
import subprocess
import time

import httpx
import pytest
from websockets.sync.client import connect

from serverproc import Deployment

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")

PAYLOAD = "p" * 30_000
RESULT = "r" * 30_000


@contextlib.contextmanager
def small_disk(path, size="2m"):
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_nothing_acknowledged_is_lost_when_the_disk_fills(tmp_path):
    deployment = Deployment(tmp_path)
    with small_disk(deployment.data_dir):
        deployment.prepare(queues=["jobs"])
        deployment.create_queue("jobs", "--lease-seconds", "600", "--retain-seconds", "3600")
        with deployment.server(fsync=True) as server, httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {deployment.token}"}, timeout=30
        ) as http:
            answers = []

            def call(method, path, **kwargs):
                answer = http.request(method, path, **kwargs)
                answers.append(answer.status_code)
                return answer

            # posts until the reserve is reached
            posted = []
            while True:
                answer = call("POST", "/api/queues/jobs/items", json={"payload": {"n": len(posted), "pad": PAYLOAD}})
                if answer.status_code != 201:
                    break
                posted.append(answer.json()["id"])
            assert answer.status_code == 503 and answer.json()["error"] == "storage_unavailable"
            assert "nearly full" in answer.json()["message"]
            assert len(posted) > 20
            health = call("GET", "/healthz")
            assert health.status_code == 503 and "nearly full" in health.json()["message"]

            # results go on below the reserve, over HTTP and the socket, until the disk is full
            claimed = [item["id"] for _ in range(3) for item in call(
                "POST", "/api/queues/jobs/claim", json={"max": 100}).json()["items"]]
            assert sorted(claimed) == sorted(posted)
            accepted, refused = {}, []
            half = len(claimed) // 2
            for item_id in claimed[:half]:
                answer = call("POST", f"/api/queues/jobs/items/{item_id}/result", json={"result": [item_id, RESULT]})
                if answer.status_code == 200 and answer.json()["accepted"]:
                    accepted[item_id] = [item_id, RESULT]
                else:
                    assert answer.json()["error"] == "storage_unavailable"
                    refused.append(item_id)
            with connect(server.ws_url, additional_headers={"Authorization": f"Bearer {deployment.token}"},
                         max_size=None) as socket:
                rest = claimed[half:]
                socket.send(json.dumps({"op": "results", "items": [
                    {"queue": "jobs", "id": item_id, "result": [item_id, RESULT]} for item_id in rest]}))
                acks = json.loads(socket.recv(timeout=30))["items"]
                for item_id, ack in zip(rest, acks):
                    if ack["accepted"]:
                        accepted[item_id] = [item_id, RESULT]
                    else:
                        assert ack["error"] == "storage_unavailable"
                        refused.append(item_id)
            assert accepted and refused  # the disk did fill while results came in

            # every acknowledged post and accepted result is readable
            for item_id in posted:
                item = call("GET", f"/api/queues/jobs/items/{item_id}?payload=1").json()
                assert item["payload"]["pad"] == PAYLOAD
                if item_id in accepted:
                    assert (item["status"], item["result"]) == ("finished", accepted[item_id])
                else:
                    assert item["status"] in ("pending", "processing")
            assert not any(status >= 500 and status != 503 for status in answers)
            assert os.listdir(deployment.data_dir / "jobs" / "quarantine") == []

            # retention frees room: posts are taken again
            deployment.create_queue("jobs", "--retain-seconds", "0")
            deadline = time.monotonic() + 20
            while call("POST", "/api/queues/jobs/items", json={"payload": 1}).status_code != 201:
                assert time.monotonic() < deadline, "posts were never taken again"
                time.sleep(0.5)
            assert call("GET", "/healthz").status_code == 200
