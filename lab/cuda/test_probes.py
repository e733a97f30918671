"""The probe kernels compile for sm_90a with no spill and no serialized wgmma (a spill or a
serialized wgmma would change the rates docs/cuda.md quotes). Needs no GPU:

    python -m pytest -q lab/cuda/test_probes.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from streamkl.backends.cuda import _jit

HERE = Path(__file__).parent


def _source(module: str) -> str:
    spec = importlib.util.spec_from_file_location(module, HERE / f"{module}.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded.SOURCE


@pytest.mark.parametrize(
    "module, entry, consts",
    [
        ("tma_reduce", "dq_reduce", {"IN_FLIGHT": 4}),
        ("mix_bound", "mix_bound", {"DP": 128}),
        ("mix_bound", "mix_bound", {"DP": 64}),
        ("racecheck_probe", "handoff", {"MODE": 0}),
        ("racecheck_probe", "handoff", {"MODE": 1}),
    ],
    ids=[
        "tma_reduce",
        "mix_bound-d128",
        "mix_bound-d64",
        "racecheck_probe-mbarrier",
        "racecheck_probe-syncthreads",
    ],
)
def test_probe_kernels_compile_cleanly(module, entry, consts):
    build = _jit.compile_kernel(_source(module), entry, consts)
    assert build.spill_bytes == 0 and build.stack_bytes == 0, build.log
    assert "serialized" not in build.log and "warning" not in build.log.lower(), build.log


def _variants():
    spec = importlib.util.spec_from_file_location("bwd_variants", HERE / "bwd_variants.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


@pytest.mark.parametrize("name", list(_variants().VARIANTS))
def test_backward_variants_apply_and_compile_cleanly(name):
    """Each variant of bwd_variants.py still patches the shipped kl_bwd.cu (every anchor once) and
    compiles for sm_90a at D = 128 with no spill and no serialized wgmma."""
    from streamkl.backends.cuda import _bwd

    variants = _variants()
    source = variants.patched(_bwd.source(), variants.VARIANTS[name])
    build = _jit.compile_kernel(source, _bwd.ENTRY, variants.instantiation(name, 128, 128, False))
    assert build.spill_bytes == 0 and build.stack_bytes == 0, build.log
    assert "serialized" not in build.log and "warning" not in build.log.lower(), build.log
