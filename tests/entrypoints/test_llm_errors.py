"""Offline API errors: bad input to ``LLM.generate`` raises a ValueError naming the problem,
queues nothing, and leaves the engine usable (its next outputs are still the references)."""
from __future__ import annotations

import pytest

from engine_helpers import REF_TOKENS, engine_core, engine_leaks, greedy, run_alone
from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def greedy_alone(llm, mixed_prompts):
    """The session's ``greedy_alone`` for the three prompts used here: each generated alone
    on the main engine with an empty prefix cache (the 32 of conftest's take ~25 s)."""
    llm.reset_prefix_cache()
    return run_alone(llm, mixed_prompts[:3], greedy(REF_TOKENS))


@pytest.fixture
def check_usable(llm, mixed_prompts, greedy_alone):
    """After the test: the engine is idle, and generating still gives the reference."""
    yield
    assert engine_leaks(llm) == []
    out = llm.generate(mixed_prompts[1], greedy(4), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == greedy_alone[1][:4]


def test_negative_max_tokens(llm, check_usable):
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(["Hello"], SamplingParams(max_tokens=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(["Hello"], [SamplingParams(max_tokens=0)], use_tqdm=False)


def test_prompt_over_max_model_len(llm, check_usable):
    n = llm.llm_engine.max_model_len
    assert n == 1024
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [100] * n}], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [100] * (n + 500)}], greedy(1), use_tqdm=False)
    # Prompt + max_tokens over the limit names both.
    with pytest.raises(ValueError, match=r"max_tokens.*max_model_len"):
        llm.generate([{"prompt_token_ids": [100] * (n - 10)}], greedy(11), use_tqdm=False)
    # Exactly at the limit is fine.
    out = llm.generate([{"prompt_token_ids": [100] * (n - 2)}], greedy(2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("prompts", [
    123, None, 4.5, [1.5], [None], [{"foo": "bar"}], [[]], [""], [["a", "b"]], [[1, "a"]],
    [[True, 5]], [[-1]], [[10**9]], [b"bytes"], [[1, 2], 3.0],
], ids=repr)
def test_wrong_prompt_type(llm, check_usable, prompts):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompts, greedy(2), use_tqdm=False)


def test_one_bad_prompt_queues_nothing(llm, check_usable, mixed_prompts):
    with pytest.raises(ValueError):
        llm.generate([mixed_prompts[0], mixed_prompts[1], [10**9]], greedy(4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([mixed_prompts[0], {"prompt_token_ids": [5] * 5000}], greedy(4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_sampling_params_errors(llm, check_usable):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [greedy(2)], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them, got list of dict"):
        llm.generate(["a"], [{"temperature": 0}], use_tqdm=False)
    with pytest.raises(ValueError, match="got dict$"):    # a dict was read as its keys
        llm.generate(["a"], {"max_tokens": 3}, use_tqdm=False)
    with pytest.raises(ValueError, match="got list of str"):    # cache_salt read .cache_salt of each first
        llm.generate(["a"], ["x"], use_tqdm=False, cache_salt="s")
    vocab = llm.llm_engine.config.arch.vocab_size
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["a"], SamplingParams(stop_token_ids=[vocab]), use_tqdm=False)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate(["a"], greedy(2), use_tqdm=False, cache_salt="")


def test_single_prompt_forms_are_equivalent(llm, mixed_prompts, greedy_alone):
    """A bare string, a bare token-id list and a bare prompt dict each mean one prompt."""
    text = mixed_prompts[0]
    ids = llm.get_tokenizer().encode(text)
    ref = greedy_alone[0]
    sp = greedy(REF_TOKENS)
    for form in (text, ids, [text], [ids], {"prompt": text}, {"prompt_token_ids": ids},
                 [{"prompt": text}], [{"prompt_token_ids": ids}]):
        outs = llm.generate(form, sp, use_tqdm=False)
        assert len(outs) == 1, f"{type(form).__name__} prompt gave {len(outs)} outputs"
        assert outs[0].prompt_token_ids == ids
        assert outs[0].outputs[0].token_ids == ref


def test_unknown_engine_argument():
    with pytest.raises(ValueError, match="no_such_option"):
        LLM(no_such_option=1)


@pytest.mark.parametrize("kw, param", [
    (dict(quantization=["int8"]), "quantization"), (dict(kv_cache_dtype={}), "kv_cache_dtype"),
    (dict(dtype=["bfloat16"]), "dtype"), (dict(device={}), "device"), (dict(attention_backend=[1]), "attention_backend"),
    (dict(model=5), "model"), (dict(served_model_name=["a"]), "served_model_name"), (dict(profile_dir=3), "profile_dir"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching"), (dict(seed="1"), "seed"),
    (dict(kv_cache_memory=[1]), "kv_cache_memory"), (dict(gpu_memory_utilization="a"), "gpu_memory_utilization"),
    (dict(max_model_len=True), "max_model_len"), (dict(speculative_config=[1]), "speculative_config"),
])
def test_engine_argument_of_a_wrong_type_names_it(kw, param):
    """A list, dict or string where the setting takes another type is a ValueError naming
    it before anything loads (a list for ``quantization`` was a TypeError from a dict lookup)."""
    from pagedllm.config import EngineArgs
    from pagedllm.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match=rf"^{param} must be ") as e:
        LLM(**kw)
    assert e.value.param == param
    import pathlib

    import torch

    ok = EngineArgs(model=pathlib.Path("m.gguf"), device=torch.device("cpu"), gpu_memory_utilization=1,
                    profile_dir=pathlib.Path("p"))
    ok._check_types()   # what is allowed passes; paths become strings (the loaders test str.endswith)
    assert ok.model == "m.gguf" and ok.profile_dir == "p"


def test_model_may_be_a_path_object():
    import pathlib

    from pagedllm.config import EngineArgs, EngineConfig
    from pagedllm.utils import default_model_path

    cfg = EngineConfig.from_args(EngineArgs(model=pathlib.Path(default_model_path()), dtype="float32"))
    assert cfg.model_path == default_model_path() and cfg.arch.architecture == "LlamaForCausalLM"


def test_cli_message_names_the_flag_once():
    from pagedllm.config import EngineArgs
    from pagedllm.errors import InvalidParameterError

    assert EngineArgs.cli_message(InvalidParameterError("quantization", "quantization: x is bad")) == \
        "--quantization: x is bad"
    assert EngineArgs.cli_message(InvalidParameterError("quantization", "quantization must be one of a")) == \
        "--quantization: must be one of a"
    assert EngineArgs.cli_message(InvalidParameterError("kv_cache_dtype", "--kv-cache-dtype: y")) == \
        "--kv-cache-dtype: y"
    assert EngineArgs.cli_message(InvalidParameterError("kv_cache_dtype", "fp8 needs z")) == \
        "--kv-cache-dtype: fp8 needs z"
    assert EngineArgs.cli_message(InvalidParameterError("quantization_x", "q")) == "q"
    assert EngineArgs.cli_message(ValueError("plain")) == "plain"


def test_duplicate_request_id_and_abort(llm, check_usable, mixed_prompts):
    eng = llm.llm_engine
    eng.add_request("dup", mixed_prompts[5], greedy(8))
    with pytest.raises(ValueError, match="dup"):
        eng.add_request("dup", mixed_prompts[6], greedy(8))
    eng.step()
    eng.step()
    assert engine_core(eng).kv.num_free_blocks < engine_core(eng).kv.num_blocks
    eng.abort_request("dup")
    assert engine_leaks(llm) == []
    assert not eng.has_unfinished_requests()
    assert eng.step() == []


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_abort_of_a_parallel_sampling_request_aborts_every_sequence(llm, check_usable, mixed_prompts, steps):
    """Aborting an ``n`` > 1 request by its id ends all n sequences in the core and frees
    their blocks: before its first sequence has a token (the others still wait in the
    front end, unsent) and while all n run."""
    eng = llm.llm_engine
    eng.add_request("par", mixed_prompts[5], SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=64))
    for _ in range(steps):
        eng.step()
    if steps == 3:
        assert len(engine_core(eng).scheduler.running) == 3
    eng.abort_request("par")
    assert engine_leaks(llm) == []
    assert not eng.has_unfinished_requests()
    assert eng.step() == []


def test_request_id_reusable_after_finish_and_abort(llm, check_usable, mixed_prompts, greedy_alone):
    """An id is "in use" only while its request runs: once finished or aborted, the same
    id can be submitted again (LLMEngine.add_request's contract)."""
    eng = llm.llm_engine

    def run(rid, prompt, n):
        eng.add_request(rid, prompt, greedy(n))
        final = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished and o.request_id == rid:
                    final = o
        return final.outputs[0].token_ids

    assert run("reuse", mixed_prompts[1], 4) == greedy_alone[1][:4]
    assert run("reuse", mixed_prompts[2], 4) == greedy_alone[2][:4]
    eng.add_request("reuse", mixed_prompts[3], greedy(4))
    eng.step()
    eng.abort_request("reuse")
    assert run("reuse", mixed_prompts[1], 4) == greedy_alone[1][:4]


def test_chat_template_kwargs_offline(llm, check_usable):
    """LLM.chat passes chat_template_kwargs to the template; a bad one is a ValueError
    naming it, and queues nothing."""
    msgs = [{"role": "user", "content": "hi"}]
    template = "{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = llm.llm_engine.tokenizer
    ids = llm.llm_engine.apply_chat_template(msgs, chat_template=template, chat_template_kwargs={"shout": True})
    assert ids == tok.encode("LOUD hi", add_special_tokens=False)
    out = llm.chat(msgs, greedy(1), use_tqdm=False, chat_template=template, chat_template_kwargs={"shout": True})
    assert out[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tokenize"):
        llm.chat(msgs, greedy(1), use_tqdm=False, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match="chat_template_kwargs must be an object"):
        llm.chat(msgs, greedy(1), use_tqdm=False, chat_template_kwargs=[("shout", True)])


def test_chat_message_errors_offline(llm, check_usable):
    """LLM.chat applies the server's message rules: a ValueError naming messages, not a
    template error, and nothing queued."""
    for msgs, words in [([{"role": "robot", "content": "hi"}], "messages[0].role must be one of"),
                        ([{"role": "user"}], "messages[0].content is required"),
                        ([{"role": "user", "content": None}], "messages[0].content is required")]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            llm.chat(msgs, greedy(1), use_tqdm=False)
    # An assistant turn without content (as after a tool call) renders as empty text.
    out = llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                    {"role": "user", "content": "again"}], greedy(1), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1
    # A kwarg that collides with the renderer's own parameters is named, as a ValueError.
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat([{"role": "user", "content": "hi"}], greedy(1), use_tqdm=False,
                 chat_template_kwargs={"self": 1})


def test_chat_tools_offline(llm, check_usable):
    """LLM.chat(tools=...) renders tools and tool turns as the server does (this model's
    template has no ``tools``: the Hermes system prompt and <tool_response> text), and refuses
    a bad tool or an unanswered tool result as a ValueError naming the field."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    out = llm.chat(turns, greedy(1), use_tqdm=False, tools=tools)[0]
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"name": "get_weather", "tool_call_id": "call_1", "content": "18 C, sunny"}' in prompt
    assert len(out.outputs[0].token_ids) == 1
    # Without tools the turns are still rendered as text, with no tools prompt.
    plain = llm.get_tokenizer().decode(llm.chat(turns, greedy(1), use_tqdm=False)[0].prompt_token_ids)
    assert "<tools>" not in plain and "<tool_response>" in plain
    with pytest.raises(ValueError, match=r"tools\[0\].type must be \"function\""):
        llm.chat(turns[:1], greedy(1), use_tqdm=False, tools=[{"type": "web_search"}])
    with pytest.raises(ValueError, match=r"messages\[1\].tool_call_id 'call_9' matches no tool_calls"):
        llm.chat([turns[0], {"role": "tool", "tool_call_id": "call_9", "content": "x"}], greedy(1),
                 use_tqdm=False)
    deep: dict = {"type": "object", "properties": {}}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"x": deep}}
    deep_tool = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    for bad in ("nope", deep_tool):
        try:
            llm.chat(turns[:1], greedy(1), use_tqdm=False, tools=bad)
        except ValueError as e:
            assert e.param == "tools", e
        else:
            raise AssertionError(f"tools={str(bad)[:20]} was accepted")
    # A list of conversations: the one at fault is named.
    with pytest.raises(ValueError, match=r"conversation 1: messages\[1\].tool_call_id"):
        llm.chat([turns, [turns[0], {"role": "tool", "tool_call_id": "zz", "content": "x"}]], greedy(1),
                 use_tqdm=False)
    # An empty template is refused by name, not rendered as an empty prompt.
    for empty in ("", "  \n"):
        try:
            llm.chat(turns[:1], greedy(1), use_tqdm=False, chat_template=empty)
        except ValueError as e:
            assert e.param == "chat_template" and "non-empty" in str(e), e
        else:
            raise AssertionError("an empty chat_template was accepted")
