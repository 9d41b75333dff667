"""JSON answers, and the one mapping of a domain error to its answer."""

import json
from dataclasses import dataclass
from typing import Any

from ..exceptions import Busy, TaskhosterError

Headers = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class Answer:
    status: int
    body: Any
    headers: Headers = ()

    async def send(self, send) -> None:
        # ASCII-escaped, so any text a client sent (even a lone surrogate) encodes safely
        data = json.dumps(self.body, separators=(",", ":")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": self.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                    *self.headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})


def error_answer(status: int, code: str, message: str, headers: Headers = ()) -> Answer:
    return Answer(status, {"error": code, "message": message}, headers)


def answer_for(error: TaskhosterError, headers: Headers = ()) -> Answer:
    if isinstance(error, Busy):  # a busy answer always says when to come back
        headers = (*headers, (b"retry-after", str(error.retry_after).encode()))
    return error_answer(error.status, error.code, error.message, headers)
