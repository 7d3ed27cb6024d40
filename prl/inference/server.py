"""HTTP front of the embedded engine: token generate, OpenAI /v1/completions, admin endpoints.

Every endpoint requires `Authorization: Bearer <run secret>` (OpenAI clients send their API key
that way, so the secret doubles as the key). The server binds loopback unless the recipe says
otherwise. A failed weight load answers 409 and leaves the old version serving.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from prl.inference.engine import EngineCore, SamplingParams, Sequence, WeightLoadError, prepare_weights
from prl.inference.loop import EngineLoop
from prl.inference.receiver import Receiver, ReceiveError
from prl.inference.streamed import StreamedGenerate
from prl.inference.protocol import (
    CollectiveJoin,
    CollectiveReceive,
    Completion,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerateResponse,
    Health,
    Metrics,
    PrefillRequest,
    PrefillResponse,
    ScoreRequest,
    ScoreResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    encode_routing,
)
from prl.tasks.prompts import PromptError, raw_text, render, uses_template
from prl.transport.auth import bearer
from prl.model.weights import StreamedOnly
from prl.transport.collective import GroupInfo
from prl.transport.weights import WeightFetchError
from prl.model.lora import AdapterBase


MAX_BODY_BYTES = 16 << 20  # prompts are token ids or text; larger bodies are refused unread


@dataclass
class Served:
    """What every route of one server reads: the engine loop, the tokenizer and the model's limits."""

    loop: EngineLoop
    tokenizer: object
    model_name: str
    weights: object  # a `prl.transport.weights.WeightSource`, or None
    weights_root: Path | None
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        config = self.loop.core.model.config
        self.vocab, self.context = config.vocab_size, getattr(config, "max_position_embeddings", None)
        self.eos = [self.tokenizer.eos_token_id]
        # LoRA: the base's target weights, read once from the base version's folder
        self.adapter_base = AdapterBase(self.base_folder)
        self.receiver = Receiver(self.loop.core.model, self.adapter_base)  # the collective weight path's staging
        self.weights_skipped = 0  # versions asked for while a newer one was served or staged (served instead)

    def base_folder(self, version: int) -> Path:
        if self.weights is not None:
            return self.weights.fetch(version)
        if self.weights_root is None:
            raise WeightFetchError(f"this server has no weight source for the adapters' base v{version}")
        return self.weights_root / f"v{version}"

    def check_prompt(self, ids: list[int], max_tokens: int, field_name: str) -> None:
        """Refuse what the engine cannot serve before it reaches the engine (one bad request must not
        stop the engine for everyone)."""
        bad = next((i for i, t in enumerate(ids) if t >= self.vocab), None)
        if bad is not None:
            raise HTTPException(400, f"{field_name}[{bad}] = {ids[bad]} is outside the vocabulary (0..{self.vocab - 1})")
        if self.context and len(ids) + max_tokens > self.context:
            raise HTTPException(400, f"{field_name} ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                                     f"model's context of {self.context} tokens")

    def sequences(self, req: GenerateRequest) -> list[Sequence]:
        """A /generate request's sequences, one per completion; HTTPException where the server cannot serve it."""
        stops = self.eos if req.stop_token_ids is None else req.stop_token_ids
        seeds = [None if req.seed is None else req.seed + i for i in range(req.n)]
        params = [SamplingParams(req.temperature, req.top_p, req.max_tokens, tuple(stops), sd) for sd in seeds]
        if req.return_routing and self.loop.core.capture is None:
            raise HTTPException(400, "this server does not capture routing (start it with routing capture on)")
        self.check_prompt(req.prompt_ids, req.max_tokens, "prompt_ids")
        if any(t >= self.vocab for t in stops):
            raise HTTPException(400, f"stop_token_ids: ids must be below the vocabulary size {self.vocab}")
        return [_sequence(req.prompt_ids, p, req.final) for p in params]


def create_app(loop: EngineLoop, tokenizer, secret: str, model_name: str = "prl", weights=None,
               weights_root: Path | None = None) -> StreamedGenerate:
    """`weights`: a `prl.transport.weights.WeightSource` for update requests that carry no path;
    `weights_root`: the only folder an update's `path` may point into (the run's weights). The app behind
    `StreamedGenerate`, which answers the rollouts' member streams itself."""
    app = new_app("prl inference")
    served, guarded = Served(loop, tokenizer, model_name, weights, weights_root), [Depends(bearer(secret))]
    for add in (add_token_routes, add_openai_routes, add_weight_routes, add_status_routes):
        add(app, served, guarded)
    return StreamedGenerate(app, secret, MAX_BODY_BYTES, served.sequences,
                            lambda seqs, req: _member_lines(loop, seqs, req))


def new_app(title: str) -> FastAPI:
    """A server's app: bodies over MAX_BODY_BYTES refused unread, errors in one shape (OpenAI's on /v1)."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(LimitBody)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    return app


def add_token_routes(app: FastAPI, s: Served, guarded: list) -> None:
    """prl's own API: token ids in, token ids with logprobs, versions and routing out; P/D prefill."""
    loop = s.loop

    @app.post("/generate", dependencies=guarded, response_model=GenerateResponse)
    async def generate(req: GenerateRequest, request: Request):
        seqs = s.sequences(req)
        if req.stream_members:  # the orchestrator's requests are answered by `StreamedGenerate` in front
            return StreamingResponse(_member_lines(loop, seqs, req), media_type="application/x-ndjson")
        await _unless_disconnected(request, [loop.generate(seq) for seq in seqs])
        return _generate_response(seqs, req)

    @app.post("/score", dependencies=guarded, response_model=ScoreResponse)
    async def score(req: ScoreRequest) -> ScoreResponse:
        """Logprobs of given tokens under the served weights: one forward, nothing generated (a teacher's)."""
        for i, item in enumerate(req.items):
            if item.start >= len(item.ids):
                raise HTTPException(400, f"items[{i}]: start ({item.start}) must be below the {len(item.ids)} ids: at "
                                         f"least one is scored")
            s.check_prompt(item.ids, 0, f"items[{i}].ids")
        logprobs, version = await loop.run(lambda core: core.score([(i.ids, i.start) for i in req.items]))
        return ScoreResponse(logprobs=logprobs, version=version)

    @app.post("/prefill", dependencies=guarded)
    async def prefill(req: PrefillRequest, request: Request) -> PrefillResponse:
        """P/D: the prompt's KV and routing into the KV pool, for a decode server to load."""
        if loop.core.pool is None:
            raise HTTPException(400, "this server has no KV pool (inference.kv_pool): nothing to prefill into")
        s.check_prompt(req.prompt_ids, 0, "prompt_ids")
        seq = _sequence(req.prompt_ids, SamplingParams(max_tokens=1))
        seq.prefill_only = True
        [seq] = await _unless_disconnected(request, [loop.generate(seq)])
        version, pooled = seq.pooled  # what the prefill left in the pool, under the version it ran with
        return PrefillResponse(version=version, pooled_tokens=pooled)


def add_openai_routes(app: FastAPI, s: Served, guarded: list) -> None:
    """OpenAI's /v1/models, /v1/completions (text or token prompts) and /v1/chat/completions, for its clients and
    tools (an LLM judge the run serves, `prl.orchestrator.judge`)."""

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": int(s.started),
                                            "owned_by": "prl"}]}

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(req: CompletionRequest, request: Request) -> dict:
        why = req.unsupported()
        if why:
            raise HTTPException(400, why)
        ids = req.prompt if isinstance(req.prompt, list) else s.tokenizer(req.prompt).input_ids
        if not ids:
            raise HTTPException(400, "prompt: the text encodes to no tokens")
        s.check_prompt(ids, req.max_tokens, "prompt")
        seeds = [None if req.seed is None else req.seed + i for i in range(req.n)]  # n different completions
        params = [SamplingParams(req.temperature, req.top_p, req.max_tokens, tuple(s.eos), sd) for sd in seeds]
        if req.max_tokens == 0:  # echo: the prompt scored, nothing generated
            seqs = [Sequence(list(ids), p, finish_reason="length") for p in params]
        else:
            seqs = await _unless_disconnected(request, [s.loop.generate(_sequence(ids, p)) for p in params])
        echoed = None
        if req.echo:  # the prompt's logprobs cost a forward: only when asked for
            echoed = await prompt_logprobs(s.loop, ids) if req.logprobs is not None else [None] * len(ids)
        return _openai_response(req, ids, seqs, s.tokenizer, s.model_name, echoed)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> dict:
        why = req.unsupported()
        if why:
            raise HTTPException(400, why)
        try:
            ids = chat_ids(s.tokenizer, [m.model_dump() for m in req.messages])
        except PromptError as e:
            raise HTTPException(400, f"messages: {e}") from None
        s.check_prompt(ids, req.max_tokens, "messages")
        seeds = [None if req.seed is None else req.seed + i for i in range(req.n)]
        params = [SamplingParams(req.temperature, req.top_p, req.max_tokens, tuple(s.eos), sd) for sd in seeds]
        seqs = await _unless_disconnected(request, [s.loop.generate(_sequence(ids, p)) for p in params])
        return chat_response(_openai_response(req, ids, seqs, s.tokenizer, s.model_name))


