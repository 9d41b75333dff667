"""The bench's producer side: one keep-alive connection through the standard library's
http.client. It measures the server, not an HTTP library: httpx spends ~0.8 ms of CPU per request
here, more than the server's own work for a post. The workers use our client (taskhoster.Worker)."""

import http.client
import json
import time
from urllib.parse import urlsplit

TERMINAL = ("finished", "failed")


class LeanProducer:
    def __init__(self, url: str, token: str, *, timeout: float = 120):
        parts = urlsplit(url)
        self._connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    def _call(self, method: str, path: str, body=None) -> dict:
        data = None if body is None else json.dumps(body, separators=(",", ":"))
        self._connection.request(method, path, data, self._headers)
        answer = self._connection.getresponse()
        content = answer.read()
        if answer.status >= 400:
            raise RuntimeError(f"{method} {path} answered {answer.status}: {content[:200]!r}")
        return json.loads(content)

    def post(self, queue: str, payload) -> dict:
        return self._call("POST", f"/api/queues/{queue}/items", {"payload": payload})

    def post_many(self, queue: str, payloads: list) -> list[dict]:
        return self._call("POST", f"/api/queues/{queue}/items", {"items": [{"payload": p} for p in payloads]})["items"]

    def wait(self, queue: str, item_id: str, *, timeout: float) -> dict:
        """The item once terminal (long-polling with GET ?wait), or as it is after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            step = max(0, min(60, round(deadline - time.monotonic())))
            item = self._call("GET", f"/api/queues/{queue}/items/{item_id}?wait={step}")
            if item["status"] in TERMINAL or time.monotonic() >= deadline:
                return item

    def stats(self, queue: str) -> dict:
        return self._call("GET", f"/api/queues/{queue}")

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> "LeanProducer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
