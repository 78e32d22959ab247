"""Shared fixtures of the engine test suite.

Models are loaded once per session (``make_llm`` caches engines by their settings, and
``hf_model`` loads the transformers reference once). After every test, the autouse
``_kv_blocks_released`` fixture checks that every engine built so far is idle with all of
its KV blocks free, so a test that leaks blocks or leaves requests behind fails.

Tiny random-weight models come from one factory, ``tiny_model_dir`` (model_helpers.py),
which saves each distinct configuration once per session; ``tiny_dir`` is the tiny Llama
most tests share.

Helper modules (``engine_helpers``, ``model_helpers``, ``server_helpers``, ...) sit in
tests/ itself, which this file puts on ``sys.path``, so a test in any subfolder imports
them by name; tests never import other test modules.

Environment knobs:
    PAGEDLLM_TEST_THREADS: torch intra-op threads (default 1; on a shared 2-core machine
        two OpenMP threads spin against other processes and run ~20x slower).
"""
from __future__ import annotations

import copy
import ctypes
import gc
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the helper modules next to this file, importable from every subfolder's tests
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch  # noqa: E402
from engine_helpers import REF_TOKENS, engine_core, engine_leaks, greedy, model_runner, run_alone  # noqa: E402,F401

torch.set_num_threads(int(os.environ.get("PAGEDLLM_TEST_THREADS", "1")))



def pytest_sessionstart(session):
    """Build (or load) the C++ CPU kernels once, before any test, so that no test's time
    and no server's start-up deadline includes the first build (~1-3 min on a new
    machine), and a server stopped by its test cannot be stopped half-way through it."""
    import time

    from pagedllm.kernels.cpu import load_cpu_kernels

    t0 = time.monotonic()
    built = load_cpu_kernels() is not None
    print(f"\nC++ CPU kernels {'ready' if built else 'UNAVAILABLE (torch ops)'} "
          f"after {time.monotonic() - t0:.1f} s")


# Every engine built through ``make_llm`` (checked after each test). Those a test module
# built are shut down when the module ends (``_release_module_engines``), except the ones
# whose keys are in ``_KEEP_ENGINES`` (the session's main ``llm``).
_ENGINES: dict[tuple, object] = {}
_KEEP_ENGINES: set[tuple] = set()

# Models built through the shared ``build_model`` (``_share_weights``), by their settings.
_BUILT: dict[tuple, tuple[int, torch.nn.Module]] = {}

# Settings shared by every engine of the suite: float32 so that results can be compared
# with the float32 transformers reference, and a modest CPU KV cache.
# The core runs in this process (engine_process=False) so that the leak check can look
# inside it; test_engine_process.py tests the default, the core in its own process.
BASE_LLM_KW = dict(dtype="float32", device="cpu", seed=0, engine_process=False)

# Greedy tokens generated per request in the engine invariance tests. Every decode step
# streams all weights (~90 ms on one core), so the 32 one-at-a-time reference runs
# dominate the suite's time; 16 tokens make each request cross one block boundary.


# --------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------
_FILLER = (
    "The history of the city goes back more than two thousand years, when a small "
    "settlement grew up around a river crossing used by traders who carried salt, wine "
    "and pottery between the coast and the mountains. Over the centuries the town was "
    "ruled by kings, bishops and merchant councils, each of whom left buildings, laws "
    "and habits that still shape the daily life of its people. Today visitors come for "
    "the old markets, the cathedral with its painted ceiling, the long gardens along the "
    "water and the small restaurants that serve fish caught the same morning. In winter "
    "the streets are quiet and the fog rolls in from the sea, while in summer the squares "
    "fill with music, students and families who stay outside until long after midnight."
).split()

_TOPICS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Question: What is 17 plus 25? Answer:",
    "My favorite recipe for pancakes starts with",
    "In 1969, the first humans to walk on the Moon",
    "Water boils at a temperature of",
    "The best way to learn a new language is",
    "Translate to French: 'Good morning, my friend.'",
    "A list of the planets in the solar system:",
    "import numpy as np\n\nx = np.arange(10)\n",
    "Dear hiring manager, I am writing to",
    "The main causes of the French Revolution were",
    "Photosynthesis is the process by which",
    "Here is a short poem about the sea:\n",
]


