"""The engine's locked control plane: one token per job, checked on every route.

vLLM's `--api-key` guards only `/v1` and `/inference`; the dev-mode routes vime drives (/pause,
/update_weights, /collective_rpc, ...) answer anyone who reaches the port. vime starts every
server it launches with `--middleware vime.engines.auth.TokenMiddleware` and the token in the
server's environment (TOKEN_ENV; /proc/PID/environ is readable by its user only). The middleware
answers 401 to any request, on any route, that does not carry `Authorization: Bearer <token>`,
before vLLM sees it. vime's clients send the header (`auth_headers`).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from typing import Any

TOKEN_ENV = "VIME_ENGINE_TOKEN"
MIDDLEWARE = "vime.engines.auth.TokenMiddleware"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def auth_headers(token: str | None) -> dict[str, str]:
    """The header vime's clients send; none when the engine has no token (an external server
    the user runs without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class TokenMiddleware:
    """Pure ASGI middleware (streams pass through untouched): 401 without the job's token."""

    def __init__(self, app: Any) -> None:
        token = os.environ.get(TOKEN_ENV)
        if not token:
            raise RuntimeError(
                f"{MIDDLEWARE} is installed but ${TOKEN_ENV} is empty: the server would refuse "
                "every request. Start it through vime (which sets the token) or set the variable"
            )
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)  # lifespan
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return None
        body = json.dumps(
            {"error": "vime engine: missing or wrong 'Authorization: Bearer <token>' header"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return None
