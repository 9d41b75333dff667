"""A blocking call run in a thread pool and awaited on the event loop. Its outcome is handed
straight back to the loop: run_in_executor chains two futures (and, under uvloop or in debug
mode, checks every call is no coroutine), and before Python 3.13 leaves its caller waiting
forever if the call raises StopIteration (an asyncio future refused that exception)."""

import asyncio
from concurrent.futures import Executor, Future
from functools import partial


def in_thread(pool: Executor, call, /, *args, **kwargs) -> asyncio.Future:
    """`call(*args, **kwargs)`, handed now to one of `pool`'s threads; its outcome, a future of
    the running loop to await. Once started it runs to its end even if the future is cancelled
    meanwhile; one not started yet never starts."""
    loop = asyncio.get_running_loop()
    work = pool.submit(call, *args, **kwargs)
    answer = _Answer(work, loop=loop)
    work.add_done_callback(partial(_hand_back, loop, answer))
    return answer


class _Answer(asyncio.Future):
    """A thread's outcome on the loop. Cancelling it cancels the work in the same instant (a
    callback a turn later could come after a thread has picked the work up)."""

    def __init__(self, work: Future, *, loop: asyncio.AbstractEventLoop):
        super().__init__(loop=loop)
        self._work = work

    def cancel(self, msg=None) -> bool:
        self._work.cancel()
        return super().cancel(msg=msg)


def _hand_back(loop: asyncio.AbstractEventLoop, answer: asyncio.Future, work: Future) -> None:
    """In the thread that ran `work` (or on the loop, if it had ended or was cancelled there)."""
    try:
        loop.call_soon_threadsafe(_settle, answer, work)
    except RuntimeError:  # the loop is closed: nobody waits for the outcome
        pass


def _settle(answer: asyncio.Future, work: Future) -> None:
    if answer.done():  # its caller was cancelled
        return
    if work.cancelled():
        answer.cancel()
    elif isinstance(error := work.exception(), StopIteration):
        failure = RuntimeError(f"a call in a thread raised {error!r}")
        failure.__cause__ = error
        answer.set_exception(failure)
    elif error is not None:
        answer.set_exception(error)
    else:
        answer.set_result(work.result())