async def prompt_logprobs(loop: EngineLoop, ids: list[int]) -> list[float | None]:
    """Each prompt token's logprob given those before it (the first has none: null), under the served weights."""
    if len(ids) < 2:
        return [None]
    [scored], _ = await loop.run(lambda core: core.score([(ids, 1)]))
    return [None, *scored]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages as the prompt's tokens: the tokenizer's chat template with the assistant's turn opened, or
    without one their contents joined by newlines (prl's tiny tokenizer)."""
    if uses_template(tokenizer, "auto"):
        ids = render(tokenizer, messages, generation_prompt=True)
    else:
        ids = tokenizer(raw_text(messages)).input_ids
    if not ids:
        raise PromptError("the messages render to no tokens")
    return ids


def chat_response(completion: dict) -> dict:
    """A /v1/completions answer in /v1/chat/completions' shape."""
    choices = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                "finish_reason": c["finish_reason"]} for c in completion["choices"]]
    return {**completion, "id": completion["id"].replace("cmpl-", "chatcmpl-"), "object": "chat.completion",
            "choices": choices}


async def staged_or_read(s: Served, req: UpdateWeightsRequest):
    """(policy, source, where) of the version asked for, or of the newest staged after it: staged from the
    collective stream (off the event loop: it may wait for that version's receive to end), else read
    and checked from its folder. A
    refused version answers 409; one that went by the stream only, which this server missed, 503."""
    policy = None if req.path else await asyncio.to_thread(s.receiver.take, req.version)
    if policy is not None:
        return policy, "collective", "the collective"
    try:
        path = req.path or await asyncio.to_thread(s.weights.fetch, req.version)
        return await asyncio.to_thread(prepare_weights, s.loop.core.model, path, s.adapter_base), "folder", path
    except StreamedOnly as e:  # not a bad version: this server missed the stream (503: taken out, rejoins)
        raise HTTPException(503, str(e)) from None
    except (WeightLoadError, WeightFetchError) as e:
        raise HTTPException(409, f"weights rejected, still serving v{s.loop.core.version}: {e}") from None


