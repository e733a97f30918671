"""pytest-benchmark runs of the harness's providers at one size each, deselected by default (marker
`bench`): `pytest -m bench benchmarks --benchmark-only` (docs/benchmarks/README.md, Run)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks import indexer_providers
from benchmarks.bench import synchronize
from benchmarks.indexer_providers import IndexerCase, indexer_kl_flops
from benchmarks.providers import Case, Unsupported, all_providers, attn_kl_flops

pytestmark = pytest.mark.bench

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
N, HEADS, DIM = (4096, 32, 128) if ON_GPU else (128, 2, 16)
PROVIDERS = {p.name: p for p in all_providers("inductor" if ON_GPU else "aot_eager")}
# indexer_kl at DeepSeek-V3.2's shapes, 4K tokens (tiny on CPU); its sparse form keeps 2048 keys a row
INDEXER = (
    IndexerCase(1, 128, 1, 64, 4096, 4096, 576, 128, True, "bfloat16", scale=192**-0.5)
    if ON_GPU
    else IndexerCase(1, 4, 1, 3, 128, 128, 32, 16, True, "bfloat16", scale=0.2)
)
TOPK = 2048 if ON_GPU else 16
INDEXER_PROVIDERS = {
    p.name: p for p in indexer_providers.all_providers("inductor" if ON_GPU else "aot_eager")
}


def _time(benchmark, fn, args, flops: int, n: int) -> None:
    def call():
        out = fn(*args)
        synchronize(DEVICE)
        return out

    # the warm-up rounds (compilation and autotuning among them) stay out of the timing
    benchmark.pedantic(call, rounds=20 if ON_GPU else 5, warmup_rounds=2)
    if benchmark.stats is not None:  # None under --benchmark-disable: the calls ran untimed
        tflops = flops / benchmark.stats.stats.median / 1e12
        benchmark.extra_info.update(flops=flops, tflops=tflops, device=str(DEVICE), n=n)


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
    _time(benchmark, fn, args, attn_kl_flops(case, mode), N)


@pytest.mark.parametrize("mode", ["fwd", "train"])
@pytest.mark.parametrize("topk", [0, TOPK], ids=["dense", "sparse"])
@pytest.mark.parametrize("name", list(INDEXER_PROVIDERS))
def test_indexer_speed(benchmark, name, topk, mode):
    """indexer_kl's providers (benchmarks/indexer_providers.py), the lse given; the training step is
    the mean KL's gradients to qi, ki, w."""
    prov, case = INDEXER_PROVIDERS[name], dataclasses.replace(INDEXER, topk=topk)
    inputs = indexer_providers.make_inputs(case, DEVICE)
    if reason := prov.why_not(case, inputs):
        pytest.skip(reason)
    fn = prov.fwd(case) if mode == "fwd" else prov.train(case)
    try:
        fn(*inputs)
    except Unsupported as exc:  # a backend that does not implement indexer_kl
        pytest.skip(str(exc))
    _time(benchmark, fn, inputs, indexer_kl_flops(case, mode), case.nq)
