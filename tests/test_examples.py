"""The attention-distillation example runs as a user would run it, at the size CI affords."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "distill_attention.py"


def test_distillation_example_runs_and_its_loss_falls():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--tiny", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    final = re.search(r"distillation loss: ([0-9.]+) -> ([0-9.]+)", proc.stdout)
    assert final is not None, proc.stdout[-2000:]
    before, after = map(float, final.groups())
    assert after < before, proc.stdout[-2000:]
    assert "(includes compilation)" in proc.stdout, proc.stdout[-2000:]  # it ran under torch.compile
    assert re.search(r"distil\s+step\s+\d+\s+kl [0-9.]+\s+[0-9.]+ ms/step", proc.stdout), proc.stdout[-2000:]
