"""vLLM's ``POST /tokenize`` (a prompt, or a conversation rendered as a chat request renders
it, tools included) and ``POST /detokenize``, in AsyncLLM's tokenizer threads."""
from __future__ import annotations

from pagedllm.entrypoints.openai.chat_tools import render_chat_tools
from pagedllm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.entrypoints.openai.tool_calls import validate_tool_request
from pagedllm.errors import InvalidParameterError, check_unicode


class OpenAIServingTokenization(OpenAIServing):
    """The tokenizer routes (``OpenAIServing``'s arguments; no admission).
    ``trust_request_chat_template``: ``--trust-request-chat-template``, as for chat."""

    def __init__(self, engine, models, trust_request_chat_template: bool = False):
        super().__init__(engine, models)
        self.trust_request_chat_template = trust_request_chat_template

    async def create_tokenize(self, body: TokenizeRequest):
        """``{"count", "max_model_len", "tokens"}``, or a 404 for another model.

        Raises:
            InvalidParameterError: neither or both of ``prompt`` and ``messages``; a chat
                field with ``prompt``; a bad message, tool, template or template variable;
                ``chat_template`` without ``--trust-request-chat-template``.
        """
        if (r := self.models.check_model(body.model)) is not None:
            return r
        engine = self.engine
        if (body.prompt is None) == (body.messages is None):
            raise InvalidParameterError("prompt", "give exactly one of prompt and messages")
        self.check_request_chat_template(body.chat_template, self.trust_request_chat_template)
        if body.messages is not None:
            tools = validate_tool_request(body.tools).tools
            template = body.chat_template or getattr(engine.tokenizer, "chat_template", None)
            messages, tools_kw, _, _ = render_chat_tools([m.model_dump() for m in body.messages], tools, template)
            ids = await self.render_chat(messages, body.add_generation_prompt, body.chat_template,
                                         body.chat_template_kwargs, tools_kw)
        else:
            # the chat fields shape a rendered conversation; with a bare prompt they
            # would be silently ignored
            for field in ("tools", "chat_template", "chat_template_kwargs", "add_generation_prompt"):
                if field in body.model_fields_set:
                    raise InvalidParameterError(field, f"{field} applies only with messages, not with prompt")
            check_unicode("prompt", body.prompt)
            ids = await engine.tokenize(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    async def create_detokenize(self, body: DetokenizeRequest):
        """``{"prompt": text}``, or a 404 for another model.

        Raises:
            InvalidParameterError(param="tokens"): an id outside the vocabulary.
        """
        if (r := self.models.check_model(body.model)) is not None:
            return r
        vocab = self.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidParameterError("tokens", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return {"prompt": await self.engine.detokenize(body.tokens)}
