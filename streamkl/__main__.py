"""python -m streamkl: every backend on a default problem, on whatever device there is.

For each backend that can run the inputs: the largest per-row KL error against the reference
backend run in float64, forward and forward+backward time (median), and peak extra memory.

Exit status: 0 when every backend run passes its check; 1 when one fails it or a backend named
with --backend cannot run here; 2 for invalid arguments.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from . import _checks, _dispatch
from .testing import cpu_peak_bytes, kl_tolerance, make_inputs

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}

# Timed calls per column, fewer when one call is slow: at most about _TIME_BUDGET_S per column.
_REPEATS = 5
_TIME_BUDGET_S = 10.0

# What the last two columns measure, printed under the table.
_NOTES = (
    f"fwd ms, fwd+bwd ms: median wall-clock time of up to {_REPEATS} calls after a first, checked one",
    "extra MiB: peak bytes allocated during one forward+backward beyond the inputs and what the",
    "  call returns (kl, lse1, lse2 and the four gradients)",
)


def _parser() -> argparse.ArgumentParser:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        prog="python -m streamkl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32 if gpu else 8)
    p.add_argument(
        "--heads-kv", type=int, default=None, help="key heads of both pairs (GQA); divides --heads"
    )
    p.add_argument("--seqlen", type=int, default=8192 if gpu else 1024, help="Nq = Nk")
    p.add_argument("--nk", type=int, default=None, help="keys, if different from --seqlen")
    p.add_argument("--dim", type=int, default=128 if gpu else 64, help="D1 = D2")
    p.add_argument("--dim2", type=int, default=None, help="D2, if different from --dim")
    p.add_argument("--dtype", choices=list(_DTYPES), default="bf16" if gpu else "fp32")
    p.add_argument("--causal", action="store_true")
    p.add_argument(
        "--backend",
        action="append",
        choices=list(_dispatch.BACKENDS),
        help="backends to run (repeatable; default: every one that can; a named one that cannot "
        "run here makes the exit status 1)",
    )
    p.add_argument("--device", default="cuda" if gpu else "cpu", help="cpu, cuda or cuda:N")
    return p


def _device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    """The --device, or a usage error saying why this job cannot use it here."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        parser.error(
            f"argument --device: {name!r} is not a device this job runs on; expected cpu, cuda or cuda:N"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"argument --device: {name!r}: no CUDA GPU is available on this machine")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            parser.error(f"argument --device: {name!r}: this machine has {count} CUDA device(s)")
    return device


def _parse(argv):
    """(parser, validated arguments); invalid ones end in a usage error (exit status 2)."""
    parser = _parser()
    args = parser.parse_args(argv)
    for option, value in (
        ("--batch", args.batch),
        ("--heads", args.heads),
        ("--seqlen", args.seqlen),
        ("--nk", args.nk),
        ("--dim", args.dim),
        ("--dim2", args.dim2),
        ("--heads-kv", args.heads_kv),
    ):
        if value is not None and value < 1:
            parser.error(f"argument {option}: must be a positive integer, got {value}")
    if args.heads_kv is not None and args.heads % args.heads_kv:
        parser.error(f"argument --heads-kv: {args.heads_kv} does not divide --heads {args.heads}")
    args.device = _device(parser, args.device)
    return parser, args


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall(fn, device):
    """(result, seconds) of one call, synchronized on CUDA."""
    _synchronize(device)
    start = time.perf_counter()
    out = fn()
    _synchronize(device)
    return out, time.perf_counter() - start


