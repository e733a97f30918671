"""Every Triton kernel specialization the launchers pick on an H200, compiled for sm_90 here on
a machine without a GPU (Triton's ptxas ships in its wheel): the code CI cannot run still has to
build, keep its matrix products on wgmma, and fit the 227 KiB of shared memory of one SM.

`python tests/test_triton_sm90.py` prints, for each kernel, a hash of its PTX instruction
histogram (every opcode with its type suffixes, counted; labels, registers and debug lines
left out) and the instruction count: equal before and after a refactor means the GPU runs the
same instructions, at most scheduled in another order.

triton.jit builds interpreter kernels, which cannot be compiled, when TRITON_INTERPRET=1 is set
as triton and the kernels are imported (tests/conftest.py sets it without a GPU). In such a
process test_compiling_process re-runs this file in a subprocess with TRITON_INTERPRET=0 and
the cases here skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from streamkl.backends.triton import _bwd, _config, _fwd  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 128)
SMEM_LIMIT = 227 * 1024
_INTS = {"H", "HK1", "HK2", "NQ", "NK", "G1", "G2", "GG", "ROWS"}
_PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
RERUN = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(autouse=True)
def _only_in_compiling_process(request):
    if RERUN and request.node.name != "test_compiling_process":
        pytest.skip("runs in the TRITON_INTERPRET=0 subprocess of test_compiling_process")


@pytest.mark.skipif(not RERUN, reason="this process compiles the kernels itself")
def test_compiling_process():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-p", "no:cacheprovider"],
        env={**os.environ, "TRITON_INTERPRET": "0"},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-2000:]


def _compile(kernel, dtype, constexprs, num_warps, num_stages):
    """Compile `kernel` for sm_90 with contiguous inputs (unit head-dim strides, as the
    launchers' callers pass most often) and float32 statistics."""
    fixed = dict(constexprs, sq1d=1, sk1d=1, sq2d=1, sk2d=1)
    signature = {}
    for name in kernel.arg_names:
        if name in fixed:
            signature[name] = "constexpr"
        elif name in ("Q1", "K1", "Q2", "K2", "DQ1", "DQ2", "DK1", "DK2"):
            signature[name] = _PTR[dtype]
        elif name == "CU":
            signature[name] = "*i32"
        elif name in ("c1", "c2", "scale1", "scale2"):
            signature[name] = "fp32"
        elif name[0].islower() or name in _INTS:
            signature[name] = "i32"
        else:  # KL, LSE1, LSE2, G, KLp, PART, DQA1, DQA2: float32 statistics and accumulators
            signature[name] = "*fp32"
    if kernel is _fwd._merge_kernel:
        signature = {
            "PART": "*fp32",
            "KL": "*fp32",
            "LSE1": "*fp32",
            "LSE2": "*fp32",
            "ROWS": "i32",
            "n_splits": "i32",
            "SPLITS_P": "constexpr",
            "BLOCK_R": "constexpr",
        }
    names = kernel.arg_names
    # What Triton's launcher specializes on the GPU: 16-byte aligned pointers and integer
    # arguments divisible by 16 (the row and head strides of contiguous D=128 inputs), except
    # those in do_not_specialize. Without these hints the tiles cannot be loaded in 16-byte
    # vectors and the pipeliner leaves them synchronous: not the code the H200 runs.
    aligned = {
        name
        for name, ty in signature.items()
        if ty.startswith("*") or (ty == "i32" and name[0] == "s" and name[1] in "qk")
    }
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in aligned}
    source = ASTSource(
        kernel, signature, {(names.index(k),): v for k, v in fixed.items() if k in names}, attrs
    )
    return triton.compile(source, target=HOPPER, options=dict(num_warps=num_warps, num_stages=num_stages))


def _dims(d1, d2):
    return dict(D1=d1, D2=d2, D1P=_config.pow2_dim(d1), D2P=_config.pow2_dim(d2))


def _torch_dtype(dtype):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]


