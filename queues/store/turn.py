"""Where a transition runs, and where its waits go.

On the event loop (`on_loop`): a transition runs in a greenlet of the loop's thread, and makes
its file calls and flushes there too. A thread working beside the loop would hand Python's GIL
back and forth with it at every file call, and waking a thread for each flush waits for a free
core on a busy machine: each costs more than the flush. Flushes are the waits transitions make
together (`together`): a transition asking for one sleeps while the loop goes on with what else
is ready, then one call flushes what every transition asked in that turn of the loop (files all
sent on their way before each is waited for, a directory once); after a gathering nobody else
joined, the next few run at once (AT_ONCE_AFTER_ALONE), but not one after the transition woke a
claim (`let_woken_go_first`): the claim runs first, and its worker works while the disk flushes.
A wait for a lock of this process (`wait_for`) holds neither the loop nor a thread: the holder
settles a future; one for another process's lock (`aside`) holds a thread of its own. So the loop
stops while the disk flushes, as the flush's own caller would, and a disk that never answers
stops it.

In threads (`taking`): of the threads running transitions (big batches), one at a time runs, for
the same reason, and it lets another run while it waits for the disk or for a lock. The turn
guards no data, so code may always run without it (the sweep does). What keeps it from
deadlocking: a thread lets go of it around every wait that a holder of the turn could be the
cause of (item and key locks, flushes, another's flush of the same directory), and takes it back
holding no plain lock that such a holder might wait on. That rule keeps a transition on the loop
from blocking the loop for good too: it never sleeps holding a plain lock.
"""

import asyncio
import copy
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any, TypeVar

import greenlet

T = TypeVar("T")

# after a gathering of waits that nobody joined, the next ones run at once (gathering costs the
# lone caller a turn of the loop) until one is gathered again, to see whether others come now
AT_ONCE_AFTER_ALONE = 8

_turn = threading.Lock()
_held = threading.local()


class _OnLoop(greenlet.greenlet):
    """A transition running on the event loop; `ended` settles with its outcome."""

    ended: asyncio.Future
    woke_others = False  # its next wait for the disk is gathered (let_woken_go_first)


def taking(call: Callable[..., T], /, **kwargs) -> T:
    """Call `call(**kwargs)` in the turn: wait for it, run, let go."""
    with _turn:
        _held.turn = True
        try:
            return call(**kwargs)
        finally:
            _held.turn = False


def outside(call: Callable[..., T], /, *args) -> T:
    """Call `call(*args)`, a wait for the disk, out of the turn if this thread has it (a
    transition on the loop never does: there the loop waits)."""
    if not getattr(_held, "turn", False):
        return call(*args)
    _held.turn = False
    _turn.release()
    try:
        return call(*args)
    finally:
        _turn.acquire()
        _held.turn = True


def together(call: Callable[[list], list], request: object) -> Any:
    """What `call` answers to `request`, a wait for the disk others may join (flushes of files
    and directories). `call` takes a list of requests and returns one outcome for each, in
    order: a value, or an exception to raise. From a transition on the loop, `call` runs once
    for every transition that asked it (the same `call`: equal bound methods are one) in the
    same turn of the loop, after them, while others have been coming (else at once); from a
    thread, out of the turn, for this request alone. Either way `call` has returned before any
    transition that asked goes on, so what a request holds (a file's descriptor) stays open."""
    current = greenlet.getcurrent()
    if isinstance(current, _OnLoop):
        on_this_loop = _OnThisLoop.of(asyncio.get_running_loop())
        if current.woke_others or on_this_loop.gathering():
            current.woke_others = False
            return _suspend((call, request))
        (outcome,) = _answers(call, [request])
    else:
        (outcome,) = outside(_answers, call, [request])
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def _answers(call: Callable[[list], list], requests: list) -> list:
    """`call(requests)`, checked to answer each request once; what it raised, for each."""
    try:
        outcomes = list(call(requests))
        if len(outcomes) != len(requests):  # a transition left without one would sleep for good
            raise RuntimeError(f"{call!r} answered {len(outcomes)} of {len(requests)} requests")
    except BaseException as error:
        outcomes = [error] * len(requests)
    return outcomes


def wait_for(future: Future) -> Any:
    """What `future` (settled by another thread or transition) comes to: from a transition on
    the loop, sleeping while the loop goes on; from a thread, out of the turn."""
    if isinstance(greenlet.getcurrent(), _OnLoop):
        return _suspend(future)
    if asyncio._get_running_loop() is not None:  # what it waits for may need this very loop
        raise RuntimeError("a store call on the event loop's thread must run through on_loop")
    return outside(future.result)


def aside(call: Callable[..., T], /, *args) -> T:
    """Call `call(*args)`, a wait that must not hold the loop (for another process's lock): from
    a transition on the loop, in a thread of its own while the loop goes on; from a thread, out
    of the turn."""
    if not isinstance(greenlet.getcurrent(), _OnLoop):
        return outside(call, *args)
    outcome: Future = Future()
    threading.Thread(target=_settle, args=(outcome, call, args), name="store-wait", daemon=True).start()
    return _suspend(outcome)


def _settle(outcome: Future, call: Callable, args: tuple) -> None:
    try:
        outcome.set_result(call(*args))
    except BaseException as error:
        outcome.set_exception(error)


