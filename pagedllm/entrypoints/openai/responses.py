"""Response pieces in OpenAI's shapes: usage, and logprobs for chat and for completions,
from ``CompletionOutput.logprobs`` / ``RequestOutput.prompt_logprobs`` (per position a dict
token id -> ``Logprob``)."""
from __future__ import annotations

import asyncio
import dataclasses

from pagedllm.outputs import Logprob


def usage(prompt_tokens: int, completion_tokens: int, cached: int, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's ``usage`` object (token counts); ``completion_tokens_details`` only with
    ``reasoning_tokens``."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of a position, by rank."""
    return sorted(entry.items(), key=lambda kv: kv[1].rank)[:k]


def _logprob(v: float) -> float:
    # JSON has no -Infinity: a token the model gives probability 0 gets OpenAI's floor
    return max(v, -9999.0)


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int) -> dict:
    """``choices[i].logprobs`` of a chat completion: ``{"content": [{"token", "logprob",
    "bytes", "top_logprobs": [{"token", "logprob", "bytes"}] (k of them)}]}``."""
    content = []
    for t, e in zip(token_ids, entries):
        lp = e[t]
        content.append({"token": lp.decoded_token, "logprob": _logprob(lp.logprob),
                        "bytes": list(lp.decoded_token.encode("utf-8")),
                        "top_logprobs": [{"token": x.decoded_token, "logprob": _logprob(x.logprob),
                                          "bytes": list(x.decoded_token.encode("utf-8"))} for _, x in _top(e, k)]})
    return {"content": content}


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], k: int,
                        token_text=None, start: int = 0) -> dict:
    """``choices[i].logprobs`` of a completion: parallel lists ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (token text -> logprob: the top k, plus the position's own token when not
    among them, as vLLM) and ``text_offset`` (from ``start``). A None entry (the first prompt
    token, with ``echo``) has null logprobs and its text from ``token_text`` (id -> text)."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = start
    for t, e in zip(token_ids, entries):
        if e is None:
            text = token_text(t)
            tokens.append(text)
            lps.append(None)
            tops.append(None)
            offsets.append(pos)
            pos += len(text)
            continue
        lp = e[t]
        tokens.append(lp.decoded_token)
        lps.append(_logprob(lp.logprob))
        top = {x.decoded_token: _logprob(x.logprob) for _, x in _top(e, k)}
        top.setdefault(lp.decoded_token, _logprob(lp.logprob))
        tops.append(top)
        offsets.append(pos)
        pos += len(lp.decoded_token)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token None (the first) or a dict
    token id (a string) -> {"logprob", "rank", "decoded_token"}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": _logprob(v.logprob), "rank": v.rank,
                                             "decoded_token": v.decoded_token} for t, v in e.items()}
            for e in entries]


class CompletionFormat:
    """The choices of one /v1/completions request (``echo``, ``logprobs``, ``n``).

    Args:
        body: the CompletionRequest; params: its SamplingParams; engine: the AsyncLLM (decodes
            what outputs do not carry as text); prompt_only: ``echo`` with ``max_tokens`` 0
            (the engine ran with 1; the generated tokens are hidden by ``visible``).
    """

    def __init__(self, body, params, engine, prompt_only: bool = False):
        self.prompt_only = prompt_only
        self.echo = body.echo
        self.k = params.logprobs
        self.n = params.n
        self.want_prompt_logprobs = body.prompt_logprobs is not None
        self.engine = engine
        self._prompt_texts: dict[str, str] = {}   # request id -> its decoded prompt

    def visible(self, out):
        """``out`` as shown: unchanged, or with ``prompt_only`` every sequence emptied (finish
        reason "length")."""
        if not self.prompt_only:
            return out
        outputs = [dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                                       cumulative_logprob=None if c.logprobs is None else 0.0,
                                       finish_reason="length" if c.finished else None, stop_reason=None)
                   for c in out.outputs]
        return dataclasses.replace(out, outputs=outputs, delta_text="", delta_token_ids=[])

    async def prompt_text(self, out) -> str:
        """The prompt as text (decoded once, when given as token ids or truncated)."""
        if out.prompt is not None:
            return out.prompt
        text = self._prompt_texts.get(out.request_id)
        if text is None:
            text = self._prompt_texts[out.request_id] = await self.engine.detokenize(out.prompt_token_ids)
        return text

    async def prompt_lp(self, out) -> dict:
        """The echoed prompt's part of ``logprobs``."""
        entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        bare = list(dict.fromkeys(t for t, e in zip(out.prompt_token_ids, entries) if e is None))
        texts = dict(zip(bare, await asyncio.gather(*[self.engine.detokenize([t]) for t in bare])))
        return completion_logprobs(out.prompt_token_ids, entries, self.k, texts.__getitem__)

    async def logprobs(self, out, c, echo: bool, start: int = 0) -> dict | None:
        """``logprobs`` of completion ``c`` of ``out`` (with the prompt's first if ``echo``);
        ``start``: the text offset of ``c``'s first token."""
        if self.k is None:
            return None
        if not echo:
            return completion_logprobs(c.token_ids, c.logprobs or [], self.k, start=start)
        p = await self.prompt_lp(out)
        gen = completion_logprobs(c.token_ids, c.logprobs or [], self.k, start=len(await self.prompt_text(out)))
        return {key: p[key] + gen[key] for key in p}

    async def choice(self, index: int, out, c) -> dict:
        """A whole choice: ``index`` (prompt i's sequence j is ``i * n + j``)."""
        text = await self.prompt_text(out) + c.text if self.echo else c.text
        ch = {"index": index, "text": text, "logprobs": await self.logprobs(out, c, self.echo),
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.want_prompt_logprobs:
            ch["prompt_logprobs"] = prompt_logprobs(out.prompt_logprobs)
        return ch
