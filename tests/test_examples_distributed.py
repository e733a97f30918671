"""examples/context_parallel.py runs as its docstring says, under torchrun on 2 CPU ranks (gloo):
every framework's shards give the single-process KL, attn_kl's and indexer_kl's."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "context_parallel.py"


def test_context_parallel_example_runs_every_framework():
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLE),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    spec = importlib.util.spec_from_file_location("context_parallel", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # defines its sections; main() runs only under torchrun
    assert {name for _, name in example.SECTIONS} == set(example.FRAMEWORKS), example.SECTIONS
    assert {op for op, _ in example.SECTIONS} == {"attn_kl", "indexer_kl"}, example.SECTIONS
    printed = {tuple(line.split()[:2]) for line in proc.stdout.splitlines() if "relative error" in line}
    for section in example.SECTIONS:  # (op, framework)
        assert section in printed, (section, proc.stdout[-2000:])
