"""The dashboard's live socket: pushes the shared snapshot to a staff browser about once a second."""

import asyncio

from channels.generic.websocket import AsyncWebsocketConsumer

from .feed import get_feed

LIVE_PATH = "dashboard/live"  # routed in taskhoster_site/asgi.py
CLOSE_NOT_LOGGED_IN = 4401
CLOSE_NOT_STAFF = 4403


class DashboardConsumer(AsyncWebsocketConsumer):
    box: asyncio.Queue | None = None
    pump: asyncio.Task | None = None

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_NOT_LOGGED_IN)
            return
        if not (user.is_active and user.is_staff):
            await self.close(code=CLOSE_NOT_STAFF)
            return
        await self.accept()
        self.box = get_feed().subscribe()
        self.pump = asyncio.create_task(self._forward(self.box))

    async def _forward(self, box: asyncio.Queue) -> None:
        while True:
            await self.send(text_data=await box.get())

    async def disconnect(self, code):
        if self.pump is not None:
            self.pump.cancel()
            get_feed().unsubscribe(self.box)