def _mixed_prompts(n: int = 32) -> list[str]:
    """``n`` prompts of mixed lengths (5 to ~105 tokens): a prefix of the filler paragraph
    of varying length followed by a topic sentence."""
    out = []
    for i in range(n):
        k = (i * 37) % 110
        prefix = " ".join(_FILLER[:k])
        topic = _TOPICS[i % len(_TOPICS)]
        out.append(f"{prefix}\n\n{topic}" if prefix else topic)
    return out


@pytest.fixture(scope="session")
def mixed_prompts() -> list[str]:
    return _mixed_prompts(32)


@pytest.fixture(scope="session")
def long_prompts() -> list[str]:
    """Six prompts of 40 to ~160 tokens (all longer than a 32-token budget)."""
    return [" ".join(_FILLER[:k]) + "\n\n" + _TOPICS[j]
            for j, k in enumerate((30, 45, 60, 75, 95, 118))]


# --------------------------------------------------------------------------------------
# Engines and references
# --------------------------------------------------------------------------------------
def _module_copy(module: torch.nn.Module, memo: dict[int, torch.nn.Module]) -> torch.nn.Module:
    """A copy of ``module``'s tree of modules that shares every tensor (weights, packed
    weights, RoPE tables) but has attributes of its own, such as the KV cache each
    engine binds to its attention layers. A module used in several places (the RoPE
    shared by all layers) is copied once."""
    if id(module) not in memo:
        c = memo[id(module)] = copy.copy(module)
        c._modules = {name: _module_copy(m, memo) for name, m in module._modules.items()}
    return memo[id(module)]


def _share_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let engines of the same model, dtype and device share one set of (read-only)
    weights, so that each further engine costs a KV-cache allocation instead of another
    ~10 s GGUF load. Each engine gets its own copy of the modules (``_module_copy``), to
    which it binds its KV cache; a model built for more positions serves engines that
    need fewer."""
    from pagedllm.models import loader

    original = getattr(loader, "build_model", None)
    if original is None:
        return
    built = _BUILT

    def build_model(path, cfg, dtype, device, max_positions, *args, **kwargs):
        if kwargs.get("quant_config") is not None:
            # each engine has a config object of its own: the key would never match again
            return original(path, cfg, dtype, device, max_positions, *args, **kwargs)
        # unquantized, ``calibrate`` does nothing: a draft model (built without it) is the same model
        same = {k: v for k, v in kwargs.items() if v is not None and k != "calibrate"}
        key = (os.path.abspath(path), str(dtype), str(device), args, tuple(sorted(same.items())))
        if key not in built or built[key][0] < max_positions:
            built[key] = (max_positions, original(path, cfg, dtype, device, max_positions, *args, **kwargs))
        return _module_copy(built[key][1], {})

    monkeypatch.setattr(loader, "build_model", build_model)


@pytest.fixture(scope="session")
def make_llm():
    """Factory: ``make_llm(**engine_args)`` → an ``LLM`` built once per distinct setting
    for the whole session (float32 on CPU unless overridden)."""
    from pagedllm import LLM

    mp = pytest.MonkeyPatch()
    _share_weights(mp)

    def make(**kw):
        kw = {**BASE_LLM_KW, **kw}
        key = tuple(sorted(kw.items()))
        if key not in _ENGINES:
            _ENGINES[key] = LLM(**kw)
        return _ENGINES[key]

    yield make
    for llm in _ENGINES.values():
        llm.shutdown()
    _ENGINES.clear()
    mp.undo()


@pytest.fixture(scope="session")
def llm(make_llm):
    """The main engine: defaults (prefix caching, chunked prefill, 2048-token budget) with
    a KV cache large enough (728 blocks) that 32 requests run without preemption. Kept for
    the whole session (other engines last as long as their test module)."""
    engine = make_llm(max_model_len=1024, kv_cache_memory="512MiB")
    _KEEP_ENGINES.update(k for k, e in _ENGINES.items() if e is engine)
    return engine


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: ``tiny_model_dir(arch="llama", *, seed=0, std=0.1, std_1d=None,
    tokenizer="bundled", **config)`` -> the directory of a seeded random-weight HF model
    (``model_helpers.save_tiny_model``), saved once per distinct setting for the session.
    Shared: copy it before changing a file in it."""
    from model_helpers import save_tiny_model, tiny_model_key

    made: dict[str, str] = {}

    def make(arch: str = "llama", **kw) -> str:
        key = tiny_model_key(arch, **kw)
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            save_tiny_model(path, arch, **kw)
            made[key] = str(path)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_dir(tiny_model_dir) -> str:
    """The suite's tiny Llama (2 layers, hidden 256, head_dim 64, weights ~N(0, 0.1), seed
    0, the bundled tokenizer and its 49152-token vocabulary)."""
    return tiny_model_dir("llama", rope_theta=10000.0)


