"""One launch of the shipped cuda backward (setting 1) for a profiler to catch: a warm-up launch,
then the profiled one (B=1, H=32, D=128, bf16).

    ncu --clock-control none -k regex:kl_bwd --launch-skip 1 -c 1 --section WarpStateStats \
        --section SourceCounters -o $OUT/bwd python lab/cuda/bwd_profile.py --n 8192
    ncu --import $OUT/bwd.ncu-rep --page source --print-source sass --csv > $OUT/bwd_sass.csv
"""

from __future__ import annotations

import argparse
import os

import torch

from streamkl import _checks
from streamkl._spec import AttnKLInputs, AttnKLStats
from streamkl.backends.cuda import _bwd
from streamkl.backends.cuda import _launch as fwd_launch
from streamkl.testing import make_inputs


def main():
    os.environ["STREAMKL_CUDA_BWD"] = "cuda"
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192, help="Nq = Nk")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    q1, k1, q2, k2 = make_inputs(1, 32, args.n, args.n, 128, 128, dtype=torch.bfloat16, device="cuda")
    inputs = AttnKLInputs(q1, k1, q2, k2, None)
    spec = _checks.attn_kl_spec(q1, k1, q2, k2, causal=args.causal, scale1=None, scale2=None)
    spec = spec.with_needs(_bwd.SETTING1)
    stats = AttnKLStats(*fwd_launch.forward(spec, inputs))
    grad = torch.randn(stats.kl.shape, device="cuda")
    for _ in range(2):
        _bwd.backward(spec, inputs, stats, grad)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
