"""A worker: holds the /work socket, claims only as many items as it has free slots, runs the
handler on each, keeps their leases while handlers run, hands results in (batched when many finish
together), reconnects by itself, and stops gracefully on SIGTERM, SIGINT or SIGHUP.

Under load it spends few frames per item: what happens in one event-loop turn (handlers finishing,
a claim or an ack coming back) is acted on once at the end of the turn, with one `results` frame
for every result ready and one claim for every free slot; a few free slots wait a moment for more.

    Worker(url, token, queues=["thumbs"], concurrency=4).run(handler)

`handler(payload, job)` is a plain function (run in a thread of its own) or an async function;
`job` is a `Job` (id, queue, attempts, max_attempts, ...). What it returns is the item's result.
If it raises, the error `{"error": {"type", "message", "traceback"}}` is

    on_error="result"   the item's result (the default)
    on_error="retry"    kept as the item's lastError while it is released for another try after
                        a backoff (exponential from `retry_base`, at most `retry_cap` seconds,
                        full jitter); on the item's last allowed try it is the result
    on_error="release"  kept as the item's lastError while it is released for another try now

A canceled item's handler is told: an async one's task is cancelled, a plain one sees
`job.canceled` become true. Whatever it makes is dropped.
"""

import asyncio
import logging
import signal
import sys
import threading

from .config import server_settings
from .jobs import Handler, check_handler
from .run import Run

ON_ERROR = ("result", "retry", "release")
MAX_RETRY_DELAY_SECONDS = 86400  # the server's limit on a release's delay


class Worker:
    """Works one or more queues with a handler; see the module docstring. `url` and `token`
    default to TASKHOSTER_URL and TASKHOSTER_TOKEN. `grace` is how long a stop waits for running
    handlers before it releases their items."""

    def __init__(self, url: str | None = None, token: str | None = None, *, queues: list[str],
                 concurrency: int = 1, on_error: str = "result", retry_base: float = 1.0,
                 retry_cap: float = 600.0, grace: float = 30.0):
        if isinstance(queues, str) or not all(isinstance(q, str) for q in queues):
            raise TypeError("queues must be a list of queue names")
        if not queues or not all(queues):
            raise ValueError("queues must name at least one queue, and no name may be empty")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError("concurrency must be a whole number of at least 1")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, not {on_error!r}")
        if not 0 < retry_base <= retry_cap <= MAX_RETRY_DELAY_SECONDS:
            raise ValueError(f"retry_base and retry_cap must be seconds with 0 < retry_base <= retry_cap <= "
                             f"{MAX_RETRY_DELAY_SECONDS}")
        if grace < 0:
            raise ValueError("grace must be 0 or more seconds")
        self.url, self._token = server_settings(url, token)
        self.queues = list(dict.fromkeys(queues))
        self.concurrency = concurrency
        self.on_error = on_error
        self.retry_base, self.retry_cap = retry_base, retry_cap
        self.grace = grace
        self._lock = threading.Lock()  # stop() may come from any thread, even before the run starts
        self._run: Run | None = None
        self._early_stop: bool | None = None  # a stop() that came before the run: its `now`

    def run(self, handler: Handler) -> None:
        """Work until SIGTERM, SIGINT or SIGHUP (a second one skips the grace period). Raises
        ConnectionFailed if the server cannot be reached at the start, Unauthorized for a bad token,
        UnknownQueue or Forbidden for a queue it may not work, TypeError for a handler that does
        not take (payload, job). Logs to stderr when the program has not set up logging."""
        check_handler(handler)
        _log_to_stderr_unless_configured()
        asyncio.run(self._run_until_signalled(handler))

    async def run_async(self, handler: Handler) -> None:
        """Work on the running event loop until stop() is called; raises as run() does."""
        check_handler(handler)
        with self._lock:
            run = self._run = Run(handler, url=self.url, token=self._token, queues=self.queues,
                                  concurrency=self.concurrency, on_error=self.on_error, retry_base=self.retry_base,
                                  retry_cap=self.retry_cap, grace=self.grace)
            if self._early_stop is not None:
                run.request_stop(self._early_stop)
                self._early_stop = None
        try:
            await run.main()
        finally:
            with self._lock:
                self._run = None

    def stop(self, *, now: bool = False) -> None:
        """Stop claiming, let running handlers finish within the grace period (`now`: skip it),
        release the rest, hand in what finished. Safe to call from any thread, also just before
        the run starts (it then stops at once)."""
        with self._lock:
            if self._run is None:
                self._early_stop = now
            else:
                self._run.loop.call_soon_threadsafe(self._run.request_stop, now)

    async def _run_until_signalled(self, handler: Handler) -> None:
        loop = asyncio.get_running_loop()
        # a hang-up (its terminal closed) stops it as SIGTERM does, unless it is ignored (nohup):
        # else the worker would die at once, and the commands `taskhoster work` runs, each in a
        # session of its own, would run on unheard
        hang_up = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
        signals = (signal.SIGTERM, signal.SIGINT, *hang_up)
        for signum in signals:
            loop.add_signal_handler(signum, self._on_signal)
        try:
            await self.run_async(handler)
        finally:
            for signum in signals:
                loop.remove_signal_handler(signum)

    def _on_signal(self) -> None:
        current = self._run
        if current is not None:
            current.request_stop(now=current.stopping)


def _log_to_stderr_unless_configured() -> None:
    """A worker that says nothing looks dead: when the program set up no logging, the worker's
    own messages (INFO and up) go to stderr."""
    logger = logging.getLogger("taskhoster")
    if logging.getLogger().handlers or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s taskhoster: %(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
