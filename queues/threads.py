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
    answer = loop.create_future()
    work = pool.submit(call, *args, **kwargs)
    work.add_done_callback(partial(_hand_back, loop, answer))
    answer.add_done_callback(partial(_give_up_unless_started, work))
    return answer


def _give_up_unless_started(work: Future, answer: asyncio.Future) -> None:
    if answer.cancelled():
        work.cancel()


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
