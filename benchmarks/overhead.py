"""Per-call host overhead of the op at a tiny shape, where the kernels take microseconds and the
Python between the caller and the launch is the whole cost.

    python benchmarks/overhead.py                       # CUDA if present, else CPU
    python benchmarks/overhead.py --json out.json --profile

Each row times `calls` back-to-back calls and one device sync, and reports the median over
`repeats` of the per-call time: the host cost when the kernels are too small to hide it.
Rows: the backend's functions called directly (the floor the op layer adds to), the public op
eager and under torch.compile (fullgraph; on CUDA also mode="reduce-overhead", CUDA graphs),
and one cuDNN attention call of the same shape as the yardstick of a fused attention op.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

import streamkl
from streamkl import _dispatch
from streamkl.testing import make_inputs


def _per_call_us(fn, device, calls, repeats):
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def _op_fwd(inputs, backend):
    return lambda: streamkl.attn_kl(*inputs, causal=True, backend=backend)


def _op_fwd_bwd(leaves, backend, fn=None):
    call = fn or (lambda *t: streamkl.attn_kl(*t, causal=True, reduction="sum", backend=backend))

    def step():
        for t in leaves:
            t.grad = None
        call(*leaves).backward()

    return step


def _direct(module, inputs, needs):
    q1, k1, q2, k2 = inputs
    d = q1.shape[-1]
    kw = dict(causal=True, scale1=d**-0.5, scale2=d**-0.5, cu_seqlens=None, max_seqlen=None)

    def fwd():
        return module.forward(q1, k1, q2, k2, **kw)

    backward = _dispatch.backward_of(module).backward  # a forward-only backend borrows one

    def fwd_bwd():
        kl, lse1, lse2 = fwd()
        return backward(torch.ones_like(kl), q1, k1, q2, k2, kl, lse1, lse2, **kw, needs=needs)

    return fwd, fwd_bwd


def _cudnn(inputs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k = inputs[0], inputs[1]
    v = k.detach().clone().requires_grad_()
    leaves = [q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_(), v]

    def fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v.detach(), is_causal=True)

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
        out.sum().backward()

    return fwd, fwd_bwd


def measure(device, dtype, n, backends, calls, repeats, compiled=True):
    inputs = make_inputs(b=1, h=1, nq=n, nk=n, d1=64, d2=64, dtype=dtype, device=device)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    student = (False, False, True, True)
    for t, need in zip(leaves, student):
        t.requires_grad_(need)
    rows = []

    def add(name, what, fn):
        us = _per_call_us(fn, device, calls, repeats)
        rows.append(dict(row=name, what=what, us=round(us, 1)))
        print(f"  {name:<42} {what:<8} {us:9.1f} us", flush=True)

    for backend in backends:
        module = _dispatch.module(backend)
        fwd, fwd_bwd = _direct(module, inputs, student)
        add(f"{backend}: backend functions", "fwd", fwd)
        add(f"{backend}: backend functions", "fwd+bwd", fwd_bwd)
        add(f"{backend}: streamkl.attn_kl eager", "fwd", _op_fwd(inputs, backend))
        add(f"{backend}: streamkl.attn_kl eager", "fwd+bwd", _op_fwd_bwd(leaves, backend))
        if not compiled:
            continue
        modes = ["default", "reduce-overhead"] if device.type == "cuda" else ["default"]
        for mode in modes:
            torch._dynamo.reset()

            def loss(*t, backend=backend):
                return streamkl.attn_kl(*t, causal=True, reduction="sum", backend=backend)

            fn = torch.compile(loss, fullgraph=True, mode=mode)
            add(f"{backend}: torch.compile {mode}", "fwd", lambda fn=fn: fn(*inputs))
            add(f"{backend}: torch.compile {mode}", "fwd+bwd", _op_fwd_bwd(leaves, backend, fn))
    if device.type == "cuda":
        fwd, fwd_bwd = _cudnn([t.detach() for t in inputs])
        add("one cuDNN attention call", "fwd", fwd)
        add("one cuDNN attention call", "fwd+bwd", fwd_bwd)
    return rows


def cprofile_table(fn, device, calls, lines=30) -> str:
    """cProfile's hottest functions, by own time, of `calls` runs of fn after 5 warm-up runs."""
    for _ in range(5):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(lines)
    return out.getvalue()


def profile(device, dtype, n, backend, calls):
    """The hottest functions of `calls` eager forward+backward calls of the public op."""
    inputs = make_inputs(b=1, h=1, nq=n, nk=n, d1=64, d2=64, dtype=dtype, device=device)
    leaves = [t.detach().clone().requires_grad_(i >= 2) for i, t in enumerate(inputs)]
    return cprofile_table(_op_fwd_bwd(leaves, backend), device, calls)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--backend", action="append", help="default: triton on CUDA, reference on CPU")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--profile", action="store_true", help="print cProfile's hottest functions")
    p.add_argument("--json", help="write the rows and the environment here")
    p.add_argument("--markdown", help="write the table as Markdown here")
    p.add_argument("--commit", help="the commit measured (default: git rev-parse HEAD of this tree)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = args.backend or (["triton"] if device.type == "cuda" else ["reference"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"per-call time, B=1 H=1 N={args.seqlen} D=64 {dtype} causal on {name}, torch {torch.__version__}")
    rows = measure(device, dtype, args.seqlen, backends, args.calls, args.repeats, not args.no_compile)
    prof = profile(device, dtype, args.seqlen, backends[0], args.calls) if args.profile else None
    if prof:
        print(prof)
    env = dict(device=name, torch=torch.__version__, seqlen=args.seqlen, dtype=str(dtype).split(".")[-1])
    if device.type == "cuda":
        import triton

        env["triton"] = triton.__version__
    env.update(
        commit=args.commit or _commit(),
        date=time.strftime("%Y-%m-%d"),
        calls=args.calls,
        repeats=args.repeats,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, rows=rows, profile=prof), f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(env, rows))


def markdown(env, rows) -> str:
    """The rows as one table: per-call microseconds, forward and forward+backward."""
    head = ", ".join(f"{k} {v}" for k, v in env.items())
    lines = [f"<!-- made by benchmarks/overhead.py: {head} -->", "", "| | forward | forward + backward |"]
    lines.append("| --- | --- | --- |")
    table: dict[str, dict[str, float]] = {}
    for row in rows:
        table.setdefault(row["row"], {})[row["what"]] = row["us"]
    for name, cols in table.items():
        lines.append(f"| {name} | {cols.get('fwd', '-')} us | {cols.get('fwd+bwd', '-')} us |")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