def add_weight_routes(app: FastAPI, s: Served, guarded: list) -> None:
    """In-flight weight updates (read and verified off the engine thread, swapped in between two
    decode steps; a rejected version answers 409 and the old one keeps serving), pause and resume."""
    loop = s.loop

    @app.post("/update_weights", dependencies=guarded)
    async def update_weights(req: UpdateWeightsRequest) -> UpdateWeightsResponse:
        t0 = time.perf_counter()
        if req.path is None and s.weights is None:
            raise HTTPException(400, "this server has no weight source: give a path")
        if req.path is not None and s.weights_root is not None and not _inside(Path(req.path), s.weights_root):
            raise HTTPException(400, f"path: {req.path} is not a version folder of this run ({s.weights_root})")
        served = loop.core.version
        if req.path is None and (req.version < served or (req.version == served and not s.receiver.holds(served))):
            # served already (asked again, e.g. by a restarted orchestrator: a streamed-only folder cannot be
            # read again, and need not be), or a newer one is (loaded in place of an older ask): skipped
            s.weights_skipped += req.version < served
            return UpdateWeightsResponse(version=served, load_s=0.0, source="served")
        policy, source, path = await staged_or_read(s, req)
        if policy.version < req.version or (source == "folder" and policy.version != req.version):
            raise HTTPException(409, f"{path} holds v{policy.version}, not v{req.version}")
        s.weights_skipped += policy.version != req.version  # a newer one came by the stream first: served instead
        await loop.load(policy)
        return UpdateWeightsResponse(version=loop.core.version, load_s=time.perf_counter() - t0, source=source)

    @app.get("/weights/collective/members", dependencies=guarded)
    async def collective_members() -> dict:
        # the server process itself receives, on its model's device, every expert
        return {"members": 1, "device": s.receiver.device().type, "experts": [None]}

    @app.post("/weights/collective/join", dependencies=guarded)
    async def collective_join(req: CollectiveJoin) -> dict:
        """Member of the trainer's weight group (answers once every member joined)."""
        try:
            await asyncio.to_thread(s.receiver.join, GroupInfo(**req.model_dump()))
        except (RuntimeError, ValueError) as e:  # unreachable store, timeout
            raise HTTPException(409, f"could not join weight group epoch {req.epoch}: {type(e).__name__}: {e}") from None
        return {"epoch": req.epoch}

    @app.post("/weights/collective/receive", dependencies=guarded)
    async def collective_receive(req: CollectiveReceive) -> dict:
        """Take one version off the group and stage it (answers when staged; the old version serves)."""
        try:
            return await asyncio.to_thread(s.receiver.receive, req.version, req.epoch)
        except ReceiveError as e:
            raise HTTPException(409, f"still serving v{loop.core.version}: {e}") from None

    @app.post("/pause", dependencies=guarded)
    async def pause() -> Health:
        loop.set_paused(True)
        return Health(ok=True, version=loop.core.version)

    @app.post("/resume", dependencies=guarded)
    async def resume() -> Health:
        loop.set_paused(False)
        return Health(ok=True, version=loop.core.version)


