"""What gets timed: streamkl backends, the dense formula eager and compiled, a bf16 GEMM.

Every provider turns a case into `fn(q1, k1, q2, k2) -> kl (B, H, Nq)`; the runner wraps it
for forward, backward and memory measurements, so all providers are measured by one code path.
The dense baselines are `streamkl.testing.dense_attn_kl` in float32, the tests' oracle written
the way users write it today (both Nq x Nk distributions materialized).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from streamkl.testing import dense_attn_kl

STREAMKL_BACKENDS = ("cuda", "triton", "reference")
BASELINES = ("torch", "torch.compile", "gemm")


def dense_fp32(q1, k1, q2, k2, causal):
    """The PyTorch baseline: the definition materialized in float32 (eager)."""
    return dense_attn_kl(q1, k1, q2, k2, causal=causal, dtype=torch.float32)


@dataclass
class Provider:
    name: str  # "streamkl-triton", "torch", "torch.compile", "gemm"
    kind: str  # "streamkl" | "dense" | "gemm"
    backend: str | None = None
    compile_backend: str = "inductor"
    env: dict = field(default_factory=dict)  # variables set around every call (ablations)
    variant: str = ""  # label of that env, e.g. "split_k=1"

    def with_variant(self, variant: str, env: dict) -> Provider:
        return Provider(self.name, self.kind, self.backend, self.compile_backend, dict(env), variant)

    @property
    def label(self) -> str:
        return f"{self.name} [{self.variant}]" if self.variant else self.name

    def unsupported(self, inputs) -> str | None:
        """None if this provider can run these inputs, else why not."""
        if self.kind != "streamkl":
            return None
        try:
            import streamkl
        except Exception as exc:  # the op is not importable: say so, keep benchmarking the rest
            return f"import streamkl failed: {type(exc).__name__}: {exc}"
        fn = getattr(streamkl, "available_backends", None)
        if fn is None:
            return "streamkl.available_backends is missing"
        reasons = fn(*inputs)
        if self.backend not in reasons:
            return f"unknown backend {self.backend!r} (known: {', '.join(reasons)})"
        return reasons[self.backend]

    def make(self, causal: bool):
        """fn(q1, k1, q2, k2) -> kl, plus a `reset()` for per-case state (compile caches)."""
        if self.kind == "streamkl":
            import streamkl

            return functools.partial(_call_streamkl, streamkl.attn_kl, self.backend, causal)
        if self.name == "torch":
            return functools.partial(dense_fp32, causal=causal)
        if self.name == "torch.compile":
            return _compiled(self.compile_backend, causal)
        raise ValueError(f"provider {self.name!r} has no callable")


def _call_streamkl(attn_kl, backend, causal, q1, k1, q2, k2):
    return attn_kl(q1, k1, q2, k2, causal=causal, backend=backend)


def _compiled(compile_backend: str, causal: bool):
    """A fresh torch.compile of dense_fp32 (static shapes). Dynamo's caches are reset first so
    each case compiles from scratch (the compile time is reported) and the per-code-object
    recompile limit is never hit, which would silently fall back to eager."""
    import torch._dynamo
    import torch._functorch.config

    torch._dynamo.reset()
    # the backward is timed with retain_graph=True (forward once, backward many times), which
    # donated buffers forbid; they only let the backward reuse saved tensors' memory
    if hasattr(torch._functorch.config, "donated_buffer"):
        torch._functorch.config.donated_buffer = False
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    compiled = torch.compile(dense_fp32, backend=compile_backend, dynamic=False)
    return functools.partial(compiled, causal=causal)


def discover(names: list[str] | None, compile_backend: str) -> list[Provider]:
    """Providers by name; None means all. 'streamkl' expands to every streamkl backend."""
    wanted = names or ["streamkl", *BASELINES]
    out: list[Provider] = []
    for name in wanted:
        name = name.strip()
        if not name:
            continue
        if name == "streamkl":
            out += [Provider(f"streamkl-{b}", "streamkl", b) for b in STREAMKL_BACKENDS]
        elif name.startswith("streamkl-"):
            out.append(Provider(name, "streamkl", name.split("-", 1)[1]))
        elif name == "torch":
            out.append(Provider("torch", "dense"))
        elif name in ("torch.compile", "compile"):
            out.append(Provider("torch.compile", "dense", compile_backend=compile_backend))
        elif name == "gemm":
            out.append(Provider("gemm", "gemm"))
        else:
            raise ValueError(
                f"unknown provider {name!r}; expected streamkl, streamkl-<backend> "
                f"({', '.join(STREAMKL_BACKENDS)}), torch, torch.compile or gemm"
            )
    seen, unique = set(), []
    for p in out:
        if p.name not in seen:
            seen.add(p.name)
            unique.append(p)
    return unique


class GemmYardstick:
    """bf16 (float32 on CPU) square GEMMs, timed once per size and cached.

    `for_flops(F)` answers "how long would a GEMM doing F FLOPs take on this device": the
    square GEMM whose 2*s^3 is nearest F (s a multiple of 256, clamped to [256, max_size]) is
    timed, and its time scaled by F / (2*s^3)."""

    def __init__(self, device, timing, bench_fn, max_size: int):
        self.device = device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.timing = timing
        self.bench_fn = bench_fn
        self.max_size = max_size
        self.cache: dict[int, dict] = {}

    def square(self, s: int, sustained: bool = False) -> dict:
        """Time an s^3 GEMM. sustained: the run's yardstick, timed for seconds (do_bench with a
        1 s warm-up and 2 s of repeats) so that it reports the clock the GPU holds under load,
        not the first burst (650-680 TFLOP/s sustained on the H200 against
        ~780 in bursts)."""
        if sustained:
            self.cache.pop(s, None)
        if s not in self.cache:
            gen = torch.Generator(device=self.device).manual_seed(s)
            a = torch.randn(s, s, device=self.device, dtype=self.dtype, generator=gen)
            b = torch.randn(s, s, device=self.device, dtype=self.dtype, generator=gen)
            fn = functools.partial(torch.matmul, a, b)
            t0 = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            est = time.perf_counter() - t0
            if sustained and self.device.type == "cuda":
                from .timing import TimingConfig, bench

                res = bench(fn, self.device, 0.0, TimingConfig(warmup_ms=1000.0, rep_ms=2000.0))
            else:
                res = self.bench_fn(fn, est)
            flops = 2 * s**3
            self.cache[s] = {
                "m": s,
                "n": s,
                "k": s,
                "dtype": str(self.dtype).replace("torch.", ""),
                "ms": res["ms"],
                "tflops": flops / (res["ms"] * 1e-3) / 1e12,
                "timer": res["timer"],
            }
            del a, b
        return self.cache[s]

    def for_flops(self, flops: int) -> dict:
        s = round((flops / 2) ** (1 / 3) / 256) * 256
        s = int(min(max(s, 256), self.max_size))
        ref = self.square(s)
        return {**ref, "scaled_ms": ref["ms"] * flops / (2 * s**3)}
