"""Shared by the client, CLI and README tests: a live `serve` process with the queues a test
module needs, and the environment a client process runs with."""

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from serverproc import PROJECT_DIR, Deployment, ServerProcess


@dataclass
class Live:
    deployment: Deployment
    server: ServerProcess
    token: str

    @property
    def url(self) -> str:
        return self.server.url


# Every queue and the token in one manage.py run: one Django start instead of one per queue.
SETUP = """
import json
from queues.models import ApiToken
from queues.services import save_queue
for name, settings in json.loads(QUEUES).items():
    save_queue(name, **settings)
token = ApiToken(name="client-tests")
raw = token.set_new_value()
token.save()
print(raw)
"""


@contextmanager
def live_server(root: Path, queues: dict[str, dict]):
    """A started server with these queues (`{"jobs": {}, "slow": {"lease_seconds": 2}}`) and a
    token that may produce and work on all of them. fsync is off: these tests are about the
    client, not about power loss."""
    deployment = Deployment(root, extra_env={"TASKHOSTER_FSYNC": "0"})
    with deployment.server() as server:  # serve migrates the database itself
        output = deployment.manage("shell", "--no-imports", "-c", SETUP.replace("QUEUES", repr(json.dumps(queues))))
        token = output.split()[-1]
        _wait_until_served(server.url, token, set(queues))
        yield Live(deployment, server, token)


def _wait_until_served(url: str, token: str, queues: set[str]) -> None:
    """Queues and tokens made while the server runs reach it within a second."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answer = httpx.get(f"{url}/api/queues", headers={"Authorization": f"Bearer {token}"}, timeout=5)
        if answer.status_code == 200 and queues <= {queue["name"] for queue in answer.json()["queues"]}:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the server did not see the queues {sorted(queues)} and the token")


def client_env(live: Live | None = None, **extra: str) -> dict[str, str]:
    """The environment of a client process: the project importable, TASKHOSTER_URL and
    TASKHOSTER_TOKEN set to the live server's (when given), and nothing of the caller's
    TASKHOSTER_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKHOSTER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_DIR), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    if live is not None:
        env["TASKHOSTER_URL"] = live.url
        env["TASKHOSTER_TOKEN"] = live.token
    env.update(extra)
    return env

