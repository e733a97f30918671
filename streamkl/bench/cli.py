"""`python -m streamkl.bench`: run the sweeps, write results.json, results.md and plots.

On a GPU machine without an install, from the repository root:

    PYTHONPATH=. python3 -m streamkl.bench --sweep all --quick --out /tmp/bench

See docs/benchmarks/README.md for the sweeps, the FLOP count and how to read the outputs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import sys
import threading
import time
from pathlib import Path

import torch

from . import environment, report
from .runner import DTYPES, RunConfig, Runner, log_to
from .sweeps import SWEEPS, Geometry, build
from .timing import TimingConfig

# quick: the device tool kills a command at 600 s; the budget, plus the hard timeout's 40 s,
# plus start-up leaves the JSON, table and plots written before that
PRESET_BUDGET_S = {"quick": 500.0, "full": float("inf"), "smoke": 120.0}


def _size(text: str) -> int:
    text = text.strip().lower()
    mult = 1
    if text.endswith("k"):
        mult, text = 1024, text[:-1]
    elif text.endswith("m"):
        mult, text = 1024 * 1024, text[:-1]
    return int(float(text) * mult)


def _sizes(text: str | None) -> list[int] | None:
    return None if not text else [_size(t) for t in text.split(",") if t.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m streamkl.bench",
        description="Benchmark streamkl against PyTorch eager, torch.compile and a bf16 GEMM, "
        "side by side in one process; results as JSON, Markdown and PNG plots.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--sweep", default="n", help=f"comma list of {', '.join(SWEEPS)}, or 'all', or 'smoke' (= --smoke)"
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--quick",
        action="store_true",
        help="(the default preset) the main sweeps sized for one ~8 minute H200 run, time budget 500 s",
    )
    g.add_argument("--full", action="store_true", help="the whole published grid (hours)")
    g.add_argument(
        "--smoke", action="store_true", help="every sweep at tiny sizes on CPU in seconds (what CI runs)"
    )
    p.add_argument("--sizes", help="N for the n sweep (and long, when run alone), e.g. 4k,8k,16k")
    p.add_argument("--long-sizes", help="N for the long sweep, e.g. 128k,512k,1m")
    p.add_argument("--decode-nq", help="Nq of the decode sweep, e.g. 1,16,64,256")
    p.add_argument("--decode-nk", help="Nk of the decode sweep, e.g. 32k,128k")
    p.add_argument("--bwd-sizes", help="N = Nq = Nk of the bwd-strategy sweep")
    p.add_argument(
        "--settings",
        help="gradient settings: comma list of q2k2 (setting 1, teacher fixed), q1k1 (setting 2), all",
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", default=None, help="bfloat16 (GPU default), float16, float32 (CPU default)")
    p.add_argument("--causal", choices=["0", "1", "both"], default="both")
    p.add_argument(
        "--providers",
        help="comma list: streamkl (all backends), streamkl-triton, "
        "streamkl-cuda, streamkl-reference, torch, torch.compile, gemm",
    )
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--out", default=None, help="output folder (default docs/benchmarks/<date>_<device>)")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="CPU repeats; at most this many event-timed repeats of long GPU calls",
    )
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench measuring time")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds after which no new measurement starts (quick: 500)",
    )
    p.add_argument(
        "--hard-timeout",
        type=float,
        default=None,
        help="seconds after which the process writes its report and exits even if a "
        "call hangs (default: time budget + 40 s, none without a budget)",
    )
    p.add_argument(
        "--single-shot-s",
        type=float,
        default=20.0,
        help="calls projected longer than this are timed once, without warm-up call",
    )
    p.add_argument(
        "--max-call-reference-s",
        type=float,
        default=None,
        help="skip streamkl-reference when its projected call exceeds this",
    )
    p.add_argument(
        "--check-rows",
        type=int,
        default=None,
        help="query rows checked against the reference (GPU default 1024, CPU all)",
    )
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend (GPU default inductor; CPU default aot_eager, "
        "which keeps the smoke run in seconds)",
    )
    p.add_argument("--gemm-size", type=int, default=8192, help="the yardstick GEMM's M=N=K")
    p.add_argument(
        "--tf32",
        type=int,
        choices=[0, 1],
        default=0,
        help="allow TF32 in the float32 dense baselines' matmuls",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default on CPU: 1, which keeps timings stable on a shared machine)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default=None, help="git commit to record when .git is absent")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--dry-run", action="store_true", help="print the plan (sweeps, cases, providers, modes) and exit"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    threads = torch.get_num_threads()
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    finally:  # tests call main() in-process
        torch.set_num_threads(threads)


def _main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    sweep_arg = args.sweep.strip().lower()
    if sweep_arg == "smoke":
        args.smoke = True
    preset = "smoke" if args.smoke else "full" if args.full else "quick"
    if args.smoke or sweep_arg in ("all", "smoke"):
        sweeps = list(SWEEPS)
    else:
        sweeps = [s.strip() for s in sweep_arg.split(",") if s.strip()]
        bad = [s for s in sweeps if s not in SWEEPS]
        if bad:
            print(f"unknown sweep(s) {bad}; expected {', '.join(SWEEPS)}, all or smoke", file=sys.stderr)
            return 2

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" or args.threads:
        torch.set_num_threads(args.threads or 1)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype not in DTYPES:
        print(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}", file=sys.stderr)
        return 2
    try:
        torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
        torch.backends.cudnn.allow_tf32 = bool(args.tf32)
    except Exception as exc:  # newer torch may refuse mixing with its fp32_precision API
        print(f"could not set TF32 flags: {exc}", file=sys.stderr)

    geo = Geometry(
        b=args.batch,
        h=args.heads,
        d=args.dim,
        dtype=dtype,
        causal=args.causal,
        sizes=_sizes(args.sizes),
        long_sizes=_sizes(args.long_sizes),
        decode_nq=_sizes(args.decode_nq),
        decode_nk=_sizes(args.decode_nk),
        bwd_sizes=_sizes(args.bwd_sizes),
        settings=args.settings.split(",") if args.settings else None,
    )
    if geo.sizes and sweeps == ["long"] and not geo.long_sizes:
        geo.long_sizes = geo.sizes
    plan = build(preset, sweeps, geo)

    if args.dry_run:
        for sw in plan:
            print(f"{sw.name}: {sw.description}")
            print(
                f"  providers {', '.join(sw.providers)}; modes "
                + ", ".join(m + (f"[{st}]" if st else "") for m, st in sw.modes)
                + "".join(
                    f"; {p} only " + ", ".join(m + (f"[{st}]" if st else "") for m, st in ms)
                    for p, ms in sw.provider_modes.items()
                )
                + "".join(f"; {p} up to N={n}" for p, n in sw.provider_max_n.items())
                + "".join(f"; {p} at N in {ns} only" for p, ns in sw.provider_only_n.items())
                + "".join(f"; {p} variants " + ", ".join(v[0] for v in vs) for p, vs in sw.variants.items())
            )
            for c in sw.cases:
                print(f"  {c.key}" + (f" ({c.label})" if c.label else ""))
        return 0
    on_gpu = device.type == "cuda"
    budget = args.time_budget if args.time_budget is not None else PRESET_BUDGET_S[preset]
    tcfg = TimingConfig(
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
        repeats=args.repeats or (5 if on_gpu else 3),
        long_rep_budget_s=30.0 if on_gpu else 2.0,
    )
    cfg = RunConfig(
        device=str(device),
        providers=args.providers.split(",") if args.providers else None,
        compile_backend=args.compile_backend or ("inductor" if on_gpu else "aot_eager"),
        timing=tcfg,
        time_budget_s=budget if budget and budget > 0 else float("inf"),
        max_call_s_reference=args.max_call_reference_s or (1.0 if on_gpu else 5.0),
        single_shot_s=args.single_shot_s,
        check=not args.no_check,
        check_rows=args.check_rows or (1024 if on_gpu else 1 << 30),
        gemm_size=args.gemm_size,
        seed=args.seed,
    )
    if args.time_budget is not None and args.time_budget <= 0:
        cfg.time_budget_s = 0.0

    meta = environment.collect(device, ["python -m streamkl.bench", *argv], commit=args.commit)
    out = (
        Path(args.out)
        if args.out
        else (Path("docs/benchmarks") / f"{meta['date']}_{environment.device_slug(meta['device'])}")
    )
    config_record = {
        "preset": preset,
        "sweeps": sweeps,
        "dtype": dtype,
        "causal": args.causal,
        "providers": cfg.providers,
        "compile_backend": cfg.compile_backend,
        "time_budget_s": cfg.time_budget_s if math.isfinite(cfg.time_budget_s) else None,
        "timing": vars(tcfg),
        "check_rows": cfg.check_rows,
        "single_shot_s": cfg.single_shot_s,
        "tf32": bool(args.tf32),
        "seed": args.seed,
        "plan": [
            {
                "sweep": sw.name,
                "description": sw.description,
                "cases": len(sw.cases),
                "providers": sw.providers,
                "modes": sw.modes,
                "variants": {k: [v[0] for v in vs] for k, vs in sw.variants.items()},
            }
            for sw in plan
        ],
    }
    log = log_to(sys.stdout)
    runner = Runner(cfg, out, meta, config_record, log=log)
    log(
        f"streamkl.bench: preset={preset} sweeps={','.join(sweeps)} device={meta['device'].get('name')} "
        f"dtype={dtype} out={out} budget={config_record['time_budget_s']}"
    )

    hard = args.hard_timeout
    if hard is None and math.isfinite(cfg.time_budget_s):
        hard = cfg.time_budget_s + 40.0
    watchdog = _watchdog(hard, runner, out, not args.no_plots, log) if hard else None

    t0 = time.perf_counter()
    status = 0
    try:
        runner.measure_gemm_yardstick("gemm_yardstick")
        runner.run_sweeps(plan)
        if runner.remaining() > 0 or not math.isfinite(cfg.time_budget_s):
            runner.measure_gemm_yardstick("gemm_yardstick_end")
        runner.data["meta"]["clocks_at_end"] = environment.clocks(device)
    except KeyboardInterrupt:
        log("interrupted: writing what was measured")
        status = 130
    finally:
        if watchdog is not None:  # the run is over: a later hang elsewhere is not ours to end
            watchdog.cancel()
        runner.data["meta"]["finished"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        path = runner.save()
    written = report.render(runner.data, out, plots=not args.no_plots, log=log)
    counts = {}
    for r in runner.results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    log(
        f"done in {time.perf_counter() - t0:.1f} s: {counts}; wrote {path}"
        + "".join(f", {p}" for p in written)
    )
    return status


def _watchdog(seconds: float, runner: Runner, out: Path, plots: bool, log) -> threading.Timer:
    """If a call hangs past the hard timeout, render what was saved and leave."""
    import os

    def fire():
        log(f"hard timeout of {seconds:g} s: writing the report from saved results and exiting")
        try:
            import json

            data = json.loads((out / "results.json").read_text())
            data["meta"]["hard_timeout"] = True
            report.render(data, out, plots=plots, log=log)
        finally:
            os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    return t
