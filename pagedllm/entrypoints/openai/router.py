"""The server's routes. Each takes its serving object from ``app.state`` (put there by
``api_server.build_app``) and returns what it answers; errors it raises become OpenAI's
error bodies in ``errors.py``'s handlers."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

import pagedllm
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest)
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

router = APIRouter()


def engine(raw: Request) -> AsyncLLM:
    return raw.app.state.engine


def models(raw: Request) -> OpenAIServingModels:
    return raw.app.state.openai_serving_models


def completion(raw: Request) -> OpenAIServingCompletion:
    return raw.app.state.openai_serving_completion


def chat(raw: Request) -> OpenAIServingChat:
    return raw.app.state.openai_serving_chat


def responses(raw: Request) -> OpenAIServingResponses:
    return raw.app.state.openai_serving_responses


def tokenization(raw: Request) -> OpenAIServingTokenization:
    return raw.app.state.openai_serving_tokenization


@router.get("/health")
async def health(raw: Request):
    """200 while an engine serves (503 when none does); with data parallelism the body
    lists each engine, ``{"engines": [{"engine": 0, "alive": true}, ...]}``."""
    eng = engine(raw)
    await eng.check_health()
    status = eng.engine_status()
    if not status:
        return Response(status_code=200)
    return {"engines": [{"engine": i, "alive": why is None, **({"error": why} if why else {})}
                        for i, why in status]}


@router.get("/version")
async def version():
    return {"version": pagedllm.__version__}


@router.get("/metrics")
async def metrics(raw: Request):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    prometheus = raw.app.state.prometheus
    if prometheus is None:
        return Response(status_code=404)
    return Response(generate_latest(prometheus.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(raw: Request):
    n = await engine(raw).reset_prefix_cache()
    return {"status": "ok", "num_blocks_dropped": n}


@router.get("/v1/models")
async def show_available_models(raw: Request):
    return models(raw).show_available_models()


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, raw: Request):
    # a served name may contain "/" (e.g. "org/model"), hence the path converter
    return models(raw).retrieve_model(model_id)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request):
    return await tokenization(raw).create_tokenize(body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request):
    return await tokenization(raw).create_detokenize(body)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, raw: Request):
    return await completion(raw).create_completion(body, raw)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
    return await chat(raw).create_chat_completion(body, raw)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, raw: Request):
    return await responses(raw).create_response(body, raw)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, raw: Request):
    return responses(raw).retrieve_response(response_id, raw)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw: Request):
    return responses(raw).delete_response(response_id)
