"""What the harness times: streamkl's backends and every other way a user gets the same KL today, each
a forward `fwd(case)(q1, k1, q2, k2) -> kl` and, where it has one, a training step
`train(case)(q1, k1, q2, k2, g) -> (kl, dq2, dk2)`; docs/benchmarks/README.md (Providers) says which."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

import streamkl
from benchmarks import fla_kl, sdpa_trick
from streamkl.testing import dense_attn_kl, visible_mask

REFERENCE_MAX_PAIRS_CUDA = 2**31  # the slow oracle on a GPU: up to N = 8K at 32 heads, non-causal


@dataclass(frozen=True)
class Case:
    b: int
    h: int
    nq: int
    nk: int
    d1: int
    d2: int
    causal: bool
    dtype: str
    hk1: int | None = None  # key heads (GQA); None: h
    hk2: int | None = None
    label: str = ""

    @property
    def key(self) -> str:
        heads, d = f"{self.h}/{self.hk1 or self.h}/{self.hk2 or self.h}", f"{self.d1}/{self.d2}"
        return f"b={self.b} h={heads} nq={self.nq} nk={self.nk} d={d} causal={int(self.causal)} {self.dtype}"

    @property
    def logits(self) -> int:
        """Entries of one Nq x Nk logits matrix over batch and heads: what dense memory grows with."""
        return self.b * self.h * self.nq * self.nk

    def inputs(self, device, seed: int = 0) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator(device=device).manual_seed(seed)
        shapes = [(self.h, self.nq, self.d1), (self.hk1 or self.h, self.nk, self.d1)]
        shapes += [(self.h, self.nq, self.d2), (self.hk2 or self.h, self.nk, self.d2)]
        dtype = getattr(torch, self.dtype)  # "bfloat16", "float16", "float32"
        return tuple(torch.randn(self.b, *s, generator=gen, device=device, dtype=dtype) for s in shapes)


def visible_pairs(nq: int, nk: int, causal: bool) -> int:
    """(row, key) pairs of one (batch, head) that are visible; causal is bottom-right aligned."""
    if not causal:
        return nq * nk
    if nk >= nq:  # row i sees i + (nk - nq) + 1 keys
        return nq * (nk - nq + 1) + nq * (nq - 1) // 2
    return nk * (nk + 1) // 2  # the first nq - nk rows see nothing


def attn_kl_bytes(case: Case) -> int:
    """What a forward must move at the least: the four inputs read once and the (B, H, Nq) float32
    KL written; against the copy bandwidth, the bound of memory-bound cases (decode)."""
    size = getattr(torch, case.dtype).itemsize
    q = case.b * case.h * case.nq * (case.d1 + case.d2)
    k = case.b * case.nk * ((case.hk1 or case.h) * case.d1 + (case.hk2 or case.h) * case.d2)
    return (q + k) * size + 4 * case.b * case.h * case.nq


def attn_kl_flops(case: Case, mode: str) -> int:
    """The GEMM work over the visible pairs, the one count behind every TFLOP/s (docs/benchmarks/README.md,
    FLOPs): fwd = S1 and S2 = 2 * pairs * (D1 + D2); train = fwd + S1, S2 recomputed, dq2 and dk2."""
    pairs = case.b * case.h * visible_pairs(case.nq, case.nk, case.causal)
    fwd = 2 * pairs * (case.d1 + case.d2)
    if mode == "fwd":
        return fwd
    if mode == "train":
        return 2 * fwd + 4 * pairs * case.d2
    raise ValueError(f"mode must be 'fwd' or 'train', got {mode!r}")


class Unsupported(Exception):
    """Raised by a provider's call that finds it cannot run the case (a backend that does not
    implement the op yet, say): the harness records it n/a with this message, not as an error."""


@dataclass
class Provider:
    name: str
    kind: str  # "streamkl" | "baseline" | "exact" | "yardstick"
    what: str  # one line for the report
    fwd: Callable[[Case], Callable]
    train: Callable[[Case], Callable] | None = None
    why_not: Callable[[Case, tuple], str | None] = lambda case, inputs: None
    # The provider's own error check (case, inputs, mode, rows) -> errors, where its output is not
    # the per-row KL the shared reference compares (fla-fused-kl's per-head means).
    check: Callable[[Case, tuple, str, int], dict] | None = None


def autograd_step(kl_of: Callable, q1, k1, q2, k2, g):
    """The training step of a forward through autograd: the teacher detached, the gradients of q2, k2."""
    q2, k2 = q2.detach().requires_grad_(), k2.detach().requires_grad_()
    kl = kl_of(q1, k1, q2, k2)
    return kl.detach(), *torch.autograd.grad(kl, (q2, k2), g)


def by_autograd(fwd: Callable[[Case], Callable]) -> Callable[[Case], Callable]:
    return lambda case: functools.partial(autograd_step, fwd(case))


@contextlib.contextmanager
def exact_fp32_matmuls():
    """Float32 products in true float32 (TF32 off) for the exact baselines; restored after."""
    matmul = torch.backends.cuda.matmul
    # torch >= 2.9 has fp32_precision and may refuse the older flag once it is in use
    attr, exact = ("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    saved = getattr(matmul, attr)
    setattr(matmul, attr, exact)
    try:
        yield
    finally:
        setattr(matmul, attr, saved)


def dense_autocast(q1, k1, q2, k2, causal: bool):
    """The dense formula as autocast code runs it: matmuls in the inputs' dtype, the rest in float32."""
    mask = visible_mask(q1.shape[2], k1.shape[2], True, q1.device) if causal else None

    def log_probs(q, k):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
        return (s if mask is None else s.masked_fill(~mask, -math.inf)).log_softmax(-1)

    logp1, logp2 = log_probs(q1, k1), log_probs(q2, k2)
    diff = logp1 - logp2
    if mask is not None:  # -inf - -inf on the masked keys: 0, and no NaN in the backward
        diff = diff.masked_fill(~mask, 0.0)
    return (logp1.exp() * diff).sum(-1)


