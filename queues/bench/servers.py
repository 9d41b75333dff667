"""Throw-away installations and real `manage.py serve` processes over them, for the bench and
the end-to-end tests.

A `Deployment` is what the server processes of one installation share: a data directory, a
database (a SQLite file under `root` unless `database_url` is given) and optionally a Redis URL.
Its settings come from here only: the caller's DATABASE_URL, REDIS_URL and TASKHOSTER_* do not
leak in. A `ServerProcess` is one `serve` of it on 127.0.0.1, on a port it picks itself (or one
you give), with serve's default HTTP server (or the one you name), with its output in a log file
under `root`.

    deployment = Deployment(tmp_path)
    deployment.prepare(queues=["jobs"])            # migrate, create the queues, keep a token
    with deployment.server(fsync=True) as server:  # started; stopped (SIGTERM) at the end
        httpx.post(f"{server.url}/api/queues/jobs/items", json={"payload": 1},
                   headers={"Authorization": f"Bearer {deployment.token}"})
        server.kill()                              # SIGKILL
        server.start()                             # again, on the same port

Queues and tokens made before a server starts are seen by it at once; made later, within a second.
"""

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PROJECT_DIR = Path(__file__).resolve().parents[2]
MANAGE = PROJECT_DIR / "manage.py"
READY_LINE = re.compile(r"ws://\S+:(\d+)/work")
START_TIMEOUT = 60.0  # generous: a busy machine starts Django slowly
STOP_TIMEOUT = 15.0


@dataclass
class Deployment:
    root: Path
    database_url: str | None = None  # default: a SQLite file under root
    redis_url: str | None = None  # default: none (the in-memory channel layer)
    extra_env: dict[str, str] = field(default_factory=dict)
    token: str = ""  # made by prepare()

    def __post_init__(self):
        self.root = Path(self.root)
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def environ(self) -> dict[str, str]:
        """The environment of every process of this deployment (settings only from here: the
        caller's DATABASE_URL, REDIS_URL and the like do not leak in)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKHOSTER_", "DJANGO_"))}
        for name in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DEBUG", "ALLOWED_HOSTS"):
            env.pop(name, None)
        env.update(
            DJANGO_SETTINGS_MODULE="taskhoster_site.settings",
            TASKHOSTER_DATA_DIR=str(self.data_dir),
            DATABASE_URL=self.database_url or f"sqlite:///{self.root / 'db.sqlite3'}",
            SECRET_KEY="a-throw-away-installation",
            PYTHONUNBUFFERED="1",
        )
        if self.redis_url:
            env["REDIS_URL"] = self.redis_url
        env.update(self.extra_env)
        return env

    def manage(self, *args: str) -> str:
        """Run a management command of this deployment; its standard output."""
        done = subprocess.run(
            [sys.executable, str(MANAGE), *args],
            cwd=PROJECT_DIR,
            env=self.environ(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def migrate(self) -> None:
        self.manage("migrate", "--no-input", "--verbosity", "0")

    def create_queue(self, name: str, *options: str) -> None:
        """`createqueue NAME [options]`, e.g. create_queue("jobs", "--lease-seconds", "5")."""
        self.manage("createqueue", name, *options)

    def create_token(self, name: str, *options: str) -> str:
        """`createtoken NAME [options]`; the token it prints."""
        return self.manage("createtoken", name, *options).strip()

    def prepare(self, *, queues: list[str]) -> None:
        """Migrate, create `queues`, and keep in `token` one that may produce and work on all."""
        self.migrate()
        for name in queues:
            self.create_queue(name)
        self.token = self.create_token("everything")

    def server(self, *, port: int = 0, server: str | None = None, fsync: bool | None = None) -> "ServerProcess":
        return ServerProcess(self, port=port, server=server, fsync=fsync)


class ServerProcess:
    """One `manage.py serve` of a deployment, with `--server server` and TASKHOSTER_FSYNC=`fsync`
    when given. `start()` returns once /healthz answers 200."""

    def __init__(self, deployment: Deployment, *, port: int = 0, server: str | None = None,
                 fsync: bool | None = None):
        self.deployment = deployment
        self.fsync = fsync
        self.port = port  # 0 until the first start has picked one; then kept for restarts
        self.server_option = ["--server", server] if server else []
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/work"

    @property
    def pid(self) -> int:
        return self.process.pid

    def environ(self) -> dict[str, str]:
        env = self.deployment.environ()
        if self.fsync is not None:
            env["TASKHOSTER_FSYNC"] = "on" if self.fsync else "off"
        return env

    def start(self) -> "ServerProcess":
        self.starts += 1
        self.log_path = self.deployment.root / f"serve-{id(self)}-{self.starts}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(MANAGE), "serve", "--host", "127.0.0.1", "--port", str(self.port),
                 *self.server_option],
                cwd=PROJECT_DIR,
                env=self.environ(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT
        self.port = self._wait_for_port(deadline)
        self._wait_for_health(deadline)
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def _wait_for_port(self, deadline: float) -> int:
        while time.monotonic() < deadline:
            found = READY_LINE.search(self.output())
            if found:
                return int(found.group(1))
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self._give_up("did not report its address")

    def _wait_for_health(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self._give_up("did not become healthy")

    def _give_up(self, what: str):
        self.kill()
        raise RuntimeError(f"serve {what}; its output:\n{self.output()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Ask the server to stop (SIGTERM, or SIGINT as Ctrl-C does); its exit code."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(sig)
        try:
            return self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"serve did not stop on signal {sig}; its output:\n{self.output()[-4000:]}")

    def peak_memory_mb(self) -> float:
        """The process's peak resident memory so far (VmHWM), in MiB."""
        status = Path(f"/proc/{self.pid}/status").read_text()
        kib = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
        return int(kib.group(1)) / 1024

    def kill(self) -> None:
        """SIGKILL: the server gets no chance to clean up."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.stop()
            except RuntimeError:
                pass  # killed instead; the test's own outcome is what matters
