"""The embedded engine as an `InferenceBackend`: a client of prl's own inference HTTP API."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pydantic

from prl.backends.base import BROKEN, NEVER_SENT, BackendError, InferenceBackend, MalformedResponse, WeightsRejected
from prl.inference.protocol import (GenerateRequest, GenerateResponse, Metrics, PrefillResponse, RewardResponse,
                                    ScoreResponse, UpdateWeightsResponse)
from prl.transport.line_stream import LineClient


class EmbeddedBackend(InferenceBackend):
    def __init__(self, base_url: str, secret: str, max_connections: int = 128):
        super().__init__(base_url, secret, max_connections)
        self.lines = LineClient(base_url, {"Authorization": f"Bearer {secret}"})

    async def wait_ready(self, timeout: float = 120.0) -> None:
        await self.poll_health(timeout)

    def generate_body(self, req: GenerateRequest) -> dict:
        return req.model_dump()

    def parse_generate(self, r: httpx.Response, req: GenerateRequest) -> GenerateResponse:
        return GenerateResponse.model_validate_json(r.content)

    async def send_generate(self, req: GenerateRequest, on_member: Callable[[int], None] | None) -> GenerateResponse:
        """With `on_member`: the server streams a line as each member finishes, then the response. Sent
        again, as `post` would, only while no member was heard of (the server drops what it was doing
        for a connection that broke)."""
        if on_member is None:
            return await super().send_generate(req, None)
        body = {**self.generate_body(req), "stream_members": True}
        heard: list[int] = []  # a retry happens only while this is empty
        for attempt in range(3):
            try:
                return await self._member_stream(body, lambda i: (heard.append(i), on_member(i)))
            except httpx.TransportError as e:
                if heard or attempt == 2 or not isinstance(e, NEVER_SENT + BROKEN):
                    raise BackendError(f"{self.base_url}{self.generate_path}: {type(e).__name__}: {e}") from None
                await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    async def _member_stream(self, body: dict, on_member: Callable[[int], None]) -> GenerateResponse:
        """Over the lean line client (`prl.transport.line_stream`): read to the answer's end, past the response
        line, so its connection is kept for the next group."""
        self.lines.base_url = self.base_url  # a restarted server may have moved (`retarget`)
        response = None
        async with self.lines.post(self.generate_path, body) as r:
            if r.status_code >= 400:
                self.check(httpx.Response(r.status_code, content=await r.read()), self.generate_path)
            async for line in r.lines():
                response = self.member_line(line, response, on_member)
        if response is None:
            raise BackendError(f"{self.base_url}{self.generate_path}: the member stream ended without the response")
        return response

    def member_line(self, line: str, response: GenerateResponse | None,
                    on_member: Callable[[int], None]) -> GenerateResponse | None:
        """One line of a member stream: a member finished (`on_member`), or the response (returned)."""
        try:
            msg = json.loads(line) if line else None
            if msg is not None and response is not None:
                raise ValueError("a line after the response")
            if isinstance(msg, dict) and set(msg) == {"member"}:
                on_member(int(msg["member"]))
            elif msg is not None:
                return GenerateResponse.model_validate(msg)
        except (ValueError, TypeError, pydantic.ValidationError) as e:
            raise MalformedResponse(f"{self.base_url}{self.generate_path}: bad member stream line "
                                    f"{line[:200]!r}: {e}") from None
        return response

    async def prefill(self, prompt_ids: list[int]) -> PrefillResponse:
        """P/D: have this (prefill) server put the prompt's KV into the run's pool."""
        r = self.check(await self.post("/prefill", {"prompt_ids": prompt_ids}, repeatable=True), "/prefill")
        return PrefillResponse.model_validate_json(r.content)

    async def score(self, items: list[tuple[list[int], int]]) -> ScoreResponse:
        """For each (ids, start): the logprobs of `ids[start:]` under the weights this server serves, in one forward
        (a teacher's scoring; nothing generated)."""
        body = {"items": [{"ids": ids, "start": start} for ids, start in items]}
        r = self.check(await self.post("/score", body, repeatable=True), "/score")
        return ScoreResponse.model_validate_json(r.content)

    async def reward(self, items: list[dict]) -> RewardResponse:
        """A reward-model server's scores of conversations (`prl.inference.reward_model`)."""
        r = self.check(await self.post("/reward", {"items": items}, repeatable=True), "/reward")
        try:
            return RewardResponse.model_validate_json(r.content)
        except pydantic.ValidationError as e:
            raise MalformedResponse(f"{self.base_url}/reward: {e.error_count()} errors in the answer") from None

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

    async def close(self) -> None:
        await self.lines.aclose()
        await super().close()

    async def metrics(self) -> Metrics:
        return Metrics.model_validate_json(self.check(await self.get("/metrics"), "/metrics").content)
