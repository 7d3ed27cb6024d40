"""The embedded engine as an `InferenceBackend`: a client of prl's own inference HTTP API."""

from __future__ import annotations

import httpx

from prl.backends.base import InferenceBackend, WeightsRejected
from prl.inference.protocol import GenerateRequest, GenerateResponse, Metrics, PrefillResponse, UpdateWeightsResponse


class EmbeddedBackend(InferenceBackend):
    async def wait_ready(self, timeout: float = 120.0) -> None:
        await self.poll_health(timeout)

    def generate_body(self, req: GenerateRequest) -> dict:
        return req.model_dump()

    def parse_generate(self, r: httpx.Response, req: GenerateRequest) -> GenerateResponse:
        return GenerateResponse.model_validate_json(r.content)

    async def prefill(self, prompt_ids: list[int]) -> PrefillResponse:
        """P/D: have this (prefill) server put the prompt's KV into the run's pool."""
        r = self.check(await self.post("/prefill", {"prompt_ids": prompt_ids}, repeatable=True), "/prefill")
        return PrefillResponse.model_validate_json(r.content)

    async def load_weights(self, version: int) -> float:
        """The engine reads and verifies off its thread and copies the version in between two decode
        steps: decoding never pauses (the copy is not reported; `bench/weight_update.py` times it)."""
        await self.update_weights(version)
        return 0.0

    async def update_weights(self, version: int, path: str | None = None) -> UpdateWeightsResponse:
        """Load `version`: from `path` if given, else from where the server's config says weights come."""
        r = await self.post("/update_weights", {"path": path, "version": version})
        if r.status_code == 409:
            raise WeightsRejected(f"{self.base_url} rejected weights v{version}: {r.json().get('detail')}")
        self.check(r, "/update_weights")
        out = UpdateWeightsResponse.model_validate_json(r.content)
        self.version = out.version
        return out

    async def metrics(self) -> Metrics:
        return Metrics.model_validate_json(self.check(await self.get("/metrics"), "/metrics").content)
