"""python -m streamkl: every backend on a default problem, on whatever device there is.

One row per backend: if it cannot run the inputs, why not; else its check, its forward and
forward+backward time (median) and its peak extra memory. The check holds the backend's KL and
its four gradients (dq1, dk1, dq2, dk2, from its backward) to the definition: the dense formula
of streamkl.testing.dense_attn_kl in float64, which shares no code with any backend, its
gradients by autograd. `--backend auto` runs what attn_kl's default picks and names it.

The defaults shown below are this machine's: with a CUDA GPU, --heads 32 --seqlen 8192 --dim 128
--dtype bf16 --device cuda; without one, a smaller fp32 problem on the CPU.

Exit status: 0 when every backend run passes its check; 1 when one fails it or raises, or a
backend named with --backend cannot run here; 2 for invalid arguments.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from . import _checks, _dispatch
from ._spec import AttnKLInputs, AttnKLStats
from .ops import attn_kl as _op
from .testing import cpu_peak_bytes, dense_attn_kl, kl_tolerance, make_inputs, rel_err

OP = "attn_kl"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}

# Timed calls per column, fewer when one call is slow: at most about _TIME_BUDGET_S per column.
_REPEATS = 5
_TIME_BUDGET_S = 10.0

# Bytes of one float64 (heads, rows, Nk) matrix of the dense check: it runs over chunks of query
# rows, so checking a long sequence needs no Nq x Nk matrix of every head at once.
_DENSE_CHUNK_BYTES = 1 << 27


def grad_tolerance(dtype: torch.dtype) -> float:
    """The gradients' check: ||dx - ref|| / ||ref|| <= this for each of dq1, dk1, dq2, dk2.
    The KL's budget, or two units of rounding of the dtype the gradients are returned in
    (16-bit gradients carry their own rounding), whichever is larger."""
    return max(kl_tolerance(dtype), 2 * torch.finfo(dtype).eps)


def _notes(dtype: torch.dtype) -> tuple[str, ...]:
    """What the columns measure, printed under the table."""
    return (
        "kl err: max over rows of |kl - ref| / max(1, |ref|)",
        "grad err: the largest of ||dx - ref|| / ||ref|| over dq1, dk1, dq2, dk2",
        "  ref: the dense formula in float64 (streamkl.testing.dense_attn_kl), gradients by autograd",
        f"check: ok when kl err <= {kl_tolerance(dtype):g} and grad err <= {grad_tolerance(dtype):g} "
        f"({str(dtype).replace('torch.', '')})",
        f"fwd ms, fwd+bwd ms: median wall-clock time of up to {_REPEATS} calls after a first, checked one",
        "extra MiB: peak bytes allocated during one forward+backward beyond the inputs and what the",
        "  call returns (kl, lse1, lse2 and the four gradients)",
    )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The description as written; each option's default, where it has one."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        prog="python -m streamkl", description=__doc__, formatter_class=_HelpFormatter
    )
    p.add_argument("--batch", type=int, default=1, help="B")
    p.add_argument("--heads", type=int, default=32 if gpu else 8, help="query heads H")
    p.add_argument(
        "--heads-kv",
        type=int,
        default=None,
        help="key heads of both pairs (GQA), dividing --heads; default: --heads",
    )
    p.add_argument("--seqlen", type=int, default=8192 if gpu else 1024, help="query rows Nq, and keys Nk")
    p.add_argument("--nk", type=int, default=None, help="keys Nk (0 allowed), if different from --seqlen")
    p.add_argument("--dim", type=int, default=128 if gpu else 64, help="head dim D1 = D2")
    p.add_argument("--dim2", type=int, default=None, help="D2, if different from --dim")
    p.add_argument("--dtype", choices=list(_DTYPES), default="bf16" if gpu else "fp32", help="input dtype")
    p.add_argument("--causal", action="store_true", help="bottom-right causal masks")
    p.add_argument(
        "--backend",
        action="append",
        choices=list(_dispatch.CHOICES),
        help="backends to run (repeatable; auto: the one attn_kl picks by default); default: every "
        "backend, one row each; a named one that cannot run here makes the exit status 1",
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
    for option, value, least in (
        ("--batch", args.batch, 1),
        ("--heads", args.heads, 1),
        ("--seqlen", args.seqlen, 1),
        ("--nk", args.nk, 0),  # Nk = 0 is a valid call: every row sees no key
        ("--dim", args.dim, 1),
        ("--dim2", args.dim2, 1),
        ("--heads-kv", args.heads_kv, 1),
    ):
        if value is not None and value < least:
            kind = "a positive integer" if least == 1 else "a non-negative integer"
            parser.error(f"argument {option}: must be {kind}, got {value}")
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


def _dense_reference(inputs, causal, scale1, scale2, grad):
    """(kl, (dq1, dk1, dq2, dk2)) of the dense formula in float64, gradients by autograd for the
    upstream gradient `grad`. Computed per batch, per group of query heads sharing their key
    heads, per chunk of query rows: a chunk of rows [r0, r1) sees, causally, the keys
    [0, r1 + Nk - Nq), so it is the dense formula on those rows and keys."""
    q1, k1, q2, k2 = inputs
    b, h, nq, nk = q1.shape[0], q1.shape[1], q1.shape[2], k1.shape[2]
    group = math.lcm(h // k1.shape[1], h // k2.shape[1])  # query heads per slice
    kl = torch.zeros(q1.shape[:3], dtype=torch.float64, device=q1.device)
    grads = [torch.zeros(t.shape, dtype=torch.float64, device=t.device) for t in inputs]
    step = max(1, _DENSE_CHUNK_BYTES // max(1, group * nk * 8))
    for bi in range(b):
        for h0 in range(0, h, group):
            heads = slice(h0, h0 + group)
            kv1 = slice(h0 * k1.shape[1] // h, (h0 + group) * k1.shape[1] // h)
            kv2 = slice(h0 * k2.shape[1] // h, (h0 + group) * k2.shape[1] // h)
            for r0 in range(0, nq, step):
                r1 = min(nq, r0 + step)
                keys = slice(0, max(0, r1 + nk - nq) if causal else nk)
                rows = slice(r0, r1)
                parts = (
                    (q1, 0, (bi, heads, rows)),
                    (k1, 1, (bi, kv1, keys)),
                    (q2, 2, (bi, heads, rows)),
                    (k2, 3, (bi, kv2, keys)),
                )
                leaves = [t[idx].unsqueeze(0).double().requires_grad_() for t, _, idx in parts]
                with torch.enable_grad():
                    out = dense_attn_kl(*leaves, causal=causal, scale1=scale1, scale2=scale2)
                    g = grad[bi, heads, rows].unsqueeze(0).double()
                    found = (
                        torch.autograd.grad(out, leaves, g, allow_unused=True) if out.requires_grad else ()
                    )
                kl[bi, heads, rows] = out.detach()[0]
                for (_, i, idx), d in zip(parts, found):
                    if d is not None:
                        grads[i][idx] += d[0]
    return kl, grads


def _impl_name(impl) -> str:
    """The BACKENDS name of a backend's implementation of the op."""
    return next(name for name in _dispatch.BACKENDS if _dispatch.implementation(name, OP) is impl)


