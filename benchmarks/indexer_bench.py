"""The indexer_kl benchmark: `streamkl.indexer_kl` (the DSA indexer loss) against Megatron-LM's formula
eager, compiled and head-chunked, at DeepSeek-V3.2's shapes, dense and sparse (top-k), each provider's
error against float64 beside its time. The harness (timing, memory, failures, the GEMM yardstick,
results.json, results.md and plots) is benchmarks/bench.py's; the case, the inputs, the FLOPs and the
providers are benchmarks/indexer_providers.py's; docs/benchmarks/README.md (The indexer benchmark)
says how to run it and what its columns mean."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import streamkl
from benchmarks.bench import K, Op, Options, Prepared, Sweep, _sizes, add_run_flags, chosen_providers, execute
from benchmarks.indexer_providers import (
    HEAD_CHUNK,
    IndexerCase,
    IndexerInputs,
    all_providers,
    indexer_kl_bytes,
    indexer_kl_flops,
    make_inputs,
)
from streamkl.testing import rel_err

SWEEPS = {  # name: what it varies
    "dense": "Sq = Sk, every key a row sees",
    "sparse": "Sq = Sk, each row's top-k set of the keys it sees",
}
SIZES = [4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K]
# The float64 check of the whole case (the mean loss and every gradient, dki included) runs while
# B*H*Sq*Sk is at most this: 8K tokens at H = 128. Beyond, the last rows alone (their KL, dqi, dw).
FULL_CHECK_LOGITS = 2**33
GPU_COMMAND = "python benchmarks/indexer_bench.py --max-seconds 480"


def build_sweeps(names: list[str], args) -> list[Sweep]:
    """The sweeps named ('dense', or 'dense:4k+16k' for its own sizes, in that order; a sweep may be
    named twice, its sizes split to order the run) at their sizes (default --sizes, else 4K-128K),
    or in miniature on CPU (--smoke)."""
    if args.smoke:  # bf16 where the Megatron baselines run; float32 with the lse computed (streamkl only)
        shape = dict(b=1, h=4, hk=1, g=3, nq=64, nk=64, d=32, di=16, causal=True, scale=0.2)
        smoke = {
            "dense": [IndexerCase(dtype="bfloat16", **shape)],
            "sparse": [
                IndexerCase(dtype="bfloat16", topk=16, **shape),
                IndexerCase(dtype="float32", topk=16, lse="computed", **shape),
            ],
        }
        return [Sweep(name, SWEEPS[name], smoke[name]) for name in SWEEPS]
    causals = {"0": [False], "1": [True], "both": [True, False]}[args.causal]
    shape = dict(b=args.batch, h=args.heads, hk=args.kv_heads, g=args.index_heads, d=args.dim)
    shape.update(di=args.index_dim, scale=args.scale, dtype=args.dtype, lse=args.lse)
    sweeps = []
    for item in names:
        name, _, sizes = item.partition(":")
        sizes = _sizes(sizes.replace("+", ",")) if sizes else args.sizes or SIZES
        topk = args.topk if name == "sparse" else 0
        cases = [IndexerCase(nq=n, nk=n, causal=c, topk=topk, **shape) for c in causals for n in sizes]
        sweeps.append(Sweep(name, SWEEPS[name], cases))
    return sweeps


def parse_sweeps(text: str) -> list[str]:
    """--sweep's items ('all' is every sweep); ValueError naming an unknown sweep or size."""
    items = list(SWEEPS) if text == "all" else text.split(",")
    for item in items:
        name, _, sizes = item.partition(":")
        if name not in SWEEPS:
            raise ValueError(f"unknown sweep {name!r}; expected {', '.join(SWEEPS)} or all")
        if sizes:
            _sizes(sizes.replace("+", ","))
    return items


