"""python -m streamkl: every backend on a default problem, on whatever device there is.

For each backend that can run the inputs: the largest per-row KL error against the reference
backend run in float64, forward and forward+backward time (median), and peak extra memory.
"""

from __future__ import annotations

import argparse
import sys

import torch

from . import _checks, _dispatch
from .bench.timing import PeakMemory, TimingConfig, bench, tensor_bytes, wall
from .testing import cpu_peak_bytes, kl_tolerance, make_inputs

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def _parse(argv):
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        prog="python -m streamkl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32 if gpu else 8)
    p.add_argument("--heads-kv", type=int, default=None, help="key heads of both pairs (GQA)")
    p.add_argument("--seqlen", type=int, default=8192 if gpu else 1024, help="Nq = Nk")
    p.add_argument("--nk", type=int, default=None, help="keys, if different from --seqlen")
    p.add_argument("--dim", type=int, default=128 if gpu else 64, help="D1 = D2")
    p.add_argument("--dim2", type=int, default=None, help="D2, if different from --dim")
    p.add_argument("--dtype", choices=list(_DTYPES), default="bf16" if gpu else "fp32")
    p.add_argument("--causal", action="store_true")
    p.add_argument(
        "--backend",
        action="append",
        choices=["reference", "triton", "cuda"],
        help="backends to run (repeatable; default: every one that can)",
    )
    p.add_argument("--device", default="cuda" if gpu else "cpu")
    return p.parse_args(argv)


def _row(name, module, inputs, args, ref):
    q1, k1, q2, k2 = inputs
    kw = dict(causal=args.causal, scale1=args.scale1, scale2=args.scale2, cu_seqlens=None, max_seqlen=None)
    device = q1.device

    def fwd():
        return module.forward(q1, k1, q2, k2, **kw)

    (kl, lse1, lse2), fwd_s = wall(fwd, device)  # the first call: JIT warm-up and the check
    err = ((kl.double() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
    grad = torch.randn_like(kl)

    def fwd_bwd():
        out = module.forward(q1, k1, q2, k2, **kw)
        return out, module.backward(grad, q1, k1, q2, k2, *out, **kw, needs=(True,) * 4)

    results, fwd_bwd_s = wall(fwd_bwd, device)
    config = TimingConfig()
    fwd_ms = bench(fwd, device, fwd_s, config)["ms"]
    fwd_bwd_ms = bench(fwd_bwd, device, fwd_bwd_s, config)["ms"]
    # the workspace: peak beyond the inputs, minus what the call hands back (kl, lse, gradients)
    kept = tensor_bytes(results)
    del results
    if device.type == "cuda":
        with PeakMemory(device) as peak:
            fwd_bwd()
        extra = peak.extra(kept)
    else:
        extra = max(cpu_peak_bytes(fwd_bwd) - kept, 0)
    ok = err <= kl_tolerance(q1.dtype)
    return [
        name,
        f"{err:.2e}",
        "ok" if ok else "FAIL",
        f"{fwd_ms:.2f}",
        f"{fwd_bwd_ms:.2f}",
        f"{extra / 2**20:.1f}",
    ], ok


def main(argv=None) -> int:
    args = _parse(argv)
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype]
    hk = args.heads_kv or args.heads
    nk = args.nk or args.seqlen
    inputs = make_inputs(
        b=args.batch,
        h=args.heads,
        nq=args.seqlen,
        nk=nk,
        d1=args.dim,
        d2=args.dim2 or args.dim,
        hk1=hk,
        hk2=hk,
        dtype=dtype,
        device=device,
    )
    _checks.check_inputs(*inputs)
    args.scale1 = _checks.resolve_scale(None, args.dim, "scale1")
    args.scale2 = _checks.resolve_scale(None, args.dim2 or args.dim, "scale2")
    problem = (
        f"B={args.batch} H={args.heads} Hkv={hk} Nq={args.seqlen} Nk={nk} D1={args.dim} "
        f"D2={args.dim2 or args.dim} {args.dtype} causal={args.causal} on {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )
    print(f"streamkl: KL(softmax(S1) || softmax(S2)) per row, {problem}")

    reference = _dispatch._module("reference")
    ref = reference.forward(
        *(t.double() for t in inputs), causal=args.causal, scale1=args.scale1, scale2=args.scale2
    )[0]
    available = _dispatch.available_backends(*inputs)
    names = args.backend or list(available)
    rows, all_ok = [], True
    for name in names:
        reason = available[name]
        if reason is not None:
            rows.append([name, "-", "n/a", "-", "-", "-"])
            print(f"  {name}: not run: {reason}")
            continue
        row, ok = _row(name, _dispatch._module(name), inputs, args, ref)
        rows.append(row)
        all_ok &= ok
    header = ["backend", "max err", "check", "fwd ms", "fwd+bwd ms", "extra MiB"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
