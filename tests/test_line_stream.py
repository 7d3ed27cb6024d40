"""The lean line client (`prl.transport.line_stream`) against a scripted HTTP/1.1 server on a real socket: the
bytes each answer is made of are chosen per path (chunk boundaries inside lines, chunk extensions and trailers,
Content-Length, Connection: close, a server closing the connection before or while answering), and the server
counts the connections it accepted, so reuse is checked, not assumed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from prl.backends.base import BackendError, MalformedResponse
from prl.backends.embedded import EmbeddedBackend
from prl.inference.protocol import GenerateRequest
from prl.transport.line_stream import LineClient


def chunked(*parts: bytes, trailer: bytes = b"") -> bytes:
    body = b"".join(f"{len(p):x}".encode() + (b";ext=1" if i == 0 else b"") + b"\r\n" + p + b"\r\n"
                    for i, p in enumerate(parts))
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n" + trailer + b"\r\n"


RESPONSE = {"completions": [{"token_ids": [1, 2], "logprobs": [-0.5, -0.25], "versions": [3, 3],
                             "finish_reason": "length"}]}
ANSWERS = {
    "/chunks": chunked(b'{"a": 1}\n{"b"', b': 2}\n', b"\n{\"c\": 3}", trailer=b"X-Trailer: 1\r\n"),
    "/length": b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nab\ncd\nef",
    "/close": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nxy\n",
    "/error": b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 14\r\n\r\nserver paused!",
    "/silent": b"",  # the server closes the connection having read the request
    "/badlen": b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n",
    "/cut": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nonly ",  # closed inside a chunk
    "/members": chunked(b'{"member": 1}\n{"member": 0}\n', (json.dumps(RESPONSE) + "\n").encode()),
    "/after": chunked((json.dumps(RESPONSE) + '\n{"member": 0}\n').encode()),
}


class Scripted:
    """A TCP server answering each request with ANSWERS[path]; closes after /silent, /cut, /close and /badlen."""

    def __init__(self):
        self.accepted, self.requests, self.closed = 0, [], asyncio.Event()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                lines = head.decode().split("\r\n")
                headers = dict(h.split(": ", 1) for h in lines[1:] if h)
                body = await reader.readexactly(int(headers["Content-Length"]))
                path = lines[0].split(" ")[1]
                self.requests.append((lines[0], headers, json.loads(body)))
                if path == "/hang":  # answers nothing; sees the client go away
                    await reader.read()
                    self.closed.set()
                    return
                writer.write(ANSWERS[path])
                await writer.drain()
                if path in ("/silent", "/cut", "/close", "/badlen"):
                    return
        except asyncio.IncompleteReadError:
            return
        finally:
            writer.close()


async def lines_of(client: LineClient, path: str) -> list[str]:
    async with client.post(path, {"k": 1}) as r:
        return [line async for line in r.lines()]


def test_lines_across_chunks_and_reuse():
    async def main():
        async with Scripted() as srv:
            client = LineClient(srv.url, {"Authorization": "Bearer s3"})
            assert await lines_of(client, "/chunks") == ['{"a": 1}', '{"b": 2}', "", '{"c": 3}']
            assert await lines_of(client, "/length") == ["ab", "cd", "ef"]
            assert srv.accepted == 1  # both answers were read to their end: one connection carried them
            request_line, headers, body = srv.requests[0]
            assert request_line == "POST /chunks HTTP/1.1" and headers["Authorization"] == "Bearer s3"
            assert body == {"k": 1} and headers["Content-Type"] == "application/json"
            assert await lines_of(client, "/close") == ["xy"]
            assert await lines_of(client, "/length") == ["ab", "cd", "ef"]
            assert srv.accepted == 2  # the server said Connection: close
            client.keepalive_s = 0.0  # an idle connection past its keep-alive is not used again
            await lines_of(client, "/length")
            assert srv.accepted == 3
            await client.aclose()

    asyncio.run(main())


def test_errors_are_httpx_kinds():
    async def main():
        async with Scripted() as srv:
            client = LineClient(srv.url, {})
            with pytest.raises(httpx.RemoteProtocolError, match="without answering"):
                await lines_of(client, "/silent")
            with pytest.raises(httpx.ReadError, match="broke in the answer"):
                await lines_of(client, "/cut")
            with pytest.raises(httpx.RemoteProtocolError, match="neither a Content-Length"):
                await lines_of(client, "/badlen")
            async with client.post("/error", {}) as r:
                assert r.status_code == 503 and await r.read() == b"server paused!"
            assert await lines_of(client, "/length") == ["ab", "cd", "ef"]  # the 503's connection was kept
            assert srv.accepted == 4
        with pytest.raises(httpx.ConnectError):
            await lines_of(LineClient(srv.url, {}), "/length")  # the server is gone: nothing listens

    asyncio.run(main())


def test_cancel_closes_the_connection():
    async def main():
        async with Scripted() as srv:
            client = LineClient(srv.url, {})
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await lines_of(client, "/hang")
            await asyncio.wait_for(srv.closed.wait(), 30)  # the server saw the connection close
            assert not any(client.idle.values())

    asyncio.run(main())


def test_backend_member_stream():
    """The embedded backend's member streams over the line client: members heard in the order they finished,
    the response parsed, a status error named, a line after the response refused."""
    async def main():
        async with Scripted() as srv:
            backend = EmbeddedBackend(srv.url, "s3")
            req = GenerateRequest(prompt_ids=[5], n=2)
            heard: list[int] = []
            for path, expect in [("/members", None), ("/error", BackendError), ("/after", MalformedResponse)]:
                backend.generate_path = path
                if expect is None:
                    resp = await backend.generate(req, on_member=heard.append)
                    assert heard == [1, 0] and resp.completions[0].versions == [3, 3]
                    continue
                with pytest.raises(expect) as e:
                    await backend.generate(req, on_member=heard.append)
                assert path in str(e.value)
            assert srv.requests[0][2]["stream_members"] is True
            assert isinstance(e.value, MalformedResponse) and "a line after the response" in str(e.value)
            await backend.close()

    asyncio.run(main())
