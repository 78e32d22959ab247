"""``bench accuracy --dtype bfloat16 --hf`` (the fidelity mode) on a tiny random-weight
Llama: one row per engine in the same run, each scored against our float32 engine over the
fixed chat prompts, HF transformers on the same weights among them."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from pagedllm.benchmarks import accuracy

pytestmark = pytest.mark.slow   # bench accuracy runs several engines and HF transformers


# tiny_dir: the suite's tiny Llama (tests/conftest.py)
def test_fidelity_rows_in_one_run(tiny_dir, tmp_path, capsys):
    out = tmp_path / "acc.json"
    args = argparse.Namespace(model=tiny_dir, dtype="bfloat16", quantization=[], kv_cache_dtype=[], hf=True,
                              max_tokens=4, output_json=str(out))
    assert accuracy.accuracy_main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["float32", "bfloat16", "HF bfloat16"]
    assert [r["engine"] for r in rows] == ["ours", "ours", "hf"]
    n = len(accuracy.chat_prompts())
    assert n >= 50
    for r in rows:
        assert len(r["agreement"]) == n and all(0 <= a <= 4 for a in r["agreement"])
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1
        assert r["min_agreement"] == min(r["agreement"])
    assert rows[0]["mean_agreement"] == 4            # the reference against itself
    printed = capsys.readouterr().out
    assert "HF bfloat16: perplexity" in printed and f"{n} chat prompts x 4 greedy tokens" in printed


def test_hf_perplexity_and_greedy_agree_with_ours_in_float32(tiny_dir):
    """The HF row's arithmetic (perplexity from one forward, greedy one prompt at a time)
    matches our float32 engine on the same tiny weights: the comparison is like for like."""
    from pagedllm import LLM
    from pagedllm.benchmarks.throughput import load_hf_model
    from pagedllm.tokenizer import get_tokenizer

    hf = load_hf_model(argparse.Namespace(model=tiny_dir, dtype="float32", device="cpu"))[0]
    ids = get_tokenizer(tiny_dir).encode(accuracy.eval_text())
    ours = accuracy.model_perplexity(tiny_dir, None, "float32")[0]
    assert accuracy.hf_perplexity(hf, ids) == pytest.approx(ours, rel=1e-3)
    llm = LLM(model=tiny_dir, dtype="float32", max_model_len=256, kv_cache_memory="32MiB")
    try:
        prompts = accuracy.chat_prompt_ids(llm)[:4]
        mine = accuracy.greedy_outputs(llm, prompts, 6)
        eos = list(llm.llm_engine.eos_token_ids)
    finally:
        llm.shutdown()
    theirs = accuracy.hf_greedy_outputs(hf, prompts, 6, eos)
    assert [accuracy.greedy_agreement(m, t, eos, 6) for m, t in zip(mine, theirs)] == [6] * 4


def test_agreement_stops_at_eos():
    """What follows an EOS is not an answer: two continuations equal up to and including
    their first EOS agree in full, whether one went on past it (ignore_eos) or stopped."""
    eos = [2]
    ref = [5, 6, 2, 9, 9, 9]
    assert accuracy.greedy_agreement(ref, [5, 6, 2], eos, 6) == 6            # HF stopped at EOS
    assert accuracy.greedy_agreement(ref, [5, 6, 2, 7, 7, 7], eos, 6) == 6   # differs only after EOS
    assert accuracy.greedy_agreement(ref, [5, 6, 7, 2], eos, 6) == 2         # diverges before it
    assert accuracy.greedy_agreement(ref, [5, 6, 7, 2]) == 2                 # no EOS rule: plain prefix
    assert accuracy.greedy_agreement([5, 6, 7], [5, 6, 7], eos, 6) == 3      # no EOS: the common length
