"""Any program as a handler: it runs once per item with the payload as JSON on stdin, and its
stdout, parsed as JSON, is the result.

A program that exits non-zero, or whose stdout is not one JSON value, yields an in-band error
result instead:

    {"error": {"type": "ExitStatus", "message": ..., "exitCode": 3, "stderr": "<tail>"}}
    {"error": {"type": "InvalidOutput", "message": ..., "stdout": "<tail>", "stderr": "<tail>"}}

The program also finds the item in its environment: TASKHOSTER_ITEM_ID, TASKHOSTER_QUEUE and
TASKHOSTER_ATTEMPTS.
"""

import asyncio
import json
import os
import signal
from typing import Any

from .jobs import Job

TAIL_CHARS = 2000


def _tail(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")[-TAIL_CHARS:]


class ProgramHandler:
    """An async handler that runs `command` (a list: program and arguments) for each item."""

    def __init__(self, command: list[str]):
        self.command = list(command)

    async def __call__(self, payload: Any, job: Job) -> Any:
        env = {
            **os.environ,
            "TASKHOSTER_ITEM_ID": job.id,
            "TASKHOSTER_QUEUE": job.queue,
            "TASKHOSTER_ATTEMPTS": str(job.attempts),
        }
        process = await asyncio.create_subprocess_exec(
            *self.command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            stdout, stderr = await process.communicate(json.dumps(payload).encode() + b"\n")
        except asyncio.CancelledError:
            # the worker gave up on this item (grace period over): do not leave the program behind
            process.kill()
            raise
        if process.returncode != 0:
            return {"error": {
                "type": "ExitStatus",
                "message": _exit_message(self.command[0], process.returncode),
                "exitCode": process.returncode,
                "stderr": _tail(stderr),
            }}
        try:
            return json.loads(stdout)
        except ValueError as exc:
            return {"error": {
                "type": "InvalidOutput",
                "message": f"the output of {self.command[0]} is not JSON: {exc}",
                "stdout": _tail(stdout),
                "stderr": _tail(stderr),
            }}


def _exit_message(program: str, returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"{program} was killed by {name}"
    return f"{program} exited with status {returncode}"
