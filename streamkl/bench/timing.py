"""Timing, peak memory and failure handling, shared by every provider and sweep.

GPU: `triton.testing.do_bench(..., return_mode="median")` (it flushes L2 between calls and
excludes its warm-up), except for calls so long that do_bench's own estimate loop (five calls)
would waste minutes: those get CUDA events around each of a few calls, median taken.
CPU (the smoke run): `time.perf_counter` medians after warm-up calls.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from dataclasses import dataclass

import torch

OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    {getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)} - {None}
)


def is_oom(exc: BaseException) -> bool:
    """Out of device memory, whichever layer noticed it (caching allocator, cuBLAS, Triton)."""
    if OOM_ERRORS and isinstance(exc, OOM_ERRORS):
        return True
    text = str(exc).lower()
    return "out of memory" in text and "shared memory" not in text


def is_fatal_cuda_error(exc: BaseException) -> bool:
    """Sticky CUDA errors after which nothing more can run in this process."""
    text = str(exc).lower()
    return any(
        s in text
        for s in (
            "illegal memory access",
            "device-side assert",
            "unspecified launch failure",
            "misaligned address",
            "illegal instruction",
        )
    )


@contextlib.contextmanager
def env_vars(values: dict[str, str] | None):
    """Set environment variables for the duration of a block (None or "" unsets one)."""
    values = values or {}
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None or v == "":
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":  # on CPU a gc pass per measurement costs more than the smoke run
        gc.collect()
        try:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        except Exception:  # a sticky CUDA error was already recorded by the caller
            pass


def tensor_bytes(obj) -> int:
    """Bytes held by the tensors in obj (a tensor or a nested tuple/list of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    return 0


def wall(fn, device: torch.device):
    """(result, seconds) of one synchronized call."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0


class PeakMemory:
    """Peak device memory allocated inside the block above what was allocated at its start.
    `extra(keep)` subtracts the bytes of the results the call hands back (outputs, gradients),
    so what is left is the workspace: saved activations, logits, partial results.
    On CPU nothing is tracked and `extra` is None."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = None

    def __enter__(self):
        if self.device.type == "cuda":
            free_memory(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda" and exc[0] is None:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        return False

    def extra(self, keep_bytes: int) -> int | None:
        return None if self.peak is None else max(0, self.peak - keep_bytes)


@dataclass
class TimingConfig:
    warmup_ms: float = 25.0  # do_bench warm-up (GPU)
    rep_ms: float = 100.0  # do_bench measuring time (GPU)
    repeats: int = 5  # CPU repeats; cap on event-timed repeats for long calls
    cpu_warmup: int = 1  # CPU warm-up calls beyond the first (checked) call
    # above this, CUDA events instead of do_bench: do_bench repeats a call rep_ms / est times
    # after five estimate calls, so a 200 ms call would be measured once
    event_threshold_s: float = 0.02
    long_rep_budget_s: float = 30.0  # event-timed repeats: at most this many seconds in all


def bench(fn, device: torch.device, est_s: float, cfg: TimingConfig) -> dict:
    """Median milliseconds of fn() after warm-up; est_s is the duration of a call already made
    (so warm-up, JIT and autotuning are behind us)."""
    if device.type == "cuda":
        if est_s <= cfg.event_threshold_s:
            try:
                from triton.testing import do_bench
            except ImportError:
                do_bench = None
            if do_bench is not None:
                ms = do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median")
                return {
                    "ms": float(ms),
                    "timer": (
                        f"triton.testing.do_bench(warmup={cfg.warmup_ms:g}ms, rep={cfg.rep_ms:g}ms, median)"
                    ),
                }
        reps = int(max(1, min(cfg.repeats, cfg.long_rep_budget_s // max(est_s, 1e-9))))
        if est_s <= cfg.event_threshold_s:  # no triton: do_bench's job by hand
            reps = max(reps, int(cfg.rep_ms / 1e3 / max(est_s, 1e-9)))
            for _ in range(max(1, int(cfg.warmup_ms / 1e3 / max(est_s, 1e-9)))):
                fn()
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)  # > L2, as do_bench
        times = []
        for _ in range(reps):
            flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del flush
        return {
            "ms": statistics.median(times),
            "timer": f"cuda events, L2 flushed, median of {reps}",
            "reps": reps,
        }
    reps = int(max(1, min(cfg.repeats, cfg.long_rep_budget_s // max(est_s, 1e-9))))
    for _ in range(cfg.cpu_warmup if est_s < 1.0 else 0):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(times), "timer": f"perf_counter, median of {reps}", "reps": reps}
