"""vime's HTTP calls to engines: every call has a timeout; errors name the URL and carry the body.

The health probes (`engines.watchdog`, the server's start-up wait in `engines.server`) call
`requests` themselves: they tell a timeout (a stalled engine) from a refused connection (a dead
or not yet listening one), which this helper folds into one error."""

from __future__ import annotations

import logging
from typing import Any

import requests

logger = logging.getLogger(__name__)

MAX_BODY_CHARS = 2000


class EngineHTTPError(RuntimeError):
    """An HTTP call to an engine failed: unreachable, timed out, or answered with an error."""

    def __init__(self, message: str, *, url: str = "", status: int | None = None, body: str = ""):
        # url has a default so the error survives pickling (Ray passes it between processes:
        # an exception is rebuilt from its args, then its fields are restored).
        super().__init__(message)
        self.url = url
        self.status = status
        self.body = body


def request_json(
    method: str,
    url: str,
    *,
    timeout_s: float,
    params: dict[str, Any] | None = None,
    json: Any = None,
    session: requests.Session | None = None,
    headers: dict[str, str] | None = None,
) -> Any:
    """Send one request and return the decoded JSON body (None for an empty body).

    Raises EngineHTTPError naming the method and URL on connection failure, on timeout and on any
    status >= 400; an error status carries the start of the response body.
    """
    sender = session if session is not None else requests
    try:
        response = sender.request(
            method, url, params=params, json=json, headers=headers, timeout=timeout_s
        )
    except requests.Timeout as exc:
        raise EngineHTTPError(f"{method} {url} timed out after {timeout_s:g} s", url=url) from exc
    except requests.ConnectionError as exc:
        raise EngineHTTPError(f"{method} {url}: cannot connect ({exc})", url=url) from exc
    if response.status_code >= 400:
        body = response.text[:MAX_BODY_CHARS]
        raise EngineHTTPError(
            f"{method} {url} -> HTTP {response.status_code}: {body}",
            url=url,
            status=response.status_code,
            body=body,
        )
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text
