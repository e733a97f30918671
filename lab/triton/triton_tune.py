"""Check and time the triton backend's variants on one GPU, in one run.

    PYTHONPATH=. python3 lab/triton/triton_tune.py [--parts fwd,split,bwd,decode_bwd]

A variant is a set of kernel configs (None: the shipped table), put in place of every entry of
the launchers' config tables for its run (`Variant.applied`: the tables of
streamkl/backends/triton/_config.py, with the cached launch plans dropped before and after),
plus the split-K and backward-strategy settings (STREAMKL_TRITON_SPLIT_K, STREAMKL_TRITON_BWD;
None: the auto rules). For every variant: first a correctness check on fresh
random data against the float64 dense formula (streamkl.testing.dense_attn_kl; forward kl/lse and
the needed gradients, within the budgets of docs/contract.md, Numerics), then a timing with
triton.testing.do_bench (median of repeats, warm-up excluded) on the benchmark shape (B=1, H=32,
D=128, bf16 unless told). A bf16 8192^3 GEMM timed the same way, at the start and at the end of
the run, is the yardstick. Prints a table last; writes JSON to $OUT/triton_tune.json (or --out).

FLOP counts (the GEMM count of benchmarks/providers.py, `attn_kl_flops`): forward =
4*B*H*Nq*Nk*D (two GEMMs), backward of one setting = 8*B*H*Nq*Nk*D (four GEMMs: S1, S2
recomputed, dq, dk), both settings = 12*B*H*Nq*Nk*D; all halved when causal with Nq == Nk.

The ablations of the forward and backward kernels (no tile exponentials, one logit GEMM, the
GEMMs alone), which needed a switch inside the shipped kernels, are gone from this script; their
numbers and the commands that took them are in lab/notes/triton_log.md ("Where the forward's time
goes, measured", and the backward's), and the script that ran them is in git history.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import sys
import time
import traceback

import torch
import triton
from triton.testing import do_bench

from streamkl import _checks
from streamkl._spec import AttnKLInputs, AttnKLStats
from streamkl.backends.triton import _config, _launch
from streamkl.backends.triton._config import Cfg
from streamkl.testing import dense_attn_kl, make_inputs

ROWS: list[dict] = []
LOG = []


def log(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


def flops(kind: str, b, h, nq, nk, d, causal) -> float:
    mult = {"fwd": 4, "bwd1": 8, "bwd2": 8, "bwd12": 12}[kind]
    f = mult * b * h * nq * nk * d
    return f / 2 if causal else f


def bench(fn, reps_ms=200) -> float:
    return do_bench(fn, warmup=50, rep=reps_ms, return_mode="median")


def gemm_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: a @ b, 500)
    return 2 * n**3 / ms / 1e9


def _cfg(c) -> Cfg | None:
    """A Cfg from its JSON form: a list of the fields in order (block_m, block_n, num_warps,
    num_stages, qrows) or a dict of them; None stays None (the shipped table)."""
    if c is None or isinstance(c, Cfg):
        return c
    return Cfg(**c) if isinstance(c, dict) else Cfg(*c)


def cfg_list(c: Cfg | None):
    """The JSON form of a Cfg that a result row records."""
    return None if c is None else list(dataclasses.astuple(c))


@contextlib.contextmanager
def replaced_tables(fwd: Cfg | None, bq: Cfg | None, bk: Cfg | None):
    """The launchers' config tables (_config._FWD, _BWD_Q, _BWD_K) with every entry replaced by
    `fwd`, `bq`, `bk` where not None, restored on exit. The launch plans are cached per call
    spec, so both caches are dropped on the way in and out: every call inside builds its plan
    from the replaced tables (the forward still fits BLOCK_M to Nq), none after reuses one."""
    tables = ((_config._FWD, fwd), (_config._BWD_Q, bq), (_config._BWD_K, bk))
    saved = [dict(table) for table, _ in tables]
    for table, cfg in tables:
        if cfg is not None:
            table.update(dict.fromkeys(table, cfg))
    _launch.fwd_plan.cache_clear()
    _launch.bwd_plan.cache_clear()
    try:
        yield
    finally:
        for (table, _), old in zip(tables, saved):
            table.clear()
            table.update(old)
        _launch.fwd_plan.cache_clear()
        _launch.bwd_plan.cache_clear()


@contextlib.contextmanager
def environment(**values):
    """Sets (or, for None, clears) environment variables, restored on exit."""
    old = {key: os.environ.get(key) for key in values}
    try:
        for key, val in values.items():
            if val is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = str(val)
        yield
    finally:
        for key, val in old.items():
            if val is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = val


@dataclasses.dataclass(frozen=True)
class Variant:
    """What one row runs. fwd, bq, bk: the forward, dq and key-major kernel configs put in the
    launchers' tables (None: the shipped table, streamkl/backends/triton/_config.py); split, bwd:
    STREAMKL_TRITON_SPLIT_K and STREAMKL_TRITON_BWD (None: the auto rules)."""

    fwd: Cfg | None = None
    bq: Cfg | None = None
    bk: Cfg | None = None
    split: str | int | None = None
    bwd: str | None = None

    @classmethod
    def of(cls, fwd=None, bq=None, bk=None, split=None, bwd=None) -> Variant:
        return cls(_cfg(fwd), _cfg(bq), _cfg(bk), split, bwd)

    @contextlib.contextmanager
    def applied(self):
        """The launchers run this variant inside: its configs in the tables, its settings in the
        two variables they read on every call."""
        env = dict(STREAMKL_TRITON_SPLIT_K=self.split, STREAMKL_TRITON_BWD=self.bwd)
        with replaced_tables(self.fwd, self.bq, self.bk), environment(**env):
            yield


SHIPPED = Variant()


def _prewarm_one(job):
    variant, chk = job
    try:
        with variant.applied():
            check(**chk)
        return None
    except Exception as e:  # noqa: BLE001 - reported again by the main process
        return f"{variant} {type(e).__name__}: {str(e)[:120]}"


def prewarm(jobs, workers):
    """Compile every variant in parallel processes (they fill Triton's disk cache; sizes are not
    specialized, so the main process's check and timing shapes reuse those binaries)."""
    if workers <= 1 or not jobs:
        return
    import multiprocessing as mp

    t = time.time()
    with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        errs = [e for e in pool.map(_prewarm_one, jobs, chunksize=1) if e]
    log(f"[prewarm: {len(jobs)} variants in {time.time() - t:.0f}s; {len(errs)} failed]")
    for e in errs:
        log(f"  prewarm failure: {e}")


def call(q1, k1, q2, k2, causal, needs=None):
    """The launchers' (spec, inputs) of a dense call at scales 1/sqrt(D), validated once here so
    that a timed call pays the launcher alone; `needs` (dq1, dk1, dq2, dk2) for a backward."""
    spec = _checks.attn_kl_spec(q1, k1, q2, k2, causal=causal, scale1=None, scale2=None)
    if needs is not None:
        spec = spec.with_needs(needs)
    return spec, AttnKLInputs(q1, k1, q2, k2)


def run_fwd(q1, k1, q2, k2, causal):
    return _launch.forward(*call(q1, k1, q2, k2, causal))


def run_bwd(g, q1, k1, q2, k2, out, causal, needs):
    spec, inputs = call(q1, k1, q2, k2, causal, needs)
    return _launch.backward(spec, inputs, AttnKLStats(*out), g)


NEEDS = {
    "bwd1": (False, False, True, True),
    "bwd2": (True, True, False, False),
    "bwd12": (True, True, True, True),
}


def check(kind, causal, nq, nk, dtype=torch.bfloat16, d=128, h=4, seed=None, groups=(2, 4)):
    """Max error / budget ratio (<= 1 passes) of the variant applied on fresh data.
    groups: query heads per key head of each side (default GQA 2 and 4: two key-major launches)."""
    seed = int(time.time_ns() % 2**31) if seed is None else seed
    hk1, hk2 = max(1, h // groups[0]), max(1, h // groups[1])
    q1, k1, q2, k2 = make_inputs(
        b=1, h=h, nq=nq, nk=nk, d1=d, d2=d, hk1=hk1, hk2=hk2, dtype=dtype, device="cuda", seed=seed
    )
    kl, l1, l2 = run_fwd(q1, k1, q2, k2, causal)
    ref_in = [t.detach().double().requires_grad_() for t in (q1, k1, q2, k2)]
    rkl, rl1, rl2 = dense_attn_kl(*ref_in, causal=causal, return_lse=True)
    tol = 2e-3 if dtype != torch.float32 else 1e-4
    worst = ((kl.double() - rkl).abs() / (tol * rkl.abs().clamp_min(1))).max().item()
    fin = torch.isfinite(rl1)
    worst = max(worst, ((l1.double() - rl1)[fin].abs() / (tol * rl1[fin].abs().clamp_min(1))).max().item())
    if not torch.isfinite(kl).all():
        worst = float("inf")
    if kind == "fwd":
        return worst
    g = torch.randn_like(kl)
    rkl.backward(g.double())
    grads = run_bwd(g, q1, k1, q2, k2, (kl, l1, l2), causal, NEEDS[kind])
    gtol = 2e-2 if dtype != torch.float32 else 1e-3
    for got, ref in zip(grads, ref_in):
        if got is None:
            continue
        err = ((got.double() - ref.grad).norm() / ref.grad.norm()).item()
        worst = max(worst, err / gtol if math.isfinite(err) else float("inf"))
    return worst


_SEEN_KERNELS: set[int] = set()
_CONSTS = (
    *("BLOCK_M", "BLOCK_N", "QROWS", "CAUSAL"),
    *("DK1_ON", "DK2_ON", "DQ1_ON", "DQ2_ON", "FQ1", "FQ2"),
)  # the constexprs a resource row names


def new_kernel_resources() -> list[dict]:
    """Registers, spills and shared memory of the backward kernels compiled since the last call,
    as this GPU's Triton built them (ptxas figures differ between Triton versions, so only the
    device's count): register pressure is what the key-major kernel's tile layouts trade."""
    from streamkl.backends.triton import _bwd

    out = []
    for jit_fn in (_bwd._bwd_dk_kernel, _bwd._bwd_dq_kernel):
        for entry in list(getattr(jit_fn, "device_caches", {}).values()):
            for compiled in list(entry[0].values()):
                if id(compiled) in _SEEN_KERNELS:
                    continue
                _SEEN_KERNELS.add(id(compiled))
                try:
                    compiled._init_handles()
                    consts = {}
                    for key, val in getattr(compiled.src, "constants", {}).items():
                        idx = key[0] if isinstance(key, tuple) else key
                        name = jit_fn.arg_names[idx] if isinstance(idx, int) else str(idx)
                        if name in _CONSTS:
                            consts[name] = getattr(val, "value", val)
                    out.append(
                        dict(
                            kernel=jit_fn.__name__,
                            n_regs=compiled.n_regs,
                            n_spills=compiled.n_spills,
                            shared=compiled.metadata.shared,
                            num_warps=compiled.metadata.num_warps,
                            num_stages=compiled.metadata.num_stages,
                            **consts,
                        )
                    )
                except Exception as e:  # noqa: BLE001 - diagnostics only
                    out.append(dict(kernel=jit_fn.__name__, error=f"{type(e).__name__}: {str(e)[:80]}"))
    for r in out:
        log("       kernel " + " ".join(f"{k}={v}" for k, v in r.items()))
    return out


def record(**row):
    ROWS.append(row)
    extra = f" err/budget={row['check']:.3f}" if row.get("check") is not None else ""
    log(
        f"{row['part']:6s} {row['variant']:34s} {row['shape']:28s} {row['ms']:9.4f} ms "
        f"{row.get('tflops', 0):7.1f} TF/s{extra}"
    )


B, H, D = 1, 32, 128  # the benchmark shape, bf16


def _inputs(nq, nk, seed):
    return make_inputs(b=B, h=H, nq=nq, nk=nk, d1=D, d2=D, dtype=torch.bfloat16, device="cuda", seed=seed)


def time_fwd(ns, causal, gemm, **row):
    """Time the applied variant's forward at N = Nq = Nk for each N in ns; record a row each."""
    for n in ns:
        q1, k1, q2, k2 = _inputs(n, n, n)
        spec, inputs = call(q1, k1, q2, k2, causal)
        ms = bench(lambda: _launch.forward(spec, inputs))  # noqa: B023 - timed at once
        tf = flops("fwd", B, H, n, n, D, causal) / ms / 1e9
        record(shape=f"B{B} H{H} N{n} D{D}", ms=ms, tflops=tf, frac_gemm=tf / gemm, causal=causal, n=n, **row)


def kernel_ms(fn, iters=5) -> dict[str, float]:
    """Device time per kernel name (ms per call of fn), from torch.profiler over `iters` calls:
    which of a backward's launches the time goes to."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None)
        if us is None:
            us = getattr(ev, "self_cuda_time_total", 0)
        if us:
            out[ev.key[:40]] = out.get(ev.key[:40], 0.0) + us / iters / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def time_bwd(ns, kind, causal, gemm, memory=False, per_kernel=False, resources=False, **row):
    """Time the applied variant's backward of `kind` at each N in ns; record a row each, with the
    peak device memory beyond inputs, forward outputs and the gradients when `memory`, and the
    device time of each launch when `per_kernel`, and the registers and spills of the kernels
    it compiled when `resources`."""
    for n in ns:
        q1, k1, q2, k2 = _inputs(n, n, n)
        out = AttnKLStats(*run_fwd(q1, k1, q2, k2, causal))
        g = torch.randn_like(out.kl)
        spec, inputs = call(q1, k1, q2, k2, causal, NEEDS[kind])
        bwd = lambda: _launch.backward(spec, inputs, out, g)  # noqa: B023, E731 - timed at once
        ms = bench(bwd)
        tf = flops(kind, B, H, n, n, D, causal) / ms / 1e9
        if resources:
            row["kernels"] = new_kernel_resources()
        if per_kernel:
            try:
                row["kernels_ms"] = kernel_ms(bwd)
                split = ", ".join(f"{k} {v:.3f} ms" for k, v in row["kernels_ms"].items())
                log(f"       per kernel: {split}")
            except Exception as e:  # noqa: BLE001 - a profiler failure must not lose the timing
                log(f"       per kernel: profiler failed: {type(e).__name__}: {str(e)[:120]}")
        if memory:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            grads = bwd()
            torch.cuda.synchronize()
            own = sum(t.numel() * t.element_size() for t in grads if t is not None)
            row["extra_mem_mb"] = (torch.cuda.max_memory_allocated() - base - own) / 2**20
            del grads
        record(shape=f"B{B} H{H} N{n} D{D}", ms=ms, tflops=tf, frac_gemm=tf / gemm, causal=causal, n=n, **row)


def part_fwd(args, gemm):
    plan = [(causal, Variant.of(fwd=cfg, split="off")) for causal in (False, True) for cfg in args.fwd_cfgs]
    chk = lambda causal: dict(kind="fwd", causal=causal, nq=1000, nk=1000 if causal else 1111)  # noqa: E731
    prewarm([(v, chk(causal)) for causal, v in plan], args.workers)
    for causal, v in plan:
        name = "default" if v.fwd is None else tuple(cfg_list(v.fwd))
        try:
            with v.applied():
                err = check(**chk(causal))
                label = f"fwd {'causal' if causal else 'full'} {name}"
                time_fwd(args.ns, causal, gemm, part="fwd", variant=label, check=err, cfg=cfg_list(v.fwd))
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result
            log(f"fwd {v.fwd} causal={causal} FAILED: {type(e).__name__}: {str(e)[:200]}")


def part_split(args, gemm):
    b, h, d = B, H, D
    splits = [x if x in ("off", "auto") else int(x) for x in args.splits]
    chk = lambda nq: dict(kind="fwd", causal=False, nq=nq, nk=3000)  # noqa: E731
    prewarm([(Variant(split=sp), chk(nq)) for nq in args.split_nqs for sp in ("off", "auto")], args.workers)
    for nk in args.split_nks:
        for nq in args.split_nqs:
            q1, k1, q2, k2 = _inputs(nq, nk, nq)
            spec, inputs = call(q1, k1, q2, k2, False)
            for split in splits:
                try:
                    with Variant(split=split).applied():
                        err = check(**chk(nq)) if split in ("off", "auto", 8) else None
                        ms = bench(lambda: _launch.forward(spec, inputs), 100)  # noqa: B023
                    tf = flops("fwd", b, h, nq, nk, d, False) / ms / 1e9
                    cfg = _config.fwd_cfg(128, 128, torch.bfloat16, False, nq, False)
                    chosen = _config.split_count(
                        b * h * triton.cdiv(nq, cfg.block_m),
                        triton.cdiv(nk, cfg.block_n),
                        132,
                        None,
                        cfg.block_m,
                    )
                    record(
                        part="split",
                        variant=f"split={split}" + (f"(->{chosen})" if split == "auto" else ""),
                        shape=f"B{b} H{h} Nq{nq} Nk{nk} D{d}",
                        ms=ms,
                        tflops=tf,
                        frac_gemm=tf / gemm,
                        check=err,
                        nq=nq,
                        nk=nk,
                        split=str(split),
                        auto_choice=chosen,
                    )
                except Exception as e:  # noqa: BLE001
                    log(f"split {split} nq={nq} FAILED: {type(e).__name__}: {str(e)[:200]}")


def part_bwd(args, gemm):
    plan = [
        (kind, causal, Variant.of(bq=bq, bk=bk, bwd=strategy, split="off"))
        for kind in args.bwd_kinds
        for causal in (False, True)
        for strategy in args.strategies
        for bq, bk in args.bwd_cfgs
    ]
    chk = lambda kind, causal: dict(kind=kind, causal=causal, nq=700, nk=700 if causal else 777)  # noqa: E731
    prewarm([(v, chk(kind, causal)) for kind, causal, v in plan], args.workers)
    for kind, causal, v in plan:
        bq, bk = cfg_list(v.bq), cfg_list(v.bk)
        try:
            with v.applied():
                err = check(**chk(kind, causal))
                label = f"{v.bwd[:3]} {'causal' if causal else 'full'} " + (
                    "default"
                    if bq is None and bk is None
                    else f"q{'=table' if bq is None else tuple(bq)} k{'=table' if bk is None else tuple(bk)}"
                )
                time_bwd(
                    args.bwd_ns,
                    kind,
                    causal,
                    gemm,
                    memory=True,
                    per_kernel=True,
                    resources=True,
                    part=kind,
                    variant=label,
                    check=err,
                    strategy=v.bwd,
                    cfg_q=bq,
                    cfg_k=bk,
                )
        except Exception as e:  # noqa: BLE001
            log(f"{kind} {v.bwd} {bq} {bk} causal={causal} FAILED: {type(e).__name__}: {str(e)[:300]}")


def part_decode_bwd(args, gemm):
    """The backward (dq2, dk2) at decode shapes, Nq in --split-nqs against Nk in --split-nks: the
    table's tiles (BLOCK_M 128 in the dq kernel and 64 in the key-major one at any Nq, shipped)
    against BLOCK_M fitted to Nq as the forward's (at least 16, 4 warps below 64 rows) in the dq
    kernel, the key-major kernel or both, under the separate and the fused strategy, and fused
    with 128-key tiles, keys x queries tiles (no dS^T through shared memory) or an unpipelined
    (one-stage) key-major loop. Checks each on
    setting 1 with GQA and three times on both settings with one launch for dk1 and dk2; times the
    backward of setting 1 alone; TFLOP/s count its four GEMMs (bwd1)."""

    def variants(nq):
        bm = max(16, min(128, triton.next_power_of_2(nq)))
        fit_q = Cfg(bm, 64, 8 if bm >= 64 else 4, 3)
        fit_k = Cfg(min(bm, 64), 64, 4, 2, qrows=True)
        fit_kq = dataclasses.replace(fit_k, qrows=False)  # dS^T to the dk GEMM from registers
        one_stage = dataclasses.replace(fit_k, num_stages=1)
        table = dict(bq=Cfg(128, 64, 8, 3), bk=Cfg(64, 64, 4, 2, qrows=True))
        return [
            ("table tiles, separate", Variant.of(**table, bwd="separate")),
            ("table tiles, fused", Variant.of(**table, bwd="fused")),
            ("dq fitted, separate", Variant.of(bq=fit_q, bk=table["bk"], bwd="separate")),
            ("key-major fitted, separate", Variant.of(bq=table["bq"], bk=fit_k, bwd="separate")),
            ("fitted, separate", Variant.of(bq=fit_q, bk=fit_k, bwd="separate")),
            ("fitted, fused", Variant.of(bq=fit_q, bk=fit_k, bwd="fused")),
            ("fitted, fused, 128 keys", Variant.of(bk=dataclasses.replace(fit_k, block_n=128), bwd="fused")),
            ("fitted, keys x queries, separate", Variant.of(bq=fit_q, bk=fit_kq, bwd="separate")),
            ("fitted, keys x queries, fused", Variant.of(bq=fit_q, bk=fit_kq, bwd="fused")),
            # One stage: the key-major loop unpipelined. The run-to-run wrong dk1 at 16-row tiles
            # may be the pipeliner's race of a loaded value used a stage later (triton-lang/triton
            # PR 8139); without a pipeline there is no earlier stage to race with.
            ("fitted, 1-stage key-major, separate", Variant.of(bq=fit_q, bk=one_stage, bwd="separate")),
            ("fitted, 1-stage key-major, fused", Variant.of(bq=fit_q, bk=one_stage, bwd="fused")),
            ("shipped rule", SHIPPED),
        ]

    chk = lambda nq, causal: dict(kind="bwd1", causal=causal, nq=nq, nk=3000)  # noqa: E731
    # all four gradients with one key head per query head (one key-major launch forms dk1 and
    # dk2): the case whose dk1 came out wrong at 16-row key-major tiles (lab/notes/triton_log.md)
    chk_all = lambda nq, causal: dict(kind="bwd12", causal=causal, nq=nq, nk=4096, h=8, groups=(1, 1))  # noqa: E731
    checks = (chk, chk_all)  # their specializations differ (GQA, both settings): compile both
    cases = [(nq, m) for nq in args.split_nqs for m in (False, True)]
    jobs = [(v, c(nq, m)) for nq, m in cases for _, v in variants(nq) for c in checks]
    prewarm(jobs, args.workers)
    for nk in args.split_nks:
        for nq in args.split_nqs:
            q1, k1, q2, k2 = _inputs(nq, nk, nq)
            for causal in (False, True):
                g = torch.randn(B, H, nq, device="cuda")
                out = AttnKLStats(*run_fwd(q1, k1, q2, k2, causal))
                spec, inputs = call(q1, k1, q2, k2, causal, NEEDS["bwd1"])
                for name, v in variants(nq):
                    try:
                        with v.applied():
                            errs = [check(**chk(nq, causal))]
                            errs += [check(**chk_all(nq, causal)) for _ in range(3)]
                            err = max(errs)
                            ms = bench(lambda: _launch.backward(spec, inputs, out, g), 100)  # noqa: B023
                        tf = flops("bwd1", B, H, nq, nk, D, False) / ms / 1e9
                        record(
                            part="decode_bwd",
                            variant=f"{'causal' if causal else 'full'} {name}",
                            shape=f"B{B} H{H} Nq{nq} Nk{nk} D{D}",
                            ms=ms,
                            tflops=tf,
                            frac_gemm=tf / gemm,
                            check=err,
                            nq=nq,
                            nk=nk,
                            causal=causal,
                            strategy=v.bwd,
                            cfg_q=cfg_list(v.bq),
                            cfg_k=cfg_list(v.bk),
                        )
                    except Exception as e:  # noqa: BLE001
                        log(f"decode_bwd {name} nq={nq} nk={nk} FAILED: {type(e).__name__}: {str(e)[:200]}")


def dump(args, meta):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "triton_tune.json"), "w") as f:
        json.dump(dict(meta=meta, rows=ROWS), f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="gemm,fwd,split,bwd")
    p.add_argument("--ns", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--bwd-ns", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--bwd-kinds", nargs="+", default=["bwd1", "bwd12"])
    p.add_argument("--split-nqs", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512])
    p.add_argument("--split-nks", type=int, nargs="+", default=[32768])
    p.add_argument(
        "--fwd-cfgs",
        type=json.loads,
        default=[[128, 64, 8, 3], [128, 64, 8, 2], [128, 128, 8, 2], [128, 32, 8, 3], [64, 64, 4, 2]],
    )
    p.add_argument(
        "--bwd-cfgs",
        type=json.loads,
        default=[
            [[128, 64, 8, 2], [32, 128, 8, 2]],
            [[64, 32, 4, 2], [64, 64, 8, 2]],
            [[64, 64, 8, 2], [32, 64, 4, 2]],
        ],
    )
    p.add_argument("--splits", nargs="+", default=["off", "auto", "2", "4", "8", "16", "32", "64"])
    p.add_argument("--strategies", nargs="+", default=["separate", "fused"])
    p.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    p.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    parts = args.parts.split(",")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    meta = dict(
        device=props.name,
        sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        commit=args.commit,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        args=vars(args),
    )
    log(f"# {meta}")
    t0 = time.time()
    gemm0 = gemm_tflops()
    log(f"gemm bf16 8192^3: {gemm0:.1f} TFLOP/s (start)")
    meta.update(gemm_tflops_start=gemm0)
    for name, fn in (
        ("fwd", part_fwd),
        ("split", part_split),
        ("bwd", part_bwd),
        ("decode_bwd", part_decode_bwd),
    ):
        if name in parts:
            try:
                fn(args, gemm0)
            except Exception:  # noqa: BLE001
                log(traceback.format_exc())
            log(f"[{name} done at {time.time() - t0:.0f}s]")
            dump(args, meta)
    gemm1 = gemm_tflops()
    log(f"gemm bf16 8192^3: {gemm1:.1f} TFLOP/s (end)")
    meta.update(gemm_tflops_start=gemm0, gemm_tflops_end=gemm1, seconds=time.time() - t0)
    dump(args, meta)
    print("\n# summary (TFLOP/s, fraction of the start GEMM; err/budget <= 1 passes)")
    for r in ROWS:
        chk = "" if r.get("check") is None else f" {r['check']:.2f}"
        print(
            f"{r['part']:5s} {r['variant'][:44]:44s} {r['shape']:24s} {r['ms']:8.3f}ms "
            f"{r['tflops']:6.1f} {r['frac_gemm']:.2f}{chk}"
        )
    print(f"gemm {gemm0:.0f} -> {gemm1:.0f} TFLOP/s; {time.time() - t0:.0f}s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
