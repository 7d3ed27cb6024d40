"""Async client of the inference HTTP API (embedded server or any backend speaking it)."""

from __future__ import annotations

import asyncio
import time

import httpx

from prl.inference.protocol import (
    GenerateRequest,
    GenerateResponse,
    Health,
    Metrics,
    UpdateWeightsResponse,
)


class InferenceClient:
    def __init__(self, base_url: str, secret: str, max_connections: int = 128):
        self.base_url = base_url
        self.http = httpx.AsyncClient(
            base_url=base_url,
            headers={"Authorization": f"Bearer {secret}"},
            timeout=httpx.Timeout(600.0, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def post(self, path: str, body: dict, attempts: int = 3) -> httpx.Response:
        """POST, retrying transport errors (a keep-alive connection closed under us is not a dead
        server; a dead server fails every attempt and the error surfaces)."""
        for attempt in range(attempts):
            try:
                return await self.http.post(path, json=body)
            except httpx.TransportError:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        r = await self.post("/generate", req.model_dump())
        r.raise_for_status()
        return GenerateResponse.model_validate_json(r.content)

    async def update_weights(self, version: int, path: str | None = None) -> UpdateWeightsResponse:
        """Load `version`: from `path` if given, else from where the server's config says weights come."""
        r = await self.post("/update_weights", {"path": path, "version": version})
        if r.status_code == 409:
            raise RuntimeError(f"{self.base_url} rejected weights v{version}: {r.json().get('detail')}")
        r.raise_for_status()
        return UpdateWeightsResponse.model_validate_json(r.content)

    async def metrics(self) -> Metrics:
        r = await self.http.get("/metrics")
        r.raise_for_status()
        return Metrics.model_validate_json(r.content)

    async def wait_ready(self, timeout: float = 120.0) -> Health:
        deadline = time.monotonic() + timeout
        while True:
            try:
                r = await self.http.get("/health")
                if r.status_code == 200:
                    return Health.model_validate_json(r.content)
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"inference server {self.base_url} not healthy after {timeout}s")
            await asyncio.sleep(0.2)
