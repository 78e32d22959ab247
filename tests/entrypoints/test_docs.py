"""The README and docs/ say what the code does: every flag of ``pagedllm serve`` /
``generate`` and every ``PAGEDLLM_*`` variable ``envs.py`` reads is in
docs/configuration.md and nothing there names one that does not exist; every command the
README lists parses; every Makefile target it names exists; and its Python and curl
examples run as written against a live server (slow)."""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys

import pytest

from pagedllm.entrypoints.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def _code_blocks(text: str, lang: str) -> list[str]:
    """The fenced blocks of ``text`` whose fence names ``lang`` ("" for a bare fence)."""
    blocks, current, current_lang = [], None, None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current, current_lang = [], line[3:].strip()
            else:
                if current_lang == lang:
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_configuration_names_every_flag_and_no_other():
    doc = _read("docs/configuration.md")
    parser = build_parser()
    flags = _flags(_subparser(parser, "serve")) | _flags(_subparser(parser, "generate")) | {"--log-level"}
    named = {f.replace("[no-]", "") for f in re.findall(r"`(--[a-zA-Z0-9\-\[\]]+)`", doc)}
    named |= {f.replace("--[no-]", "--no-") for f in re.findall(r"`(--\[no-\][a-z0-9\-]+)", doc)}
    boolean_pairs = {f"--no-{f[2:]}" for f in flags} & flags | {f for f in flags if f.startswith("--no-")}
    missing = sorted(f for f in flags - boolean_pairs if f not in named)
    assert not missing, f"docs/configuration.md does not name {missing}"
    unknown = sorted(f for f in named if f not in flags)
    assert not unknown, f"docs/configuration.md names flags that do not exist: {unknown}"


def test_configuration_names_every_variable_and_no_other():
    doc = _read("docs/configuration.md")
    read = set(re.findall(r'"(PAGEDLLM_[A-Z0-9_]+)"', _read("pagedllm/envs.py")))
    named = set(re.findall(r"`(PAGEDLLM_[A-Z0-9_]+)`", doc))
    assert read and read <= named, f"docs/configuration.md does not name {sorted(read - named)}"
    assert named <= read, f"docs/configuration.md names variables envs.py does not read: {sorted(named - read)}"


def test_readme_commands_parse_and_make_targets_exist():
    readme = _read("README.md")
    parser = build_parser()
    block = next(b for b in _code_blocks(readme, "") if b.lstrip().startswith("pagedllm "))
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.startswith("pagedllm ")]
    assert len(commands) >= 8
    for line in commands:
        words = shlex.split(line)[1:]
        alternatives = [[]]
        for w in words:
            if w.startswith("[") or w.startswith("-") or w.isupper() or w.startswith('"'):
                break      # options and placeholders: the sub-command path is what is checked
            alternatives = [a + [part] for a in alternatives for part in w.split("|")]
        for path in alternatives:
            _subparser(parser, *path)          # raises (StopIteration/KeyError) for an unknown command
    makefile = _read("Makefile")
    for target in re.findall(r"^make ([a-z\-]+)", "\n".join(_code_blocks(readme, "bash")), flags=re.M):
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"README names make {target}"
    for link in re.findall(r"\]\((docs/[a-z\-]+\.md)\)", readme):
        assert os.path.exists(os.path.join(ROOT, link)), link


def test_every_relative_link_in_the_docs_resolves():
    """README.md, docs/*.md and docs/notes/*.md: each relative markdown link names a file
    that exists (anchors and web addresses are not checked)."""
    import glob

    pages = ["README.md", "tests/README.md"] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    assert len(pages) > 20
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", _read(page)):
            target = target.split("#")[0]
            if not target or "://" in target or target.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.join(ROOT, os.path.dirname(page), target)):
                broken.append(f"{page} -> {target}")
    assert not broken, broken


@pytest.mark.slow
def test_readme_and_api_examples_run_as_written(tmp_path):
    """The README's curl request and Python examples, and docs/api.md's, against a live
    server on another port (the examples say 127.0.0.1:8000; the port is the one thing
    changed); the offline example as it is."""
    from server_helpers import _Server

    server = _Server()
    try:
        port_fix = lambda code: code.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")  # noqa: E731
        readme, api = _read("README.md"), _read("docs/api.md")
        curl = next(b for b in _code_blocks(readme, "bash") if b.lstrip().startswith("curl"))
        out = subprocess.run(["bash", "-c", port_fix(curl)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "Paris" in out.stdout, out
        scripts = [b for b in _code_blocks(readme, "python") + _code_blocks(api, "python")]
        assert len(scripts) == 3
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        for i, code in enumerate(scripts):
            path = tmp_path / f"example{i}.py"
            path.write_text(port_fix(code) if "OpenAI(" in code else
                            code.replace("LLM()", 'LLM(max_model_len=512, kv_cache_memory="64MiB")'))
            run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=600,
                                 env=env, cwd=ROOT)
            assert run.returncode == 0, (code, run.stderr[-2000:])
            assert run.stdout.strip(), code
            if "capital of France" in code and "LLM(" in code:
                assert "Paris" in run.stdout
    finally:
        server.stop()
