"""HTTPS behind a TLS-ending proxy: Debian's nginx, started here with the very configuration
docs/deployment.md gives (a self-signed certificate, ports of the test's own), in front of a
real `serve` with the HTTPS settings from the environment. The admin login, the dashboard, the
API, /metrics and both WebSockets (/work and the dashboard's live feed) work through it."""

import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from serverproc import MANAGE, PROJECT_DIR, Deployment

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"
GUIDE = PROJECT_DIR / "docs" / "deployment.md"
START_TIMEOUT = 30.0
PASSWORD = "a-long-test-password-9"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def guide_site(*, listen: int, upstream: int, cert: Path, key: Path) -> str:
    """The nginx block of the deployment guide, on the test's ports and certificate."""
    [block] = re.findall(r"```nginx\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    replacements = {
        "listen 443 ssl;": f"listen 127.0.0.1:{listen} ssl;",
        "server 127.0.0.1:8000;": f"server 127.0.0.1:{upstream};",
        "server_name taskhoster.example.com;": "server_name localhost;",
        "/etc/ssl/taskhoster/fullchain.pem": str(cert),
        "/etc/ssl/taskhoster/privkey.pem": str(key),
    }
    for old, new in replacements.items():
        assert old in block, f"the guide's nginx block no longer has {old!r}"
        block = block.replace(old, new)
    return block


def self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


