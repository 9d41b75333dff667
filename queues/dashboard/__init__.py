"""The staff dashboard: every queue's counts live over a WebSocket, and per-queue item pages."""
