"""pytest-benchmark runs of the harness's providers at one size each, deselected by default (marker
`bench`): `pytest -m bench benchmarks --benchmark-only` (docs/benchmarks/README.md, Run)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench import synchronize
from benchmarks.providers import Case, all_providers, attn_kl_flops

pytestmark = pytest.mark.bench

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
N, HEADS, DIM = (4096, 32, 128) if ON_GPU else (128, 2, 16)
PROVIDERS = {p.name: p for p in all_providers("inductor" if ON_GPU else "aot_eager")}


@pytest.mark.parametrize("mode", ["fwd", "train"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(PROVIDERS))
def test_speed(benchmark, name, causal, mode):
    prov = PROVIDERS[name]
    case = Case(b=1, h=HEADS, nq=N, nk=N, d1=DIM, d2=DIM, causal=causal, dtype="bfloat16")
    inputs = case.inputs(DEVICE)
    reason = prov.why_not(case, inputs) or (prov.train is None and mode == "train" and "no training step")
    if reason:
        pytest.skip(reason)
    fn = prov.fwd(case) if mode == "fwd" else prov.train(case)
    g = torch.randn(case.b, case.h, case.nq, device=DEVICE)
    args = inputs if mode == "fwd" else (*inputs, g)

    def call():
        out = fn(*args)
        synchronize(DEVICE)
        return out

    # the warm-up rounds (compilation and autotuning among them) stay out of the timing
    benchmark.pedantic(call, rounds=20 if ON_GPU else 5, warmup_rounds=2)
    if benchmark.stats is not None:  # None under --benchmark-disable: the calls ran untimed
        flops = attn_kl_flops(case, mode)
        tflops = flops / benchmark.stats.stats.median / 1e12
        benchmark.extra_info.update(flops=flops, tflops=tflops, device=str(DEVICE), n=N)