def add_status_routes(app: FastAPI, s: Served, guarded: list) -> None:
    loop = s.loop

    @app.get("/health", dependencies=guarded)
    async def health() -> Health:
        if loop.failed:
            raise HTTPException(500, "engine failed")
        return Health(ok=True, version=loop.core.version)

    @app.get("/metrics", dependencies=guarded)
    async def metrics() -> Metrics:
        core, st = loop.core, loop.core.stats
        pool = core.pool.stats if core.pool else None
        return Metrics(
            version=core.version, running=len(core.running), waiting=len(core.waiting), paused=loop.paused,
            generated_tokens=st.generated_tokens, prompt_tokens=st.prompt_tokens, prefill_tokens=st.prefill_tokens,
            prefix_hits=st.prefix_hits, prefix_hit_tokens=st.prefix_hit_tokens, weight_loads=st.weight_loads,
            tokens_per_s=loop.tokens_per_s(),
            pool_hit_tokens=pool.hit_tokens if pool else 0, pool_stored_chunks=pool.stored_chunks if pool else 0,
            pool_errors=pool.errors if pool else 0, pool_full=pool.full if pool else 0,
            pool_dropped=pool.dropped if pool else 0, kv_usage=core.kv_usage(),
            busy_frac=min(1.0, st.busy_s / max(time.monotonic() - s.started, 1e-9)), busy_s=st.busy_s,
            collective_staged=s.receiver.received, collective_receiving=s.receiver.receiving,
            weights_skipped=s.weights_skipped,
            decode_steps=st.steps, prefill_forwards=st.prefill_forwards,
        )


async def _unless_disconnected(request: Request, coros: list) -> list:
    """Run the generations; if the client disconnects first, cancel them (the engine drops them at its
    next step) instead of generating for nobody."""
    work = asyncio.ensure_future(asyncio.gather(*coros))
    while not work.done():
        done, _ = await asyncio.wait({work}, timeout=0.25)
        if not done and await request.is_disconnected():
            work.cancel()
            raise HTTPException(499, "client disconnected")
    return work.result()


