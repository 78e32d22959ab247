"""Imports only go down the layers, and the packages form no cycle.

Every ``import`` of a ``pagedllm`` module (at module level or inside a function) is read
from the source with ``ast``; each top-level unit of the package (a subpackage or a
module) has a rank below, and an import may only reach a unit of strictly lower rank.
A new unit must be given a rank here, which is where its place in the design is decided.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

import pagedllm

# Low to high: an import may only point to a lower rank.
RANKS = {
    "errors": 0, "envs": 0, "outputs": 0, "forward_context": 0, "platform": 0, "kv_cache_interface": 0,
    "utils": 1, "sampling_params": 1, "kernels": 1, "logger": 1, "distributed": 1,
    "messages": 2, "attention": 2, "tokenizer": 2,
    "layers": 3, "structured_output": 3, "sample": 3,
    "models": 4,
    "config": 5,
    "spec_decode": 6,
    "worker": 7,
    "executor": 8,
    "core": 9,
    "engine": 10,
    "entrypoints": 11,
    "benchmarks": 12,
}
ROOT = pathlib.Path(pagedllm.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = ("pagedllm",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """(imported module, line) for every pagedllm import in ``path``."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            # "from pagedllm import envs" imports the module pagedllm.envs
            out += [(f"{module}.{a.name}" if module == "pagedllm" else module, node.lineno)
                    for a in node.names]
    return [(m, line) for m, line in out if m == "pagedllm" or m.startswith("pagedllm.")]


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    if parts[1] not in RANKS and hasattr(pagedllm, parts[1]):   # a re-export, e.g. pagedllm.LLM
        return getattr(pagedllm, parts[1]).__module__.split(".")[1]
    return parts[1]


def test_every_unit_has_a_rank():
    units = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert units == set(RANKS), f"rank these units: {sorted(units - set(RANKS))}; gone: {sorted(set(RANKS) - units)}"


def test_imports_only_go_down():
    back_edges = []
    for path in sorted(ROOT.rglob("*.py")):
        src = _unit(_module_name(path))
        if src is None:   # pagedllm/__init__.py re-exports the public API from the top
            continue
        for module, line in _imports(path):
            dst = _unit(module)
            if dst is None or dst == src:
                continue
            if RANKS[dst] >= RANKS[src]:
                back_edges.append(f"{path.relative_to(ROOT.parent)}:{line}: {src} -> {dst}")
    assert not back_edges, "imports that go up or sideways:\n" + "\n".join(back_edges)


@pytest.mark.parametrize("package", ["engine", "entrypoints"])
def test_front_end_reaches_no_core_internals(package):
    """The front end talks to the core through EngineCoreClient and messages only."""
    bad = []
    for path in (ROOT / package).rglob("*.py"):
        text = path.read_text()
        for needle in (".core.", "last_step", ".runner."):
            if needle in text:
                bad.append(f"{path.name}: {needle}")
    assert not bad, bad


def test_model_files_import_only_layers():
    for path in (ROOT / "models").glob("*.py"):
        for module, line in _imports(path):
            assert not module.startswith(("pagedllm.kernels", "pagedllm.attention")), (
                f"{path.name}:{line} imports {module}: models are built from layers/ only")


def test_layers_reach_attention_through_its_interface():
    """layers/ (the Attention layer above all) knows the attention backends only through
    ``pagedllm/attention/backend.py``'s interface; which backend computes is the runner's
    choice (``bind_kv_cache``), so no layer imports a backend module (cpu_backend,
    torch_backend, or any later one)."""
    bad = []
    for path in sorted((ROOT / "layers").rglob("*.py")):
        for module, line in _imports(path):
            if module.startswith("pagedllm.attention") and module != "pagedllm.attention.backend":
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module}")
    assert not bad, "layers/ imports attention backends (use attention/backend.py):\n" + "\n".join(bad)


def _runtime_imports(path: pathlib.Path) -> set[str]:
    """The pagedllm modules ``path`` imports when it runs (module level or inside a
    function; not under ``if TYPE_CHECKING:``), ``from pkg import mod`` naming ``pkg.mod``."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for n in ast.walk(block)}
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{module}.{a.name}"
                out.add(sub if (ROOT.parent / (sub.replace(".", "/") + ".py")).exists() else module)
    return {m for m in out if m.startswith("pagedllm.") and m != mod}


@pytest.mark.parametrize("package", ["models", "attention"])
def test_package_modules_form_no_cycle(package):
    """No module of models/ or attention/ imports one that imports it back, even from inside a
    function: models/registry (what each architecture is) sits below arch_config and loader,
    which ask it; attention/registry names the backends, which know only attention/backend."""
    graph = {_module_name(p): _runtime_imports(p) for p in (ROOT / package).glob("*.py")}
    graph = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    cycles = []

    def visit(m, stack):
        if m in stack:
            cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            return
        for d in sorted(graph[m]):
            visit(d, stack + [m])
    for m in sorted(graph):
        visit(m, [])
    assert not cycles, f"import cycles in {package}/:\n" + "\n".join(sorted(set(cycles)))


@pytest.mark.parametrize("package", ["tool_calls", "reasoning"])
def test_output_parsers_stay_pure(package):
    """entrypoints/openai/tool_calls/ and reasoning/ are pure functions over JSON values
    and text: they need only the error type, never the engine or the server (which use
    them)."""
    root = ROOT / "entrypoints" / "openai" / package
    assert (root / "__init__.py").exists(), root
    bad = [f"{path.name}:{line}: {module}" for path in sorted(root.glob("*.py"))
           for module, line in _imports(path)
           if module != "pagedllm.errors" and not module.startswith(f"pagedllm.entrypoints.openai.{package}")]
    assert not bad, f"{package} imports outside itself:\n" + "\n".join(bad)
