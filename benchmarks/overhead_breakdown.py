"""Where the per-call time of a tiny forward+backward goes: the same triton backend calls made
directly, inside a minimal autograd.Function, through the public op, and the autograd engine's
own cost for a trivial Function, on the backward's worker thread and on the calling thread.

    python benchmarks/overhead_breakdown.py     # B=1 H=1 N=128 D=64 causal; bf16 triton on CUDA,
                                                # float32 triton-interpreter on CPU (a smoke run)
    python benchmarks/overhead_breakdown.py --profile DIR   # also cProfile and torch.profiler
                                                # tables of the rows on the calling thread

Each row is the median per-call time of 200 back-to-back calls and one sync (benchmarks/overhead.py).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from overhead import _per_call_us, cprofile_table  # benchmarks/ is on the path when run as a script

import streamkl
from streamkl import _dispatch
from streamkl.testing import make_inputs


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


def _probe(backend, dev, rows):
    """The wall time spent inside the backend's forward and backward per step, for each row that
    calls them: whether the same Python runs slower inside autograd than outside it."""
    spent = {"forward": 0.0, "backward": 0.0}
    originals = {name: getattr(backend, name) for name in spent}

    def timed(name):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return originals[name](*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return call

    calls = 200 if dev.type == "cuda" else 2
    try:
        for name in spent:
            setattr(backend, name, timed(name))
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
            print(f"{name:48s} step {total:7.1f} us: in forward {fwd:6.1f}, in backward {bwd:6.1f}")
    finally:
        for name, fn in originals.items():
            setattr(backend, name, fn)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", type=Path, help="write cProfile and torch.profiler tables here")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x = make_inputs(h=1, nq=128, nk=128, d1=64, d2=64, dtype=dtype, device=dev)
    q1, k1 = x[0], x[1]
    q2, k2 = x[2].clone().requires_grad_(), x[3].clone().requires_grad_()
    backend = _dispatch.module("triton")
    kw = dict(causal=True, scale1=0.125, scale2=0.125, cu_seqlens=None, max_seqlen=None)
    student = (False, False, True, True)

    def direct():
        kl, lse1, lse2 = backend.forward(q1, k1, q2, k2, **kw)
        return backend.backward(torch.ones_like(kl), q1, k1, q2, k2, kl, lse1, lse2, needs=student, **kw)

    class Wrapped(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            kl, lse1, lse2 = backend.forward(q1, k1, a, b, **kw)
            ctx.save_for_backward(a, b, kl, lse1, lse2)
            return kl

        @staticmethod
        def backward(ctx, g):
            a, b, kl, lse1, lse2 = ctx.saved_tensors
            grads = backend.backward(
                g.float().contiguous(), q1, k1, a, b, kl, lse1, lse2, needs=student, **kw
            )
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

    op = step(lambda: streamkl.attn_kl(q1, k1, q2, k2, causal=True, backend="triton"))
    wrapped = step(lambda: Wrapped.apply(q2, k2))
    trivial = step(lambda: Trivial.apply(q2))

    def direct_fwd():
        return backend.forward(q1, k1, q2, k2, **kw)

    def wrapped_fwd():
        with torch.no_grad():
            return Wrapped.apply(q2, k2)

    rows = [
        ("backend forward, called directly", direct_fwd),
        ("the same inside a minimal autograd.Function", wrapped_fwd),
        ("backend forward + backward, called directly", direct),
        ("the same inside a minimal autograd.Function", wrapped),
        ("  ... with the backward on the calling thread", calling_thread(wrapped)),
        ("the public op, eager", op),
        ("  ... with the backward on the calling thread", calling_thread(op)),
        ("a trivial autograd.Function (x * 2)", trivial),
        ("  ... with the backward on the calling thread", calling_thread(trivial)),
    ]
    for name, fn in rows:
        calls = 200 if dev.type == "cuda" else 2
        print(f"{name:48s} {_per_call_us(fn, dev, calls, 5):8.1f} us", flush=True)
    _probe(backend, dev, rows)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        for i, (name, fn) in enumerate(rows):
            if name.startswith("  ") or name.startswith("backend"):
                _profile(f"{i} {name}", fn, dev, 50 if dev.type == "cuda" else 2, args.profile)


if __name__ == "__main__":
    main()
