"""The benchmark harness: streamkl against every other way to get the same KL, in one process, written to
results.json, then results.md and plots (benchmarks/report.py); docs/benchmarks/README.md says how."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import gc
import importlib.metadata
import itertools
import json
import math
import platform
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.benchmark import Timer

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import streamkl
from benchmarks import report
from benchmarks.providers import (
    Case,
    Provider,
    Unsupported,
    all_providers,
    attn_kl_bytes,
    attn_kl_flops,
    autograd_step,
)
from streamkl.testing import rel_err

K = 1024
SWEEPS = {  # name: what it varies
    "n": "N = Nq = Nk",
    "decode": "a few query rows against a long key sequence",
    "shapes": "D1 != D2 and grouped key heads",
    "long": "long context, streamkl only",
}
SCHEMA = "streamkl-bench/2"
STREAMKL_NAMES = tuple(f"streamkl-{name}" for name in streamkl.BACKENDS)


# the cases of one sweep, each timed by its providers (names; None: every provider) in its modes
Sweep = collections.namedtuple("Sweep", "name what cases providers modes", defaults=(None, ("fwd", "train")))


def _sizes(text: str) -> list[int]:
    """'4k,8k,1m' -> [4096, 8192, 1048576]: the type of the size flags."""
    unit = {"k": K, "m": K * K}
    return [int(float(t.rstrip("km")) * unit.get(t[-1], 1)) for t in text.lower().replace(" ", "").split(",")]


def build_sweeps(names: list[str], args) -> list[Sweep]:
    """The sweeps named, at the quick sizes, every size (--full), or in miniature on CPU (--smoke)."""
    b, h, d, dtype = (1, 2, 16, "float32") if args.smoke else (args.batch, args.heads, args.dim, args.dtype)
    case = lambda nq, nk, causal, **kw: dataclasses.replace(Case(b, h, nq, nk, d, d, causal, dtype), **kw)
    if args.smoke:  # bf16 in n, where every CPU provider runs
        cases = {
            "n": [case(n, n, c, dtype="bfloat16") for c in (False, True) for n in (64, 128)],
            "decode": [case(1, 128, True), case(8, 128, False)],
            "shapes": [
                case(64, 64, True, d2=8, label="D2=D/2"),
                case(64, 64, False, hk1=1, hk2=1, label="GQA H/2"),
            ],
            "long": [case(256, 256, True)],
        }
    else:
        full, causals = args.full, {"0": [False], "1": [True], "both": [False, True]}[args.causal]
        ns = args.sizes or [s * K for s in [4, 8, 16, 32, *([64, 128, 256, 512] if full else [])]]
        nqs = args.decode_nq or ([1, 2, 4, 8, 16, 32, 64, 128, 256] if full else [1, 16, 64, 256])
        nks = args.decode_nk or [s * K for s in ([32, 64, 128] if full else [32, 128])]
        n_shapes, gqa = ns[0] if args.sizes else 8 * K, max(1, h // 4)
        shapes = {
            "D2=D/2": dict(d2=d // 2),
            "D1=D/2": dict(d1=d // 2),
            "GQA H/4": dict(hk1=gqa, hk2=gqa),
            "D2=D/2, GQA H/4, H/8": dict(d2=d // 2, hk1=gqa, hk2=max(1, h // 8)),
            **({"MQA": dict(hk1=1, hk2=1)} if full else {}),
        }
        long_causals = causals if full or args.causal != "both" else [True]
        longs = args.long_sizes or [128 * K, 512 * K, K * K]
        cases = {
            "n": [case(n, n, c) for c in causals for n in ns],
            "decode": [case(nq, nk, c) for c in causals for nk in nks for nq in nqs],
            "shapes": [
                case(n_shapes, n_shapes, c, label=k, **kw) for c in causals for k, kw in shapes.items()
            ],
            "long": [case(n, n, c) for c in long_causals for n in longs],
        }
    long = (STREAMKL_NAMES, ("fwd", "train") if args.full else ("train",))
    return [Sweep(name, SWEEPS[name], cases[name], *(long if name == "long" else ())) for name in names]


@dataclasses.dataclass
class Options:
    warmup_ms: float = 25.0  # do_bench (CUDA)
    rep_ms: float = 100.0
    min_run_time: float = 0.2  # blocked_autorange (CPU), seconds
    long_call_s: float = 5.0  # a call at least this long after warm-up is timed by that one call
    check_rows: int = 64
    max_seconds: float | None = None  # no measurement starts after this many seconds
    gemm_size: int = 8192
    seed: int = 0


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nbytes(out) -> int:
    """The bytes of the tensors a call returned (a tensor, or a tuple or list of them)."""
    if isinstance(out, torch.Tensor):
        return out.nbytes
    return sum(nbytes(t) for t in out) if isinstance(out, (tuple, list)) else 0


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":  # on CPU a gc pass per measurement costs more than the smoke run
        gc.collect()
        torch.cuda.empty_cache()


def time_ms(fn, device: torch.device, opt: Options) -> tuple[float, str]:
    """Median milliseconds of fn() (already warm) and how they were measured."""
    if device.type == "cuda":
        from triton.testing import do_bench

        ms = do_bench(fn, warmup=opt.warmup_ms, rep=opt.rep_ms, return_mode="median")
        return float(ms), f"triton.testing.do_bench(warmup={opt.warmup_ms:g}, rep={opt.rep_ms:g}), median"
    m = Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=opt.min_run_time)
    return m.median * 1e3, f"torch.utils.benchmark blocked_autorange, median of {len(m.times)} blocks"


def gemm_yardstick(device: torch.device, size: int) -> dict:
    """The bf16 GEMM behind "% of GEMM", timed sustained (a second of warm-up settles the clock)."""
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms, _ = time_ms(lambda: a @ b, device, Options(warmup_ms=1000, rep_ms=2000))
    return {"size": size, "dtype": "bfloat16", "ms": ms, "tflops": 2 * size**3 / ms / 1e9}


def copy_yardstick(device: torch.device, size: int = 2**31) -> dict:
    """Device-to-device copy bandwidth (bytes read + written per second), the bound behind "% of
    copy" for memory-bound cases; timed sustained like the GEMM."""
    src = torch.empty(size, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ms, _ = time_ms(lambda: dst.copy_(src), device, Options(warmup_ms=300, rep_ms=600))
    return {"bytes": size, "ms": ms, "gbps": 2 * size / ms / 1e6}


def _git(*cmd: str) -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:
        return subprocess.run(["git", "-C", root, *cmd], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _version(*dists: str) -> str | None:
    """The installed version of the first of `dists` found (a package renamed across releases)."""
    for name in dists:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _nvrtc() -> str | None:
    """NVRTC's version as cuda-python loads it (what the cuda backend compiles with), if it loads."""
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
    except Exception:  # noqa: BLE001 - no cuda-python, or no NVRTC library: recorded as unknown
        return None
    return f"{major}.{minor}" if int(err) == 0 else None


def _driver() -> str | None:
    """The NVIDIA driver release (nvidia-smi), or None where there is none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def environment(device: torch.device, argv: list[str], commit: str | None = None) -> dict:
    """What a result must record to be reproduced: date, command, commit, card and software."""
    dirty = None  # unknown where --commit names the commit: a copy without .git
    if commit is None:
        commit = (_git("rev-parse", "HEAD") or "").strip() or None
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no")) if commit else None
    cuda = device.type == "cuda"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "argv": argv,
        "commit": commit,
        "dirty": dirty,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda_python": _version("cuda-python", "cuda-bindings"),
        "nvrtc": _nvrtc(),
        "fla_core": _version("fla-core"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "driver": _driver() if cuda else None,
        "device": torch.cuda.get_device_name(device) if cuda else _cpu_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))) if cuda else None,
        "device_type": device.type,
        "platform": platform.platform(),
    }


class Reference:
    """The float64 answer on the case's last `rows` query rows, once; g_check: g zero on the others."""

    def __init__(self, case: Case, inputs: tuple, g: torch.Tensor, rows: int):
        self.case, self.inputs, self.rows = case, inputs, max(1, min(rows, case.nq))
        self.g_check = torch.zeros_like(g)
        self.g_check[..., -self.rows :] = g[..., -self.rows :]

    @functools.cached_property
    def answer(self) -> tuple | str:
        """(name, kl, dq2, dk2) on the checked rows, or why the reference failed."""
        q1, k1, q2, k2 = self.inputs
        r = self.rows
        # float64 copies of the keys up to 8 GiB; beyond, the inputs' dtype (float32 accumulation)
        dtype = torch.float64 if (k1.numel() + k2.numel()) * 8 <= 2**33 else q1.dtype
        kl_of = functools.partial(streamkl.attn_kl, causal=self.case.causal, backend="reference")
        try:
            x = [t.to(dtype) for t in (q1[:, :, -r:], k1, q2[:, :, -r:], k2)]
            kl, dq2, dk2 = autograd_step(kl_of, *x, self.g_check[..., -r:])
        except Exception as exc:  # noqa: BLE001 - the measurements go on without their check
            return f"reference: {type(exc).__name__}: {str(exc)[:300]}"
        name = f"streamkl-reference in {str(dtype).replace('torch.', '')}, last {r} rows"
        return name, kl, dq2, dk2

    def errors(self, out, mode: str) -> dict:
        """KL: max over the rows of |kl - ref| / max(1, |ref|); gradients: relative norm error."""
        if isinstance(self.answer, str):
            return {"failed": self.answer}
        name, kl, dq2, dk2 = self.answer
        got = out if mode == "fwd" else out[0]
        r = self.rows
        err = (got[..., -r:].double() - kl.double()).abs() / kl.double().abs().clamp_min(1.0)
        errors = {"reference": name, "kl": err.max().item()}
        if mode == "train":
            errors["dq2"] = rel_err(out[1][:, :, -r:], dq2)
            errors["dk2"] = rel_err(out[2], dk2)
        return errors


class Prepared(NamedTuple):
    """One case's measurements' material: its tensors (what `why_not` and a provider's own check
    see), per mode the timed call's arguments and the first (checked) call's, and the float64
    check (`.rows`, `.errors(out, mode)`)."""

    inputs: tuple
    args: dict[str, tuple]
    checked: dict[str, tuple]
    reference: Any


@dataclasses.dataclass(frozen=True)
class Op:
    """What the harness needs of an op: its name, the GEMM FLOPs of a case and mode (behind every
    TFLOP/s), the bytes a forward must move, and the material of a case's measurements."""

    name: str
    flops: Callable[[Any, str], int]
    bytes: Callable[[Any], int]
    prepare: Callable[[Any, torch.device, Options], Prepared]


def _prepare_attn_kl(case: Case, device: torch.device, opt: Options) -> Prepared:
    """attn_kl's inputs, a per-row upstream gradient g, and the float64 check on the last rows."""
    inputs = case.inputs(device, opt.seed)
    gen = torch.Generator(device=device).manual_seed(opt.seed + 1)
    g = torch.randn(case.b, case.h, case.nq, generator=gen, device=device)
    reference = Reference(case, inputs, g, opt.check_rows)
    args = {"fwd": inputs, "train": (*inputs, g)}
    return Prepared(inputs, args, {"fwd": inputs, "train": (*inputs, reference.g_check)}, reference)


ATTN_KL = Op("attn_kl", attn_kl_flops, attn_kl_bytes, _prepare_attn_kl)


class Runner:
    """Sweeps x cases x modes x providers, one measurement at a time; a failure or an OOM is a record."""

    def __init__(self, device, providers: list[Provider], out: Path, options: Options, run: dict, log=print,
                 op: Op = ATTN_KL):  # fmt: skip
        self.device, self.providers, self.out, self.opt, self.log = device, providers, Path(out), options, log
        self.op = op
        self.data = {"schema": SCHEMA, "runs": [run], "records": []}
        self.oom_at: dict[tuple, int] = {}  # (sweep, provider, mode) -> fewest logits that ran out
        self.t0 = time.perf_counter()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "results.tmp"  # then renamed: a run killed mid-write keeps the last one
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.out / "results.json")

    def run(self, sweeps: list[Sweep]) -> dict:
        entry, cuda = self.data["runs"][0], self.device.type == "cuda"  # the yardsticks are CUDA's
        gemm = entry["gemm"] = {"start": gemm_yardstick(self.device, self.opt.gemm_size) if cuda else None}
        entry["copy"] = copy_yardstick(self.device) if cuda else None
        for sweep in sweeps:
            self.log(f"== sweep {sweep.name}: {sweep.what}, {len(sweep.cases)} cases")
            providers = [p for p in self.providers if sweep.providers is None or p.name in sweep.providers]
            for case in sweep.cases:
                self.run_case(sweep, case, providers)
        gemm["end"] = gemm_yardstick(self.device, self.opt.gemm_size) if cuda else None
        entry["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.save()
        return self.data

    def run_case(self, sweep: Sweep, case: Case, providers: list[Provider]) -> None:
        """Every measurement of the case, each recorded (and results.json rewritten) as it is made."""
        failed = prepared = None
        try:
            prepared = self.op.prepare(case, self.device, self.opt)
        except Exception as exc:  # noqa: BLE001 - inputs that do not fit: every measurement says so
            failed = {"status": "error", "reason": f"inputs: {type(exc).__name__}: {exc}"[:500]}
            free_memory(self.device)
        for mode, prov in itertools.product(sweep.modes, providers):
            fields = failed or self.measure(sweep, case, prov, mode, prepared)
            rec = {"run": 0, "op": self.op.name, "sweep": sweep.name, "case": dataclasses.asdict(case)}
            rec.update(
                case_key=case.key, provider=prov.name, kind=prov.kind, mode=mode,
                flops=self.op.flops(case, mode), bytes=self.op.bytes(case), **fields,
            )  # fmt: skip
            self.data["records"].append(rec)
            self.save()
            self.log(report.one_line(rec))
        prepared = None  # freed before the next case
        free_memory(self.device)

    def measure(self, sweep, case, prov, mode, prepared: Prepared) -> dict:
        """The record's fields: why it did not run, or its timing, or its failure."""
        key = (sweep.name, prov.name, mode)
        if self.opt.max_seconds is not None and time.perf_counter() - self.t0 > self.opt.max_seconds:
            return {"status": "n/a", "reason": f"not started: --max-seconds {self.opt.max_seconds:g} spent"}
        if mode == "train" and prov.train is None:
            return {"status": "n/a", "reason": "no training step (a forward yardstick)"}
        if reason := prov.why_not(case, prepared.inputs):
            return {"status": "n/a", "reason": reason}
        if case.logits >= self.oom_at.get(key, math.inf):
            reason = f"not run: out of memory at {self.oom_at[key]} logits, here {case.logits}"
            return {"status": "oom", "reason": reason}
        try:
            fields = self._time(case, prov, mode, prepared)
        except Unsupported as exc:  # the provider found out on its first call that it cannot run this
            fields = {"status": "n/a", "reason": str(exc)[:1000]}
        except torch.cuda.OutOfMemoryError as exc:
            self.oom_at[key] = case.logits  # fewer than any before: larger cases were not run
            fields = {"status": "oom", "reason": str(exc).splitlines()[0][:300]}
        except Exception as exc:  # noqa: BLE001 - a failure is a result, the run goes on
            fields = {"status": "error", "reason": f"{type(exc).__name__}: {str(exc)[:1000]}"}
            fields["traceback"] = traceback.format_exc(limit=-6)[-3000:]
        free_memory(self.device)
        return fields

    def _time(self, case, prov, mode, prepared: Prepared) -> dict:
        """A first call (the warm-up, checked), a second (peak memory on CUDA), then the timing."""
        fn = prov.fwd(case) if mode == "fwd" else prov.train(case)
        args, checked, reference = prepared.args[mode], prepared.checked[mode], prepared.reference
        t0 = time.perf_counter()
        out = fn(*(args if prov.check else checked))
        synchronize(self.device)
        fields = {"first_call_s": round(time.perf_counter() - t0, 4)}
        if prov.check is not None:
            fields["error"] = prov.check(case, prepared.inputs, mode, reference.rows)
        elif prov.kind != "yardstick":
            fields["error"] = reference.errors(out, mode)
        del out
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        t0 = time.perf_counter()
        out = fn(*args)
        synchronize(self.device)
        one_call_s = time.perf_counter() - t0
        fields["mem_bytes"] = torch.cuda.max_memory_allocated(self.device) - before if cuda else None
        fields["out_bytes"] = nbytes(out)
        del out
        if one_call_s >= self.opt.long_call_s:  # a multi-second call: one sample is enough
            ms, timer = one_call_s * 1e3, "one synchronized call (over --long-call-s)"
        else:
            ms, timer = time_ms(lambda: fn(*args), self.device, self.opt)
        tflops = self.op.flops(case, mode) / ms / 1e9
        return {"status": "ok", "ms": ms, "tflops": tflops, "timer": timer, **fields}


def add_run_flags(p: argparse.ArgumentParser, out_default: str) -> None:
    """The flags of every op's CLI: which providers, where to write, how to time, what to record."""
    p.add_argument("--providers", help="comma list of provider names (default: all)")
    p.add_argument("--out", help=f"output folder (default: {out_default})")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench measuring time")
    p.add_argument("--long-call-s", type=float, default=5.0, help="calls this long are timed once")
    p.add_argument("--check-rows", type=int, default=64, help="query rows checked against float64")
    p.add_argument("--max-seconds", type=float, help="start no measurement after this")
    p.add_argument("--commit", help="the commit to record where the copy has no .git")
    p.add_argument("--no-plots", action="store_true")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/bench.py",
        description="Time streamkl and the other ways to compute the same KL, with their errors "
        "against float64; write results.json, results.md and plots.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--sweep", default="n", help=f"comma list of {', '.join(SWEEPS)}, or all")
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--full", action="store_true", help="every size (default: the quick sizes)")
    preset.add_argument("--smoke", action="store_true", help="every sweep in miniature on CPU (CI)")
    p.add_argument("--sizes", type=_sizes, help="N of the n sweep (and of shapes: its first), e.g. 4k,8k")
    p.add_argument("--long-sizes", type=_sizes, help="N of the long sweep, e.g. 128k,1m")
    p.add_argument("--decode-nq", type=_sizes, help="Nq of the decode sweep, e.g. 1,16,256")
    p.add_argument("--decode-nk", type=_sizes, help="Nk of the decode sweep, e.g. 32k,128k")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: bf16 on GPU")
    p.add_argument("--causal", choices=["0", "1", "both"], default="both")
    add_run_flags(p, "docs/benchmarks/<date>_<device>")
    return p


def chosen_providers(providers: list[Provider], args, p: argparse.ArgumentParser) -> list[Provider]:
    """The providers --providers names (all by default); in --smoke, those Triton runs left out."""
    if args.smoke:  # Triton's interpreter takes about a second a call: the smoke run leaves it to the tests
        for interpreted in (p for p in providers if p.name in ("streamkl-triton", "fla-fused-kl")):
            interpreted.why_not = lambda case, inputs: (
                "left out of --smoke (Triton's interpreter: about 1 s a call)"
            )
    if not args.providers:
        return providers
    wanted = args.providers.split(",")
    if unknown := set(wanted) - {p.name for p in providers}:
        known = ", ".join(p.name for p in providers)
        p.error(f"unknown providers {sorted(unknown)}; known: {known}")
    return [p for p in providers if p.name in wanted]


def execute(script: str, argv: list[str], args, device, sweeps: list[Sweep], providers, op: Op = ATTN_KL,
            folder_suffix: str = "", config: dict | None = None) -> int:  # fmt: skip
    """Run the sweeps, write results.json, then results.md and the plots; the shared tail of every
    op's CLI (`script` and `argv` are the command recorded)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Options) if hasattr(args, f.name)}
    options = Options(**given, min_run_time=0.01 if args.smoke else 0.2)
    env = environment(device, [script, *argv], args.commit)
    slug = re.sub(r"[^a-z0-9]+", "-", env["device"].lower().replace("nvidia", "")).strip("-")
    where = slug if device.type == "cuda" else "cpu"
    out = Path(args.out or f"docs/benchmarks/{env['date'][:10]}_{where}{folder_suffix}")
    preset = "smoke" if args.smoke else "full" if getattr(args, "full", False) else "quick"
    config = {"preset": preset, **(config or {}), "sweeps": {s.name: s.what for s in sweeps}}
    config.update(providers={p.name: p.what for p in providers}, options=dataclasses.asdict(options))
    log = functools.partial(print, flush=True)
    log(f"{script} on {env['device']}: sweeps {', '.join(s.name for s in sweeps)}; out {out}")
    run = {"environment": env, "config": config}
    data = Runner(device, providers, out, options, run, log, op=op).run(sweeps)
    written = report.render(data, out, with_plots=not args.no_plots)
    counts = dict(collections.Counter(r["status"] for r in data["records"]))
    paths = ", ".join(str(p) for p in [out / "results.json", *written])
    log(f"done in {data['runs'][0]['elapsed_s']} s: {counts}; wrote {paths}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    names = list(SWEEPS) if args.sweep == "all" or args.smoke else args.sweep.split(",")
    if set(names) - set(SWEEPS):
        parser().error(f"unknown sweep in {args.sweep!r}; expected {', '.join(SWEEPS)} or all")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    sweeps = build_sweeps(names, args)
    providers = chosen_providers(all_providers("inductor" if cuda else "aot_eager"), args, parser())
    return execute("benchmarks/bench.py", argv, args, device, sweeps, providers)


if __name__ == "__main__":
    sys.exit(main())
