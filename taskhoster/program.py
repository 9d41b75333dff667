"""Any program as a handler: it runs once per item with the payload as JSON on stdin, and its
stdout, parsed as JSON, is the result.

A program that exits non-zero, or whose stdout is not one JSON value, fails the item with one of
these errors (the result, or with retries the item's lastError until its last try):

    {"error": {"type": "ExitStatus", "message": ..., "exitCode": 3, "stderr": "<tail>"}}
    {"error": {"type": "InvalidOutput", "message": ..., "stdout": "<tail>", "stderr": "<tail>"}}

What the program leaves running when it exits (a command put in the background) is killed a
second later if it still holds the program's output open, so the item ends with what the program
printed. The program also finds the item in its environment: TASKHOSTER_ITEM_ID, TASKHOSTER_QUEUE,
TASKHOSTER_ATTEMPTS and TASKHOSTER_MAX_ATTEMPTS (empty when the queue has no limit).
"""

import asyncio
import errno
import json
import os
import signal
from typing import Any

from .jobs import HandlerFailed, Job

TAIL_CHARS = 2000
# a command that fails to start so will fail for every item: no such file, not executable, no #!
UNUSABLE = {errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ENOEXEC}
EXITED_LOOK_SECONDS = 0.5  # while a program runs, how often to look whether it has exited
LEFT_RUNNING_SECONDS = 1.0  # then how long what it started may keep its output open


def _tail(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")[-TAIL_CHARS:]


class CommandUnusable(BaseException):
    """The command cannot be started at all. Not the item's failure but the worker's, as a
    KeyboardInterrupt is: it stops, rather than hand every item in the queue this error."""


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
            "TASKHOSTER_MAX_ATTEMPTS": "" if job.max_attempts is None else str(job.max_attempts),
        }
        try:
            process = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                # a session of its own: a Ctrl-C at the worker's terminal reaches the worker alone,
                # which lets the command finish, as a stop does
                start_new_session=True,
            )
        except OSError as exc:
            if exc.errno in UNUSABLE:  # so for every item
                raise CommandUnusable(f"cannot run {self.command[0]}: {exc.strerror or exc}") from exc
            raise  # out of processes or descriptors for now, say: this item's failure
        talking = asyncio.ensure_future(process.communicate(json.dumps(payload).encode() + b"\n"))
        try:
            while not talking.done():
                await asyncio.wait([talking], timeout=EXITED_LOOK_SECONDS)
                if process.returncode is not None and not talking.done():
                    # the program has exited, but what it left running holds its output open
                    await asyncio.wait([talking], timeout=LEFT_RUNNING_SECONDS)
                    if not talking.done():
                        _kill_group(process.pid)
            stdout, stderr = talking.result()
        except asyncio.CancelledError:
            # the item was canceled, or the worker gave up on it: do not leave the program, or
            # what it started, behind
            _kill_group(process.pid)
            talking.cancel()
            raise
        if process.returncode != 0:
            raise HandlerFailed({
                "type": "ExitStatus",
                "message": _exit_message(self.command[0], process.returncode),
                "exitCode": process.returncode,
                "stderr": _tail(stderr),
            })
        try:
            return json.loads(stdout, parse_constant=_not_json)
        except ValueError as exc:
            raise HandlerFailed({
                "type": "InvalidOutput",
                "message": f"the output of {self.command[0]} is not JSON: {exc}",
                "stdout": _tail(stdout),
                "stderr": _tail(stderr),
            }) from None


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")  # NaN and the infinities, which Python reads as numbers


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the program leads its own group (start_new_session)
    except ProcessLookupError:
        pass  # it ended meanwhile


def _exit_message(program: str, returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"{program} was killed by {name}"
    return f"{program} exited with status {returncode}"
