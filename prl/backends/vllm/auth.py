"""Bearer check on every route of a vLLM server, passed to it as `--middleware`; also answers
`GET /prl/staged` (weights staging status, `prl.backends.vllm.staging`) and the collective weight
path's routes (`prl.backends.vllm.collective`).

vLLM's `--api-key` guards only `/v1`, `/inference` and a few other prefixes; its RL routes
(`/pause`, `/update_weights`, `/collective_rpc`, ...) answer anyone who can reach the port. prl's
servers bind their host's address on a cluster, so every route needs the run's secret, compared in
constant time. The key comes from `VLLM_API_KEY`, which prl's launcher sets from the run's secret
file (never on a command line, where `ps` would show it).
"""

from __future__ import annotations

import os

from starlette.responses import JSONResponse

from prl.transport.auth import UNAUTHORIZED, bearer_ok

OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no secret; they reveal nothing
STAGED_PATH = "/prl/staged"  # prl's one route of its own on a vLLM server


async def require_bearer(request, call_next):
    key = os.environ.get("VLLM_API_KEY", "")
    if request.url.path in OPEN_PATHS:
        return await call_next(request)
    given = request.headers.get("authorization", "")
    if not key or not bearer_ok(given, key):
        return JSONResponse({"error": {"message": UNAUTHORIZED,
                                       "type": "authentication_error", "code": 401}}, status_code=401)
    if request.url.path == STAGED_PATH:
        return staged(request)
    if request.url.path.startswith("/weights/collective/"):
        from prl.backends.vllm import collective

        if request.url.path in collective.PATHS:
            return await collective.handle(request, collective.config())
    return await call_next(request)


def staged(request) -> JSONResponse:
    """`GET /prl/staged?version=N`: whether every worker has staged vN (`prl.backends.vllm.staging`)."""
    from prl.backends.vllm.staging import read_status, status_dir
    from prl.recipe.resolve import load_process_config

    raw = request.query_params.get("version", "")
    if not raw.lstrip("-").isdigit():
        return JSONResponse({"error": {"message": "version: an integer is required", "code": 400}}, status_code=400)
    cfg = load_process_config(os.environ["PRL_CONFIG"])
    return JSONResponse(read_status(status_dir(cfg), int(raw)))
