"""A vLLM OpenAI server as an `InferenceBackend`, through vLLM's own RL API (no patches).

- Rollouts: `POST /inference/v1/generate` (token ids in and out, the sampled token's logprob,
  `weight_versions` spans, `routed_experts`). The server runs with `--logprobs-mode
  processed_logprobs`, which is log_softmax(logits / temperature) as long as no top-p/top-k/min-p
  or penalty is applied (the recipe refuses `sampling.top_p < 1` with this backend).
- In-flight update of version N: stage (the prl weight-transfer engine in every worker fetches,
  verifies and checks vN on a thread while decoding goes on; the client polls `/prl/staged`),
  `/pause?mode=keep` (running requests keep their KV), load the staged tensors, `/finish_weight_update`
  with weight version "vN", `/resume`. A version that fails a check is refused before any tensor is
  touched (`WeightsRejected`): the old one keeps serving. A failure after the load began leaves the
  server paused (a half-loaded model is never served) and raises `ServerStuck`, as does a `/resume`
  that fails: the orchestrator takes the server out, the driver restarts it, it rejoins with the
  served version, and the run goes on. A server that answers with a reason (a missed or skipped
  version, a refused one) is never taken for stuck.
- Versions race: asked for vN while every worker staged a newer version whole (the trainer streamed
  it first), the client loads the newest instead, labelled with its own number; vN is skipped
  (`weights_skipped`). Asked for a version older than the one served: nothing to do, skipped too.
- Prefix KV: requests carry `cache_salt = "prl-v{N}"`, N the version served. Requests queued while the
  server is paused for a load carry a salt of their own (prefilled after the resume, under the new
  version or, if the load failed, the old one: either way no other request reuses their KV), and
  "prl-v{N+1}" once the load succeeded; no request ever hits blocks computed under another version
  (a request sent before keeps running under the new weights, like any in-flight request).
- A dead engine: a request that fails answers 5xx; any 5xx or transport error is raised as
  `BackendError` naming the server, so the run stops at once (vLLM's API server exits soon after).
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
import uuid

import httpx

from prl.backends.base import BackendError, InferenceBackend, MalformedResponse, ServerStuck, WeightsRejected
from prl.backends.vllm.rejected import REJECTED
from prl.model.weights import STREAMED_ONLY
from prl.inference.protocol import (Completion, GenerateRequest, GenerateResponse, Metrics, Routing, ScoreResponse,
                                    encode_routing)

# vLLM's label for the weights it started with (a tiny model's dummy init, or the pretrained folder)
STARTUP_VERSION = -1
WARM_UP_PROMPT = list(range(3, 19))
MAX_NEWER = 8  # newer versions in a row one stage may move on to before the server is taken out


class VersionMissed(BackendError):
    """The version went by the stream only and this server missed it (answered, not loaded): the server
    is taken out, not restarted, and rejoins on a later version, which the trainer writes whole."""


def version_label(version: int) -> str:
    return f"v{version}"


def parse_version(label: str) -> int:
    if label.startswith("v") and label[1:].isdigit():
        return int(label[1:])
    return STARTUP_VERSION


class VllmBackend(InferenceBackend):
    def __init__(self, base_url: str, secret: str, max_connections: int = 128, eos_token_id: int | None = None,
                 draft_weights: bool = False):
        """`draft_weights`: the server drafts with MTP but started on dummy weights (FP8 serving): after
        its first version, its drafter loads the model folder's draft layer (`prl.model.mtp`)."""
        super().__init__(base_url, secret, max_connections)
        self.eos, self.draft_weights, self.drafted = eos_token_id, draft_weights, False
        self.salt = version_label(STARTUP_VERSION)  # the cache_salt of requests sent now (see the module docstring)
        self.staged_version: int | None = None  # staged in an open weight-update session
        self._rate: list[tuple[float, float]] = []
        self.weight_loads = 0  # versions this client swapped in (vLLM counts none)
        self.weights_skipped = 0  # versions asked for while the server held a newer one (not loaded)
        self.busy = BusyClock()

    # ---- start ----
    async def wait_ready(self, timeout: float = 600.0) -> None:
        await self.poll_health(timeout)
        await self.warm_up()
        self.check(await self.post("/init_weight_transfer_engine", {"init_info": {}}), "/init_weight_transfer_engine")
        r = self.check(await self.get("/weight_info"), "/weight_info")
        self.version = parse_version(str(r.json().get("weight_version") or ""))
        self.salt = version_label(self.version)
        await self.metrics()  # the busy clock's first sample: its share spans time from here

    async def warm_up(self) -> None:
        """One short generation before any real request. vLLM checks some kernel constraints only
        when the first batch runs (on CPU: the attention head size; its engine then dies), so a
        server that cannot serve this model fails here, at start, naming the server."""
        body = {"token_ids": WARM_UP_PROMPT, "sampling_params": {"max_tokens": 2, "temperature": 0.0}}
        self.check(await self.post("/inference/v1/generate", body, repeatable=True), "warm-up /inference/v1/generate")

    # ---- rollouts ----
    generate_path = "/inference/v1/generate"

    def generate_body(self, req: GenerateRequest) -> dict:
        return self.request_body(req)

    def parse_generate(self, r: httpx.Response, req: GenerateRequest) -> GenerateResponse:
        return self.parse_response(r.json(), req)

    def request_body(self, req: GenerateRequest) -> dict:
        params = {
            "n": req.n, "temperature": req.temperature, "top_p": req.top_p, "max_tokens": req.max_tokens,
            "seed": req.seed, "logprobs": 0,
            # prl's rule: explicit stop ids replace the tokenizer's EOS (an empty list: no stop at all)
            "stop_token_ids": req.stop_token_ids or [], "ignore_eos": req.stop_token_ids is not None,
        }
        if req.stop_token_ids is None and self.eos is not None:
            params["stop_token_ids"] = [self.eos]
        if req.return_routing:
            params["routed_experts_prompt_start"] = req.routing_start
        return {"token_ids": req.prompt_ids, "sampling_params": params,
                "cache_salt": f"prl-{self.salt}"}

    def parse_response(self, body: dict, req: GenerateRequest) -> GenerateResponse:
        completions, prompt_routing = [], None
        n_prompt = len(req.prompt_ids) - req.routing_start
        for choice in sorted(body["choices"], key=lambda c: c["index"]):
            tokens = choice["token_ids"]
            logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
            if len(logprobs) != len(tokens):
                raise MalformedResponse(f"{self.base_url}: {len(tokens)} tokens but {len(logprobs)} logprobs")
            routing = None
            if req.return_routing:
                if choice.get("routed_experts") is None:
                    raise MalformedResponse(f"{self.base_url}: no routed_experts in the answer (trainer.router_replay "
                                       f"needs vLLM's Model Runner V2 on a GPU)")
                rows = decode_npy(choice["routed_experts"])
                prompt_routing = prompt_routing or to_routing(rows[:n_prompt])
                routing = to_routing(rows[n_prompt:])
            completions.append(Completion(
                token_ids=tokens, logprobs=logprobs, versions=token_versions(choice["weight_versions"], len(tokens)),
                finish_reason=choice["finish_reason"] or "length", routing=routing,
            ))
        return GenerateResponse(completions=completions, prompt_routing=prompt_routing)

    # ---- scoring ----
    async def score(self, items: list[tuple[list[int], int]]) -> ScoreResponse:
        """For each (ids, start): the logprobs of `ids[start:]` under the served weights (a teacher's scoring), from
        one /v1/completions request of all the sequences with `prompt_logprobs` (vLLM's prompt logprobs: one
        prefill each; the one token it also generates is dropped)."""
        body = {"prompt": [ids for ids, _ in items], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0,
                "cache_salt": f"prl-{self.salt}"}
        r = self.check(await self.post("/v1/completions", body, repeatable=True), "/v1/completions")
        try:
            choices = sorted(r.json()["choices"], key=lambda c: c["index"])
            out = [[row[str(ids[i])]["logprob"] for i, row in enumerate(c["prompt_logprobs"]) if i >= start]
                   for (ids, start), c in zip(items, choices, strict=True)]
        except (ValueError, KeyError, TypeError) as e:
            raise MalformedResponse(f"{self.base_url}/v1/completions: no prompt logprobs in the answer "
                                    f"({type(e).__name__}: {e})") from None
        return ScoreResponse(logprobs=out, version=self.version)

    # ---- weights ----
    def reset(self) -> None:
        super().reset()
        self.staged_version = None  # a restarted server holds no staged session
        self.drafted = False  # nor its drafter's weights
        # counted per server process, as the embedded engine does
        self.weight_loads, self.weights_skipped, self.busy = 0, 0, BusyClock()

    async def load_weights(self, version: int) -> float:
        """Stage (on a worker thread, decoding goes on), then swap in; returns the seconds decoding
        stood still (from the pause to the resume). A server whose workers all staged a newer version
        than `version` (the trainer streamed it first) loads that one instead, and one that serves a
        newer version already loads nothing: `version` is skipped and counted."""
        if version <= self.version:  # served already, or a newer one is (loaded in place of an older ask)
            self.weights_skipped += version < self.version
            return 0.0
        target = await self.stage(version)
        paused = await self.swap(target)
        self.weights_skipped += target != version
        return paused

    async def stage(self, version: int) -> int:
        """Open a weight-update session and have every worker fetch, verify and check `version`, or
        take the newest version every worker staged whole after it; returns the version staged (the
        session stays open for `swap`)."""
        if self.staged_version is not None and self.staged_version >= version:
            return self.staged_version
        await self.open_session()
        try:
            for _ in range(MAX_NEWER):
                await self.update(version, "stage")  # pins it in every worker: kept until loaded
                newest = await self.wait_staged(version)
                if newest is None:
                    break
                version = newest  # staged whole on every worker (streamed first): pin and load that one
            else:
                raise BackendError(f"{self.base_url}: newer weights kept arriving while staging ({MAX_NEWER} in a "
                                   f"row); taken out, it rejoins on the served version")
        except BaseException:
            await self.end_session()
            raise
        self.staged_version = version
        return version

    async def open_session(self) -> None:
        """Start a weight-update session; one left open by a client that went away (an orchestrator
        restarted between stage and swap) is ended first: nothing of it was loaded."""
        try:
            await self.weight_call("/start_weight_update")
        except BackendError as e:
            if "already active" not in str(e):
                raise
            await self.end_session()
            await self.weight_call("/start_weight_update")

    async def swap(self, version: int) -> float:
        """Pause (keep), load the staged `version`, label it, resume. A failure once the load began, or
        a `/resume` that fails, raises `ServerStuck`: the server stays paused until it is restarted."""
        self.staged_version = None
        t0 = time.perf_counter()
        loading, salt = False, self.salt
        try:
            self.check(await self.post("/pause", params={"mode": "keep", "clear_cache": "false"}), "/pause")
            # queued from now on: prefilled after the resume, under vN if the load succeeds, else under the
            # old version; a salt of their own, so that no other request reuses their KV in either case
            self.salt = f"{version_label(version)}-load-{uuid.uuid4().hex[:12]}"
            loading = True
            await self.update(version, "load")
            await self.weight_call("/finish_weight_update", {"weight_version": version_label(version)})
            if self.draft_weights and not self.drafted:
                await self.load_draft(version)
        except ServerStuck:
            raise
        except VersionMissed:  # answered before touching the model: the old version serves on
            self.salt = salt
            await self.end_session()
            await self.resume()
            raise
        except WeightsRejected:
            await self.end_session()
            await self.resume(quiet=True)  # the run stops on a rejected version: its error is the one to report
            raise
        except BackendError as e:
            if loading and not await self.gone():  # alive, the model maybe half-loaded: never serve it
                raise ServerStuck(f"{e}; the server stays paused until it is restarted") from None
            if loading:  # its process is gone (killed mid-load): down, the driver restarts it and it rejoins
                raise BackendError(f"{e}; the server is gone (it no longer accepts connections)") from None
            await self.end_session()
            await self.resume()  # /pause may have taken effect with its answer lost
            raise
        except BaseException:  # cancelled: the server was taken out, or the run stops
            if not loading:
                await self.end_session()
                await self.resume(quiet=True)
            raise
        await self.resume()
        self.version, self.salt = version, version_label(version)
        self.weight_loads += 1
        return time.perf_counter() - t0

    async def gone(self) -> bool:
        """Whether the server no longer accepts connections (its process died), asked once."""
        try:
            await self.http.get("/health", timeout=httpx.Timeout(5.0, connect=5.0))
        except httpx.ConnectError:
            return True
        except httpx.TransportError:
            return False
        return False

    async def load_draft(self, version: int) -> None:
        """The drafter's session (vLLM retargets prl's engine at the draft model): the folder's MTP layer,
        read and checked by each worker, then loaded; once per server process, while it is paused."""
        await self.weight_call("/start_draft_weight_update")
        await self.update(version, "draft")
        await self.weight_call("/finish_weight_update", {"weight_version": version_label(version)})
        self.drafted = True

    async def wait_staged(self, version: int, timeout: float = 600.0) -> int | None:
        """Poll prl's status route (not vLLM's engine loop) until every worker staged `version` or a
        newer one: None, or that newer version (the newest every worker staged whole)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.check(await self.get(f"/prl/staged?version={version}"), "/prl/staged").json()
            if status.get("newest") is not None:
                return int(status["newest"])
            if status["state"] == "ready":
                return None
            if status["state"] == "failed":
                if STREAMED_ONLY in (status["error"] or ""):  # missed the stream: taken out, rejoins on a later version
                    raise VersionMissed(f"{self.base_url}: weights v{version}: {status['error']}")
                raise WeightsRejected(f"{self.base_url} rejected weights v{version}: {status['error']}")
            if time.monotonic() > deadline:
                raise BackendError(f"{self.base_url}: weights v{version} not staged after {timeout:.0f}s")
            await asyncio.sleep(0.02)

    async def update(self, version: int, action: str) -> None:
        r = await self.post("/update_weights", {"update_info": {"version": version, "action": action}})
        if r.status_code < 400:
            return
        if STREAMED_ONLY in r.text:  # the version went by the stream only and this server missed it: taken out
            raise VersionMissed(f"{self.base_url}: weights v{version}: {r.text[:400]}")
        if action == "stage" or REJECTED in r.text:  # refused before any tensor was touched: the old version serves on
            raise WeightsRejected(f"{self.base_url} rejected weights v{version}: {r.text[:400]}")
        raise ServerStuck(f"{self.base_url}: loading weights v{version} failed after it began; the model is in an "
                          f"undefined state and the server stays paused (restart it): {r.text[:400]}")

    async def end_session(self) -> None:
        """vLLM ends a weight-update session when an update fails; end it in any case (best effort)."""
        try:  # ending a session twice is harmless: sent again if its connection broke (vLLM may close one after a 500)
            await self.post("/finish_weight_update", repeatable=True)
        except BackendError:
            pass

    async def resume(self, quiet: bool = False) -> None:
        """`/resume`; a server that does not resume stays paused: `ServerStuck` (or, `quiet`, printed)."""
        try:
            self.check(await self.post("/resume", repeatable=True), "/resume")
        except BackendError as e:
            if not quiet:
                raise ServerStuck(f"{e}; the server did not resume and stays paused until it is restarted") from None
            print(f"prl: {e}", flush=True)

    async def weight_call(self, path: str, body: dict | None = None) -> None:
        self.check(await self.post(path, body), path)

    # ---- metrics ----
    async def metrics(self) -> Metrics:
        """vLLM's counters in prl's terms. Busy time: vLLM exports no engine-busy counter, so it is
        sampled, as `BusyClock` says; weight loads: the versions this client swapped in."""
        r = self.check(await self.get("/metrics"), "/metrics")
        m = prometheus_values(r.text)
        generated = int(m.get("vllm:generation_tokens_total", 0))
        paused = self.check(await self.get("/is_paused"), "/is_paused").json().get("is_paused", False)
        running = int(m.get("vllm:num_requests_running", 0))
        busy_s, busy_frac = self.busy.sample(running > 0 and not paused)
        return Metrics(
            version=self.version, running=running,
            waiting=int(m.get("vllm:num_requests_waiting", 0)), paused=bool(paused), generated_tokens=generated,
            prompt_tokens=int(m.get("vllm:prompt_tokens_total", 0)),
            prefill_tokens=int(m.get("vllm:prompt_tokens_total", 0) - m.get("vllm:prefix_cache_hits_total", 0)
                               - m.get("vllm:external_prefix_cache_hits_total", 0)),  # computed here
            prefix_hits=int(m.get("vllm:prefix_cache_hits_total", 0)), weight_loads=self.weight_loads,
            weights_skipped=self.weights_skipped,
            pool_hit_tokens=int(m.get("vllm:external_prefix_cache_hits_total", 0)),
            kv_usage=prometheus_max(r.text, "vllm:kv_cache_usage_perc"),
            **mooncake_counts(r.text),
            tokens_per_s=self.rate(generated), busy_frac=busy_frac, busy_s=busy_s,
        )

    def rate(self, total: float) -> float:
        now = time.monotonic()
        self._rate = [(t, n) for t, n in self._rate if now - t < 10][-32:] + [(now, total)]
        t0, n0 = self._rate[0]
        return (total - n0) / (now - t0) if now > t0 else 0.0


class BusyClock:
    """Busy time of a server sampled at each metrics poll (about once a second): the time between two
    polls counts as busy by the share of its two ends that found requests running and the server not
    paused. An estimate with one poll's resolution; busy share = busy time / time observed. The first
    sample is taken when the server is ready (`wait_ready`), so every reported share spans time."""

    def __init__(self):
        self.last: tuple[float, bool] | None = None
        self.first = 0.0
        self.busy_s = 0.0

    def sample(self, busy: bool, now: float | None = None) -> tuple[float, float]:
        now = time.monotonic() if now is None else now
        if self.last is None:
            self.first = now
        else:
            t, was_busy = self.last
            self.busy_s += (now - t) * (was_busy + busy) / 2
        self.last = (now, busy)
        span = now - self.first
        return self.busy_s, (min(1.0, self.busy_s / span) if span > 0 else 0.0)


def token_versions(spans: list[dict] | None, n: int) -> list[int]:
    """vLLM's half-open `weight_versions` spans over output tokens -> one version per token."""
    out = [STARTUP_VERSION] * n
    for span in spans or []:
        for i in range(span["start"], min(span["end"], n)):
            out[i] = parse_version(str(span["version"]))
    return out