def specializations():
    """(name, kernel, dtype, constexprs, num_warps, num_stages), as the launchers build them."""
    out = []
    for dtype, d1, d2 in (("bf16", 128, 128), ("fp16", 128, 64), ("fp32", 64, 64)):
        prec = "ieee" if dtype == "fp32" else "tf32"
        dims = _dims(d1, d2)
        for causal in (False, True):
            cfg = _config.fwd_cfg(dims["D1P"], dims["D2P"], _torch_dtype(dtype), causal, 1 << 14, False)
            for split, varlen in ((False, False), (True, False), (False, True)):
                ce = dict(
                    dims,
                    BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n,
                    CAUSAL=causal,
                    VARLEN=varlen,
                    SPLIT=split,
                    PREC=prec,
                )
                name = f"fwd-{dtype}-{d1}x{d2}-causal{int(causal)}-split{int(split)}-varlen{int(varlen)}"
                out.append((name, _fwd._fwd_kernel, dtype, ce, cfg.num_warps, cfg.num_stages))
            for both in (False, True):
                cq, ck = _config.bwd_cfgs(dims["D1P"], dims["D2P"], _torch_dtype(dtype), causal, False, both)
                common = dict(dims, CAUSAL=causal, VARLEN=False, PREC=prec)
                on = (True, True) if both else (False, True)
                dq_on = dict(DQ1_ON=on[0], DQ2_ON=on[1])
                for split in (False, True):
                    out.append(
                        (
                            f"dq-{dtype}-{d1}x{d2}-causal{int(causal)}-both{int(both)}-split{int(split)}",
                            _bwd._bwd_dq_kernel,
                            dtype,
                            dict(common, BLOCK_M=cq.block_m, BLOCK_N=cq.block_n, SPLIT=split, **dq_on),
                            cq.num_warps,
                            cq.num_stages,
                        )
                    )
                for fused in (False, True):
                    out.append(
                        (
                            f"dk-{dtype}-{d1}x{d2}-causal{int(causal)}-both{int(both)}-fused{int(fused)}",
                            _bwd._bwd_dk_kernel,
                            dtype,
                            dict(
                                common,
                                BLOCK_M=ck.block_m,
                                BLOCK_N=ck.block_n,
                                DK1_ON=on[0],
                                DK2_ON=on[1],
                                FQ1=False,
                                FQ2=fused,
                                QROWS=ck.qrows,
                            ),
                            ck.num_warps,
                            ck.num_stages,
                        )
                    )
    # The key-major kernel's other tile layout (Cfg.qrows), a timing variant of
    # benchmarks/triton_tune.py, at the tile shape docs/triton.md times it with.
    qrows = not _config.bwd_cfgs(128, 128, _torch_dtype("bf16"), False, False, False)[1].qrows
    bm, bn = (128, 64) if qrows else (64, 128)
    out.append(
        (
            f"dk-bf16-128x128-causal0-both0-fused0-qrows{int(qrows)}",
            _bwd._bwd_dk_kernel,
            "bf16",
            dict(
                _dims(128, 128),
                CAUSAL=False,
                VARLEN=False,
                PREC="tf32",
                BLOCK_M=bm,
                BLOCK_N=bn,
                DK1_ON=False,
                DK2_ON=True,
                FQ1=False,
                FQ2=False,
                QROWS=qrows,
            ),
            8,
            2,
        )
    )
    out.append(("merge", _fwd._merge_kernel, "fp32", dict(SPLITS_P=8, BLOCK_R=128), 4, 1))
    return out


SPECS = specializations()


@pytest.mark.parametrize("spec", SPECS, ids=[s[0] for s in SPECS])
def test_compiles_for_hopper(spec):
    name, kernel, dtype, constexprs, num_warps, num_stages = spec
    compiled = _compile(kernel, dtype, constexprs, num_warps, num_stages)
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.shared <= SMEM_LIMIT, f"{compiled.metadata.shared} B of shared memory"
    if kernel is not _fwd._merge_kernel and dtype != "fp32":
        assert "wgmma.mma_async" in ptx, "16-bit matrix products must run on wgmma"


def _opcode_count(compiled, prefix: str) -> int:
    return len(re.findall(rf"^\s+{re.escape(prefix)}", compiled.asm["ptx"], re.M))