def _median_ms(fn, device, first_s: float) -> float:
    """Median wall-clock milliseconds of a few more calls; first_s is the time of a call already
    made, so JIT compilation and autotuning are behind."""
    repeats = max(1, min(_REPEATS, int(_TIME_BUDGET_S / max(first_s, 1e-9))))
    return statistics.median(_wall(fn, device)[1] * 1e3 for _ in range(repeats))


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (None entries skipped)."""
    storages = {}
    for t in tensors:
        if t is not None:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _extra_bytes(fwd_bwd, tensors, device) -> int:
    """Peak bytes fwd_bwd(*tensors) allocates beyond `tensors` and the tensors it returns."""
    if device.type == "cuda":
        _synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)  # the inputs and everything else already held
        out = fwd_bwd(*tensors)
        _synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        return max(0, peak - _storage_bytes(out))
    kept = {}

    def run():
        # Copies made inside the tracker: it takes a view of a tensor allocated outside it for a
        # fresh allocation of that tensor's whole storage.
        copies = [t.clone() for t in tensors]
        kept["bytes"] = _storage_bytes((*copies, *fwd_bwd(*copies)))

    peak = cpu_peak_bytes(run)
    return max(0, peak - kept["bytes"])


def _row(name, backend, inputs, args, ref):
    device = args.device
    kw = dict(causal=args.causal, scale1=args.scale1, scale2=args.scale2, cu_seqlens=None, max_seqlen=None)

    def fwd():
        return backend.forward(*inputs, **kw)

    backward = _dispatch.backward_of(backend).backward  # a forward-only backend borrows one

    def fwd_bwd(q1, k1, q2, k2, grad):
        out = backend.forward(q1, k1, q2, k2, **kw)
        return (*out, *backward(grad, q1, k1, q2, k2, *out, **kw, needs=(True,) * 4))

    (kl, _, _), fwd_s = _wall(fwd, device)  # the first call: JIT warm-up and the check
    err = ((kl.double() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
    grad = torch.randn_like(kl)
    del kl
    _, fwd_bwd_s = _wall(lambda: fwd_bwd(*inputs, grad), device)
    fwd_ms = _median_ms(fwd, device, fwd_s)
    fwd_bwd_ms = _median_ms(lambda: fwd_bwd(*inputs, grad), device, fwd_bwd_s)
    extra = _extra_bytes(fwd_bwd, (*inputs, grad), device)
    ok = err <= kl_tolerance(inputs[0].dtype)
    cells = [name, f"{err:.2e}", "ok" if ok else "FAIL", f"{fwd_ms:.2f}", f"{fwd_bwd_ms:.2f}"]
    return [*cells, f"{extra / 2**20:.1f}"], ok


def main(argv=None) -> int:
    parser, args = _parse(argv)
    device = args.device
    dtype = _DTYPES[args.dtype]
    hk = args.heads_kv or args.heads
    nk = args.nk or args.seqlen
    d2 = args.dim2 or args.dim
    try:
        inputs = make_inputs(
            b=args.batch,
            h=args.heads,
            nq=args.seqlen,
            nk=nk,
            d1=args.dim,
            d2=d2,
            hk1=hk,
            hk2=hk,
            dtype=dtype,
            device=device,
        )
        _checks.check_inputs(*inputs)
        args.scale1 = _checks.resolve_scale(None, args.dim, "scale1")
        args.scale2 = _checks.resolve_scale(None, d2, "scale2")
    except (ValueError, TypeError) as exc:  # arguments the checks above let through
        parser.error(str(exc))
    problem = (
        f"B={args.batch} H={args.heads} Hkv={hk} Nq={args.seqlen} Nk={nk} D1={args.dim} "
        f"D2={d2} {args.dtype} causal={args.causal} on {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )
    print(f"streamkl: KL(softmax(S1) || softmax(S2)) per row, {problem}")

    available = _dispatch.available_backends(*inputs)
    names = list(dict.fromkeys(args.backend)) if args.backend else list(available)
    ref = None
    if any(available[name] is None for name in names):
        ref = _dispatch.module("reference").forward(
            *(t.double() for t in inputs), causal=args.causal, scale1=args.scale1, scale2=args.scale2
        )[0]
    rows, status = [], 0
    for name in names:
        reason = available[name]
        if reason is None:
            module = _dispatch.module(name)
            borrowed = getattr(module, "BACKWARD", None)  # the backend whose backward it runs
            label = f"{name} (+{borrowed} backward)" if borrowed else name
            row, ok = _row(label, module, inputs, args, ref)
            rows.append(row)
            status = status or (0 if ok else 1)
            continue
        rows.append([name, "-", "n/a", "-", "-", "-"])
        print(f"  {name}: not run: {reason}")
        if args.backend:  # named on the command line: not running it is a failure
            print(f"python -m streamkl: backend {name!r} cannot run here: {reason}", file=sys.stderr)
            status = 1
    header = ["backend", "max err", "check", "fwd ms", "fwd+bwd ms", "extra MiB"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    for note in _NOTES:
        print(f"  {note}")
    return status


if __name__ == "__main__":
    sys.exit(main())
