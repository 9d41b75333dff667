"""The bench's own installations: a throw-away root holding a data directory and a SQLite
database, and `manage.py serve` processes over it on a free port of 127.0.0.1.

    deployment = Deployment(root)
    deployment.prepare(queues=["work"])          # migrate, create the queues, make a token
    with deployment.server(fsync=True, server="uvicorn") as server:   # server: None for serve's default
        ... server.url, server.pid, server.peak_memory_mb() ...
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROJECT_DIR = Path(__file__).resolve().parents[2]
MANAGE = PROJECT_DIR / "manage.py"
READY_LINE = re.compile(r"ws://\S+:(\d+)/work")
START_TIMEOUT = 60.0  # generous: a busy machine starts Django slowly
STOP_TIMEOUT = 30.0


class Deployment:
    """What the server processes of one bench installation share. Its settings come from here
    only: the caller's DATABASE_URL, REDIS_URL and TASKHOSTER_* do not leak in."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.token = ""

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def environ(self, *, fsync: bool = False) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKHOSTER_", "DJANGO_"))}
        for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DEBUG", "ALLOWED_HOSTS"):
            env.pop(name, None)
        env.update(
            DJANGO_SETTINGS_MODULE="taskhoster_site.settings",
            TASKHOSTER_DATA_DIR=str(self.data_dir),
            TASKHOSTER_FSYNC="on" if fsync else "off",
            DATABASE_URL=f"sqlite:///{self.root / 'db.sqlite3'}",
            SECRET_KEY="taskhoster-bench",
            PYTHONUNBUFFERED="1",
        )
        return env

    def manage(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, str(MANAGE), *args],
            cwd=PROJECT_DIR, env=self.environ(), capture_output=True, text=True, timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def prepare(self, *, queues: list[str]) -> None:
        """Migrate, create `queues` and a token that may produce and work on every queue."""
        self.manage("migrate", "--no-input", "--verbosity", "0")
        for name in queues:
            self.manage("createqueue", name)
        self.token = self.manage("createtoken", "bench").strip()

    def server(self, *, fsync: bool, server: str | None = None) -> "ServerProcess":
        return ServerProcess(self, fsync=fsync, server=server)


class ServerProcess:
    """One `manage.py serve` of a deployment (with `--server server` when given); `start()`
    returns once /healthz answers 200."""

    def __init__(self, deployment: Deployment, *, fsync: bool, server: str | None = None):
        self.deployment = deployment
        self.fsync = fsync
        self.server_option = ["--server", server] if server else []
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.log_path = deployment.root / f"serve-fsync-{'on' if fsync else 'off'}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self) -> "ServerProcess":
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(MANAGE), "serve", "--host", "127.0.0.1", "--port", "0", *self.server_option],
                cwd=PROJECT_DIR, env=self.deployment.environ(fsync=self.fsync), stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT
        self.port = self._wait_for_port(deadline)
        self._wait_for_health(deadline)
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_for_port(self, deadline: float) -> int:
        while time.monotonic() < deadline and self.process.poll() is None:
            found = READY_LINE.search(self.output())
            if found:
                return int(found.group(1))
            time.sleep(0.05)
        self._give_up("did not report its address")

    def _wait_for_health(self, deadline: float) -> None:
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self._give_up("did not become healthy")

    def _give_up(self, what: str):
        self.stop()
        raise RuntimeError(f"serve {what}; its output:\n{self.output()[-4000:]}")

    def peak_memory_mb(self) -> float:
        """The process's peak resident memory so far (VmHWM), in MiB."""
        status = Path(f"/proc/{self.pid}/status").read_text()
        kib = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
        return int(kib.group(1)) / 1024

    def stop(self) -> None:
        """SIGTERM, and SIGKILL if it has not stopped within STOP_TIMEOUT."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
