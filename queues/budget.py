"""The bytes of request bodies and socket frames the process holds at once, shared by every
request and socket: past the limit an upload is answered 503 `busy` and a frame waits for room,
so concurrent uploads cannot grow memory without bound."""

import asyncio

from .exceptions import Busy

# The bodies of this many requests of the largest size may be received, and held while they are
# handled, at once: past that a request is answered 503 `busy`, so concurrent uploads cannot grow
# memory without bound. A multiple of TASKHOSTER_MAX_BODY_BYTES, so that one setting sizes both.
BODIES_AT_ONCE = 4
# An upload refused for want of room is retried after this long: most others are done by then.
BUSY_RETRY_SECONDS = 1
ROOM_CHECK_SECONDS = 0.01  # how often a frame waiting for room looks again
# a request body that stops coming for this long is refused: as long as a request head may take
BODY_IDLE_SECONDS = 10


class BodyBudget:
    """The bytes of request bodies and frames the process is receiving or holding. Used on the
    event loop only."""

    def __init__(self):
        self.taken = 0

    def take(self, size: int, *, limit: int) -> None:
        """Take `size` bytes more, or raise Busy if that would pass `limit`."""
        if self.taken + size > limit:
            raise Busy("the server is receiving too many request bodies at once", retry_after=BUSY_RETRY_SECONDS)
        self.taken += size

    async def wait_for_room(self, size: int, *, limit: int) -> None:
        """Take `size` bytes more once there is room. A socket waits rather than answer busy: while
        it waits the server reads no more of its frames, so its sender is held back too."""
        while self.taken + size > limit and self.taken:
            await asyncio.sleep(ROOM_CHECK_SECONDS)
        self.taken += size

    def give_back(self, size: int) -> None:
        self.taken -= size


receiving = BodyBudget()