def _label(name: str, impl, spec, inputs) -> str:
    label = f"auto: {_impl_name(impl)}" if name == "auto" else name
    serving = _dispatch.backward_of(impl, spec, inputs)  # where its own backward declines, another's
    return f"{label} (+{_impl_name(serving)} backward)" if serving is not impl else label


def _row(impl, spec, inputs, grad, expected, device):
    """The row's cells after the name, and whether the backend passes its check."""

    def fwd():
        return _op._forward(impl, spec, inputs)

    def fwd_bwd(q1, k1, q2, k2, grad):
        call = AttnKLInputs(q1, k1, q2, k2, None)
        stats = _op._forward(impl, spec, call)
        return (*stats, *_op._backward(impl, spec, call, AttnKLStats(*stats), grad))

    ref_kl, ref_grads = expected
    (kl, _, _), fwd_s = _wall(fwd, device)  # the first calls: JIT warm-up and the check
    kl_err = ((kl.double() - ref_kl).abs() / ref_kl.abs().clamp_min(1.0)).max().item() if kl.numel() else 0.0
    del kl
    out, fwd_bwd_s = _wall(lambda: fwd_bwd(*inputs[:4], grad), device)
    grad_err = max(rel_err(d, ref) for d, ref in zip(out[3:], ref_grads))
    del out
    fwd_ms = _median_ms(fwd, device, fwd_s)
    fwd_bwd_ms = _median_ms(lambda: fwd_bwd(*inputs[:4], grad), device, fwd_bwd_s)
    extra = _extra_bytes(fwd_bwd, (*inputs[:4], grad), device)
    dtype = inputs.q1.dtype
    ok = kl_err <= kl_tolerance(dtype) and grad_err <= grad_tolerance(dtype)  # False on NaN
    cells = [f"{kl_err:.2e}", f"{grad_err:.2e}", "ok" if ok else "FAIL", f"{fwd_ms:.2f}", f"{fwd_bwd_ms:.2f}"]
    return [*cells, f"{extra / 2**20:.1f}"], ok


