"""indexer_kl's Triton kernels compiled for sm_90 here, on a machine without a GPU (as
tests/test_triton_sm90.py does for attn_kl's): each specialization the launchers build on a GPU
for DeepSeek-V3.2's shapes (bfloat16, H = 128 on the 576-wide MQA key, G = 64 x 128, dense and
top-k) and for an MHA teacher (float16, 192-wide keys, G = 8) must build, keep its products on
tensor cores (wgmma for the 128-row MQA GEMMs) and fit one SM's 227 KiB of shared memory.

The constexprs are read off the launcher's plan (`_indexer_launch.plan` with `interpret=False`)
and the kernel variants each launch uses (statistics pass with and without the teacher's LSE;
main pass for the forward, the fused step, the backward and the correction; deterministic
mode's dki passes, key-major in dense mode and row shares in sparse mode). Interpreter kernels
cannot be compiled, so one subprocess with TRITON_INTERPRET=0 (`python -m
tests.test_triton_indexer_sm90 --json FILE`) builds them all.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402

from streamkl._spec import IndexerKLSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMEM_LIMIT = 227 * 1024
_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
_STATS = {"LSE", "LSE2", "COEF_A", "COEF_B", "GRAD_SCALE", "DCOEF_A", "DCOEF_B", "DGRAD_SCALE"}
_STATS |= {"KL", "MASS", "DKI", "PART"}  # float32 statistics, dki, sparse dki shares
# Strides of contiguous (B, heads, N, D) inputs and of w (B, G, Sq) that are multiples of 16 at
# every shape below (N = 4096; D = 576, 192; Di = 128; G = 64, 8).
_DIVISIBLE_STRIDES = {"sqb", "sqh", "sqn", "skb", "skh", "skn", "sib", "sig", "sin", "skib", "skin"}
_DIVISIBLE_STRIDES |= {"swb", "swg"}

# (name, dtype, H, H_kv, D, G, sparse)
SHAPES = [
    ("mqa576-dense", torch.bfloat16, 128, 1, 576, 64, False),
    ("mqa576-sparse", torch.bfloat16, 128, 1, 576, 64, True),
    ("mha192-dense", torch.float16, 16, 16, 192, 8, False),
]
# (name, kernel, flags): the variants the launchers use
_GRADS = dict(NEED_DQI=True, NEED_DKI=True, NEED_DW=True)
VARIANTS = [
    ("stats-teacher", "lse", dict(TEACHER_LSE=True)),
    ("stats-student", "lse", dict(TEACHER_LSE=False)),
    ("forward", "main", dict(WRITE_KL=True, GRADS=False, REDO=False, **dict.fromkeys(_GRADS, False))),
    ("step", "main", dict(WRITE_KL=True, GRADS=True, REDO=False, **_GRADS)),
    ("backward", "main", dict(WRITE_KL=False, GRADS=True, REDO=False, **_GRADS)),
    ("correction", "main", dict(WRITE_KL=False, GRADS=True, REDO=True, **_GRADS)),
    ("dki", "dki", {}),  # deterministic mode's dki: key-major in dense mode,
    ("dki-rows", "dki_rows", {}),  # row shares in sparse mode
]


class Specialization(NamedTuple):
    name: str
    kernel: str  # "lse", "main", "dki" or "dki_rows"
    dtype: torch.dtype
    constexprs: tuple
    num_warps: int
    num_stages: int


def specializations() -> list[Specialization]:
    from streamkl.backends.triton import _indexer_launch

    out = []
    for shape, dtype, h, hk, d, g, sparse in SHAPES:
        spec = IndexerKLSpec(1, h, hk, g, 4096, 4096, d, 128, True, 192**-0.5, 2048 if sparse else 0, sparse,
                             False, 1, None, False)  # fmt: skip
        consts = dict(_indexer_launch.plan(spec, dtype, dtype, False).consts)
        warps, stages = consts.pop("num_warps"), consts.pop("num_stages")
        for variant, kernel, flags in VARIANTS:
            if (kernel == "dki" and sparse) or (kernel == "dki_rows" and not sparse):
                continue
            merged = tuple(sorted({**consts, **flags}.items()))
            out.append(Specialization(f"{shape}-{variant}", kernel, dtype, merged, warps, stages))
    _indexer_launch.plan.cache_clear()
    return out


def compile_for_hopper(spec: Specialization):
    """Compile for sm_90 with unit head-dim strides and 16-byte aligned pointers."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from streamkl.backends.triton._indexer_dki import _indexer_dki_kernel, _indexer_dki_rows_kernel
    from streamkl.backends.triton._indexer_lse import _indexer_lse_kernel
    from streamkl.backends.triton._indexer_main import _indexer_main_kernel

    kernels = dict(
        lse=_indexer_lse_kernel,
        main=_indexer_main_kernel,
        dki=_indexer_dki_kernel,
        dki_rows=_indexer_dki_rows_kernel,
    )
    kernel = kernels[spec.kernel]
    fixed = dict(spec.constexprs, sqd=1, skd=1, sid=1, skid=1)
    signature = {}
    for name in kernel.arg_names:
        if name in fixed:
            signature[name] = "constexpr"
        elif name in ("Q", "K", "QI", "KI", "W", "DQI", "DW"):
            signature[name] = _PTR[spec.dtype]
        elif name in ("TOPK", "CU", "SEQ_OF"):
            signature[name] = "*i32"
        elif name in _STATS:
            signature[name] = "*fp32"
        elif name in ("c_log2", "inv_h"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    names = kernel.arg_names
    # What Triton's launcher specializes on the GPU: 16-byte aligned pointers and integer
    # arguments divisible by 16 (every stride but W's rows of contiguous inputs at these shapes;
    # the counts are do_not_specialize). Without these hints the tiles are not loaded in 16-byte
    # vectors and the pipeliner leaves them synchronous, so the shared memory of the stages the
    # H200 runs would go unchecked.
    aligned = [
        i
        for i, (name, ty) in enumerate(signature.items())
        if ty.startswith("*") or (ty == "i32" and name in _DIVISIBLE_STRIDES)
    ]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    constants = {(names.index(k),): v for k, v in fixed.items() if k in names}
    source = ASTSource(kernel, signature, constants, attrs)
    options = dict(num_warps=spec.num_warps, num_stages=spec.num_stages)
    return triton.compile(source, target=GPUTarget("cuda", 90, 128), options=options)


def _build(spec: Specialization) -> dict:
    try:
        compiled = compile_for_hopper(spec)
    except Exception as e:  # noqa: BLE001 - reported by the test of this specialization
        return dict(error=f"{type(e).__name__}: {e}"[-3000:])
    ptx = compiled.asm["ptx"]
    wgmma = len(re.findall(r"\bwgmma\.mma_async", ptx))
    return dict(
        error=None, shared=compiled.metadata.shared, wgmma=wgmma, mma=len(re.findall(r"\bmma\.sync", ptx))
    )


SPECS = specializations()


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("sm90") / "builds.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_triton_indexer_sm90", "--json", str(out)],
        env={**os.environ, "TRITON_INTERPRET": "0"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_compiles_for_hopper(spec, builds):
    build = builds[spec.name]
    assert build["error"] is None, build["error"]
    assert build["shared"] <= SMEM_LIMIT, f"{build['shared']} B of shared memory"
    if spec.name.startswith("mqa"):  # 128-row GEMMs
        assert build["wgmma"] > 0, "the MQA teacher's and the student's products must run on wgmma"
    else:  # an MHA chunk is 16 rows, under wgmma's 64: mma.sync
        assert build["wgmma"] + build["mma"] > 0, "16-bit matrix products must run on tensor cores"


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run with TRITON_INTERPRET=0: interpreter kernels cannot be compiled")
    if sys.argv[1:2] == ["--json"]:
        Path(sys.argv[2]).write_text(json.dumps({spec.name: _build(spec) for spec in SPECS}))
        return
    for spec in SPECS:
        print(spec.name, _build(spec))


if __name__ == "__main__":
    main()
