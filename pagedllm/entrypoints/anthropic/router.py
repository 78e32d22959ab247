"""The Messages API's routes; each takes its serving object from ``app.state`` (put there by
``api_server.build_app``). Their errors reach the client in Anthropic's shape (``errors``)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from pagedllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedllm.entrypoints.anthropic.serving_messages import AnthropicServingMessages

router = APIRouter()


def messages(raw: Request) -> AnthropicServingMessages:
    return raw.app.state.anthropic_serving_messages


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, raw: Request):
    return await messages(raw).create_message(body, raw)


@router.post("/v1/messages/count_tokens")
async def count_message_tokens(body: CountTokensRequest, raw: Request):
    return await messages(raw).count_tokens(body)