class IndexerReference:
    """The float64 answer: streamkl's reference backend on the case's last `rows` query rows (their
    KL, and the mean loss's dqi and dw there: a row's dqi and dw depend on that row alone), and on
    the whole case where its B*H*Sq*Sk teacher logits are at most `full_logits` (every row's KL,
    the loss, dqi, dki and dw whole). The keys stay in float64 up to 8 GiB, else in the inputs'
    dtype with float32 accumulation (the name says which)."""

    def __init__(self, case: IndexerCase, inputs: IndexerInputs, rows: int, full_logits: int):
        self.case, self.inputs, self.rows = case, inputs, max(1, min(rows, case.nq))
        self.full_logits = full_logits

    def _solve(self, rows: int) -> tuple:
        """(name, kl (B, rows), dqi, dki, dw) of the last `rows` rows, the gradients those of the
        mean loss over all the case's rows (dki only when rows is the whole case)."""
        q, k, qi, ki, w, lse, topk = self.inputs
        case, whole = self.case, rows == self.case.nq
        dtype = torch.float64 if (k.numel() + ki.numel()) * 8 <= 2**33 else q.dtype
        xq, xqi, xw = (t[:, :, -rows:].to(dtype) for t in (q, qi, w))
        xk, xki = k.to(dtype), ki.to(dtype).requires_grad_(whole)
        xqi, xw = xqi.requires_grad_(), xw.requires_grad_()
        xlse = None if lse is None else lse[:, :, -rows:].double()
        xtopk = None if topk is None else topk[:, -rows:]
        kl = streamkl.indexer_kl(
            xq, xk, xqi, xki, xw, lse=xlse, scale=case.logit_scale, causal=case.causal, topk=xtopk,
            reduction="none", backend="reference",
        )  # fmt: skip
        g = torch.full_like(kl, 1.0 / max(1, case.rows_seen))  # the mean's upstream gradient per row
        leaves = (xqi, xki, xw) if whole else (xqi, xw)
        grads = torch.autograd.grad(kl, leaves, g)
        dqi, dki, dw = grads if whole else (grads[0], None, grads[1])
        where = "all rows" if whole else f"last {rows} rows"
        name = f"streamkl-reference in {str(dtype).replace('torch.', '')}, {where}"
        return name, kl.detach(), dqi, dki, dw

    @functools.cached_property
    def answer(self) -> tuple | str:
        """_solve's answer (the whole case where it fits the budget), or why the reference failed."""
        whole = self.case.logits <= self.full_logits
        try:
            return self._solve(self.case.nq if whole else self.rows)
        except Exception as exc:  # noqa: BLE001 - the measurements go on without their check
            return f"reference: {type(exc).__name__}: {str(exc)[:300]}"

    def errors(self, out, mode: str) -> dict:
        """KL: max over the checked rows of |kl - ref| / max(1, |ref|) (forward), or the same of the
        mean loss (training step, with the whole case only); gradients: relative norm error, dqi and
        dw on the checked rows, dki with the whole case only (None: not checked)."""
        if isinstance(self.answer, str):
            return {"failed": self.answer}
        name, kl, dqi, dki, dw = self.answer
        rows = kl.shape[-1]
        rel = lambda got, ref: (
            ((got.double() - ref.double()).abs() / ref.double().abs().clamp_min(1.0)).max().item()
        )
        if mode == "fwd":
            return {"reference": name, "kl": rel(out[..., -rows:], kl)}
        loss, got_dqi, got_dki, got_dw = out
        whole = rows == self.case.nq
        errors = {"reference": name}
        errors["kl"] = rel(loss, kl.sum() / max(1, self.case.rows_seen)) if whole else None
        errors["dqi"] = rel_err(got_dqi[:, :, -rows:], dqi)
        errors["dki"] = rel_err(got_dki, dki) if whole else None
        errors["dw"] = rel_err(got_dw[:, :, -rows:], dw)
        if not whole:
            errors["unchecked"] = (
                f"the loss and dki: B*H*Sq*Sk = {self.case.logits:.3g} is over the whole-case check's "
                f"{self.full_logits:.3g}"
            )
        return errors


def prepare(case: IndexerCase, device: torch.device, opt: Options, full_logits: int = FULL_CHECK_LOGITS):
    """A case's inputs (the same for every mode: the training step's upstream gradient is the mean's)
    and its float64 check."""
    inputs = make_inputs(case, device, opt.seed)
    reference = IndexerReference(case, inputs, opt.check_rows, full_logits)
    both = {"fwd": inputs, "train": inputs}
    return Prepared(inputs, both, both, reference)


def op(full_logits: int = FULL_CHECK_LOGITS) -> Op:
    """indexer_kl for the harness (bench.Runner)."""
    return Op(
        "indexer_kl", indexer_kl_flops, indexer_kl_bytes, functools.partial(prepare, full_logits=full_logits)
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/indexer_bench.py",
        description="Time streamkl.indexer_kl (the DSA indexer loss) and Megatron-LM's formula eager, "
        "compiled and head-chunked, with their errors against float64; write results.json, "
        "results.md and plots. Defaults: DeepSeek-V3.2's shapes, causal, bf16 on a GPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--sweep",
        default="dense,sparse",
        help=f"comma list of {', '.join(SWEEPS)} (or all), each optionally with its own sizes in the "
        "order run: dense:4k+16k,sparse:64k",
    )
    p.add_argument("--smoke", action="store_true", help="both sweeps in miniature on CPU (CI)")
    p.add_argument("--sizes", type=_sizes, help="Sq = Sk of both sweeps, e.g. 4k,16k (default 4K-128K)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=128, help="teacher heads H")
    p.add_argument("--kv-heads", type=int, default=1, help="teacher key heads (1: MLA's absorbed MQA)")
    p.add_argument("--dim", type=int, default=576, help="teacher head dim D")
    p.add_argument("--scale", type=float, default=192**-0.5, help="teacher logit scale")
    p.add_argument("--index-heads", type=int, default=64, help="indexer heads G")
    p.add_argument("--index-dim", type=int, default=128, help="indexer head dim Di")
    p.add_argument("--topk", type=int, default=2048, help="K of the sparse sweep")
    lse = "pass streamkl the teacher's lse (as the attention forward returns it), or not"
    p.add_argument("--lse", choices=["given", "computed"], default="given", help=lse)
    p.add_argument(
        "--head-chunk", type=int, default=HEAD_CHUNK, help="teacher heads per megatron-head-chunked step"
    )
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: bf16 on GPU")
    p.add_argument("--causal", choices=["0", "1", "both"], default="1")
    p.add_argument("--full-check-logits", type=float, default=FULL_CHECK_LOGITS,
                   help="check the whole case against float64 up to this B*H*Sq*Sk")  # fmt: skip
    add_run_flags(p, "docs/benchmarks/<date>_<device>_indexer")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    try:
        names = parse_sweeps(args.sweep)
    except ValueError as exc:
        p.error(f"--sweep {args.sweep!r}: {exc}")
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    sweeps = build_sweeps(names, args)
    providers = all_providers("inductor" if cuda else "aot_eager", args.head_chunk)
    providers = chosen_providers(providers, args, p)
    config = {"op": "indexer_kl", "full_check_logits": int(args.full_check_logits)}
    return execute(
        "benchmarks/indexer_bench.py", argv, args, device, sweeps, providers,
        op=op(int(args.full_check_logits)), folder_suffix="_indexer", config=config,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
