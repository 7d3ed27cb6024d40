"""The rollouts' route without the web framework's per-request machinery: `POST /generate` with
`stream_members` (every request the orchestrator sends the embedded engine) answered in plain ASGI.

A profile of the server under reverse-tiny's loop had FastAPI's routing, middleware, dependency and
`StreamingResponse` (a task group per response to watch for the client going away) as the main thread's
largest part, beside the engine thread on the same two cores. Here a request is read, checked and
answered with the same lines (`prl.inference.server._member_lines`), and the client's going away cancels
its sequences as before.

Rule: only a request this path would answer 200 is answered here. Anything else (another route, no body
length, a body over the limit, a content type other than JSON, a header given twice, a wrong bearer, a body
that does not validate, no `stream_members`, a prompt the server refuses) goes to the app with its body
replayed, so every error keeps the app's one shape.
"""

from __future__ import annotations

import asyncio

from fastapi import HTTPException
from pydantic import ValidationError

from prl.inference.protocol import GenerateRequest
from prl.transport.auth import bearer_ok

HEADERS = [(b"content-type", b"application/x-ndjson")]
READ = (b"authorization", b"content-length", b"content-type")  # the request headers this path reads


class StreamedGenerate:
    """ASGI in front of the server's app. `sequences(req)`: the request's sequences, or HTTPException where
    the server refuses it (the route's own checks); `lines(seqs, req)`: the member lines, then the response."""

    def __init__(self, app, secret: str, max_body: int, sequences, lines):
        self.app, self.secret, self.max_body = app, secret, max_body
        self.sequences, self.lines = sequences, lines

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/generate":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if not self.plain(scope["headers"], headers):
            return await self.app(scope, receive, send)  # the app refuses or reads it
        body, gone = await read_body(receive)
        if gone:
            return None  # the client left before its request was whole
        accepted = self.accept(headers, body)
        if accepted is None:
            return await self.app(scope, replay(body, receive), send)
        await self.stream(*accepted, receive, send)
        return None

    def plain(self, raw: list, headers: dict) -> bool:
        """One JSON body of a stated length within the limit, each header this path reads given once."""
        if len(raw) != len(headers) and any(sum(k == name for k, _ in raw) > 1 for name in READ):
            return False
        size = headers.get(b"content-length", b"")
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        json_kind = kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))
        return json_kind and size.isdigit() and int(size) <= self.max_body

    def accept(self, headers: dict, body: bytes):
        """(sequences, request) where this path answers the request, else None (the app does)."""
        if not bearer_ok(headers.get(b"authorization", b"").decode("latin-1"), self.secret):
            return None
        try:
            req = GenerateRequest.model_validate_json(body)
            return (self.sequences(req), req) if req.stream_members else None
        except (ValidationError, HTTPException):
            return None

    async def stream(self, seqs, req, receive, send) -> None:
        """The member lines as they come; the client going away (or the app's lines failing) stops them,
        and closing the lines cancels the sequences still generating."""
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        lines = self.lines(seqs, req)
        pumping = asyncio.ensure_future(pump(lines, send))
        watching = asyncio.ensure_future(receive())  # http.disconnect: gone, or the response complete
        try:
            await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            pumping.cancel()
            try:
                await asyncio.wait({pumping})  # its end, without taking this task's own cancellation
            finally:
                await lines.aclose()
        if not pumping.cancelled() and pumping.exception() is not None:
            raise pumping.exception()  # the lines failed: the connection closes mid-answer, as the app's would


async def pump(lines, send) -> None:
    async for line in lines:
        await send({"type": "http.response.body", "body": line.encode(), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def read_body(receive) -> tuple[bytes, bool]:
    """The request's body, and whether the client went away before it was whole."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", True
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts), False


def replay(body: bytes, receive):
    """`receive` that gives the app the body already read, then whatever the client sends next."""
    sent = False

    async def again():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return again
