"""Where a CTA of the cuda forward spends its fixed cost: an instrumented copy of kernels/kl_fwd.cu
(the shipped instantiation) writes clock64 stamps per CTA, and per SM the script reads consecutive
CTAs' phases (docs/cuda.md, "A CTA's fixed cost"). Measurement only: the stamps replace lse2.

    python benchmarks/cta_stamps.py [--json out.json]

Stamps (consumer 0's first thread unless named): entry (thread 0, after its work is known); Q
arrived; the first key tile arrived; the loop done; its rows written; the last consumer's rows
written; the producer's last load issued. Reported per CTA in cycles of its SM's clock, the median
over CTAs: the gap from the CTA before on the SM (its last stamp) to this one's entry, the wait
for Q, the wait from Q to the first key tile, cycles per key tile of the loop, the epilogue."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from streamkl.backends.cuda import _launch
from streamkl.testing import make_inputs

SLOTS = 12  # u64 stamps per CTA
SHIPPED_SOURCE = _launch.source


def instrumented_source() -> str:
    slot = f"((unsigned long long*)p.lse2)[(blockIdx.x + gridDim.x * blockIdx.z) * {SLOTS} + (K)]"
    macros = (
        f"#define STAMP_AS(K, V) ({slot} = (V))\n"
        "#define STAMP(K) { unsigned long long t_; "
        'asm volatile("mov.u64 %0, %%clock64;" : "=l"(t_)); STAMP_AS(K, t_); }'
    )
    entry = (
        '  if (tid == 0) { STAMP(0); unsigned sm_; asm("mov.u32 %0, %%smid;" : "=r"(sm_));'
        " STAMP_AS(7, sm_ | ((unsigned long long)w.n << 32)); }\n"
    )
    producer_end = "    return;\n  }\n  regs_inc<REG_CONS>();"
    edits = [
        ('#include "sm90.cuh"', '#include "sm90.cuh"\n' + macros),
        ("  p.lse2[o] = lse2;\n", "  (void)lse2;\n"),
        ("  mbar_wait(bar_q, 0);\n", "  mbar_wait(bar_q, 0);\n  if (tid == 0 && c == 0) STAMP(1);\n"),
        ("    mbar_wait(full + 8 * stage, phase);\n",
         "    mbar_wait(full + 8 * stage, phase);\n    if (i == 0 && tid == 0 && c == 0) STAMP(2);\n"),
        ("  finish(p, r, rows, sp.nq, lane, sp.out0, w.split);\n",
         "  if (tid == 0 && c == 0) STAMP(4);\n  finish(p, r, rows, sp.nq, lane, sp.out0, w.split);\n"
         "  if (tid == 0) { if (c == 0) STAMP(5); if (c == NWG - 1) STAMP(6); }\n"),
        ("  const int tid = threadIdx.x;\n", "  const int tid = threadIdx.x;\n" + entry),
        (producer_end, "    if (tid == 0) STAMP(9);\n" + producer_end),
    ]  # fmt: skip
    src = SHIPPED_SOURCE()
    for old, new in edits:
        if src.count(old) != 1:
            raise SystemExit(f"kl_fwd.cu changed: cannot place a stamp at {old.strip()!r}")
        src = src.replace(old, new)
    return src


def phases(d: int, n: int, causal: bool) -> dict:
    x = make_inputs(b=1, h=32, nq=n, nk=n, d1=d, d2=d, dtype=torch.bfloat16, device="cuda", seed=3)
    consts = dict(_launch.shipped(_launch.padded_dim(d), _launch.padded_dim(d), False), STAMPS=1)
    kw = dict(causal=causal, scale1=d**-0.5, scale2=d**-0.5, consts=consts)
    for _ in range(30):  # the clock settles under load
        _launch.forward(*x, **kw)
    torch.cuda.synchronize()
    # zeroed outputs: the CTAs that ran are the records with an entry stamp, whatever grid and
    # split count the launch chose
    out = tuple(torch.zeros(1, 32, n, device="cuda") for _ in range(3))
    _launch.forward(*x, **kw, out=out)
    slots = out[2].view(torch.int64).flatten()
    st = [s for s in slots[: slots.numel() // SLOTS * SLOTS].view(-1, SLOTS).cpu().tolist() if s[0]]
    ctas = len(st)
    splits = ctas // (-(-n // (64 * consts["NWG"])) * 32)
    by_sm: dict[int, list] = {}
    for s in st:
        by_sm.setdefault(s[7] & 0xFFFFFFFF, []).append(s)
    gap, q_wait, k_wait, tile, epilogue = [], [], [], [], []
    for ctas_on_sm in by_sm.values():
        ctas_on_sm.sort(key=lambda s: s[0])
        for a, b in zip(ctas_on_sm, ctas_on_sm[1:]):
            gap.append(b[0] - max(a[5], a[6], a[9]))
        for s in ctas_on_sm:
            q_wait.append(s[1] - s[0])
            k_wait.append(s[2] - s[1])
            if s[7] >> 32:
                tile.append((s[4] - s[2]) / (s[7] >> 32))
            epilogue.append(max(s[5], s[6]) - s[4])
    med = lambda v: float(statistics.median(v))  # noqa: E731
    # per SM: CTAs run and cycles per key tile (the hardware's dispatch gives a slower SM fewer)
    per_sm = [len(v) for v in by_sm.values()]
    sm_tile = [med([(s[4] - s[2]) / (s[7] >> 32) for s in v if s[7] >> 32]) for v in by_sm.values()]
    row = dict(d=d, n=n, causal=causal, splits=splits, ctas=ctas, key_tile=med(tile), gap=med(gap))
    row.update(q_wait=med(q_wait), first_key_tile_wait=med(k_wait), epilogue=med(epilogue))
    row.update(ctas_per_sm_min=min(per_sm), ctas_per_sm_max=max(per_sm))
    row.update(sm_key_tile_min=min(sm_tile), sm_key_tile_max=max(sm_tile))
    row["fixed"] = row["gap"] + row["q_wait"] + row["first_key_tile_wait"] + row["epilogue"]
    row["fixed_in_key_tiles"] = row["fixed"] / row["key_tile"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("cta_stamps.py times the cuda backend: it needs a CUDA GPU", file=sys.stderr)
        return 2
    instrumented = instrumented_source()
    _launch.source = lambda: instrumented  # the build, keyed on its source, is a build of its own
    shapes = [(128, 4096, False), (128, 8192, False), (128, 16384, False), (128, 8192, True),
              (64, 4096, False), (64, 8192, False)]  # fmt: skip
    rows = [phases(*s) for s in shapes]
    cols = ["key_tile", "gap", "q_wait", "first_key_tile_wait", "epilogue", "fixed", "fixed_in_key_tiles"]
    print(f"{'D':>4} {'N':>6} {'causal':>6} {'splits':>6} " + " ".join(f"{c:>20}" for c in cols))
    for r in rows:
        print(f"{r['d']:>4} {r['n']:>6} {str(r['causal']):>6} {r['splits']:>6} "
              + " ".join(f"{r[c]:>20.1f}" for c in cols))  # fmt: skip
    for r in rows:
        per_sm = f"CTAs per SM {r['ctas_per_sm_min']}-{r['ctas_per_sm_max']}"
        tile = f"cycles per key tile by SM {r['sm_key_tile_min']:.0f}-{r['sm_key_tile_max']:.0f}"
        print(f"{r['d']:>4} {r['n']:>6} {str(r['causal']):>6}: {per_sm}, {tile}")
    print("(cycles of the SM's clock, median over CTAs; B=1 H=32 bf16, the shipped build with stamps)")
    if args.json:
        json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
