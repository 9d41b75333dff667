"""A throw-away `redis-server` for the peers' runs: on a free port of 127.0.0.1, its files in a
directory of its own, either in memory only (no snapshots, no AOF) or durable (AOF with
`appendfsync always`: every write is fsynced before it is answered, as Taskhoster's fsync on
flushes every post and result).

    with RedisServer(tmp_dir, durable=True) as redis_server:
        redis_server.url  # redis://127.0.0.1:PORT/0
"""

import shutil
import socket
import subprocess
import time
from pathlib import Path

START_TIMEOUT = 20.0
STOP_TIMEOUT = 15.0
START_TRIES = 3  # another process may take the free port between our look and redis' bind


class RedisUnavailable(RuntimeError):
    """No redis-server to run, or it would not start."""


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise RedisUnavailable(
            "--peers needs redis-server on PATH, the bench starts its own "
            "(Debian: apt-get install redis-server; it need not run as a service)"
        )
    return found


def redis_server_version() -> str:
    done = subprocess.run([find_redis_server(), "--version"], capture_output=True, text=True, timeout=10)
    words = dict(part.split("=", 1) for part in done.stdout.split() if "=" in part)
    return words.get("v", done.stdout.strip())


class RedisServer:
    def __init__(self, directory: Path, *, durable: bool):
        self.directory = Path(directory)
        self.durable = durable
        self.port = 0
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _arguments(self) -> list[str]:
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.durable else ["--appendonly", "no"]
        return [
            find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
            "--save", "", *persistence, "--daemonize", "no", "--logfile", str(self.directory / "redis.log"),
        ]

    def start(self) -> "RedisServer":
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(START_TRIES):
            self.port = _free_port()
            self.process = subprocess.Popen(self._arguments(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._answers():
                return self
            self.stop()
        raise RedisUnavailable(f"redis-server did not start; its log:\n{self._log()[-2000:]}")

    def _answers(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as connection:
                    connection.sendall(b"PING\r\n")
                    if connection.recv(64).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def _log(self) -> str:
        path = self.directory / "redis.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
