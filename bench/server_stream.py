"""What a member stream costs the embedded server's process: `POST /generate` with `stream_members` answered by
`prl.inference.streamed` (what the orchestrator's requests take) against the same request answered by the
FastAPI route (`StreamingResponse`), alternating in one invocation against one real server.

    .venv/bin/python bench/server_stream.py [--rounds 6] [--requests 400] [--concurrency 16]

The server is prl's own (`python -m prl.inference`, reverse-tiny's model), started as `prl run` starts it. Each
request is a group of 8 completions of 1 token (the engine's part small and the same on both paths). The
streamed path gets each request with a Content-Length (as prl's line client sends it); the route gets it with a
chunked body, which the streamed path hands to the app. Per path and round: `--requests` requests,
`--concurrency` at a time (a step's 16 groups); the figure is the server process's CPU seconds per request
(user + system, from /proc), the median over rounds. Ends with one JSON line: `streamed_over_route` is the CPU per
request of the one over the other, engine included; `saved_ms_per_request` the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import start_server  # noqa: E402
from prl.recipe.load import load_recipe  # noqa: E402

BODY = {"prompt_ids": [5, 6, 7, 8, 9, 10], "max_tokens": 1, "n": 8, "temperature": 1.0, "stream_members": True,
        "final": True}


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_round(client: httpx.AsyncClient, chunked: bool, requests: int, concurrency: int) -> None:
    raw = json.dumps(BODY).encode()
    gate = asyncio.Semaphore(concurrency)

    async def body():
        yield raw

    async def one() -> None:
        async with gate:
            r = await client.post("/generate", content=body() if chunked else raw,
                                  headers={"Content-Type": "application/json"})
            lines = r.text.splitlines()
            assert r.status_code == 200 and len(lines) == 9, r.text[:300]

    await asyncio.gather(*(one() for _ in range(requests)))


async def measure(url: str, secret: str, pid: int, args) -> dict[str, list[float]]:
    out = {"streamed": [], "route": []}
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {secret}"}, limits=limits,
                                 timeout=60) as client:
        await one_round(client, False, 50, args.concurrency)  # warm-up, both paths
        await one_round(client, True, 50, args.concurrency)
        for r in range(args.rounds):
            for name in (("streamed", "route") if r % 2 == 0 else ("route", "streamed")):
                before = cpu_s(pid)
                await one_round(client, name == "route", args.requests, args.concurrency)
                out[name].append((cpu_s(pid) - before) / args.requests)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, cfg, client = start_server(Path(tmp), load_recipe(ROOT / "recipes" / "reverse-tiny.toml"), timeout=120)
        try:
            per = asyncio.run(measure(f"http://{cfg.host}:{cfg.port}", cfg.secret(), proc.pid, args))
        finally:
            client.close()
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    ms = {k: statistics.median(v) * 1e3 for k, v in per.items()}
    for k, v in per.items():
        print(f"{k}: " + " ".join(f"{x * 1e3:.2f}" for x in v) + " ms of the server's CPU a request")
    print(json.dumps({"streamed_ms_per_request": round(ms["streamed"], 3), "route_ms_per_request": round(ms["route"], 3),
                      "saved_ms_per_request": round(ms["route"] - ms["streamed"], 3),
                      "streamed_over_route": round(ms["streamed"] / ms["route"], 3)}))


if __name__ == "__main__":
    main()
