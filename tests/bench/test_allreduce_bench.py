"""``python -m pagedllm.benchmarks.allreduce`` runs two gloo ranks on loopback and prints a
positive time per call for each dtype and shape it was asked for."""
from __future__ import annotations

import re

from pagedllm.benchmarks import allreduce


def test_allreduce_bench_prints_each_shape(capsys):
    allreduce.main(["--hidden", "64", "--rows", "1", "8", "--iters", "5", "--layers", "2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if re.match(r"\s*(float32|bfloat16) ", line)]
    assert [(r[0], r[1], r[2]) for r in rows] == [("bfloat16", "64", "1"), ("bfloat16", "64", "8"),
                                                  ("float32", "64", "1"), ("float32", "64", "8")]
    assert all(float(r[4]) > 0 for r in rows)
