"""The `sandbox` run role: a process that runs model-written code for the orchestrator over HTTP, with
its own concurrency limit (`env.sandbox.concurrency`), started, watched, restarted and stopped by the
driver like every other role. On a cluster it runs on the hosts `placement.sandbox` names (default:
the inference hosts), so programs use their CPUs, not the orchestrator's.

Routes (every one needs `Authorization: Bearer <run secret>`):
- `POST /run` {"code", "language", "stdin", "files", "args"}: one execution under the worker's limits
  (the recipe's `[env.sandbox]`; a request cannot raise them), answered with `Result` as JSON. A
  client that goes away cancels its execution.
- `GET /health`: concurrency, executions in flight, counts of executions and stop reasons.

A bad request (unknown language, a file name that leaves the working folder, fields of the wrong
type, an oversize body) is answered 4xx and the worker keeps serving.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from prl.transport.auth import bearer

MAX_BODY_CHARS = 1 << 20  # code, stdin and each file


class RunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(max_length=MAX_BODY_CHARS)
    language: str = "python"
    stdin: Optional[str] = Field(None, max_length=MAX_BODY_CHARS)
    files: dict[str, str] = Field(default_factory=dict, max_length=64)
    args: list[str] = Field(default_factory=list, max_length=64)


def create_app(pool, secret: str) -> FastAPI:
    app = FastAPI(title="prl sandbox worker", dependencies=[Depends(bearer(secret))])

    @app.get("/health")
    async def health():
        return {"concurrency": pool.concurrency, "in_flight": pool.in_flight, "peak_in_flight": pool.peak_in_flight,
                "counts": dict(pool.counts), "isolation": pool.defaults.get("isolation")}

    @app.post("/run")
    async def run(body: RunRequest, request: Request):
        if any(len(v) > MAX_BODY_CHARS for v in body.files.values()):
            raise HTTPException(413, f"a file is over {MAX_BODY_CHARS} characters")
        task = asyncio.ensure_future(pool.run(body.code, language=body.language, stdin=body.stdin,
                                              files=body.files or None, args=body.args))
        try:
            result = await until_disconnected(task, request)
        except ValueError as e:  # a bad language or file name: the request's fault
            raise HTTPException(400, str(e)) from None
        if result is None:
            raise HTTPException(499, "the client went away; its execution was cancelled")
        return result.to_dict()

    return app


async def until_disconnected(task: asyncio.Task, request, poll_s: float = 0.25):
    """The execution's result, or None once the client has gone away (the execution is then cancelled:
    killed_reason "cancelled")."""
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None


def main(cfg) -> None:
    import uvicorn

    from prl.metrics import EventLog
    from prl.sandbox import SandboxPool, SandboxUnavailable
    from prl.transport import ports

    log = EventLog(cfg.run_path / "metrics.jsonl", cfg.name)
    try:
        pool = SandboxPool.from_config(cfg.sandbox)
    except SandboxUnavailable as e:
        log.emit("error", name=cfg.name, type="SandboxUnavailable", line=f"env.sandbox.isolation = "
                 f"{cfg.sandbox.isolation!r}: {e}")
        raise SystemExit(f"{cfg.name}: the sandbox is unavailable on this host: {e}") from None
    sock = ports.bind(cfg.host, cfg.port, cfg.port_fallback)
    port = sock.getsockname()[1]
    ports.publish(cfg.run_dir, cfg.name, cfg.host, port)
    print(f"{cfg.name}: running programs on http://{cfg.host}:{port} ({cfg.sandbox.isolation}, "
          f"{cfg.sandbox.concurrency} at once)", flush=True)
    uvicorn.Server(uvicorn.Config(create_app(pool, cfg.secret()), log_level="warning", timeout_keep_alive=600,
                                  timeout_graceful_shutdown=2)).run(sockets=[sock])
