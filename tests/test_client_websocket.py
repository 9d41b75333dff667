"""The worker's WebSocket (taskhoster/websocket.py) against websockets' own server: messages whole
however they are framed, pings both ways, the closing handshake, a refused handshake."""

import asyncio

import pytest
from websockets.asyncio.server import serve
from websockets.exceptions import InvalidStatus
from websockets.server import ServerProtocol

import taskhoster.websocket as websocket_module
from taskhoster.websocket import SocketClosed, WebSocket


async def open_socket(server, messages: list[str] | None = None) -> WebSocket:
    port = server.sockets[0].getsockname()[1]
    socket = await WebSocket.open(f"ws://127.0.0.1:{port}/work", {"Authorization": "Bearer th_x"}, timeout=5)
    if messages is not None:
        socket.on_message = messages.append
    return socket


async def test_messages_reach_on_message_whole_however_they_are_framed():
    async def talk(ws):
        await ws.recv()
        await ws.send('{"n":1}')
        await ws.send(['{"n":', "2}"])  # one message in two frames
        await ws.send(b"\x00\x01")  # binary: not ours, dropped
        await ws.send('{"n":3}')

    messages = []
    async with serve(talk, "127.0.0.1", 0) as server:
        socket = await open_socket(server, messages)
        socket.send("go")
        async with asyncio.timeout(5):
            while len(messages) < 3:
                await asyncio.sleep(0.01)
        await socket.close()
    assert messages == ['{"n":1}', '{"n":2}', '{"n":3}']


async def test_the_handshake_carries_the_headers_and_a_refusal_raises_invalid_status():
    seen = []

    def refuse(connection, request):
        seen.append(request.headers["Authorization"])
        return connection.respond(403, "no\n")

    async with serve(lambda ws: None, "127.0.0.1", 0, process_request=refuse) as server:
        with pytest.raises(InvalidStatus) as raised:
            await open_socket(server)
    assert raised.value.response.status_code == 403
    assert seen == ["Bearer th_x"]


async def test_the_server_s_pings_are_answered():
    pongs = []

    async def ping(ws):
        pongs.append(await asyncio.wait_for(await ws.ping(), 5))
        await ws.close()

    async with serve(ping, "127.0.0.1", 0) as server:
        socket = await open_socket(server, [])
        await asyncio.wait_for(socket.wait_closed(), 5)
    assert len(pongs) == 1


async def test_a_server_that_answers_no_ping_is_given_up(monkeypatch):
    monkeypatch.setattr(websocket_module, "PING_SECONDS", 0.1)

    async def deaf(reader, writer):
        """Shakes hands, then reads every frame and answers none, pings neither."""
        protocol = ServerProtocol()
        protocol.receive_data(await reader.readuntil(b"\r\n\r\n"))
        protocol.send_response(protocol.accept(protocol.events_received()[0]))
        for data in protocol.data_to_send():
            writer.write(data)
        await reader.read()
        writer.close()

    server = await asyncio.start_server(deaf, "127.0.0.1", 0)
    async with server:
        socket = await open_socket(server, [])
        await asyncio.wait_for(socket.wait_closed(), 5)
    with pytest.raises(SocketClosed):
        socket.send("anyone?")


async def test_close_is_the_closing_handshake_and_the_server_s_close_code_is_kept():
    codes = []

    async def keep(ws):
        async for _ in ws:
            pass
        codes.append(ws.close_code)

    async def refuse_after_open(ws):
        await ws.close(4401, "unauthorized")

    async with serve(keep, "127.0.0.1", 0) as server:
        socket = await open_socket(server, [])
        await socket.close()
        assert socket.close_code == 1000
    async with serve(refuse_after_open, "127.0.0.1", 0) as server:
        socket = await open_socket(server, [])
        await asyncio.wait_for(socket.wait_closed(), 5)
        assert socket.close_code == 4401
    assert codes == [1000]
