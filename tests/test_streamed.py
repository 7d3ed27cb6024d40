"""`StreamedGenerate` (prl/inference/streamed.py) in front of an app that records what reaches it: it answers a
good member-stream request itself, hands every other request to the app with its body whole, and stops the
lines when the client goes away. The real server behind it: tests/test_server.py."""

import asyncio
import json

from fastapi import HTTPException

from prl.inference.streamed import StreamedGenerate

SECRET = "s3"
GOOD = {"prompt_ids": [5, 6], "max_tokens": 2, "n": 2, "stream_members": True}


class Recorder:
    """The app behind: notes each request's path and the body it could read."""

    def __init__(self):
        self.seen = []

    async def __call__(self, scope, receive, send):
        message = await receive()
        self.seen.append((scope["path"], message["body"]))
        await send({"type": "http.response.start", "status": 418, "headers": []})
        await send({"type": "http.response.body", "body": b"app", "more_body": False})


def sequences(req):
    if req.prompt_ids[0] == 99:
        raise HTTPException(400, "refused")
    return [f"seq{i}" for i in range(req.n)]


def call(body, path="/generate", auth=f"Bearer {SECRET}", length=True, disconnect_after=None, closed=None,
         ctype="application/json", extra=(), messages=None):
    """One request through `StreamedGenerate`: the app's record, the messages sent back. `messages`: what the
    client sends instead of the whole body at once."""
    app, sent = Recorder(), []
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()

    async def lines(seqs, req):
        try:
            for i in range(len(seqs)):
                await asyncio.sleep(0.01)
                yield f'{{"member": {i}}}\n'
            yield '{"completions": []}\n'
        finally:
            if closed is not None:
                closed.append(True)

    async def main():
        queue = asyncio.Queue()
        for message in messages or [{"type": "http.request", "body": raw, "more_body": False}]:
            queue.put_nowait(message)

        async def send(message):
            sent.append(message)
            if disconnect_after is not None and len(sent) == disconnect_after:
                queue.put_nowait({"type": "http.disconnect"})
                await asyncio.sleep(0.05)  # the client's going away is seen while this line is being sent

        headers = [(b"authorization", auth.encode())] + ([(b"content-length", str(len(raw)).encode())] if length else [])
        headers += [(b"content-type", ctype.encode())] if ctype else []
        headers += [(k.encode(), v.encode()) for k, v in extra]
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        await StreamedGenerate(app, SECRET, 1 << 20, sequences, lines)(scope, queue.get, send)
        if closed is not None:
            closed.append("returned")

    asyncio.run(main())
    return app.seen, sent


def test_a_good_member_stream_is_answered_without_the_app():
    seen, sent = call(GOOD)
    assert seen == []
    assert sent[0] == {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-ndjson")]}
    body = b"".join(m["body"] for m in sent[1:])
    assert body == b'{"member": 0}\n{"member": 1}\n{"completions": []}\n' and sent[-1]["more_body"] is False


def test_every_other_request_reaches_the_app_with_its_body_whole():
    cases = [({**GOOD, "stream_members": False}, {}), (GOOD, {"auth": "Bearer wrong"}), (GOOD, {"path": "/score"}),
             ({**GOOD, "temperature": -1}, {}), (b'{"prompt_ids": [5', {}), ({**GOOD, "prompt_ids": [99]}, {}),
             (GOOD, {"length": False}), (GOOD, {"ctype": None}), (GOOD, {"ctype": "text/plain"}),
             (GOOD, {"auth": "Bearer wrong", "extra": [("authorization", f"Bearer {SECRET}")]}), ({**GOOD, "prompt_ids": [5] * 400_000}, {})]
    for body, how in cases:
        seen, sent = call(body, **how)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        assert seen == [(how.get("path", "/generate"), raw)], (body, how)
        assert sent[0]["status"] == 418, (body, how)


def test_a_json_subtype_with_parameters_is_answered_and_a_client_gone_mid_body_is_dropped():
    seen, sent = call(GOOD, ctype="application/vnd.prl+json; charset=utf-8")
    assert seen == [] and sent[0]["status"] == 200
    raw = json.dumps(GOOD).encode()
    seen, sent = call(GOOD, messages=[{"type": "http.request", "body": raw[:5], "more_body": True},
                                      {"type": "http.disconnect"}])
    assert seen == [] and sent == [], "nothing answered, nothing handed on"


def test_a_client_gone_mid_stream_closes_the_lines():
    closed = []
    seen, sent = call({**GOOD, "n": 50}, disconnect_after=3, closed=closed)
    assert seen == [] and closed == [True, "returned"], "the lines were closed before the request ended"
    assert len(sent) < 10 and not any(m.get("more_body") is False for m in sent), "the lines stopped at once"
