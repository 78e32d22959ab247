"""Inputs a user sent to the server, each with what it must get:

- ``Authorization: bearer KEY``: the scheme is case-insensitive (RFC 9110), the key is
  not."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from pagedllm.entrypoints.openai.middleware import ApiKeyMiddleware


# --------------------------------------------------------------------------------------
# Authorization: the scheme is case-insensitive, the key is not
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("authorization,status", [
    ("Bearer Key-123", 200), ("bearer Key-123", 200), ("BEARER Key-123", 200), ("bEaReR   Key-123", 200),
    ("bearer key-123", 401), ("Bearer KEY-123", 401), ("Bearer Key-1234", 401), ("BearerKey-123", 401),
    ("Basic Key-123", 401), ("Key-123", 401), ("Bearer", 401), ("", 401),
])
def test_bearer_scheme_any_case_key_exact(authorization, status):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def go():
        transport = httpx.ASGITransport(app=ApiKeyMiddleware(app, "Key-123"))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            headers = {"Authorization": authorization} if authorization else {}
            return await c.get("/v1/models", headers=headers)

    r = asyncio.run(go())
    assert r.status_code == status
    if status == 401:
        assert r.json()["error"]["code"] == 401 and r.headers["www-authenticate"] == "Bearer"
