"""Bearer check on every route of a vLLM server, passed to it as `--middleware`.

vLLM's `--api-key` guards only `/v1`, `/inference` and a few other prefixes; its RL routes
(`/pause`, `/update_weights`, `/collective_rpc`, ...) answer anyone who can reach the port. prl's
servers bind their host's address on a cluster, so every route needs the run's secret, compared in
constant time. The key comes from `VLLM_API_KEY`, which prl's launcher sets from the run's secret
file (never on a command line, where `ps` would show it).
"""

from __future__ import annotations

import hmac
import os

from starlette.responses import JSONResponse

OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no secret; they reveal nothing


async def require_bearer(request, call_next):
    key = os.environ.get("VLLM_API_KEY", "")
    if request.scope.get("type") != "http" or request.url.path in OPEN_PATHS:
        return await call_next(request)
    given = request.headers.get("authorization", "")
    if not key or not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        return JSONResponse({"error": {"message": "missing or wrong bearer token (the run's secret file)",
                                       "type": "authentication_error", "code": 401}}, status_code=401)
    return await call_next(request)
