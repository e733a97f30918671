"""What `benchmarks/indexer_bench.py` times for `streamkl.indexer_kl` (the DSA indexer loss): the case
(DeepSeek-V3.2's shapes by default), its inputs (the teacher's lse as the attention forward returns
it, a top-k set per row in sparse mode), the FLOPs it is credited with, and the providers: Megatron-LM's
formula eager, compiled and head-chunked, and streamkl's backends. Each provider has a forward
`fwd(case)(q, k, qi, ki, w, lse, topk) -> kl (B, Sq)` and a training step
`train(case)(q, k, qi, ki, w, lse, topk) -> (loss, dqi, dki, dw)`, the loss being the mean KL over
the rows, as DSA trains it. docs/benchmarks/README.md (The indexer benchmark) says which is what.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import NamedTuple

import torch

import streamkl
from benchmarks.providers import Provider, Unsupported, visible_pairs

MEGATRON_EPS = 1e-10  # inside both logarithms of Megatron's KL
HEAD_CHUNK = 16  # teacher heads per step of megatron-head-chunked
# streamkl's reference backend (the slow, exact one) on a GPU: it forms every (B, H, rows, Sk)
# chunk, so its cost follows B * H * Sq * Sk: up to 8K tokens at H = 128
REFERENCE_MAX_LOGITS_CUDA = 2**33
LSE_CHUNK_BYTES = 2**31  # the float32 teacher logits of one chunk of rows while forming the lse


@dataclasses.dataclass(frozen=True)
class IndexerCase:
    """One indexer_kl case: teacher q (B, H, Sq, D) on k (B, Hk, Sk, D) at `scale`; indexer qi
    (B, G, Sq, Di), ki (B, 1, Sk, Di), w (B, G, Sq); topk 0 (dense) or K (sparse, a set of K keys per
    row); lse "given" (the attention forward's, passed to streamkl) or "computed" (streamkl forms it)."""

    b: int
    h: int
    hk: int
    g: int
    nq: int
    nk: int
    d: int
    di: int
    causal: bool
    dtype: str
    topk: int = 0
    scale: float | None = None  # None: D**-0.5
    lse: str = "given"
    label: str = ""

    @property
    def logit_scale(self) -> float:
        return self.d**-0.5 if self.scale is None else self.scale

    @property
    def key(self) -> str:
        mode = f"topk={self.topk}" if self.topk else "dense"
        return (
            f"b={self.b} h={self.h}/{self.hk} g={self.g} nq={self.nq} nk={self.nk} d={self.d}/{self.di} "
            f"scale={self.logit_scale:.6g} {mode} causal={int(self.causal)} {self.dtype} lse={self.lse}"
        )

    @property
    def logits(self) -> int:
        """Entries of the teacher's (B, H, Sq, Sk) scores: what the dense formula's memory grows with."""
        return self.b * self.h * self.nq * self.nk

    def visible(self) -> torch.Tensor:
        """(Sq,) int64: the keys each row sees (bottom-right causal)."""
        if not self.causal:
            return torch.full((self.nq,), self.nk, dtype=torch.long)
        return (torch.arange(self.nq) + (self.nk - self.nq + 1)).clamp(0, self.nk)

    def admitted(self) -> torch.Tensor:
        """(Sq,) int64: the keys each row admits: what it sees, or min(K, that) in sparse mode
        (the top-k sets of `topk_sets` are distinct keys the row sees)."""
        seen = self.visible()
        return seen.clamp(max=self.topk) if self.topk else seen

    @property
    def pairs(self) -> int:
        """Admitted (row, key) pairs over the batch: the pairs every FLOP is counted on."""
        if not self.topk:
            return self.b * visible_pairs(self.nq, self.nk, self.causal)
        return self.b * int(self.admitted().sum())

    @property
    def rows_seen(self) -> int:
        """Rows that admit a key: the divisor of the mean loss."""
        return self.b * int((self.admitted() > 0).sum())


def indexer_kl_flops(case: IndexerCase, mode: str) -> int:
    """The GEMM work the method needs over the admitted pairs (docs/benchmarks/README.md, The indexer
    benchmark): the teacher's 2*H*D once per pair, the student's 2*G*Di once in a forward and four
    times in a training step (its log-sum-exp pass, its scores beside the teacher, and the two
    gradient GEMMs dqi = dz ki, dki = dz^T qi). Every provider of a case is credited with this."""
    teacher, student = 2 * case.h * case.d * case.pairs, 2 * case.g * case.di * case.pairs
    if mode == "fwd":
        return teacher + student
    if mode == "train":
        return teacher + 4 * student
    raise ValueError(f"mode must be 'fwd' or 'train', got {mode!r}")


def indexer_kl_bytes(case: IndexerCase) -> int:
    """What a forward must move at the least: the inputs read once, the (B, Sq) float32 KL written."""
    size = getattr(torch, case.dtype).itemsize
    teacher = case.b * (case.h * case.nq + case.hk * case.nk) * case.d
    student = case.b * ((case.g * case.nq + case.nk) * case.di + case.g * case.nq)
    extra = 4 * case.b * case.h * case.nq * (case.lse == "given") + 4 * case.b * case.nq * case.topk
    return (teacher + student) * size + extra + 4 * case.b * case.nq


class IndexerInputs(NamedTuple):
    """The tensors of one case, in the providers' argument order."""

    q: torch.Tensor
    k: torch.Tensor
    qi: torch.Tensor
    ki: torch.Tensor
    w: torch.Tensor
    lse: torch.Tensor | None  # (B, H, Sq) float32, over the keys each row admits; None: lse computed
    topk: torch.Tensor | None  # (B, Sq, K) int32, -1 padding; None: dense


def make_inputs(case: IndexerCase, device, seed: int = 0) -> IndexerInputs:
    """Random teacher and indexer tensors (the indexer's w carrying G^-0.5 Di^-0.5, as DeepSeek-V3.2
    folds it), the top-k sets in sparse mode, and in "given" mode the teacher's per-head lse over
    the admitted keys, as the (sparse) attention forward returns it."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=dtype)
    q, k = rand(case.b, case.h, case.nq, case.d), rand(case.b, case.hk, case.nk, case.d)
    qi, ki = rand(case.b, case.g, case.nq, case.di), rand(case.b, 1, case.nk, case.di)
    w = rand(case.b, case.g, case.nq) * (case.g * case.di) ** -0.5
    topk = topk_sets(case, device, seed + 1) if case.topk else None
    lse = teacher_lse(q, k, case.logit_scale, case.causal, topk) if case.lse == "given" else None
    return IndexerInputs(q, k, qi, ki, w, lse, topk)


def topk_sets(case: IndexerCase, device, seed: int) -> torch.Tensor:
    """(B, Sq, K) int32: per row, K distinct keys it sees, stratified (one uniform draw in each of K
    equal strata of the visible keys), in random order (as a top-k's score order leaves them); a row
    that sees at most K keys takes them all, then -1. Formed on the device a chunk of rows at a time."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width, out = case.topk, torch.empty(case.b, case.nq, case.topk, dtype=torch.int32, device=device)
    seen_all = case.visible().to(device)
    j = torch.arange(width, device=device)
    step = max(1, 2**26 // (case.b * width))
    for r0 in range(0, case.nq, step):
        seen = seen_all[r0 : r0 + step, None]
        lo, hi = (j * seen) // width, ((j + 1) * seen) // width  # strata of [0, seen) when seen >= K
        u = torch.rand(case.b, *lo.shape, generator=gen, device=device)
        drawn = torch.minimum(lo + (u * (hi - lo)).long(), hi - 1)  # u * n may round up to n in float32
        idx = torch.where(seen >= width, drawn, torch.where(j < seen, j, -1))
        order = torch.rand(idx.shape, generator=gen, device=device).argsort(-1)
        out[:, r0 : r0 + step] = idx.gather(-1, order).int()
    return out


@contextlib.contextmanager
def _fp32_matmul_precision(value: str):
    """torch's float32 GEMM precision ("ieee" or "tf32") around a block, restored after."""
    matmul = torch.backends.cuda.matmul
    attr = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"
    saved = getattr(matmul, attr)
    setattr(matmul, attr, value if attr == "fp32_precision" else value == "tf32")
    try:
        yield
    finally:
        setattr(matmul, attr, saved)


def teacher_lse(q, k, scale: float, causal: bool, topk=None) -> torch.Tensor:
    """(B, H, Sq) float32: each teacher head's log-sum-exp over the keys each row admits (the keys it
    sees, or its top-k set), from exact products: 16-bit inputs are products exact in TF32, so the
    float32 GEMM may run in TF32 (as an attention kernel's float32 accumulators hold them)."""
    b, h, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    group, offset = h // hk, nk - nq
    precision = "tf32" if q.dtype in (torch.bfloat16, torch.float16) else "ieee"
    kf = k.float()
    out = torch.empty(b, h, nq, dtype=torch.float32, device=q.device)
    if topk is None:  # a chunk's logits (B, H, rows, Sk)
        step = LSE_CHUNK_BYTES // (4 * b * h * max(nk, 1))
    else:  # its logits (B, H, rows, K) and gathered keys (B, Hk, rows, K, D)
        step = LSE_CHUNK_BYTES // (4 * b * max(topk.shape[-1], 1) * (h + hk * d))
    step = max(1, step)
    with _fp32_matmul_precision(precision):
        for r0 in range(0, nq, step):
            r1 = min(nq, r0 + step)
            qc = q[:, :, r0:r1].float().reshape(b, hk, group, r1 - r0, d)
            rows = torch.arange(r0, r1, device=q.device)[:, None]
            if topk is None:
                end = max(0, min(nk, r1 + offset)) if causal else nk  # what the chunk's last row sees
                s = (qc.flatten(2, 3) @ kf[:, :, :end].transpose(-1, -2)).view(b, hk, group, r1 - r0, end)
                cols = torch.arange(end, device=q.device)[None]
                seen = cols <= rows + offset if causal else torch.ones_like(cols, dtype=torch.bool)
            else:
                idx = topk[:, r0:r1].long()  # (B, rows, K)
                seen = idx >= 0
                if causal:
                    seen &= idx <= rows + offset
                kg = torch.stack([kf[i][:, idx[i].clamp(min=0)] for i in range(b)])  # (B, Hk, rows, K, D)
                s = torch.einsum("bcgrd,bcrkd->bcgrk", qc, kg)
                seen = seen[:, None, None]
            s = s.mul_(scale).masked_fill_(~seen, -math.inf)
            out[:, :, r0:r1] = torch.logsumexp(s, -1).reshape(b, h, r1 - r0)
    return out


# --- Megatron-LM's formula --------------------------------------------------------------------


def megatron_indexer_kl(q, k, qi, ki, w, topk, *, scale: float, causal: bool, head_chunk: int | None = None):
    """KL per row (B, Sq) by Megatron-LM's DSA indexer loss, written here from its definition
    (NVIDIA/Megatron-LM, megatron/core/transformer/experimental_attention_variant/dsa.py,
    `compute_dsa_indexer_loss`, with the index scores of its `_compute_index_scores`; later
    revisions moved both to megatron/core/ops/attention/dsa/reference.py): the index scores
    sum_g w_g relu(qi_g . ki_j) as a dense (B, G, Sq, Sk) array summed over heads; an additive -inf
    mask (causal, and in sparse mode the top-k set scattered into a -inf (B, Sq, Sk) mask, applied to
    both sides); each teacher head's float32 softmax over (B, H, Sq, Sk), summed over heads and
    L1-normalized; then sum_j t_j (log(t_j + 1e-10) - log(softmax(I)_j + 1e-10)). Its GEMMs run in
    the inputs' 16-bit dtype and the rest in float32, as the issue's measured baseline does
    (Megatron's code upcasts before the GEMMs; a float32 GEMM would only be slower). The MQA
    teacher's heads share one GEMM (heads stacked on M), no copy of the key per head.

    head_chunk: the teacher's heads a chunk at a time, the mixture accumulated (what a careful user
    writes to fit memory); the index scores stay dense, as Megatron forms them."""
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    g = qi.shape[1]
    z = (qi.reshape(b, 1, g * sq, -1) @ ki.transpose(-1, -2)).float().view(b, g, sq, sk)  # heads on M
    index = (torch.relu(z) * w.float()[..., None]).sum(1)  # (B, Sq, Sk)
    mask = torch.zeros(sq, sk, dtype=torch.float32, device=q.device)
    if causal:  # bottom-right: row i sees keys j <= i + sk - sq
        mask = torch.triu(torch.full_like(mask, -math.inf), diagonal=sk - sq + 1)
    mask = mask.expand(b, sq, sk)
    if topk is not None:  # -1 padding scattered into a spare column
        chosen = torch.full((b, sq, sk + 1), -math.inf, dtype=torch.float32, device=q.device)
        chosen.scatter_(-1, torch.where(topk < 0, sk, topk).long(), 0.0)
        mask = mask + chosen[..., :sk]
    index = index + mask

    def head_probs(h0: int, h1: int) -> torch.Tensor:
        """Softmax of heads h0..h1 over the admitted keys, summed over those heads: (B, Sq, Sk)."""
        group = h // hk
        qc = q[:, h0:h1]
        if hk == 1:  # MQA: the heads stacked on the GEMM's M against the one key
            s = (qc.reshape(b, 1, (h1 - h0) * sq, d) @ k.transpose(-1, -2)).view(b, h1 - h0, sq, sk)
        else:  # head hh reads key head hh // group
            s = qc @ k[:, torch.arange(h0, h1, device=q.device) // group].transpose(-1, -2)
        s = s.float().mul_(scale)  # in place: 6 bytes an entry here (16-bit and float32), not 10
        s += mask[:, None]
        return torch.softmax(s, dim=-1, dtype=torch.float32).sum(1)

    if head_chunk is None:
        t = head_probs(0, h)
    else:
        t = head_probs(0, min(h, head_chunk))
        for h0 in range(head_chunk, h, head_chunk):
            t += head_probs(h0, min(h, h0 + head_chunk))
    t = t / t.sum(-1, keepdim=True)
    p_index = torch.softmax(index, dim=-1, dtype=torch.float32)
    return (t * (torch.log(t + MEGATRON_EPS) - torch.log(p_index + MEGATRON_EPS))).sum(-1)


def _train_step(kl_of):
    """The training step of a per-row KL: the mean over rows (DSA's loss), its gradients to qi, ki, w."""

    def step(q, k, qi, ki, w, lse, topk):
        qi, ki, w = (t.detach().requires_grad_() for t in (qi, ki, w))
        loss = kl_of(q, k, qi, ki, w, lse, topk, reduction="mean")
        return (loss.detach(), *torch.autograd.grad(loss, (qi, ki, w)))

    return step


def _megatron(
    name: str, what: str, needs, head_chunk: int | None = None, compiled: str | None = None
) -> Provider:
    """The formula as a provider; needs = (what it must hold at the least, its bytes(case)): a case
    whose least exceeds the device's memory is refused before it runs (it would only run out)."""
    held, min_bytes = needs

    def make(case: IndexerCase):
        def kl(q, k, qi, ki, w, lse, topk, reduction="none"):
            out = megatron_indexer_kl(
                q, k, qi, ki, w, topk, scale=case.logit_scale, causal=case.causal, head_chunk=head_chunk
            )
            return out.mean() if reduction == "mean" else out

        if compiled is not None:
            torch._dynamo.reset()  # each measurement compiles afresh: its first call is the compilation
            kl = torch.compile(kl, backend=compiled, dynamic=False)
        return kl

    def why_not(case: IndexerCase, inputs) -> str | None:
        if case.dtype not in ("bfloat16", "float16"):
            return f"runs 16-bit inputs (its GEMMs in the inputs' dtype), not {case.dtype}"
        if inputs.q.is_cuda:
            need, total = min_bytes(case), torch.cuda.get_device_properties(inputs.q.device).total_memory
            if need > total:
                gib = lambda n: f"{n / 2**30:,.0f} GiB"
                return f"does not fit: {held} alone take {gib(need)}, the device has {gib(total)}"
        return None

    fwd = lambda case: functools.partial(make(case), reduction="none")
    train = lambda case: _train_step(make(case))
    return Provider(name, "baseline", what, fwd, train, why_not)


def _streamkl(backend: str) -> Provider:
    def make(case: IndexerCase):
        def kl(q, k, qi, ki, w, lse, topk, reduction="none"):
            try:
                return streamkl.indexer_kl(
                    q, k, qi, ki, w, lse=lse, scale=case.logit_scale, causal=case.causal, topk=topk,
                    reduction=reduction, backend=backend,
                )  # fmt: skip
            except ValueError as exc:  # the named backend cannot run these (valid) inputs
                if "cannot run these inputs" in str(exc):
                    raise Unsupported(f"backend not available: {exc}") from None
                raise

        return kl

    def why_not(case: IndexerCase, inputs) -> str | None:
        if backend == "reference" and inputs.q.is_cuda and case.logits > REFERENCE_MAX_LOGITS_CUDA:
            return (
                f"the reference backend (the slow oracle) forms B*H*Sq*Sk = {case.logits:.3g} teacher "
                f"logits; on a GPU it runs up to 2^33"
            )
        return None

    what = (
        f"`streamkl.indexer_kl(..., backend={backend!r})`, the lse given or not as the case says; "
        "train: reduction='mean', autograd of qi, ki, w"
    )
    fwd = lambda case: functools.partial(make(case), reduction="none")
    train = lambda case: _train_step(make(case))
    return Provider(f"streamkl-{backend}", "streamkl", what, fwd, train, why_not)


def all_providers(compile_backend: str = "inductor", head_chunk: int = HEAD_CHUNK) -> list[Provider]:
    formula = "Megatron-LM's DSA indexer loss formula (16-bit GEMMs, float32 softmax, 1e-10 in both logs)"
    teacher = lambda size: lambda case: case.logits * size  # bytes of (B, H, Sq, Sk) entries
    student = lambda size: lambda case: case.b * case.g * case.nq * case.nk * size  # of (B, G, Sq, Sk)
    chunked = (
        f"{formula}, eager, the teacher {head_chunk} heads at a time, their softmaxes summed into one "
        "(B, Sq, Sk) mixture; the index scores dense"
    )
    return [  # in the report's order
        *(_streamkl(name) for name in streamkl.BACKENDS),
        _megatron(
            "megatron-eager",
            f"{formula}, eager",
            ("its (B, H, Sq, Sk) 16-bit teacher scores and their float32 copy", teacher(6)),
        ),
        _megatron(
            "megatron-compile",
            f"{formula}, torch.compile ({compile_backend})",
            ("its (B, H, Sq, Sk) 16-bit teacher scores", teacher(2)),
            compiled=compile_backend,
        ),
        _megatron(
            "megatron-head-chunked",
            chunked,
            ("its (B, G, Sq, Sk) 16-bit index scores and their float32 copy", student(6)),
            head_chunk=head_chunk,
        ),
    ]