def _dense(name, kind, what, formula, compile_backend, why_not=Provider.why_not) -> list:
    """The formula eager (`torch-<name>`) and compiled afresh per measurement (`torch.compile-<name>`)."""

    def fwd(case, compiled):
        fn = lambda q1, k1, q2, k2: formula(q1, k1, q2, k2, case.causal)
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(fn, backend=compile_backend, dynamic=False)
        return exact_fp32_matmuls()(fn) if kind == "exact" else fn  # a context manager is a decorator too

    hows = {"torch": "eager", "torch.compile": f"torch.compile ({compile_backend})"}
    makers = [functools.partial(fwd, compiled=c) for c in (False, True)]
    return [
        Provider(f"{prefix}-{name}", kind, f"{what}, {how}", make, by_autograd(make), why_not)
        for (prefix, how), make in zip(hows.items(), makers)
    ]


def _streamkl(backend: str) -> Provider:
    def why_not(case, inputs):
        pairs = case.b * case.h * visible_pairs(case.nq, case.nk, case.causal)
        if backend == "reference" and inputs[0].is_cuda and pairs > REFERENCE_MAX_PAIRS_CUDA:
            return f"the reference backend (the slow oracle) runs up to 2^31 pairs on a GPU, not {pairs}"
        return streamkl.available_backends(*inputs)[backend]

    fwd = lambda case: functools.partial(streamkl.attn_kl, causal=case.causal, backend=backend)
    what = f"`streamkl.attn_kl(..., backend={backend!r})`; train: autograd of q2, k2"
    return Provider(f"streamkl-{backend}", "streamkl", what, fwd, by_autograd(fwd), why_not)


def _sdpa_trick(backend: str) -> Provider:
    kw = lambda case: dict(causal=case.causal, scale1=case.d1**-0.5, scale2=case.d2**-0.5, backend=backend)
    fwd = lambda case: functools.partial(sdpa_trick.kl, **kw(case))
    train = lambda case: functools.partial(sdpa_trick.train, **kw(case))
    why_not = lambda case, inputs: sdpa_trick.unsupported(*inputs, case.causal, backend)
    what = (
        f"KL from three {backend} attention forwards; train: the same three forwards, then the two "
        "value-gradients of O12 and O22 in one autograd call (sdpa_trick.train)"
    )
    return Provider(f"sdpa-trick-{backend}", "baseline", what, fwd, train, why_not)


def _attention_cudnn() -> Provider:
    def fwd(case):
        return lambda q1, k1, q2, k2: sdpa_trick.attention(q1, k1, k1, case.causal, case.d1**-0.5, "cudnn")[0]

    def train(case):
        def step(q1, k1, q2, k2, g):
            # one cuDNN attention forward+backward on the student's (q2, k2, k2): the upstream
            # gradient of the output is g broadcast over the head dim (one elementwise op more)
            q2, k2 = q2.detach().requires_grad_(), k2.detach().requires_grad_()
            out = sdpa_trick.attention(q2, k2, k2, case.causal, case.d2**-0.5, "cudnn")[0]
            grad_out = g.unsqueeze(-1).to(out.dtype).expand_as(out).contiguous()
            return out.detach(), *torch.autograd.grad(out, (q2, k2), grad_out)

        return step

    def why_not(case, inputs):
        if case.d1 != case.d2 or (case.hk1 or case.h) != case.h:
            return "the yardstick runs where D1 == D2 and without GQA"
        return sdpa_trick.unsupported(*inputs, case.causal, "cudnn")

    what = (
        "one cuDNN attention forward of q1, k1 (V = k1); train: one cuDNN attention forward+backward "
        "of q2, k2 (V = k2), gradients to q2 and k2: a yardstick, not a KL"
    )
    return Provider("attention-cudnn", "yardstick", what, fwd, train, why_not)


def _fla_fused_kl() -> Provider:
    what = (
        "flash-linear-attention's `fused_kl_div_loss` per (batch, head), keys as the vocabulary "
        "(benchmarks/fla_kl.py); output: each head's mean KL over its rows; train: the gradients "
        "of their sum, formed in its forward"
    )
    return Provider(
        "fla-fused-kl", "baseline", what, fla_kl.fwd, fla_kl.train, fla_kl.unsupported, fla_kl.check
    )


def all_providers(compile_backend: str = "inductor") -> list[Provider]:
    def only_16bit(case, inputs):
        if case.dtype not in ("bfloat16", "float16"):
            return f"runs 16-bit inputs (on {case.dtype} inputs it is torch-fp32)"
        return None

    autocast = "dense formula: matmuls in the inputs' 16-bit dtype, log-softmax in float32"
    exact = "`streamkl.testing.dense_attn_kl` in float32, TF32 off: the exact baseline"
    fp32 = functools.partial(dense_attn_kl, dtype=torch.float32)
    return [  # in the report's order
        *(_streamkl(name) for name in streamkl.BACKENDS),
        *_dense("bf16", "baseline", autocast, dense_autocast, compile_backend, why_not=only_16bit),
        _sdpa_trick("flash"),
        _sdpa_trick("cudnn"),
        _fla_fused_kl(),
        *_dense("fp32", "exact", exact, fp32, compile_backend),
        _attention_cudnn(),
    ]
