"""Faults made on purpose in the store's file operations, through the seam in queues/store/files.py.

    faults.fail(at=3)                       the 3rd operation from now fails (EIO)
    faults.fail(at=3, error=errno.ENOSPC, persist=True)   ... and every write-like one after it
    faults.fail(calls={"fsync"}, where="/jobs/")         every fsync of a path under /jobs/
    faults.fail(at=2, calls={"write"}, short=10)         the 2nd write writes 10 bytes, the rest fail
"""

import errno
import os
from dataclasses import dataclass, field

import pytest

from queues.store import files

WRITES = frozenset({"create", "write", "fsync", "rename", "link", "mkdir", "setxattr", "utime"})


@dataclass
class Rule:
    at: int | None  # counted among the operations the rule matches; None: every one
    calls: frozenset[str] | None
    where: str | None
    error: int
    persist: bool
    short: int | None
    seen: int = 0
    struck: bool = False

    def matches(self, call: str, path: str) -> bool:
        return (self.calls is None or call in self.calls) and (self.where is None or self.where in path)


@dataclass
class Faults:
    calls: list[tuple[str, str]] = field(default_factory=list)
    rules: list[Rule] = field(default_factory=list)
    struck: list[tuple[str, str]] = field(default_factory=list)  # the operations made to fail

    def __call__(self, call: str, path: str) -> int | None:
        self.calls.append((call, path))
        for rule in self.rules:
            if not rule.matches(call, path):
                continue
            rule.seen += 1
            if rule.struck and rule.persist and call in WRITES and call != "rename":
                self._strike(call, path, rule.error)
            if rule.at is None or rule.seen == rule.at:
                rule.struck = True
                if rule.short is not None and call == "write":
                    return rule.short
                self._strike(call, path, rule.error)
        return None

    def _strike(self, call: str, path: str, error: int) -> None:
        self.struck.append((call, path))
        raise OSError(error, os.strerror(error), path)

    def fail(self, *, at: int | None = None, calls=None, where: str | None = None, error: int = errno.EIO,
             persist: bool = False, short: int | None = None) -> None:
        self.rules.append(Rule(at, frozenset(calls) if calls else None, where, error, persist, short))

    def clear(self) -> None:
        self.rules.clear()
        self.calls.clear()

    def count(self) -> int:
        return len(self.calls)


@pytest.fixture
def faults(monkeypatch) -> Faults:
    plan = Faults()
    monkeypatch.setattr(files, "fault", plan)
    return plan
