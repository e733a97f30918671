"""Every Triton kernel specialization the launchers pick on an H200, compiled for sm_90 here on
a machine without a GPU (Triton's ptxas ships in its wheel): the code CI cannot run still has to
build, keep its matrix products on wgmma, and fit the 227 KiB of shared memory of one SM.

The specializations are read off the launchers' own plans (`_launch.fwd_plan` / `bwd_plan` for
a GPU of 132 SMs), so they are the constexprs and launch options a call gets, each once.

Interpreter kernels cannot be compiled, and tests/conftest.py sets TRITON_INTERPRET=1 without a
GPU before triton is imported. So one subprocess with TRITON_INTERPRET=0 (`python -m
tests.test_triton_sm90 --json FILE`) compiles them all, in a process per CPU, and writes what
the tests check; Triton's disk cache, keyed on source, options and target, keeps the builds, so a
run after one with the same kernels compiles nothing. `python -m tests.test_triton_sm90` prints a
hash of each one's PTX instruction histogram; lab/triton/ptx_compare.py compares the generated
code of two trees in full.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest

triton = pytest.importorskip("triton")

import torch  # noqa: E402

from streamkl._spec import AttnKLSpec  # noqa: E402
from streamkl.backends.triton import _launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMEM_LIMIT = 227 * 1024
H200_SMS = 132
_INTS = {"H", "HK1", "HK2", "NQ", "NK", "G1", "G2", "GG", "ROWS"}
_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
_DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_KERNELS = {"fwd": "_fwd_kernel", "merge": "_merge_kernel", "dq": "_bwd_dq_kernel", "dk": "_bwd_dk_kernel"}

# (dtype, D1, D2): the config-table rows compiled here (streamkl/backends/triton/_config.py),
# D1 != D2 where the row's head-dim bucket allows it: the 16-bit D = 128 row the H200 figures are
# measured with, in both 16-bit types, and fp32 at D <= 64. The other rows (16-bit D <= 64 and
# D = 256, fp32 D = 128 and 256) run in the GPU suite only: their kernels compile for 10 s to
# minutes each on a CPU (one fp32 D = 128 key-major kernel for over 5 minutes).
TABLE_ROWS = (
    (torch.bfloat16, 128, 128),
    (torch.float16, 128, 64),
    (torch.float32, 64, 64),
)
SETTING1 = (False, False, True, True)  # grads of q2, k2
ALL = (True, True, True, True)


class Specialization(NamedTuple):
    name: str
    kernel: str  # a key of _KERNELS
    dtype: torch.dtype  # of q1, k1, q2, k2 (and dq/dk)
    constexprs: tuple  # sorted (name, value) pairs
    num_warps: int
    num_stages: int


def _spec(d1, d2, causal, packed=False, needs=SETTING1, n=16384):
    """A call of 32 heads at N = 16384 (packed: two sequences of N / 2)."""
    seqs, longest = (2, n // 2) if packed else (1, None)
    return AttnKLSpec(1, 32, 32, 32, n, n, d1, d2, causal, 1.0, 1.0, seqs, longest, packed, needs)


def specializations() -> list[Specialization]:
    """The launches the launchers build on a 132-SM GPU, for each of TABLE_ROWS, causal or not:
    the forward dense, split over the keys and packed, with its merge; the backward of setting 1
    and of both settings, separate (its dq launch split or not) and fused. Each distinct
    specialization once, in the order first met."""
    cuda = torch.device("cuda")
    found: dict[tuple, Specialization] = {}

    def add(kind, dtype, consts, tag):
        consts = dict(consts)
        warps, stages = consts.pop("num_warps"), consts.pop("num_stages", 1)
        key = (kind, dtype, tuple(sorted(consts.items())), warps, stages)
        if key not in found:
            found[key] = Specialization(f"{kind}-{_DTYPE_NAME[dtype]}-{tag}", kind, *key[1:])

    with mock.patch.object(_launch, "_num_sms", lambda device: H200_SMS):
        for dtype, d1, d2 in TABLE_ROWS:
            for causal in (False, True):
                shape = f"{d1}x{d2}-causal{int(causal)}"
                for packed, forced, tag in ((False, 1, "dense"), (False, 4, "split"), (True, None, "packed")):
                    plan = _launch.fwd_plan(_spec(d1, d2, causal, packed), dtype, cuda, forced)
                    add("fwd", dtype, plan.consts, f"{shape}-{tag}")
                    if plan.merge_consts is not None:
                        add("merge", torch.float32, plan.merge_consts, f"splits{plan.splits}")
                for needs, setting in ((SETTING1, "setting1"), (ALL, "both")):
                    spec = _spec(d1, d2, causal, needs=needs)
                    for strategy, forced in (("separate", 1), ("separate", 4), ("fused", 1)):
                        plan = _launch.bwd_plan(spec, dtype, cuda, strategy, forced)
                        tag = f"{shape}-{setting}-{strategy}"
                        if plan.dq_consts is not None:
                            add("dq", dtype, plan.dq_consts, f"{tag}-split{int(plan.dq_splits > 1)}")
                        for launch in plan.key_major:
                            add("dk", dtype, launch.consts, tag)
    _launch.fwd_plan.cache_clear()  # no plan for a device this process does not have stays behind
    _launch.bwd_plan.cache_clear()
    return list(found.values())


def compile_for_hopper(spec: Specialization):
    """Compile a specialization for sm_90 with contiguous inputs (unit head-dim strides, as the
    launchers' callers pass most often) and float32 statistics."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from streamkl.backends.triton import _bwd, _fwd

    kernel = getattr(_fwd if spec.kernel in ("fwd", "merge") else _bwd, _KERNELS[spec.kernel])
    fixed = dict(spec.constexprs, sq1d=1, sk1d=1, sq2d=1, sk2d=1)
    signature = {}
    for name in kernel.arg_names:
        if name in fixed:
            signature[name] = "constexpr"
        elif name in ("Q1", "K1", "Q2", "K2", "DQ1", "DQ2", "DK1", "DK2"):
            signature[name] = _PTR[spec.dtype]
        elif name == "CU":
            signature[name] = "*i32"
        elif name in ("c1", "c2", "scale1", "scale2"):
            signature[name] = "fp32"
        elif name[0].islower() or name in _INTS:
            signature[name] = "i32"
        else:  # KL, LSE1, LSE2, G, KLp, PART, DQA1, DQA2: float32 statistics and accumulators
            signature[name] = "*fp32"
    names = kernel.arg_names
    # What Triton's launcher specializes on the GPU: 16-byte aligned pointers and integer
    # arguments divisible by 16 (the row and head strides of contiguous D=128 inputs), except
    # those in do_not_specialize. Without these hints the tiles cannot be loaded in 16-byte
    # vectors and the pipeliner leaves them synchronous: not the code the H200 runs.
    # (In argument order: Triton's disk cache keys on the text of these hints.)
    aligned = [
        i
        for i, (name, ty) in enumerate(signature.items())
        if ty.startswith("*") or (ty == "i32" and name[0] == "s" and name[1] in "qk")
    ]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    constants = {(names.index(k),): v for k, v in fixed.items() if k in names}
    source = ASTSource(kernel, signature, constants, attrs)
    options = dict(num_warps=spec.num_warps, num_stages=spec.num_stages)
    return triton.compile(source, target=GPUTarget("cuda", 90, 128), options=options)


def instruction_histogram(compiled) -> tuple[str, int]:
    """(hash of the sorted opcode counts, instruction count) of the PTX: every opcode with its
    type suffixes, counted; labels, registers and debug lines left out."""
    ops = collections.Counter(
        m.group(1) for m in re.finditer(r"^\s+([a-z][a-z0-9._]+)", compiled.asm["ptx"], re.M)
    )
    return hashlib.sha256(repr(sorted(ops.items())).encode()).hexdigest()[:12], sum(ops.values())


def _build(spec: Specialization) -> dict:
    """What the tests check of one specialization, or the error that stopped its compile."""
    try:
        compiled = compile_for_hopper(spec)
    except Exception as e:  # noqa: BLE001 - reported by the test of this specialization
        return dict(error=f"{type(e).__name__}: {e}"[-3000:])
    ptx = compiled.asm["ptx"]
    return dict(
        error=None, shared=compiled.metadata.shared, wgmma=len(re.findall(r"\bwgmma\.mma_async", ptx))
    )


def _cost(spec: Specialization) -> int:
    # fp32 kernels (FMA loops) and the backward's take longest: started first, they do not
    # leave one process compiling alone at the end
    return (spec.dtype == torch.float32) * 4 + {"dk": 2, "dq": 1}.get(spec.kernel, 0)


def build_all(specs: list[Specialization]) -> dict[str, dict]:
    """_build of every specialization, in a process per CPU."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ordered = sorted(specs, key=_cost, reverse=True)
    workers = max(1, min(len(os.sched_getaffinity(0)), len(ordered)))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return {spec.name: result for spec, result in zip(ordered, pool.map(_build, ordered))}


SPECS = specializations()


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("sm90") / "builds.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_triton_sm90", "--json", str(out)],
        env={**os.environ, "TRITON_INTERPRET": "0"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_specializations_are_distinct_and_cover_every_kernel():
    assert len({s.name for s in SPECS}) == len(SPECS)
    kinds = collections.Counter(s.kernel for s in SPECS)
    assert set(kinds) == set(_KERNELS)
    # both key-major tile layouts ship (queries x keys for 16-bit D <= 128, else keys x queries)
    assert {dict(s.constexprs)["QROWS"] for s in SPECS if s.kernel == "dk"} == {False, True}


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_compiles_for_hopper(spec, builds):
    build = builds[spec.name]
    assert build["error"] is None, build["error"]
    assert build["shared"] <= SMEM_LIMIT, f"{build['shared']} B of shared memory"
    if spec.kernel != "merge" and spec.dtype != torch.float32:
        assert build["wgmma"] > 0, "16-bit matrix products must run on wgmma"


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run with TRITON_INTERPRET=0: interpreter kernels cannot be compiled")
    if sys.argv[1:2] == ["--json"]:
        Path(sys.argv[2]).write_text(json.dumps(build_all(SPECS)))
        return
    for spec in SPECS:
        compiled = compile_for_hopper(spec)
        digest, count = instruction_histogram(compiled)
        print(f"{spec.name:55s} {digest} {count:6d} instructions, smem={compiled.metadata.shared}")


if __name__ == "__main__":
    main()
