"""Any program as a handler: it runs once per item with the payload as JSON on stdin, and its
stdout, parsed as JSON, is the result.

A program that exits non-zero, or whose stdout is not one JSON value, fails the item with one of
these errors (the result, or with retries the item's lastError until its last try):

    {"error": {"type": "ExitStatus", "message": ..., "exitCode": 3, "stderr": "<tail>"}}
    {"error": {"type": "InvalidOutput", "message": ..., "stdout": "<tail>", "stderr": "<tail>"}}

The result is what the program printed by the time it exited: what it leaves running (a command
put in the background) does not hold the item. The program also finds the item in its
environment: TASKHOSTER_ITEM_ID, TASKHOSTER_QUEUE, TASKHOSTER_ATTEMPTS and
TASKHOSTER_MAX_ATTEMPTS (empty when the queue has no limit).
"""

import asyncio
import errno
import json
import os
import signal
import tempfile
from typing import Any

from .jobs import HandlerFailed, Job, decode

TAIL_CHARS = 2000
# a command that fails to start so will fail for every item: no such file, not executable, no #!
UNUSABLE = {errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ENOEXEC}


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
        # output into files, not pipes: what the program leaves running when it exits (a command
        # put in the background) keeps them open, and must not keep the item waiting
        with tempfile.TemporaryFile() as stdout_file, tempfile.TemporaryFile() as stderr_file:
            try:
                process = await asyncio.create_subprocess_exec(
                    *self.command,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=stdout_file,
                    stderr=stderr_file,
                    env=env,
                    # a session of its own: a Ctrl-C at the worker's terminal reaches the worker
                    # alone, which lets the command finish, as a stop does
                    start_new_session=True,
                )
            except OSError as exc:
                if exc.errno in UNUSABLE:  # so for every item
                    raise CommandUnusable(f"cannot run {self.command[0]}: {exc.strerror or exc}") from exc
                raise  # out of processes or descriptors for now, say: this item's failure
            try:
                await _feed(process.stdin, json.dumps(payload).encode() + b"\n")
                await process.wait()
            except asyncio.CancelledError:
                # the item was canceled, or the worker gave up on it: do not leave the program, or
                # what it started, behind
                _kill_group(process.pid)
                raise
            stdout, stderr = _read_all(stdout_file), _read_tail(stderr_file)
        if process.returncode != 0:
            raise HandlerFailed({
                "type": "ExitStatus",
                "message": _exit_message(self.command[0], process.returncode),
                "exitCode": process.returncode,
                "stderr": _tail(stderr),
            })
        try:
            return decode(stdout)
        except ValueError as exc:
            raise HandlerFailed({
                "type": "InvalidOutput",
                "message": f"the output of {self.command[0]} is not JSON: {exc}",
                "stdout": _tail(stdout),
                "stderr": _tail(stderr),
            }) from None


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    try:
        stdin.write(data)
        await stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program reads no input, or not all of it
    finally:
        stdin.close()


def _read_all(file) -> bytes:
    file.seek(0)
    return file.read()


def _read_tail(file) -> bytes:
    """Enough of the file's end for TAIL_CHARS characters (each at most 4 bytes as UTF-8)."""
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - 4 * TAIL_CHARS))
    return file.read()


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
