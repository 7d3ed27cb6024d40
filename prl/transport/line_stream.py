"""A lean HTTP/1.1 client for one kind of request: a JSON POST whose answer is read line by line (the embedded
server's member streams, `stream_members`).

Why not httpx, which every other request uses: a rollout step sends one such request per group, and on the
orchestrator's core httpx's per-request machinery (its pool's bookkeeping, anyio's streams, h11's events) cost
several times what the request itself does (`bench/line_stream.py`). This client keeps what those requests
need and nothing else:

- connections kept per (host, port), reused once an answer was read to its end, dropped after `keepalive_s` idle
  (before the server's own keep-alive timeout could close one under a new request);
- the answer's body by `Content-Length` or chunked transfer coding, split into lines;
- errors as httpx's own classes, so a caller's retry rules read them as they read httpx's: `ConnectError` /
  `ConnectTimeout` (the request never left), `RemoteProtocolError` (the server closed the connection before
  answering, or answered what is not HTTP/1.1), `ReadError` / `WriteError` (it broke under the request);
- a request cancelled or failed mid-answer closes its connection (the server drops what it was doing for it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import httpx

HEAD_LIMIT = 1 << 20  # a status, header or chunk-size line longer than this is not HTTP the server would send


class LineStream:
    """An answer being read: its status and headers; `lines()` its body's lines; `read()` the whole body."""

    def __init__(self, reader: asyncio.StreamReader, status: int, headers: dict[str, str]):
        self.reader, self.status_code, self.headers = reader, status, headers
        self.done = False  # the body was read to its end: the connection may carry another request

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                async for chunk in self.chunked():
                    yield chunk
            elif self.headers.get("content-length", "").isdigit():
                yield await self.reader.readexactly(int(self.headers["content-length"]))
            else:
                raise httpx.RemoteProtocolError("an answer with neither a Content-Length nor chunked coding")
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            raise httpx.ReadError(f"the connection broke in the answer: {e}") from None
        except asyncio.LimitOverrunError:
            raise httpx.RemoteProtocolError(f"a chunk-size line past {HEAD_LIMIT} bytes") from None
        self.done = True

    async def chunked(self) -> AsyncIterator[bytes]:
        while True:
            size_line = await self.reader.readuntil(b"\r\n")
            try:
                size = int(size_line.split(b";", 1)[0], 16)
            except ValueError:
                raise httpx.RemoteProtocolError(f"a bad chunk size line {size_line[:40]!r}") from None
            if size == 0:
                while await self.reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                    pass
                return
            data = await self.reader.readexactly(size + 2)
            yield data[:-2]

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines, without their newlines (a last line without one included)."""
        buf = b""
        async for chunk in self.chunks():
            buf += chunk
            *whole, buf = buf.split(b"\n")
            for line in whole:
                yield line.decode()
        if buf:
            yield buf.decode()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])


class LineClient:
    """POSTs of JSON whose answers are read as lines, over kept-alive connections to `base_url` (which the
    caller may change: a restarted server may listen elsewhere)."""

    def __init__(self, base_url: str, headers: dict[str, str], keepalive_s: float = 2.0):
        self.base_url, self.headers, self.keepalive_s = base_url, headers, keepalive_s
        self.idle: dict[tuple[str, int], list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    @asynccontextmanager
    async def post(self, path: str, body: dict, connect_timeout: float = 10.0) -> AsyncIterator[LineStream]:
        """The answer to POST `path` with `body` as JSON; the connection goes back to the pool once it was
        read to its end, and is closed otherwise (an error, a cancel, an answer left unread)."""
        url = urlsplit(self.base_url)
        where = (url.hostname or "127.0.0.1", url.port or 80)
        for other in [w for w in self.idle if w != where]:  # the server moved (a restart): its old port's are dead
            self.close_idle(other)
        data = json.dumps(body, separators=(",", ":")).encode()
        head = "".join([f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n",
                        *(f"{k}: {v}\r\n" for k, v in self.headers.items()),
                        f"Content-Length: {len(data)}\r\n\r\n"]).encode()
        reader, writer = await self.connection(where, connect_timeout)
        answer = None
        try:
            try:
                writer.write(head + data)
                await writer.drain()
            except ConnectionError as e:
                raise httpx.WriteError(f"the connection broke sending the request: {e}") from None
            answer = await read_head(reader)
            yield answer
        finally:
            if answer is not None and answer.done and answer.headers.get("connection", "").lower() != "close":
                self.idle.setdefault(where, []).append((time.monotonic(), reader, writer))
            else:
                writer.close()

    async def connection(self, where: tuple[str, int], timeout: float):
        """An idle connection to `where` kept less than `keepalive_s`, else a new one."""
        now = time.monotonic()
        pool = self.idle.get(where, [])
        for since, reader, writer in [c for c in pool if now - c[0] >= self.keepalive_s or c[1].at_eof()]:
            pool.remove((since, reader, writer))
            writer.close()
        if pool:
            _, reader, writer = pool.pop()
            return reader, writer
        try:
            async with asyncio.timeout(timeout):  # (wait_for on 3.11 can swallow a cancel that lands as it ends)
                return await asyncio.open_connection(*where, limit=HEAD_LIMIT)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {where[0]}:{where[1]} within {timeout:.0f}s") from None
        except OSError as e:
            raise httpx.ConnectError(f"{where[0]}:{where[1]}: {e.strerror or e}") from None

    def close_idle(self, where: tuple[str, int]) -> None:
        for _, _, writer in self.idle.pop(where, []):
            writer.close()

    async def aclose(self) -> None:
        for where in list(self.idle):
            self.close_idle(where)


async def read_head(reader: asyncio.StreamReader) -> LineStream:
    """The status line and headers of an answer."""
    try:
        status_line = await reader.readuntil(b"\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial:  # a kept connection the server had closed, or a server that died before answering
            raise httpx.RemoteProtocolError("the server closed the connection without answering") from None
        raise httpx.ReadError("the connection broke in the answer's status line") from None
    except ConnectionError as e:
        raise httpx.ReadError(f"the connection broke waiting for the answer: {e}") from None
    except asyncio.LimitOverrunError:
        raise httpx.RemoteProtocolError("an answer's status line past the line limit") from None
    parts = status_line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise httpx.RemoteProtocolError(f"not an HTTP/1.1 answer: {status_line[:60]!r}")
    headers = {}
    try:
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError) as e:
        raise httpx.ReadError(f"the connection broke in the answer's headers: {type(e).__name__}") from None
    return LineStream(reader, int(parts[1]), headers)
