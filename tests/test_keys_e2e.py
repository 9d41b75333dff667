"""Idempotency keys across real server processes: eight client processes, half on each of two
`serve` processes sharing one data directory, post the same keys at the same moment; each key
makes exactly one item, exactly one post of each is answered 201 and every other 200 with it."""

import json
import subprocess
import sys

from serverproc import Deployment

KEYS = 30
RACERS = 8

RACER = """
import json, sys, httpx
url, token, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
    sys.stdin.readline()  # all start together
    for n in range(count):
        answer = client.post("/api/queues/keyed/items", json={"payload": {"n": n}}, headers={"Idempotency-Key": f"order-{n}"})
        print(json.dumps([n, answer.status_code, answer.json().get("id")]), flush=True)
"""


def test_racing_posts_of_one_key_through_two_servers_leave_exactly_one_item(tmp_path):
    deployment = Deployment(tmp_path / "shared")
    deployment.migrate()
    deployment.create_queue("keyed")
    token = deployment.create_token("racers")
    with deployment.server() as first, deployment.server() as second:
        racers = [
            subprocess.Popen([sys.executable, "-c", RACER, server.url, token, str(KEYS)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for server in [first, second] * (RACERS // 2)
        ]
        for racer in racers:
            racer.stdin.write("go\n")
            racer.stdin.flush()
        answers = [[json.loads(line) for line in racer.communicate(timeout=180)[0].splitlines()] for racer in racers]
    assert [len(answer) for answer in answers] == [KEYS] * RACERS
    for n in range(KEYS):
        of_key = [answer[n] for answer in answers]
        assert len({item_id for _, _, item_id in of_key}) == 1, of_key
        assert sorted(status for _, status, _ in of_key) == [200] * (RACERS - 1) + [201]
    data = deployment.data_dir / "keyed"
    assert len(list((data / "pending").iterdir())) == KEYS
    assert len(list((data / "keys").iterdir())) == KEYS