async def _member_lines(loop: EngineLoop, seqs: list[Sequence], req: GenerateRequest):
    """`stream_members`: a line naming each member as it finishes, then the whole response. A client
    that goes away closes this generator: its members still generating are cancelled (dropped by the
    engine at its next step)."""
    async def one(i: int) -> int:
        await loop.generate(seqs[i])
        return i

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(seqs))]
    try:
        for finished in asyncio.as_completed(tasks):
            yield f'{{"member": {await finished}}}\n'
        yield _generate_response(seqs, req).model_dump_json() + "\n"
    finally:
        for t in tasks:
            t.cancel()


async def _validation_error(request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each field, without echoing the input (a NaN in it would make the answer a 500)."""
    errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()]
    if request.url.path.startswith("/v1/"):
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        param = ".".join(str(x) for x in first["loc"] if x != "body")
        return _openai_error(422, f"{param}: {first['msg']}", param)
    return JSONResponse({"detail": errors}, status_code=422)


async def _http_error(request, exc: HTTPException) -> JSONResponse:
    """OpenAI's error shape on /v1 (its clients show `error.message`); `{"detail": ...}` elsewhere."""
    if request.url.path.startswith("/v1/"):
        detail = str(exc.detail)
        return _openai_error(exc.status_code, detail, detail.split(":", 1)[0] if ":" in detail else None)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


def _openai_error(status: int, message: str, param: str | None) -> JSONResponse:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


class LimitBody:
    """Refuse bodies over MAX_BODY_BYTES unread (413). Plain ASGI, not BaseHTTPMiddleware, whose
    wrapped `receive` hides a client's disconnect from the endpoints."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            size = dict(scope["headers"]).get(b"content-length", b"0").decode("latin-1")
            if not size.isdigit() or int(size) > MAX_BODY_BYTES:
                response = JSONResponse({"detail": f"request body over {MAX_BODY_BYTES} bytes"}, status_code=413)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def _generate_response(seqs: list[Sequence], req: GenerateRequest) -> GenerateResponse:
    routed = req.return_routing
    return GenerateResponse(
        completions=[
            Completion(token_ids=s.out_ids, logprobs=s.logprobs, versions=s.versions, finish_reason=s.finish_reason,
                       routing=encode_routing(s.completion_routing()) if routed else None)
            for s in seqs
        ],
        prompt_routing=encode_routing(seqs[0].prompt_routing[req.routing_start:]) if routed else None,
    )


def _sequence(prompt_ids: list[int], params: SamplingParams, final: bool = False) -> Sequence:
    import torch

    seq = Sequence(list(prompt_ids), params, final=final)
    if params.seed is not None:
        seq.generator = torch.Generator().manual_seed(params.seed)
    return seq


def _openai_response(req: CompletionRequest, ids: list[int], seqs: list[Sequence], tokenizer, model_name,
                     echoed: list[float | None] | None = None) -> dict:
    """OpenAI's completion answer; `echoed`: the prompt's logprobs (echo), the prompt then written before each
    completion's text and tokens."""
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    prompt_text = tokenizer.decode(ids, skip_special_tokens=True) if echoed is not None else ""
    choices = []
    for i, s in enumerate(seqs):
        text = tokenizer.decode(s.out_ids, skip_special_tokens=True)
        reason = s.finish_reason
        for stop in stops:  # stop strings are applied to the text (simplified: after generation)
            if stop in text:
                text, reason = text[: text.index(stop)], "stop"
        choice = {"index": i, "text": prompt_text + text, "finish_reason": reason}
        if req.logprobs is not None:
            shown = [*ids, *s.out_ids] if echoed is not None else s.out_ids
            choice["logprobs"] = {
                "tokens": [tokenizer.decode([t]) for t in shown],
                "token_logprobs": [*(echoed or []), *s.logprobs],
            }
        choices.append(choice)
    completion = sum(len(s.out_ids) for s in seqs)
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:12]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model or model_name,
        "choices": choices,
        "usage": {"prompt_tokens": len(ids), "completion_tokens": completion, "total_tokens": len(ids) + completion},
    }


