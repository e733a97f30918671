"""examples/context_parallel.py runs as its docstring says, under torchrun on 2 CPU ranks (gloo):
every framework's shards give the single-process KL."""

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
    spec.loader.exec_module(example)  # defines its frameworks; main() runs only under torchrun
    for framework in example.FRAMEWORKS:
        assert f"{framework} " in proc.stdout and "relative error" in proc.stdout, proc.stdout[-2000:]
