"""What a member stream costs the orchestrator's process: the embedded backend's `generate` with `on_member`, over
the lean line client (`prl.transport.line_stream`, what the backend uses) and over httpx's stream (what it used
before), alternating in one invocation against one server.

    .venv/bin/python bench/line_stream.py [--rounds 6] [--requests 400] [--concurrency 16]

The server is a FastAPI app under uvicorn in its own process, answering `/generate` as prl's embedded server
does with `stream_members` (a `{"member": i}` line per member, 8 members, each after a short sleep, then the
whole response of 8 completions of 12 tokens), so its own CPU is not counted. Per client and round:
`--requests` generations, `--concurrency` at a time (a step's 16 groups); the figure is this process's CPU
seconds (`time.process_time`) per request, the median over rounds. Ends with one JSON line;
`lean_over_httpx` is the CPU per request of the one over the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prl.backends.embedded import EmbeddedBackend  # noqa: E402
from prl.inference.protocol import GenerateRequest, GenerateResponse  # noqa: E402
from prl.recipe.resolve import free_port  # noqa: E402

SERVER = '''
import asyncio, json, sys
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

app = FastAPI()
done = {"completions": [{"token_ids": list(range(12)), "logprobs": [-0.5] * 12, "versions": [3] * 12,
                         "finish_reason": "length"}] * 8}

@app.post("/generate")
async def generate(body: dict):
    async def lines():
        for i in range(8):
            await asyncio.sleep(0.002)
            yield f'{{"member": {i}}}\\n'
        yield json.dumps(done) + "\\n"
    return StreamingResponse(lines(), media_type="application/x-ndjson")

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", timeout_keep_alive=600)
'''


class HttpxStream(EmbeddedBackend):
    """The member stream over httpx's client, as the backend read it before the line client."""

    async def _member_stream(self, body, on_member):
        response = None
        async with self.http.stream("POST", self.generate_path, json=body,
                                    timeout=httpx.Timeout(None, connect=10.0)) as r:
            async for line in r.aiter_lines():
                response = self.member_line(line, response, on_member)
        return response


async def one_round(backend: EmbeddedBackend, requests: int, concurrency: int) -> float:
    """This process's CPU seconds per generation over `requests`, `concurrency` at a time."""
    req = GenerateRequest(prompt_ids=list(range(30)), n=8, max_tokens=12)
    gate, heard = asyncio.Semaphore(concurrency), []

    async def one() -> GenerateResponse:
        async with gate:
            return await backend.generate(req, on_member=heard.append)

    cpu = time.process_time()
    out = await asyncio.gather(*(one() for _ in range(requests)))
    cpu = time.process_time() - cpu
    assert len(heard) == 8 * requests and all(len(r.completions) == 8 for r in out)
    return cpu / requests


async def measure(url: str, args) -> dict[str, list[float]]:
    clients = {"lean": EmbeddedBackend(url, "s"), "httpx": HttpxStream(url, "s")}
    for c in clients.values():
        await one_round(c, 2 * args.concurrency, args.concurrency)  # connections opened, code warm
    per = {name: [] for name in clients}
    for _ in range(args.rounds):
        for name, c in clients.items():
            per[name].append(await one_round(c, args.requests, args.concurrency))
    for c in clients.values():
        await c.close()
    return per


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise SystemExit("the bench's server did not start")
                time.sleep(0.1)
        per = asyncio.run(measure(url, args))
    finally:
        server.terminate()
        server.wait(10)
    med = {name: statistics.median(v) for name, v in per.items()}
    for name, v in per.items():
        print(f"{name}: CPU ms per request {', '.join(f'{x * 1e3:.2f}' for x in v)} (median {med[name] * 1e3:.2f})")
    print(json.dumps({"lean_cpu_ms_per_request": round(med["lean"] * 1e3, 3),
                      "httpx_cpu_ms_per_request": round(med["httpx"] * 1e3, 3),
                      "lean_over_httpx": round(med["lean"] / med["httpx"], 3),
                      "requests": args.requests, "concurrency": args.concurrency}))


if __name__ == "__main__":
    main()
