"""What a client can take from a real `serve` process, on each server `serve --server` offers:
the descriptor limit is raised to the hard one at start.

The servers start with a descriptor limit of their own (soft SOFT_LIMIT, hard HARD_LIMIT), so
what these tests meet is the same on every machine.
"""

import functools
import resource
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

from queues.serving import SERVERS
from serverproc import Deployment

SOFT_LIMIT, HARD_LIMIT = 1024, 4096


@contextmanager
def descriptor_limits(soft: int, hard: int):
    """Processes started meanwhile begin with these limits on open descriptors (as after
    `ulimit -Hn hard -Sn soft`); this process's own limits stay as they are."""

    def apply() -> None:  # in the child, before it runs Python
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "Popen", functools.partial(subprocess.Popen, preexec_fn=apply))
        yield


@pytest.fixture(scope="module", autouse=True)
def _room_for_many_sockets():
    """The servers' hard limit must fit under this process's; and this process holds as many
    sockets as a server may, so its soft limit goes up to its hard one meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < HARD_LIMIT:
        pytest.fail(f"these tests need a hard descriptor limit of {HARD_LIMIT}; it is {hard} here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request, tmp_path_factory):
    deployment = Deployment(tmp_path_factory.mktemp(f"limits-{request.param}"))
    deployment.prepare(queues=["jobs"])
    process = deployment.server(server=request.param)
    with descriptor_limits(SOFT_LIMIT, HARD_LIMIT):
        process.start()
    try:
        yield process
    finally:
        process.stop()


def test_serve_raises_its_descriptor_limit_to_the_hard_limit(server):
    limits = Path(f"/proc/{server.pid}/limits").read_text()
    [line] = [line for line in limits.splitlines() if line.startswith("Max open files")]
    soft, hard = line.split()[3:5]
    assert (int(soft), int(hard)) == (HARD_LIMIT, HARD_LIMIT)
