"""Where the per-call host time of a tiny attn_kl call goes, piece by piece: validation (the spec),
backend selection, the backend's forward and backward called directly with a spec built once,
the same inside a minimal autograd.Function, the public op, and the autograd engine's own cost
for a trivial Function, with the backward on the engine's worker thread and on the calling thread.

    python lab/overhead/overhead_breakdown.py                 # B=1 H=1 N=128 D=64 causal: bf16
                                                              # triton on CUDA, float32 reference on CPU
    python lab/overhead/overhead_breakdown.py --backend cuda --json out.json
    python lab/overhead/overhead_breakdown.py --profile DIR   # also cProfile and torch.profiler
                                                              # tables of the calling-thread rows

It calls streamkl's internals (streamkl._checks, streamkl._dispatch, a backend's forward/backward
on (spec, inputs)), so it follows their refactors; the product's benchmark
(benchmarks/overhead.py) uses the public op alone. Each row is the median per-call time of
`--calls` back-to-back calls and one sync (benchmarks.overhead.per_call_us).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks/

import streamkl
from benchmarks.bench import environment
from benchmarks.overhead import cprofile_table, per_call_us
from streamkl import _checks, _dispatch
from streamkl._spec import AttnKLInputs, AttnKLStats
from streamkl.testing import make_inputs

OP = "attn_kl"
STUDENT = (False, False, True, True)


def _profile(name, fn, dev, calls, out: Path):
    """cProfile (Python, by own time) and torch.profiler (ops and CUDA API calls, by self CPU
    time) of `calls` runs of fn on the calling thread; writes both, prints the heads."""
    text = cprofile_table(fn, dev, calls, 40)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as tp:
        for _ in range(calls):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    slug = "".join(c if c.isalnum() else "_" for c in name.strip(" .")).strip("_")[:60]
    (out / f"{slug}.cprofile.txt").write_text(text)
    (out / f"{slug}.torchprof.txt").write_text(table)
    print(f"--- {name}: cProfile, {calls} calls")
    print("\n".join(text.splitlines()[:32]))
    print(f"--- {name}: torch.profiler, {calls} calls")
    print("\n".join(table.splitlines()[:28]), flush=True)


def _probe(impl, bwd_impl, dev, rows, calls):
    """The wall time spent inside the backend's forward and backward per step, for each row that
    calls them: whether the same Python runs slower inside autograd than outside it."""
    spent = {"forward": 0.0, "backward": 0.0}
    owners = {"forward": impl, "backward": bwd_impl}
    originals = {name: getattr(owners[name], name) for name in spent}

    def timed(name):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return originals[name](*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return call

    probed = []
    try:
        for name in spent:
            setattr(owners[name], name, timed(name))
        for name, fn in rows:
            for _ in range(3):
                fn()
            for key in spent:
                spent[key] = 0.0
            total = time.perf_counter()
            for _ in range(calls):
                fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            total = (time.perf_counter() - total) / calls * 1e6
            fwd, bwd = (spent[k] / calls * 1e6 for k in ("forward", "backward"))
            print(f"{name:52s} step {total:7.1f} us: in forward {fwd:6.1f}, in backward {bwd:6.1f}")
            probed.append(dict(row=name, step_us=round(total, 1), in_forward_us=round(fwd, 1)))
            probed[-1]["in_backward_us"] = round(bwd, 1)
    finally:
        for name, fn in originals.items():
            setattr(owners[name], name, fn)
    return probed


def rows_of(backend: str, dev, dtype):
    """(name, fn) per piece, for `backend` at B=1 H=1 N=128 D=64 causal."""
    x = make_inputs(b=1, h=1, nq=128, nk=128, d1=64, d2=64, dtype=dtype, device=dev)
    q1, k1 = x[0], x[1]
    q2, k2 = x[2].clone().requires_grad_(), x[3].clone().requires_grad_()
    call = dict(causal=True, scale1=None, scale2=None, cu_seqlens=None)
    spec = _checks.attn_kl_spec(q1, k1, q2, k2, **call)
    inputs = AttnKLInputs(q1, k1, q2.detach(), k2.detach())
    impl = _dispatch.select(OP, spec, inputs, backend)
    bwd_spec = spec.with_needs(STUDENT)
    bwd_impl = _dispatch.backward_of(impl, bwd_spec, inputs)  # where its own declines, another's

    def direct_fwd():
        return impl.forward(spec, inputs)

    def direct():
        stats = AttnKLStats(*impl.forward(spec, inputs))
        return bwd_impl.backward(bwd_spec, inputs, stats, torch.ones_like(stats.kl))

    class Wrapped(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            here = AttnKLInputs(q1, k1, a, b)
            stats = AttnKLStats(*impl.forward(spec, here))
            ctx.save_for_backward(a, b, *stats)
            return stats.kl

        @staticmethod
        def backward(ctx, g):
            a, b, *stats = ctx.saved_tensors
            here = AttnKLInputs(q1, k1, a, b)
            grads = bwd_impl.backward(bwd_spec, here, AttnKLStats(*stats), g.float().contiguous())
            return grads[2], grads[3]

    class Trivial(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    def step(fn):
        def run():
            q2.grad = k2.grad = None
            fn().sum().backward()

        return run

    def calling_thread(fn):
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                fn()

        return run

    def wrapped_fwd():
        with torch.no_grad():
            return Wrapped.apply(q2, k2)

    op = step(lambda: streamkl.attn_kl(q1, k1, q2, k2, causal=True, backend=backend))
    wrapped = step(lambda: Wrapped.apply(q2, k2))
    trivial = step(lambda: Trivial.apply(q2))
    rows = [
        ("validation: build the spec", lambda: _checks.attn_kl_spec(q1, k1, q2, k2, **call)),
        ("backend selection", lambda: _dispatch.select(OP, spec, inputs, backend)),
        ("backend forward, called directly", direct_fwd),
        ("the same inside a minimal autograd.Function", wrapped_fwd),
        ("backend forward + backward, called directly", direct),
        ("the same inside a minimal autograd.Function", wrapped),
        ("  ... with the backward on the calling thread", calling_thread(wrapped)),
        ("the public op, eager, forward + backward", op),
        ("  ... with the backward on the calling thread", calling_thread(op)),
        ("a trivial autograd.Function (x * 2)", trivial),
        ("  ... with the backward on the calling thread", calling_thread(trivial)),
    ]
    return rows, impl, bwd_impl


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--backend", choices=list(streamkl.BACKENDS), help="default: triton on CUDA, reference on CPU"
    )
    p.add_argument("--calls", type=int, help="calls per timed run (default: 200 on CUDA, 5 on CPU)")
    p.add_argument("--json", type=Path, help="write the rows and the environment here")
    p.add_argument("--profile", type=Path, help="write cProfile and torch.profiler tables here")
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    backend = args.backend or ("triton" if dev.type == "cuda" else "reference")
    calls = args.calls or (200 if dev.type == "cuda" else 5)
    rows, impl, bwd_impl = rows_of(backend, dev, dtype)
    print(f"{backend} on {dev.type}, {dtype}, B=1 H=1 N=128 D=64 causal, {calls} calls per run")
    timed = []
    for name, fn in rows:
        us = per_call_us(fn, dev, calls, 5)
        timed.append(dict(row=name, us=round(us, 1)))
        print(f"{name:52s} {us:8.1f} us", flush=True)
    probed = _probe(impl, bwd_impl, dev, rows[2:], calls)
    if args.json:
        env = environment(dev, ["lab/overhead/overhead_breakdown.py", *(argv or sys.argv[1:])])
        data = dict(environment=env, backend=backend, dtype=str(dtype), calls=calls, rows=timed, probe=probed)
        args.json.write_text(json.dumps(data, indent=1))
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        for i, (name, fn) in enumerate(rows):
            if name.startswith("  ") or name.startswith("backend forward + backward"):
                _profile(f"{i} {name}", fn, dev, 50 if dev.type == "cuda" else 2, args.profile)


if __name__ == "__main__":
    main()
