"""The run's secret as a bearer token: every prl endpoint (inference server, trainer endpoint, sandbox
worker, the middleware of a vLLM server) compares it in constant time and answers the same message."""

from __future__ import annotations

import hmac

UNAUTHORIZED = "missing or wrong bearer token (the run's secret file)"


def bearer_ok(authorization: str, secret: str) -> bool:
    """`authorization` (the request's Authorization header) is `Bearer <secret>`."""
    return hmac.compare_digest(authorization.encode(), f"Bearer {secret}".encode())


def bearer(secret: str):
    """A FastAPI dependency that refuses a request without the run's secret (401). A coroutine: FastAPI runs a
    plain function dependency on its thread pool, a thread hop per request on the server's event loop."""
    from fastapi import Header, HTTPException

    async def auth(authorization: str = Header("")):
        if not bearer_ok(authorization, secret):
            raise HTTPException(401, UNAUTHORIZED)
    return auth