def decode_npy(data: str):
    import numpy as np

    return np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)


def to_routing(rows) -> Routing:
    """vLLM's uint8/uint16 expert ids -> prl's wire dtype (uint8 up to 256 experts, else int16)."""
    import numpy as np
    import torch

    return encode_routing(torch.from_numpy(np.ascontiguousarray(rows.astype(np.uint8 if rows.max(initial=0) < 256
                                                                           else np.int16))))


def mooncake_counts(text: str) -> dict[str, int]:
    """Metrics' pool fields from vLLM's MooncakeStoreConnector counters: blocks stored (keys put minus
    those that failed), puts refused (failed put keys: the pool full), errors (failed lookups and
    loads, which vLLM recomputes, and operations that failed whole)."""
    keys = labelled(text, "vllm:mooncake_store_operation_keys_total")
    failed = labelled(text, "vllm:mooncake_store_operation_failed_keys_total")
    ops = labelled(text, "vllm:mooncake_store_operation_total")

    def total(samples, *, put: bool) -> float:
        return sum(v for lab, v in samples if (lab.get("operation") == "save_put") == put)

    return {"pool_stored_chunks": int(total(keys, put=True) - total(failed, put=True)),
            "pool_full": int(total(failed, put=True)),
            "pool_errors": int(total(failed, put=False) + sum(v for lab, v in ops if lab.get("status") == "error"))}


def labelled(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric `name` with its labels, from Prometheus text format."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        labels, _, value = line[len(name) + 1:].rpartition("} ")
        pairs = (item.split("=", 1) for item in labels.split('",') if "=" in item)
        try:
            out.append(({k.strip(): v.strip().strip('"') for k, v in pairs}, float(value)))
        except ValueError:
            continue
    return out


def prometheus_max(text: str, metric: str) -> float | None:
    """The largest sample of one metric over its labels (vLLM's data-parallel engines each report
    their own KV usage; the fullest one limits), None when absent."""
    values = prometheus_samples(text).get(metric)
    return max(values) if values else None


def prometheus_values(text: str) -> dict[str, float]:
    """Sum of every sample of each metric (labels dropped) from Prometheus text format."""
    return {name: sum(values) for name, values in prometheus_samples(text).items()}


def prometheus_samples(text: str) -> dict[str, list[float]]:
    """Every sample of each metric (labels dropped) from Prometheus text format."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        try:
            out.setdefault(name_labels.split("{", 1)[0], []).append(float(value))
        except ValueError:
            continue
    return out
