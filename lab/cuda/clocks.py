"""Work per clock: each workload runs alone, first for a 1 s ramp, then timed for a few seconds
while nvidia-smi samples that GPU's SM clock and board power (instantaneous where it can) every
50 ms, so a rate can be compared at the clock it ran at (the chip lowers its clock when it draws
more power). Workloads, B=1 H=32 bf16, non-causal: the bf16 8192^3 GEMM, cuDNN's attention
forward, the cuda and triton forwards through streamkl.attn_kl, and with --mix the bound of
mix_bound.py (the cuda kernel's tensor work and exponentials with no dependency between them).
Prints TFLOP/s, the median SM clock, the mean power and FLOP per clock per SM; --json writes it.

    python lab/cuda/clocks.py [--seconds 3] [--dims 128,64] [--mix 128,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks/

import mix_bound  # this folder's, beside the script

import streamkl
from benchmarks import sdpa_trick
from streamkl.testing import make_inputs

# power.draw.instant where nvidia-smi has it (power.draw is a 1 s average on recent GPUs)
POWER = ("power.draw.instant", "power.draw")
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # newer, older name
RAMP_S = 1.0  # each workload runs this long untimed first, so no sample averages in the idle gap


def gpu_id() -> str:
    """nvidia-smi's id of torch's current GPU (its UUID: indices differ under CUDA_VISIBLE_DEVICES)."""
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else str(torch.cuda.current_device())


def query(gpu: str) -> list[str]:
    """The sampling command: timestamp, SM clock, power, temperature and, where known, the reasons."""
    for power, reasons in itertools.product(POWER, (*REASONS, None)):
        fields = ",".join(f for f in ("timestamp", "clocks.sm", power, "temperature.gpu", reasons) if f)
        probe = subprocess.run(
            ["nvidia-smi", "-i", gpu, f"--query-gpu={fields}", "--format=csv"], capture_output=True
        )
        if probe.returncode == 0:
            return [
                "nvidia-smi",
                "-i",
                gpu,
                f"--query-gpu={fields}",
                "--format=csv,noheader,nounits",
                "-lms",
                "50",
            ]
    raise SystemExit(f"nvidia-smi cannot sample GPU {gpu}")


def workloads(n: int, dims: list[int], mix_dims: list[int]):
    """(name, FLOP per call, call) for each workload; a mix workload counts the attention FLOPs
    its tensor work stands for, also where it issues none (exponentials alone)."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = [("gemm-bf16-8192", 2 * 8192**3, lambda: a @ b)]
    for d in dims:
        inputs = make_inputs(b=1, h=32, nq=n, nk=n, d1=d, d2=d, dtype=torch.bfloat16, device="cuda", seed=d)
        flops = 4 * 32 * n * n * d
        q1, k1 = inputs[:2]
        out.append(
            (
                f"attention-cudnn-d{d}",
                flops,
                lambda q=q1, k=k1, d=d: sdpa_trick.attention(q, k, k, False, d**-0.5, "cudnn"),
            )
        )
        out.append((f"cuda-d{d}", flops, lambda x=inputs: streamkl.attn_kl(*x, backend="cuda")))
        out.append((f"triton-d{d}", flops, lambda x=inputs: streamkl.attn_kl(*x, backend="triton")))
    for d in mix_dims:
        mix = mix_bound.MixBound(d)
        for name, tensor, exps in mix_bound.MIXES:
            out.append((f"mix-{name}-d{d}", mix.flops, lambda m=mix, t=tensor, e=exps: m.call(t, e)))
    return out


def run(name, flops, fn, seconds):
    """The rate over `seconds` after RAMP_S of the same calls, and that window's wall-clock ends."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    batch = max(1, int(0.05 / max(time.perf_counter() - t, 1e-6)))  # about 50 ms of calls per sync

    def calls_for(duration):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < duration:
            for _ in range(batch):
                fn()
            torch.cuda.synchronize()
            calls += batch
        return calls, time.perf_counter() - t0

    calls_for(RAMP_S)
    start = datetime.datetime.now()
    calls, wall = calls_for(seconds)
    return dict(name=name, start=start, end=datetime.datetime.now(), tflops=flops * calls / wall / 1e12)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--n", type=int, default=16384, help="sequence length of the attention workloads")
    ap.add_argument("--dims", default="128,64", help="head dims of the attention workloads")
    ap.add_argument("--mix", default="", help="head dims of the mix_bound.py workloads (none by default)")
    ap.add_argument("--json")
    ap.add_argument("--commit", default="?")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU and nvidia-smi")
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: nothing blocks the sampler
    sampler = query(gpu_id())
    smi = subprocess.Popen(sampler, stdout=log, text=True)
    rows = []
    dims = [int(d) for d in args.dims.split(",") if d]
    mix_dims = [int(d) for d in args.mix.split(",") if d]
    for name, flops, fn in workloads(args.n, dims, mix_dims):
        rows.append(run(name, flops, fn, args.seconds))
        time.sleep(0.5)
    smi.terminate()
    smi.wait()
    log.seek(0)
    samples = []
    for line in log.read().splitlines():
        f = [x.strip() for x in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f")
            samples.append((stamp, float(f[1]), float(f[2]), f[4] if len(f) > 4 else "?"))
        except (ValueError, IndexError):
            continue
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    print(
        f"{torch.cuda.get_device_name()}  commit {args.commit}  {len(samples)} samples, {sms} SMs, N={args.n}"
    )
    print(" ".join(sampler))
    print(f"{'workload':>26} {'TFLOP/s':>8} {'MHz':>6} {'W':>6} {'FLOP/clk/SM':>12}  reasons")
    for r in rows:
        inside = [s for s in samples if r["start"] <= s[0] <= r["end"]]  # the timed window
        mhz = statistics.median(s[1] for s in inside) if inside else float("nan")
        r.update(mhz=mhz, watts=statistics.mean(s[2] for s in inside) if inside else float("nan"),
                 reasons=sorted({s[3] for s in inside}), samples=len(inside))  # fmt: skip
        r["flop_per_clk_sm"] = r["tflops"] * 1e12 / (mhz * 1e6 * sms)
        rate = f"{r['tflops']:8.0f} {mhz:6.0f} {r['watts']:6.0f} {r['flop_per_clk_sm']:12.0f}"
        print(f"{r['name']:>26} {rate}  {','.join(r['reasons'])}")
        r["start"], r["end"] = r["start"].isoformat(), r["end"].isoformat()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    device=torch.cuda.get_device_name(),
                    commit=args.commit,
                    n=args.n,
                    sms=sms,
                    sampler=sampler,
                    rows=rows,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
