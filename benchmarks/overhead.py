"""The host cost of one small `streamkl.attn_kl` call beside one cuDNN attention call, in one run.

At B=1, H=1, Nq=Nk=128, D=64, causal, bf16 (on a GPU) the kernels take microseconds, so a call's time is the
host's work between the caller and the launches. Each row times `--calls` back-to-back calls and
one device sync and takes the median per-call time of `--repeats` such runs. The yardstick is one
`torch.nn.functional.scaled_dot_product_attention` call of the same shape under
`sdpa_kernel(SDPBackend.CUDNN_ATTENTION)` (V = K), an attention op that is C++ from the call to the
launch; each row's ratio is its time over the yardstick's, forward and forward + backward (the
student's q2, k2 requiring grad, `attn_kl(..., reduction="sum").backward()`; for the attention
call, q, k, v requiring grad and `out.sum().backward()`). Host timings move between runs of the
same code, so only ratios within one run compare. On CPU there is no cuDNN: the reference's rows
are measured and the yardstick is recorded as unavailable.

Rows, per backend: the public op eager, under torch.compile(fullgraph=True), and on CUDA under
mode="reduce-overhead" (CUDA graphs). Results are data first (JSON), the table made from it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import streamkl
from benchmarks.bench import environment
from streamkl.testing import make_inputs

SCHEMA = "streamkl-overhead/2"
SHAPE = dict(b=1, h=1, n=128, d=64)
CUDNN = "one cuDNN attention call"
GPU_COMMAND = "python benchmarks/overhead.py --backend cuda --backend triton --out overhead_run"
MODES = ("fwd", "fwd+bwd")


def per_call_us(fn, device: torch.device, calls: int, repeats: int) -> float:
    """Median over `repeats` of the per-call time of `calls` back-to-back calls and one sync."""
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


def _fwd_bwd(leaves, loss):
    def step():
        for t in leaves:
            t.grad = None
        loss(*leaves).backward()

    return step


def _op(backend: str):
    return lambda *t: streamkl.attn_kl(*t, causal=True, reduction="sum", backend=backend)


def op_calls(inputs, backend: str, compile_mode: str | None = None):
    """(forward, forward + backward) of the public op: eager, or compiled in `compile_mode`."""
    loss = _op(backend)
    if compile_mode is not None:
        torch._dynamo.reset()  # each compiled row starts from its own graph
        loss = torch.compile(loss, fullgraph=True, mode=compile_mode)
    leaves = [t.detach().clone().requires_grad_(i >= 2) for i, t in enumerate(inputs)]  # the student's
    return (lambda: loss(*inputs)), _fwd_bwd(leaves, loss)


def cudnn_calls(inputs):
    """(forward, forward + backward) of one cuDNN attention call of q1, k1 (V = k1), causal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k = inputs[0].detach(), inputs[1].detach()
    v = k.clone()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def attention(*qkv):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(*qkv, is_causal=True)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    return (lambda: attention(q, k, v)), _fwd_bwd(leaves, lambda *t: attention(*t).sum())


def cudnn_unavailable(device: torch.device, inputs) -> str | None:
    """Why one cuDNN attention call cannot run here, or None."""
    if device.type != "cuda":
        return f"cuDNN attention runs CUDA tensors only (this run: {device.type})"
    try:
        fwd, fwd_bwd = cudnn_calls(inputs)
        fwd(), fwd_bwd()
    except RuntimeError as exc:  # sdpa_kernel with one backend raises when that backend cannot run
        return f"cuDNN attention failed: {str(exc).splitlines()[0][:300]}"
    return None


def measure(device, dtype, backends, calls, repeats, compiled=True, log=print) -> dict:
    """One run: `rows` (row, backend, mode, us, vs_cudnn), `cudnn` (the yardstick's status and
    why not), `not_run` (backend: why it cannot run these inputs)."""
    b, h, n, d = SHAPE.values()
    inputs = make_inputs(b=b, h=h, nq=n, nk=n, d1=d, d2=d, dtype=dtype, device=device)
    rows: list[dict] = []

    def add(name, backend, fns):
        for mode, fn in zip(MODES, fns):
            us = per_call_us(fn, device, calls, repeats)
            rows.append(dict(row=name, backend=backend, mode=mode, us=round(us, 1)))
            log(f"  {name:<44} {mode:<8} {us:9.1f} us")

    reason = cudnn_unavailable(device, inputs)
    cudnn = {"status": "ok" if reason is None else "n/a", "reason": reason}
    if reason is None:
        add(CUDNN, None, cudnn_calls(inputs))
    else:
        log(f"  {CUDNN}: not measured: {reason}")
    can_run = streamkl.available_backends(*inputs, causal=True)
    skipped = {}
    for backend in backends:
        if why := can_run[backend]:
            skipped[backend] = why
            log(f"  {backend}: not measured: {why}")
            continue
        add(f"{backend}: streamkl.attn_kl eager", backend, op_calls(inputs, backend))
        if compiled:
            modes = ("default", "reduce-overhead") if device.type == "cuda" else ("default",)
            for mode in modes:
                add(f"{backend}: torch.compile {mode}", backend, op_calls(inputs, backend, mode))
    return dict(cudnn=cudnn, not_run=skipped, rows=with_ratios(rows))


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row with `vs_cudnn`: its time over the cuDNN call's in the same mode (None without one)."""
    yardstick = {r["mode"]: r["us"] for r in rows if r["row"] == CUDNN}
    return [
        {**r, "vs_cudnn": round(r["us"] / yardstick[r["mode"]], 3) if r["mode"] in yardstick else None}
        for r in rows
    ]


