"""A small real HTTP server that speaks the few vLLM routes `VllmBackend` uses (health, generate, the
weight-update session, pause/resume, metrics), with switches that make it fail the way a real vLLM
can but cannot be made to on demand: refuse `/resume`, fail a load after it began. The client under
test is the real `VllmBackend` over real HTTP; only the server is a stand-in. While paused, a
generation waits for `/resume`, as vLLM's `mode=keep` pause queues it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse


class FakeVllm:
    def __init__(self, **switches):
        self.fresh(**switches)
        self.calls: list[str] = []  # every route called, in order ("/update_weights:load", ...)
        self.app = self.make_app()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def fresh(self, refuse_resume: bool = False, fail_load: bool = False) -> None:
        """The state of a server just (re)started: dummy weights, not paused, no session."""
        self.refuse_resume, self.fail_load = refuse_resume, fail_load
        self.paused, self.session, self.weight_version, self.staged = False, False, "", None
        self.running = 0  # what /metrics reports as vllm:num_requests_running

    def __enter__(self) -> FakeVllm:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def make_app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def record(request: Request, call_next):
            self.calls.append(request.url.path)
            return await call_next(request)

        @app.get("/health")
        async def health():
            return {}

        @app.post("/inference/v1/generate")
        async def generate(request: Request):
            body = await request.json()
            while self.paused:  # mode=keep: queued until /resume
                await asyncio.sleep(0.01)
            n, k = body["sampling_params"].get("n", 1), body["sampling_params"]["max_tokens"]
            choices = [{"index": i, "token_ids": [7] * k, "finish_reason": "length",
                        "logprobs": {"content": [{"logprob": -0.5}] * k},
                        "weight_versions": [{"version": self.weight_version or "default", "start": 0, "end": k}]}
                       for i in range(n)]
            return {"choices": choices}

        self.weight_routes(app)

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(f'vllm:num_requests_running{{engine="0"}} {self.running}.0\n'
                                     'vllm:num_requests_waiting{engine="0"} 0.0\n'
                                     'vllm:generation_tokens_total{engine="0"} 10.0\n')

        @app.get("/is_paused")
        async def is_paused():
            return {"is_paused": self.paused}

        return app

    def weight_routes(self, app: FastAPI) -> None:
        @app.post("/init_weight_transfer_engine")
        async def init_engine():
            return {}

        @app.get("/weight_info")
        async def weight_info():
            return {"weight_version": self.weight_version}

        @app.post("/start_weight_update")
        async def start():
            if self.session:
                return JSONResponse({"error": "a weight update is already active"}, 400)
            self.session = True
            return {}

        @app.post("/update_weights")
        async def update(request: Request):
            info = (await request.json())["update_info"]
            self.calls[-1] += f":{info['action']}"
            if info["action"] == "stage":
                self.staged = info["version"]
            elif self.fail_load:
                self.session = False
                return JSONResponse({"error": "layerwise reload failed half way"}, 500)
            return {}

        @app.get("/prl/staged")
        async def staged(version: int):
            return {"state": "ready" if self.staged == version else "staging", "error": None}

        @app.post("/pause")
        async def pause():
            self.paused = True
            return {}

        @app.post("/finish_weight_update")
        async def finish(request: Request):
            body = await request.body()
            if body and body != b"null":
                self.weight_version = (await request.json())["weight_version"]
            self.session = False
            return {}

        @app.post("/resume")
        async def resume():
            if self.refuse_resume:
                return JSONResponse({"error": "engine core is not responding"}, 503)
            self.paused = False
            return {}
