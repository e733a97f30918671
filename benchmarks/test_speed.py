"""pytest-benchmark runs of the same setup `python -m streamkl.bench` uses (inputs, providers,
FLOP count), deselected by default (marker `bench`):

    pytest -m bench benchmarks --benchmark-only                       # CPU: tiny sizes
    STREAMKL_BENCH_N=4096,8192 pytest -m bench benchmarks --benchmark-only   # GPU sizes

Each timed call synchronizes the device before it returns, so wall time is device time.
TFLOP/s (on streamkl/bench/flops.py's count) goes into each benchmark's extra_info.
The published comparison (tables, plots, OOM handling) is `python -m streamkl.bench`.
"""

from __future__ import annotations

import os

import pytest
import torch

from streamkl.bench.providers import discover
from streamkl.bench.runner import RunConfig, Runner
from streamkl.bench.sweeps import Case

pytestmark = pytest.mark.bench

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
SIZES = [int(n) for n in os.environ.get("STREAMKL_BENCH_N", "4096" if ON_GPU else "128").split(",")]
HEADS, DIM = (32, 128) if ON_GPU else (2, 16)
DTYPE = "bfloat16" if ON_GPU else "float32"
PROVIDERS = os.environ.get("STREAMKL_BENCH_PROVIDERS", "streamkl,torch").split(",")
MODES = [("fwd", None), ("bwd", "q2k2"), ("fwd+bwd", "q2k2")]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return Runner(
        RunConfig(device=DEVICE, compile_backend="inductor" if ON_GPU else "aot_eager"),
        tmp_path_factory.mktemp("bench"),
        meta={},
        config_record={},
    )


def _params():
    for prov in discover(PROVIDERS, "inductor" if ON_GPU else "aot_eager"):
        for n in SIZES:
            for causal in (False, True):
                for mode, setting in MODES:
                    yield pytest.param(
                        prov,
                        n,
                        causal,
                        mode,
                        setting,
                        id=f"{prov.name}-N{n}-{'causal' if causal else 'full'}-"
                        f"{mode}{'-' + setting if setting else ''}",
                    )


@pytest.mark.parametrize("prov,n,causal,mode,setting", list(_params()))
def test_speed(benchmark, runner, prov, n, causal, mode, setting):
    if prov.kind == "gemm":
        pytest.skip("the GEMM yardstick is measured by python -m streamkl.bench")
    case = Case("pytest", b=1, h=HEADS, nq=n, nk=n, d1=DIM, d2=DIM, causal=causal, dtype=DTYPE)
    reason = prov.unsupported(runner.inputs(case)[0])
    if reason is not None:
        pytest.skip(reason)
    try:
        call, flops = runner.prepare_call(case, prov, mode, setting)
        call()  # warm-up: JIT, compile
        stats = benchmark.pedantic(call, rounds=10 if ON_GPU else 3, warmup_rounds=2)
    except torch.OutOfMemoryError:
        pytest.skip("out of memory")
    del stats
    mean_s = benchmark.stats.stats.median
    benchmark.extra_info.update(
        flops=flops,
        tflops=flops / mean_s / 1e12,
        device=DEVICE,
        provider=prov.name,
        n=n,
        causal=causal,
        mode=mode,
        setting=setting,
    )