@pytest.fixture(scope="session")
def tokenizer():
    from pagedllm.tokenizer import get_tokenizer

    return get_tokenizer()


@pytest.fixture(scope="session")
def model_path() -> str:
    from pagedllm.utils import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def hf_model(model_path):
    """transformers' own implementation on the same GGUF file, float32 (the reference);
    loaded per module (~0.6 GiB: not held for the rest of the session)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def greedy_alone(llm, mixed_prompts):
    """Reference: each mixed prompt's greedy continuation (REF_TOKENS tokens, so that every
    request crosses a block boundary while decoding), generated alone on the main engine
    with an empty prefix cache."""
    llm.reset_prefix_cache()
    return run_alone(llm, mixed_prompts, greedy(REF_TOKENS))


# --------------------------------------------------------------------------------------
# Memory: a test module's engines and models go when it ends.
# --------------------------------------------------------------------------------------
def _first_tensor(model: torch.nn.Module):
    return next((t for t in model.state_dict().values()), None)


@pytest.fixture(scope="module", autouse=True)
def _release_module_engines():
    """After each test module: shut down the engines it built through ``make_llm`` (the
    session's ``llm`` stays) and drop the shared models no remaining engine uses (except
    the bundled model in float32, which most modules load again), so that a worker holds
    one module's engines at a time instead of every engine of the session (two workers
    once held 9.4 and 8.3 GiB)."""
    yield
    from pagedllm.utils import default_model_path

    for key in [k for k in _ENGINES if k not in _KEEP_ENGINES]:
        _ENGINES.pop(key).shutdown()
    in_use = set()
    for llm in _ENGINES.values():
        try:
            t = _first_tensor(model_runner(llm.llm_engine).model)
        except (TypeError, AttributeError):
            continue
        if t is not None:
            in_use.add(t.data_ptr())
    try:
        main_model = (os.path.abspath(default_model_path()), str(torch.float32))
    except FileNotFoundError:   # no bundled model on this machine (the GPU check's: docs/gpu.md)
        main_model = None
    for key, (_, model) in list(_BUILT.items()):
        t = _first_tensor(model)
        if key[:2] != main_model and (t is None or t.data_ptr() not in in_use):
            del _BUILT[key]
    gc.collect()
    try:   # hand the freed heap back to the OS, so that the next module starts low
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# --------------------------------------------------------------------------------------
# Per-test invariant: every engine is idle and all its KV blocks are free again.
# --------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _kv_blocks_released():
    yield
    failures = {}
    for key, llm in list(_ENGINES.items()):
        problems = engine_leaks(llm)
        if problems:
            name = ", ".join(f"{k}={v}" for k, v in key if k not in BASE_LLM_KW) or "defaults"
            failures[f"LLM({name})"] = problems
            # Clean up so that one leak does not fail every later test too.
            eng = llm.llm_engine
            eng.abort_request(list(engine_core(eng).scheduler.requests) + list(eng.states))
    assert not failures, f"engines not idle after the test: {failures}"