def on_loop(call: Callable[..., T], /, **kwargs) -> "asyncio.Future[T]":
    """Run `call(**kwargs)` on the event loop, from now: it has run up to its first wait (or its
    end) when this returns. Its outcome, a future to await; it runs to its end even if that
    future is cancelled meanwhile (the loop, not the caller, drives it)."""
    if isinstance(greenlet.getcurrent(), _OnLoop):  # it would switch back into this one, not the loop
        raise RuntimeError("a transition cannot start another on the loop")
    loop = asyncio.get_running_loop()
    transition = _OnLoop(partial(call, **kwargs))
    transition.ended = loop.create_future()
    _OnThisLoop.of(loop).running.add(transition)
    _go_on(transition, transition.switch)
    return transition.ended


def let_woken_go_first() -> None:
    """The running transition has woken others waiting on this loop (a claim waiting for the
    item it posts): its next wait for the disk is gathered, so they run before the loop stops
    for the flush, and their part (a worker's) overlaps the disk's. From a thread, nothing."""
    current = greenlet.getcurrent()
    if isinstance(current, _OnLoop):
        current.woke_others = True


async def transitions_ended(timeout: float) -> bool:
    """Wait until every transition started on this loop has ended, or `timeout` seconds: a
    stopping server must not close its loop under one asleep holding locks. Whether all ended."""
    loop = asyncio.get_running_loop()
    running = _OnThisLoop.of(loop).running
    deadline = loop.time() + timeout
    while running and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return not running


def _go_on(transition: _OnLoop, resume: Callable, *args) -> None:
    """Run `transition` from where it is (`resume(*args)`: a switch into it with what it waited
    for, or a throw) to its next wait or its end. Only from the loop's own greenlet: a
    transition switched into from another would come back to this one when it next waits."""
    ended = transition.ended
    on_this_loop = _OnThisLoop.of(ended.get_loop())
    try:
        asked = resume(*args)
    except StopIteration as error:  # an asyncio future refuses it
        on_this_loop.running.discard(transition)
        failure = RuntimeError(f"a store call raised {error!r}")
        failure.__cause__ = error
        if not ended.cancelled():
            ended.set_exception(failure)
        return
    except BaseException as error:
        on_this_loop.running.discard(transition)
        if not ended.cancelled():  # its caller is gone
            ended.set_exception(error)
        return
    if transition.dead:
        on_this_loop.running.discard(transition)
        if not ended.cancelled():
            ended.set_result(asked)
    elif isinstance(asked, Future):
        asked.add_done_callback(partial(_settled, ended.get_loop(), transition))
    else:
        call, request = asked
        on_this_loop.ask(call, request, transition)


def _settled(loop: asyncio.AbstractEventLoop, transition: _OnLoop, future: Future) -> None:
    """`future` has settled, in any thread: the transition goes on from the loop's own greenlet."""
    try:
        loop.call_soon_threadsafe(_go_on_from, transition, future)
    except RuntimeError:  # the loop is closed: nobody waits for the outcome
        pass


def _go_on_from(transition: _OnLoop, future: Future) -> None:
    try:
        value = future.result()
    except BaseException as error:  # a cancelled future's too: the transition must go on
        _go_on(transition, transition.throw, error)
    else:
        _go_on(transition, transition.switch, value)


class _OnThisLoop:
    """The transitions on one loop: those running, and the waits they asked to make together in
    this turn of it."""

    _of: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _OnThisLoop]" = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = weakref.proxy(loop)  # not the loop itself: it is this entry's key in `_of`
        self.running: set[_OnLoop] = set()
        self.asked: dict[Callable, list[tuple[object, _OnLoop]]] = {}  # call -> its requests
        self.at_once = 0  # waits to run at once before one is gathered again

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "_OnThisLoop":
        waits = cls._of.get(loop)
        if waits is None:
            waits = cls._of[loop] = cls(loop)
        return waits

    def gathering(self) -> bool:
        """Whether a wait asked now waits for this turn's others: while some are gathered
        already, or others came to the last gathering, or it is time to look again."""
        if self.asked or not self.at_once:
            return True
        self.at_once -= 1
        return False

    def ask(self, call: Callable, request: object, transition: _OnLoop) -> None:
        if not self.asked:
            self.loop.call_soon(self.run)  # after what is ready to run now
        self.asked.setdefault(call, []).append((request, transition))

    def run(self) -> None:
        asked, self.asked = self.asked, {}
        alone = all(len(requests) == 1 for requests in asked.values())  # nobody joined a wait
        self.at_once = AT_ONCE_AFTER_ALONE if alone else 0
        for call, requests in asked.items():
            outcomes = _answers(call, [request for request, _ in requests])
            given: set[int] = set()  # errors given already: the others get their own copies
            for outcome, (_, transition) in zip(outcomes, requests):
                if isinstance(outcome, BaseException):
                    error = _own_copy(outcome) if id(outcome) in given else outcome
                    given.add(id(outcome))
                    _go_on(transition, transition.throw, error)
                else:
                    _go_on(transition, transition.switch, outcome)


def _own_copy(error: BaseException) -> BaseException:
    try:
        return copy.copy(error)
    except Exception:  # an error that cannot be copied is shared
        return error


def _suspend(waiting_on: object) -> Any:
    """Hand what to wait for to the loop's side and sleep until it is there."""
    return greenlet.getcurrent().parent.switch(waiting_on)