def cprofile_table(fn, device: torch.device, calls: int, lines: int = 30) -> str:
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


def _ratio(r: dict | None) -> str:
    return "—" if r is None or r["vs_cudnn"] is None else f"{r['vs_cudnn']:.2f}x"


def markdown(data: dict) -> str:
    """The table of one run: per row, microseconds per call and the ratio to the cuDNN call."""
    env, cfg = data["environment"], data["config"]
    software = ", ".join(f"{k} {env[k]}" for k in ("torch", "triton", "cuda", "cudnn") if env.get(k))
    lines = [
        f"# Per-call host cost: {env['device']}",
        "",
        f"B={cfg['b']}, H={cfg['h']}, Nq=Nk={cfg['n']}, D={cfg['d']}, {cfg['dtype']}, causal; "
        f"median over {cfg['repeats']} runs of {cfg['calls']} calls and one sync; {software}; "
        f"commit `{(env.get('commit') or 'unknown')[:12]}`{' (dirty)' if env.get('dirty') else ''}, "
        f"{env['date']}.",
        "",
        f"Command: `{' '.join(env['argv'])}`",
        "",
        "Ratio: the row's time over one cuDNN attention call's (`scaled_dot_product_attention` under "
        "`sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`, same shape, same run).",
        "",
    ]
    if data["cudnn"]["status"] != "ok":
        lines += [f"cuDNN attention: not measured ({data['cudnn']['reason']}); no ratios.", ""]
    for backend, why in data["not_run"].items():
        lines += [f"{backend}: not measured ({why}).", ""]
    lines += [
        "| | forward us | forward + backward us | forward / cuDNN | forward + backward / cuDNN |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    table: dict[str, dict[str, dict]] = {}
    for r in data["rows"]:
        table.setdefault(r["row"], {})[r["mode"]] = r
    for name, cols in table.items():
        fwd, both = cols.get("fwd"), cols.get("fwd+bwd")
        us = [f"{c['us']:.1f}" if c else "—" for c in (fwd, both)]
        lines.append(f"| {name} | {us[0]} | {us[1]} | {_ratio(fwd)} | {_ratio(both)} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/overhead.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"The published table, on a GPU (one command):\n  {GPU_COMMAND}\n"
        "writes overhead_run/overhead.json, then overhead_run/overhead.md from it. On CPU, in seconds:\n"
        "  python benchmarks/overhead.py --no-compile --calls 20 --repeats 3 --json -\n"
        "Re-render the table from a JSON: python benchmarks/overhead.py --render overhead_run/overhead.json",
    )
    cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="default: %(default)s")
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="default: bfloat16 on CUDA, float32 on CPU (its bf16 matmuls would hide the host cost)",
    )
    p.add_argument(
        "--backend",
        action="append",
        choices=list(streamkl.BACKENDS),
        help="repeat for several (default: cuda and triton on CUDA, reference on CPU)",
    )
    p.add_argument("--calls", type=int, default=200, help="calls per timed run (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs, median taken (default: %(default)s)")
    p.add_argument("--no-compile", action="store_true", help="eager rows only")
    p.add_argument("--profile", action="store_true", help="also cProfile the first backend's eager fwd+bwd")
    p.add_argument("--out", type=Path, help="write overhead.json and overhead.md in this folder")
    p.add_argument("--json", help="write the JSON here ('-': standard output)")
    p.add_argument("--markdown", type=Path, help="write the table here")
    p.add_argument("--commit", help="the commit to record where the copy has no .git")
    p.add_argument("--render", type=Path, help="print the table of this JSON and measure nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.render:
        print(markdown(json.loads(args.render.read_text())), end="")
        return 0
    for name in ("calls", "repeats"):
        if getattr(args, name) < 1:
            parser().error(f"--{name} must be at least 1")
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    backends = args.backend or (["cuda", "triton"] if device.type == "cuda" else ["reference"])
    env = environment(device, ["benchmarks/overhead.py", *argv], args.commit)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json == "-" else print
    log(f"per-call host cost, B=1 H=1 N={SHAPE['n']} D={SHAPE['d']} {args.dtype} causal on {env['device']}")
    result = measure(device, dtype, backends, args.calls, args.repeats, not args.no_compile, log)
    config = dict(SHAPE, dtype=args.dtype, causal=True, calls=args.calls, repeats=args.repeats)
    config.update(backends=backends, compiled=not args.no_compile)
    data = dict(schema=SCHEMA, environment=env, config=config, **result, profile=None)
    if args.profile and backends:
        b, h, n, d = SHAPE.values()
        inputs = make_inputs(b=b, h=h, nq=n, nk=n, d1=d, d2=d, dtype=dtype, device=device)
        data["profile"] = cprofile_table(op_calls(inputs, backends[0])[1], device, args.calls)
        log(data["profile"])
    text, table = json.dumps(data, indent=1), markdown(data)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "overhead.json").write_text(text)
        (args.out / "overhead.md").write_text(table)
    if args.json == "-":
        print(text)
    elif args.json:
        Path(args.json).write_text(text)
    if args.markdown:
        args.markdown.write_text(table)
    if args.json != "-":
        print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
