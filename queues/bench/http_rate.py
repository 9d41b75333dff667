"""How many posts a second the HTTP API takes, under uvicorn and under daphne.

Each server runs in a subprocess on a throw-away data directory and SQLite database, on a free
port of 127.0.0.1. One keep-alive httpx client posts single items, then 100-item batches, back to
back for a few seconds each.

    python -m queues.bench.http_rate [--seconds 3] [--servers uvicorn,daphne] [--no-fsync]
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PROJECT = Path(__file__).resolve().parents[2]
# (not uvicorn's --fd: it adopts the socket as AF_UNIX, so Nagle stays on and every answer waits
# ~40 ms for a delayed ACK)
SERVERS = {
    "uvicorn": lambda port: ["-m", "uvicorn", "--host", "127.0.0.1", "--port", str(port), "--no-access-log"],
    "daphne": lambda port: ["-m", "daphne", "-b", "127.0.0.1", "-p", str(port)],
}
APPLICATION = "taskhoster_site.asgi:application"


def manage(env: dict, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=PROJECT, env=env, check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


def prepare(directory: Path, *, fsync: bool) -> tuple[dict, str]:
    """An environment with its own data directory and database, a queue `bench` and a token."""
    env = {
        **os.environ,
        "TASKHOSTER_DATA_DIR": str(directory / "data"),
        "DATABASE_URL": f"sqlite:///{directory / 'db.sqlite3'}",
        "TASKHOSTER_FSYNC": "on" if fsync else "off",
        "SECRET_KEY": "bench",
        "LOG_LEVEL": "ERROR",
    }
    manage(env, "migrate", "--verbosity", "0")
    manage(env, "createqueue", "bench")
    return env, manage(env, "createtoken", "bench")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(url: str, server: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not become healthy")


def rate(client: httpx.Client, token: str, body: dict, seconds: float) -> float:
    """Requests per second, posting `body` back to back for `seconds`."""
    headers = {"Authorization": f"Bearer {token}"}
    done, started = 0, time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        answer = client.post("/api/queues/bench/items", json=body, headers=headers)
        if answer.status_code != 201:
            raise RuntimeError(f"post answered {answer.status_code}: {answer.text}")
        done += 1
    return done / elapsed


def measure(name: str, *, seconds: float, fsync: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="taskhoster-bench-") as tmp:
        env, token = prepare(Path(tmp), fsync=fsync)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [sys.executable, *SERVERS[name](port), APPLICATION],
            cwd=PROJECT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            wait_until_healthy(url, server)
            with httpx.Client(base_url=url, timeout=30.0) as client:
                rate(client, token, {"payload": {"warm": "up"}}, 0.5)
                single = rate(client, token, {"payload": {"n": 1, "text": "x" * 100}}, seconds)
                items = [{"payload": {"n": n, "text": "x" * 100}} for n in range(100)]
                batch = rate(client, token, {"items": items}, seconds)
        finally:
            server.terminate()
            server.wait(timeout=10)
    return {"single": single, "batch": batch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="how long to post each kind")
    parser.add_argument("--servers", default="uvicorn,daphne")
    parser.add_argument("--no-fsync", dest="fsync", action="store_false")
    args = parser.parse_args()
    print(f"TASKHOSTER_FSYNC {'on' if args.fsync else 'off'}, one keep-alive client, {args.seconds:g} s each")
    print(f"{'server':<10}{'single posts/s':>16}{'100-item batches/s':>21}{'items/s in batches':>21}")
    for name in args.servers.split(","):
        result = measure(name, seconds=args.seconds, fsync=args.fsync)
        print(f"{name:<10}{result['single']:>16.0f}{result['batch']:>21.1f}{result['batch'] * 100:>21.0f}")


if __name__ == "__main__":
    main()