def main(config_path: str, serving=None) -> None:
    """The process of a server of the run: `serving(cfg, log)` (the embedded engine's `serve` by default), its
    failure reported in the run's events."""
    from prl.metrics import EventLog, reporting_errors
    from prl.recipe.resolve import load_process_config

    cfg = load_process_config(config_path)
    log = EventLog(cfg.run_path / "metrics.jsonl", cfg.name)
    with reporting_errors(log, cfg.name):
        (serving or serve)(cfg, log)
    # stopped cleanly (SIGTERM, its requests answered or dropped): leave without the interpreter's teardown, which
    # frees only what the exit drops anyway (0.2 s after the heap freeze with torch and transformers loaded, 1.3 s
    # without it; 0.07 s this way)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_app(cfg, app, what: str) -> None:
    """Serve `app` as the run's process `cfg` until SIGTERM: on its own socket (a taken port is not fatal where prl
    picked it), published for the run's clients."""
    import uvicorn

    from prl.transport import ports

    sock = ports.bind(cfg.host, cfg.port, cfg.port_fallback)
    port = sock.getsockname()[1]
    ports.publish(cfg.run_dir, cfg.name, cfg.host, port)
    print(f"{cfg.name}: serving on http://{cfg.host}:{port} ({what})", flush=True)
    # long keep-alive: the orchestrator reuses connections; closing idle ones races with reuse
    # SIGTERM: in-flight requests get 5 s, then are cancelled (and dropped by the engine)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=600,
                                  timeout_graceful_shutdown=5)).run(sockets=[sock])


def join_pool(cfg):
    """The run's KV pool (`inference.kv_pool`): wait for its master (started beside the servers),
    then contribute `memory_gb` of this process's memory."""
    if not cfg.kv_master:
        return None
    from prl.inference.kv_master import wait_for_master
    from prl.inference.kv_pool import KvPool

    pool = cfg.inference.kv_pool
    addr = wait_for_master(cfg, cfg.inference.startup_timeout_s)
    kv = KvPool.connect(master=addr.master, metadata=addr.metadata, hostname=cfg.host,
                        segment_bytes=int(pool.memory_gb * 2**30), run=cfg.run.name, chunk_tokens=pool.chunk_tokens,
                        retry_s=pool.retry_s)
    print(f"{cfg.name}: joined the KV pool at {addr.master} with {pool.memory_gb:g} GB", flush=True)
    return kv


def serve(cfg, log) -> None:
    import signal

    import torch

    from prl.model.build import build_model, load_tokenizer
    from prl.system import freeze_heap
    from prl.transport.weights import weight_source

    inf = cfg.inference
    torch.set_num_threads(inf.threads)
    model = build_model(cfg.model_dir, seed=cfg.run.seed, dtype=inf.dtype)
    if inf.fp8:
        from prl.model.fp8 import apply_fp8, backend

        report = apply_fp8(model)
        print(f"{cfg.name}: FP8 ({backend()}) on {len(report['fp8'])} layers, kept {len(report['kept'])}", flush=True)
    core = EngineCore(model, inf.max_batch_size, inf.prefix_cache_entries, seed=cfg.run.seed + 1000 * cfg.index,
                      capture_routing=cfg.router_replay, pool=join_pool(cfg), kv_capacity_tokens=inf.kv_capacity_tokens,
                      compiled=inf.compile, prefill_wait_steps=inf.prefill_wait_steps)
    if inf.compile:
        t0 = time.perf_counter()
        core.warm_up()
        print(f"{cfg.name}: forwards compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    def failed() -> None:  # the engine thread died: say why, then stop serving (the driver restarts us)
        log.emit("error", name=cfg.name, type="EngineFailure", line=str(loop.failed)[:300])
        os.kill(os.getpid(), signal.SIGTERM)

    loop = EngineLoop(core, on_failure=failed)
    loop.start()
    app = create_app(loop, load_tokenizer(cfg.model_dir), cfg.secret(), cfg.run.name, weight_source(cfg),
                     weights_root=cfg.run_path / "weights")
    freeze_heap()
    run_app(cfg, app, f"embedded engine, {inf.dtype}")
    loop.stop()
    if loop.core.pool is not None:
        loop.core.pool.close()  # leave the pool: the master frees this server's memory at once
