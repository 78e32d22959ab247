"""``--load-format dummy``: a model built from config.json alone (no weight file in the
directory), its weights seeded random on the device; greedy output deterministic for a
seed; refused with a quantization method, naming ``load_format``."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.errors import InvalidParameterError
from pagedllm.models import loader

PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18], [400, 300, 200, 100]]


@pytest.fixture(scope="module")
def config_only_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama's directory without its safetensors: config.json and the tokenizer."""
    src = tiny_model_dir("llama")
    dst = tmp_path_factory.mktemp("dummy") / "model"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    assert not [f for f in os.listdir(dst) if "safetensors" in f]
    return str(dst)


def _greedy(path: str, seed: int) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=path, load_format="dummy", dtype="float32", device="cpu", seed=seed,
              engine_process=False, kv_cache_memory="32MiB", max_model_len=128)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def test_dummy_weights_run_greedy_deterministic_for_a_seed(config_only_dir):
    a, llm = _greedy(config_only_dir, seed=0)
    llm.shutdown()
    b, llm = _greedy(config_only_dir, seed=0)
    llm.shutdown()
    c, llm = _greedy(config_only_dir, seed=1)
    llm.shutdown()
    assert all(len(t) == 8 for t in a)
    assert a == b, "same seed, same weights, same greedy tokens"
    assert a != c, "another seed draws other weights"
    assert len(set(a[0])) > 1, "a random model with sane activations does not repeat one token"


def test_init_dummy_weights_values():
    m = torch.nn.ModuleDict({"proj": torch.nn.Linear(256, 512), "input_layernorm": torch.nn.LayerNorm(512)})
    loader.init_dummy_weights(m, seed=3)
    w = m["proj"].weight
    assert abs(w.std().item() - loader.DUMMY_WEIGHT_STD) < 0.001 and abs(w.mean().item()) < 0.001
    assert torch.all(m["proj"].bias == 0) and torch.all(m["input_layernorm"].weight == 1)
    assert torch.all(m["input_layernorm"].bias == 0)
    again = torch.nn.Linear(256, 512)
    loader.init_dummy_weights(again, seed=3)
    assert torch.equal(again.weight, w)


def test_dummy_refused_with_quantization_naming_load_format(config_only_dir):
    with pytest.raises(ValueError, match="load_format") as ei:
        LLM(model=config_only_dir, load_format="dummy", quantization="q8_0", device="cpu",
            engine_process=False)
    assert isinstance(ei.value, InvalidParameterError) and ei.value.param == "load_format"
    with pytest.raises(InvalidParameterError, match="load_format"):
        EngineArgs(load_format="npz").validate()
    cfg = loader.load_arch_config(config_only_dir)
    with pytest.raises(InvalidParameterError, match="load_format"):
        loader.build_model(config_only_dir, cfg, torch.float32, torch.device("cpu"), 16,
                           quant_config=object(), load_format="dummy")