def start_nginx(root: Path, site: str) -> subprocess.Popen:
    (root / "site.conf").write_text(site)
    temp = {name: root / name for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
    for path in temp.values():
        path.mkdir()
    (root / "nginx.conf").write_text(
        ("user root;\n" if os.geteuid() == 0 else "")
        + f"daemon off;\nworker_processes 1;\npid {root}/nginx.pid;\nerror_log {root}/error.log info;\n"
        + "events { worker_connections 256; }\n"
        + "http {\n"
        + f"  access_log {root}/access.log;\n"
        + "".join(f"  {name}_temp_path {path};\n" if name != "body" else f"  client_body_temp_path {path};\n"
                  for name, path in temp.items())
        + f"  include {root}/site.conf;\n}}\n"
    )
    return subprocess.Popen([NGINX, "-p", str(root), "-e", str(root / "error.log"), "-c", str(root / "nginx.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_for_port(port: int, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        assert process.poll() is None, f"{what} exited: {process.stderr.read().decode() if process.stderr else ''}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"{what} did not listen on {port}")


@pytest.fixture
def proxied(tmp_path):
    """A server with the guide's HTTPS settings behind the guide's nginx: (deployment, https base
    URL, TLS context that trusts the certificate)."""
    assert Path(NGINX).exists(), (
        f"nginx is not installed at {NGINX}: this test needs Debian's package (apt-get install -y nginx), "
        "which the README's test line installs"
    )
    listen = free_port()
    origin = f"https://localhost:{listen}"
    deployment = Deployment(tmp_path / "site", extra_env={
        "ALLOWED_HOSTS": "localhost,127.0.0.1",
        "CSRF_TRUSTED_ORIGINS": origin,
        "SECURE_PROXY_SSL_HEADER": "HTTP_X_FORWARDED_PROTO,https",
        "SESSION_COOKIE_SECURE": "on",
        "CSRF_COOKIE_SECURE": "on",
        "SECURE_HSTS_SECONDS": "3600",
        "DJANGO_SUPERUSER_PASSWORD": PASSWORD,
    })
    deployment.prepare(queues=["jobs"])
    deployment.manage("createsuperuser", "--noinput", "--username", "operator", "--email", "op@example.com")
    cert, key = self_signed(tmp_path)
    context = ssl.create_default_context(cafile=str(cert))
    (tmp_path / "nginx").mkdir()
    with deployment.server() as server:
        nginx = start_nginx(tmp_path / "nginx", guide_site(listen=listen, upstream=server.port, cert=cert, key=key))
        try:
            wait_for_port(listen, nginx, "nginx")
            yield deployment, origin, context
        finally:
            nginx.send_signal(signal.SIGQUIT)
            try:
                nginx.wait(10)
            except subprocess.TimeoutExpired:
                nginx.kill()
                nginx.wait()


def log_in(browser: httpx.Client, origin: str) -> None:
    page = browser.get("/admin/login/?next=/")
    assert page.status_code == 200
    csrf = browser.cookies["csrftoken"]
    answer = browser.post(
        "/admin/login/?next=/",
        data={"csrfmiddlewaretoken": csrf, "username": "operator", "password": PASSWORD, "next": "/"},
        headers={"Origin": origin, "Referer": f"{origin}/admin/login/?next=/"},
    )
    assert answer.status_code == 302, answer.text[:2000]
    assert answer.headers["location"] == "/"


def test_admin_dashboard_api_and_sockets_work_through_the_tls_proxy(proxied):
    deployment, origin, context = proxied
    with httpx.Client(base_url=origin, verify=context, timeout=10) as browser:
        login_page = browser.get("/admin/login/")
        assert login_page.headers["strict-transport-security"] == "max-age=3600"
        assert "secure" in login_page.headers["set-cookie"].lower()  # the CSRF cookie: HTTPS only
        log_in(browser, origin)
        session = next(c for c in browser.cookies.jar if c.name == "sessionid")
        assert session.secure
        dashboard = browser.get("/")
        assert dashboard.status_code == 200 and "jobs" in dashboard.text
        assert browser.get("/admin/queues/queue/").status_code == 200
        assert browser.get("/metrics").status_code == 200  # staff read the metrics

        api = {"Authorization": f"Bearer {deployment.token}"}
        posted = browser.post("/api/queues/jobs/items", json={"payload": {"n": 1}}, headers=api)
        assert posted.status_code == 201
        item_id = posted.json()["id"]

        host = origin.removeprefix("https://")
        with connect(f"wss://{host}/work", ssl=context, additional_headers=api) as worker:
            worker.send(json.dumps({"op": "claim", "queue": "jobs", "ref": 1}))
            answer = json.loads(worker.recv(timeout=10))
            assert [item["id"] for item in answer["items"]] == [item_id]
            worker.send(json.dumps({"op": "result", "queue": "jobs", "id": item_id, "result": "ok", "ref": 2}))
            assert json.loads(worker.recv(timeout=10))["accepted"] is True

        cookie = f"sessionid={session.value}"
        with connect(f"wss://{host}/dashboard/live", ssl=context,
                     additional_headers={"Cookie": cookie, "Origin": origin}) as live:
            snapshot = json.loads(live.recv(timeout=10))
            assert snapshot["type"] == "snapshot"
            [jobs] = [q for q in snapshot["queues"] if q["name"] == "jobs"]
            assert jobs["counts"]["finished"] == 1


@pytest.mark.parametrize("value", ["X-Forwarded-Proto: https", "HTTP_X_FORWARDED_PROTO"])
def test_a_proxy_header_setting_not_of_the_form_name_value_stops_the_start(tmp_path, value):
    env = Deployment(tmp_path).environ() | {"SECURE_PROXY_SSL_HEADER": value}
    done = subprocess.run([sys.executable, str(MANAGE), "check"], cwd=PROJECT_DIR, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "SECURE_PROXY_SSL_HEADER" in done.stderr and "HTTP_X_FORWARDED_PROTO,https" in done.stderr


def test_the_https_settings_are_read_from_the_environment(tmp_path):
    env = Deployment(tmp_path).environ() | {
        "CSRF_TRUSTED_ORIGINS": "https://a.example,https://b.example",
        "SECURE_PROXY_SSL_HEADER": "HTTP_X_FORWARDED_PROTO,https",
        "SESSION_COOKIE_SECURE": "on",
        "CSRF_COOKIE_SECURE": "on",
        "SECURE_HSTS_SECONDS": "60",
    }
    names = ["CSRF_TRUSTED_ORIGINS", "SECURE_PROXY_SSL_HEADER", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE",
             "SECURE_HSTS_SECONDS"]
    script = ("import json, django; django.setup(); from django.conf import settings; "
              f"print(json.dumps([getattr(settings, n) for n in {names!r}]))")
    done = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_DIR, env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == [
        ["https://a.example", "https://b.example"], ["HTTP_X_FORWARDED_PROTO", "https"], True, True, 60
    ]
    defaults = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_DIR, env=Deployment(tmp_path).environ(),
                              capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(defaults.stdout) == [[], None, False, False, 0]  # Django's own defaults