def _print_table(header, rows) -> None:
    """Columns aligned (names left, numbers right); a row of two cells is a name and a sentence."""
    full = [r for r in rows if len(r) == len(header)]
    widths = [max(len(r[i]) for r in [header, *full]) for i in range(len(header))]
    widths[0] = max([widths[0], *(len(r[0]) for r in rows)])
    for r in [header, *rows]:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        print(
            "  " + "  ".join(cells).rstrip()
            if len(r) == len(header)
            else f"  {r[0].ljust(widths[0])}  {r[1]}"
        )


def main(argv=None) -> int:
    parser, args = _parse(argv)
    device = args.device
    dtype = _DTYPES[args.dtype]
    hk = args.heads_kv or args.heads
    nk = args.seqlen if args.nk is None else args.nk
    d2 = args.dim2 or args.dim
    sizes = dict(b=args.batch, h=args.heads, nq=args.seqlen, nk=nk, d1=args.dim, d2=d2, hk1=hk, hk2=hk)
    try:
        inputs = AttnKLInputs(*make_inputs(**sizes, dtype=dtype, device=device))
        spec = _checks.attn_kl_spec(*inputs[:4], causal=args.causal, scale1=None, scale2=None)
    except (ValueError, TypeError) as exc:  # arguments the checks above let through
        parser.error(str(exc))
    spec = spec.with_needs((True,) * 4)
    problem = (
        f"B={args.batch} H={args.heads} Hkv={hk} Nq={args.seqlen} Nk={nk} D1={args.dim} "
        f"D2={d2} {args.dtype} causal={args.causal} on {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )
    print(f"streamkl: KL(softmax(S1) || softmax(S2)) per row, {problem}")
    auto = _dispatch.select(OP, spec, inputs, "auto")
    print(f"attn_kl's default (auto) runs these inputs on: {_impl_name(auto)}")

    available = _dispatch.available(OP, spec, inputs)
    available["auto"] = None
    names = list(dict.fromkeys(args.backend)) if args.backend else list(_dispatch.BACKENDS)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    gen = torch.Generator().manual_seed(1)
    grad = torch.randn(inputs.q1.shape[:3], generator=gen, dtype=out_dtype).to(device)
    expected = None
    rows, status = [], 0
    for name in names:
        reason = available[name]
        if reason is not None:
            rows.append([name, f"not run: {reason}"])
            if args.backend:  # named on the command line: not running it is a failure
                print(f"python -m streamkl: backend {name!r} cannot run here: {reason}", file=sys.stderr)
                status = 1
            continue
        if expected is None:
            expected = _dense_reference(inputs[:4], args.causal, spec.scale1, spec.scale2, grad)
        impl = auto if name == "auto" else _dispatch.implementation(name, OP)
        try:
            cells, ok = _row(impl, spec, inputs, grad, expected, device)
        except Exception as exc:  # noqa: BLE001 - one backend's failure is its row; the others run
            rows.append([_label(name, impl, spec, inputs), f"FAIL: {type(exc).__name__}: {exc}"])
            print(f"python -m streamkl: backend {name!r} raised {type(exc).__name__}: {exc}", file=sys.stderr)
            status = 1
            continue
        rows.append([_label(name, impl, spec, inputs), *cells])
        status = status or (0 if ok else 1)
    _print_table(["backend", "kl err", "grad err", "check", "fwd ms", "fwd+bwd ms", "extra MiB"], rows)
    for note in _notes(dtype):
        print(f"  {note}")
    return status


if __name__ == "__main__":
    sys.exit(main())
