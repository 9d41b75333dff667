"""The store's turn: of the threads running transitions, one at a time runs, and it lets another
run while it waits for the disk or for a lock.

A transition is many short file calls, and each lets go of the GIL. Two threads making such
calls side by side hand the GIL back and forth at every one of them, which costs more CPU than
the calls do. Taking turns, a transition still overlaps another's waits for the disk, so
concurrent posts and results go on sharing their flushes.

The turn guards no data, so code may always run without it (the event loop's reads and small
claims do). What keeps it from deadlocking: a thread lets go of it around every wait that a
holder of the turn could be the cause of (item and key locks, flushes, another's flush of the same
directory), and takes it back holding no plain lock that such a holder might wait on.
"""

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_turn = threading.Lock()
_held = threading.local()


def taking(call: Callable[..., T], /, **kwargs) -> T:
    """Call `call(**kwargs)` in the turn: wait for it, run, let go."""
    with _turn:
        _held.turn = True
        try:
            return call(**kwargs)
        finally:
            _held.turn = False


def outside(call: Callable[..., T], /, *args) -> T:
    """Call `call(*args)`, a wait, out of the turn if this thread has it."""
    if not getattr(_held, "turn", False):
        return call(*args)
    _held.turn = False
    _turn.release()
    try:
        return call(*args)
    finally:
        _turn.acquire()
        _held.turn = True
