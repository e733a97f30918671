"""Markdown, plots and the README's headline, from results.json (the data first, rendering second).

Merging runs and the README's generated block: docs/benchmarks/README.md (Outputs, The README's figures)."""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import sys
from pathlib import Path

SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
MODE_TITLE = {"fwd": "forward", "train": "training step (forward, then dq2 and dk2 with the teacher fixed)"}
INDEXER_MODE_TITLE = {
    "fwd": "forward",
    "train": "training step (the mean KL, then dqi, dki and dw; teacher fixed)",
}
N_SWEEPS = ("n", "dense", "sparse")  # sweeps over N = Nq = Nk: plotted against N
COLORS = {
    "streamkl-cuda": "tab:red",
    "streamkl-triton": "tab:blue",
    "streamkl-reference": "tab:cyan",
    "torch-bf16": "tab:orange",
    "torch.compile-bf16": "tab:green",
    "sdpa-trick-flash": "tab:purple",
    "sdpa-trick-cudnn": "tab:brown",
    "fla-fused-kl": "tab:gray",
    "torch-fp32": "tab:pink",
    "torch.compile-fp32": "tab:olive",
    "attention-cudnn": "black",
    "megatron-eager": "tab:orange",
    "megatron-compile": "tab:green",
    "megatron-head-chunked": "tab:purple",
}
README_BLOCK = re.compile(
    r"<!-- bench:headline:start (?P<path>\S+)(?: sweeps=(?P<sweeps>\S+))? -->\n"
    r"(?P<body>.*?)<!-- bench:headline:end -->",
    re.S,
)


def fmt_n(n: int) -> str:
    for unit, suffix in ((2**20, "M"), (2**10, "K")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def fmt_ms(ms: float) -> str:
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:,.0f}"


def is_indexer(c: dict) -> bool:
    """An indexer_kl case (benchmarks/indexer_providers.py), told from attn_kl's by its fields."""
    return "g" in c and "di" in c


def case_name(c: dict) -> str:
    size = fmt_n(c["nq"]) if c["nq"] == c["nk"] else f"{fmt_n(c['nq'])}x{fmt_n(c['nk'])}"
    labels = [c["label"]] if c.get("label") else []
    if is_indexer(c):
        labels = [f"top-{c['topk']}"] * bool(c["topk"]) + ["lse computed"] * (c["lse"] != "given") + labels
    label = "".join(f" {x}" for x in labels)
    return f"{size} {'causal' if c['causal'] else 'full'} {SHORT_DTYPE.get(c['dtype'], c['dtype'])}{label}"


def size_order(c: dict) -> tuple:
    """An indexer case's place in its sweep's tables: causal first, then dtype, lse, size."""
    return (not c["causal"], c["dtype"], c.get("lse", ""), c.get("topk", 0), c["nq"], c["nk"])


def shape_text(c: dict) -> str:
    """A sweep's fixed shape, for its section's title."""
    if not is_indexer(c):
        return f"B={c['b']}, H={c['h']}, D={c['d1']}"
    kv = "MQA" if c["hk"] == 1 else "MHA" if c["hk"] == c["h"] else f"{c['hk']} key heads"
    scale = c["scale"] if c["scale"] is not None else c["d"] ** -0.5
    return f"B={c['b']}, H={c['h']} ({kv}, D={c['d']}, scale {scale:.4g}), G={c['g']}, Di={c['di']}"


def time_cell(rec: dict) -> str:
    return fmt_ms(rec["ms"]) if rec["status"] == "ok" else {"oom": "OOM"}.get(rec["status"], rec["status"])


def error_cell(rec: dict | None) -> str:
    """KL error (forward), or KL / dq2 / dk2 errors (attn_kl's training step), or KL / dqi / dki / dw
    (indexer_kl's); "—" for one not checked."""
    err = (rec or {}).get("error") or {}
    if "kl" not in err:
        return "check failed" if "failed" in err else "—"
    keys = [k for k in ("kl", "dq2", "dk2", "dqi", "dki", "dw") if k in err]
    return " / ".join("—" if err[k] is None else f"{err[k]:.1e}" for k in keys)


def one_line(rec: dict) -> str:
    head = f"[{rec['sweep']}] {case_name(rec['case'])} {rec['provider']} {rec['mode']}"
    if rec["status"] != "ok":
        return f"{head}: {rec['status']} ({(rec.get('reason') or '')[:160]})"
    return f"{head}: {fmt_ms(rec['ms'])} ms, {rec['tflops']:.3g} TFLOP/s, error {error_cell(rec)}"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def load(path) -> dict:
    return json.loads(Path(path).read_text())


def merge(runs: list[dict]) -> dict:
    """One report of runs on one device: a later record of a measurement wins, except a later n/a."""
    devices = {r["environment"]["device"] for data in runs for r in data["runs"]}
    if len(devices) > 1:
        raise ValueError(f"refusing to merge runs from different devices: {sorted(devices)}")
    merged, by_key = {"schema": runs[0]["schema"], "runs": [], "records": []}, {}
    for data in runs:
        offset = len(merged["runs"])
        merged["runs"] += data["runs"]
        for rec in data["records"]:
            rec = {**rec, "run": rec.get("run", 0) + offset}
            key = (rec["sweep"], rec["case_key"], rec["provider"], rec["mode"])
            if rec["status"] != "n/a" or key not in by_key:
                by_key[key] = rec
    merged["records"] = list(by_key.values())
    return merged


def headline(data: dict, sweeps: list[str] | None = None) -> str:
    """Per case and mode: streamkl's fastest backend, the fastest non-fp32 baseline, the fp32 ones;
    sweeps: 'name' (every case) or 'name:size+size' (the sizes named, a case name's first word: 4K,
    16x32K) items, default every sweep."""
    names = sweeps or {r["sweep"] for r in data["records"]}
    keep = dict(s.partition(":")[::2] for s in names)  # sweep: its sizes ('4K+16K'), '' for all
    groups = collections.defaultdict(list)  # (sweep, case_key, mode) -> its records, as measured
    for r in data["records"]:
        groups[r["sweep"], r["case_key"], r["mode"]].append(r)
    if all(is_indexer(r["case"]) for r in data["records"]):  # a sweep may be run in pieces: by size
        sweeps_seen = list(dict.fromkeys(r["sweep"] for r in data["records"]))
        order = lambda item: (
            sweeps_seen.index(item[0][0]),
            size_order(item[1][0]["case"]),
            item[0][2] != "fwd",
        )
        groups = dict(sorted(groups.items(), key=order))
    rows = []
    for (sweep, _, mode), recs in groups.items():
        fastest = {}  # kind -> its fastest record (the first measured of equals)
        for r in sorted((r for r in recs if r["status"] == "ok"), key=lambda r: r["ms"]):
            fastest.setdefault(r["kind"], r)
        ours, base = fastest.get("streamkl"), fastest.get("baseline")
        if ours is None or sweep not in keep:
            continue
        if keep[sweep] and case_name(ours["case"]).split()[0] not in keep[sweep].split("+"):
            continue
        tried = sorted({time_cell(r) for r in recs if r["kind"] == "baseline" and r["status"] != "n/a"})
        named = base["provider"] if base else f"none ran ({', '.join(tried)})" if tried else "—"
        exact = ", ".join(f"{r['provider']} {time_cell(r)}" for r in recs if r["kind"] == "exact")
        mine = [ours["provider"].removeprefix("streamkl-"), fmt_ms(ours["ms"]), error_cell(ours)]
        speed_up = f"{base['ms'] / ours['ms']:.2f}x" if base else "—"
        theirs = [fmt_ms(base["ms"]), error_cell(base), speed_up] if base else ["—"] * 3
        rows.append([sweep, case_name(ours["case"]), mode, *mine, named, *theirs, exact or "—"])
    header = ["sweep", "case", "mode", "streamkl", "ms", "error", "fastest baseline", "ms", "error"]
    return table([*header, "speed-up", "fp32 baselines, ms (exact, not competitors)"], rows)


# The StreamKL paper's forward speed-ups over its baselines (torch.compile and FLA's fused KL), by mask.
PAPER_FWD_CLAIMS = {False: "2.4-3.7x", True: "4.2-7.1x"}
PAPER_BASELINES = ("torch.compile-bf16", "fla-fused-kl")


def paper_table(data: dict) -> str:
    """The paper's comparison rows beside this run's: per attn_kl case and mode, streamkl's fastest
    backend against torch.compile's dense formula and FLA's fused KL measured in the same run (a
    baseline that did not run shows why, shortened), with the paper's claimed forward range where
    the paper claims one (Nq = Nk)."""
    groups = collections.defaultdict(list)
    for r in data["records"]:
        if not is_indexer(r["case"]):
            groups[r["sweep"], r["case_key"], r["mode"]].append(r)
    rows = []
    for (sweep, _, mode), recs in groups.items():
        ok = [r for r in recs if r["kind"] == "streamkl" and r["status"] == "ok"]
        ok.sort(key=lambda r: r["ms"])
        if not ok:
            continue
        ours, cells = ok[0], []
        for name in PAPER_BASELINES:
            base = next((r for r in recs if r["provider"] == name), None)
            if base is None:
                cells += ["not run", "—"]
            elif base["status"] != "ok":
                why = (base.get("reason") or base["status"]).split(":")[0].split(".")[0]
                cells += [f"{time_cell(base)} ({why[:60]})", "—"]
            else:
                cells += [fmt_ms(base["ms"]), f"{base['ms'] / ours['ms']:.2f}x"]
        square = ours["case"]["nq"] == ours["case"]["nk"]  # the paper's claims are for Nq = Nk
        claim = PAPER_FWD_CLAIMS[ours["case"]["causal"]] if mode == "fwd" and square else "—"
        name = ours["provider"].removeprefix("streamkl-")
        rows.append([sweep, case_name(ours["case"]), mode, f"{name} {fmt_ms(ours['ms'])}", *cells, claim])
    header = ["sweep", "case", "mode", "streamkl, ms", "torch.compile, ms", "speed-up", "FLA, ms", "speed-up"]
    return table([*header, "paper's claim (fwd)"], rows)


SOFTWARE = {  # environment key: how the runs table names it (keys a run lacks are left out)
    "torch": "torch",
    "triton": "triton",
    "cuda_python": "cuda-python",
    "nvrtc": "NVRTC",
    "cuda": "CUDA",
    "cudnn": "cuDNN",
    "driver": "driver",
}


def software(env: dict) -> str:
    """The versions a run recorded, in one cell: 'torch 2.11.0, triton 3.6.0, ..., driver 570.1'."""
    return ", ".join(f"{name} {env[key]}" for key, name in SOFTWARE.items() if env.get(key) is not None)


def device_name(env: dict) -> str:
    """The card, with its compute capability where the run recorded one."""
    cap = env.get("capability")
    return f"{env['device']} (sm {cap})" if cap else env["device"]


PROVIDERS_TEXT = (
    "TFLOP/s count the useful GEMM work of the case (`benchmarks/providers.py`, "
    "`attn_kl_flops`), whatever a provider computes; % of GEMM is against the run's bf16 GEMM at its "
    "start. Errors are against float64 on the last query rows (KL: max over rows of |kl - ref| / max(1, "
    "|ref|); dq2 on those rows and dk2: relative norm error). "
)
COPY_TEXT = (
    " % of copy (the decode forward) is the inputs' bytes read once, and the KL written, against the "
    "run's device-to-device copy bandwidth."
)
INDEXER_PROVIDERS_TEXT = (
    "TFLOP/s count the GEMM work the method needs over the admitted pairs "
    "(`benchmarks/indexer_providers.py`, `indexer_kl_flops`: the teacher's 2*H*D once per pair, the "
    "student's 2*G*Di once in a forward and four times in a training step), whatever a provider "
    "computes; % of GEMM is against the run's bf16 GEMM at its start. Errors are against float64 "
    "(streamkl's reference backend): forward, the max over the checked rows of |kl - ref| / max(1, "
    "|ref|); training step (the mean KL over the rows, then its gradients), KL / dqi / dki / dw: the "
    "loss's error as the forward's and the gradients' relative norm errors, on the whole case where "
    "it is small enough (`--full-check-logits`), else dqi and dw on the last rows only (the loss and "
    "dki: —). "
)
MEMORY_TEXT = (
    "Peak extra memory (CUDA only) counts what one call allocates beyond what was allocated before it, "
    "its outputs included; the first call (compilation, autotuning) is never timed."
)
BEYOND_TEXT = (
    " Beyond outputs: the peak extra memory less the bytes of what the call returns (the KL, and in a "
    "training step the gradients), what it held besides its inputs and results."
)


def markdown(data: dict) -> str:
    records, runs, providers, sweeps = data["records"], [], {}, {}
    for i, run in enumerate(data["runs"]):
        providers.update(run["config"]["providers"])
        sweeps.update(run["config"]["sweeps"])
        env, gemm = run["environment"], run.get("gemm") or {}
        commit = (env.get("commit") or "unknown")[:12] + (" (dirty)" if env.get("dirty") else "")
        yard = " / ".join(f"{g['tflops']:.0f}" for g in (gemm.get("start"), gemm.get("end")) if g)
        copy = f"{run['copy']['gbps']:,.0f}" if run.get("copy") else "—"
        versions = software(env)
        command = f"`{' '.join(env['argv'])}`"
        runs.append([i, env["date"], f"`{commit}`", command, versions, yard or "— (CUDA only)", copy])
    device = data["runs"][0]["environment"]["device"]
    kinds = {r["provider"]: r["kind"] for r in records}
    runs_header = ["run", "date", "commit", "command", "software", "bf16 GEMM TFLOP/s, start / end"]
    runs_header.append("copy GB/s")
    indexer = any(is_indexer(r["case"]) for r in records)
    parts = [
        f"# streamkl benchmarks{' (indexer_kl)' * indexer}: {device}\n",
        f"Device: {device_name(data['runs'][0]['environment'])}.\n\n" + table(runs_header, runs),
        "## Providers\n\n"
        + (
            INDEXER_PROVIDERS_TEXT + MEMORY_TEXT + BEYOND_TEXT
            if indexer
            else PROVIDERS_TEXT + MEMORY_TEXT + COPY_TEXT
        )
        + "\n\n"
        + table(["provider", "kind", "what"], [[n, kinds.get(n, ""), w] for n, w in providers.items()]),
        "## Headline\n\nstreamkl's fastest backend against the fastest non-fp32 baseline measured "
        f"in the same run for the same case; errors {'KL / dqi / dki / dw' if indexer else 'KL / dq2 / dk2'}"
        ".\n\n" + headline(data),
    ]
    measured = [r for r in records if r["status"] != "n/a"]
    header = ["case", "provider", "ms", "TFLOP/s", "% of GEMM", "peak extra MiB", "error", "first call s"]
    for sweep, what in sweeps.items():
        if first := next((r["case"] for r in measured if r["sweep"] == sweep), None):
            parts.append(f"## Sweep `{sweep}`: {what} ({shape_text(first)})\n")
        for mode, title in (INDEXER_MODE_TITLE if indexer else MODE_TITLE).items():
            copy = sweep == "decode" and mode == "fwd"  # memory-bound: against the copy bandwidth
            here = [r for r in measured if (r["sweep"], r["mode"]) == (sweep, mode)]
            if indexer:  # a sweep may be run in pieces (indexer_bench.py --sweep dense:16k,dense:4k): by size
                here.sort(key=lambda r: size_order(r["case"]))
            if rows := [_sweep_row(data, r, copy, indexer) for r in here]:
                extra = ["% of copy"] * copy
                head = header[:6] + ["beyond outputs MiB"] * indexer + header[6:]
                parts.append(f"### {title}\n\n" + table(head + extra, rows))
    if not_run := collections.Counter((r["provider"], r["reason"]) for r in records if r["status"] == "n/a"):
        rows = [[p, reason, n] for (p, reason), n in not_run.items()]
        parts.append("## Not run\n\n" + table(["provider", "why", "measurements"], rows))
    if failed := [r for r in records if r["status"] == "error"]:
        rows = [
            [r["sweep"], case_name(r["case"]), r["provider"], r["mode"], r["reason"][:200]] for r in failed
        ]
        parts.append("## Errors\n\n" + table(["sweep", "case", "provider", "mode", "error"], rows))
    return "\n".join(parts)


def _sweep_row(data: dict, r: dict, copy: bool = False, beyond: bool = False) -> list[str]:
    """A sweep table's row; beyond: a column of the peak memory less the call's outputs (indexer_kl:
    what a call holds beyond the gradients it returns)."""
    head = [case_name(r["case"]), r["provider"], time_cell(r)]
    if r["status"] != "ok":
        return [*head, "—", "—", "—", *["—"] * beyond, error_cell(r), "—"] + ["—"] * copy
    run = data["runs"][r.get("run", 0)]
    gemm = ((run.get("gemm") or {}).get("start") or {}).get("tflops")
    of_gemm = f"{100 * r['tflops'] / gemm:.0f}%" if gemm else "—"  # against the run's GEMM at its start
    mem = "—" if r.get("mem_bytes") is None else f"{r['mem_bytes'] / 2**20:,.1f}"
    row = [*head, f"{r['tflops']:.3g}", of_gemm, mem]
    if beyond:
        known = r.get("mem_bytes") is not None and r.get("out_bytes") is not None
        row.append(f"{(r['mem_bytes'] - r['out_bytes']) / 2**20:,.1f}" if known else "—")
    row += [error_cell(r), f"{r['first_call_s']:.2f}"]
    if copy:  # GB/s of the bytes a forward must move, against the run's copy bandwidth
        gbps = (run.get("copy") or {}).get("gbps")
        row.append(f"{100 * r['bytes'] / r['ms'] / 1e6 / gbps:.0f}%" if gbps and r.get("bytes") else "—")
    return row


def plots(data: dict, out: Path) -> list[Path]:
    """TFLOP/s and time against N (the sweeps over N, a panel per mode, sweep and mask), error
    against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, name):
        for ax in fig.axes:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        return out / name

    records = data["records"]
    n_recs = [r for r in records if r["sweep"] in N_SWEEPS]
    modes = sorted({r["mode"] for r in n_recs})
    panel_of = lambda r: (N_SWEEPS.index(r["sweep"]), r["case"]["causal"], r["case"]["dtype"])
    masks = sorted({panel_of(r) for r in n_recs})
    gemms = [g["tflops"] for run in data["runs"] if (g := (run.get("gemm") or {}).get("start"))]
    written = []
    for name, quantity in (("tflops_vs_n.png", "tflops"), ("time_vs_n.png", "ms")) if n_recs else ():
        size = (4.6 * len(masks), 3.8 * len(modes))
        fig, axes = plt.subplots(len(modes), len(masks), figsize=size, squeeze=False)
        for (i, mode), (j, mask) in itertools.product(enumerate(modes), enumerate(masks)):
            recs = [r for r in n_recs if r["mode"] == mode and panel_of(r) == mask]
            _panel(axes[i][j], recs, quantity, gemms)
            sweep, causal, dtype = N_SWEEPS[mask[0]], mask[1], SHORT_DTYPE.get(mask[2], mask[2])
            title = f"{mode}, {'causal' if causal else 'full'}, {dtype}"
            axes[i][j].set_title(title if sweep == "n" else f"{sweep}: {title}")
        written.append(save(fig, name))
    fwd = [r for r in records if (r["mode"], r["status"]) == ("fwd", "ok") and "kl" in r.get("error", {})]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for prov in dict.fromkeys(r["provider"] for r in fwd):
        pts = [(r["ms"], max(r["error"]["kl"] or 0.0, 1e-17)) for r in fwd if r["provider"] == prov]
        ax.scatter(*zip(*pts), s=12, color=COLORS.get(prov), label=prov)
    ax.set(xscale="log", yscale="log", xlabel="forward ms", ylabel="KL error against float64")
    ax.set_title("forward: error against time, every sweep", fontsize=9)
    return [*written, save(fig, "error_vs_time.png")]


def _panel(ax, recs: list[dict], quantity: str, gemms: list[float]) -> None:
    """A line per provider; for time, out-of-memory cases as crosses on the upper edge (log axes)."""
    for prov in dict.fromkeys(r["provider"] for r in recs):
        mine = [r for r in recs if r["provider"] == prov]
        pts = sorted((r["case"]["nq"], r[quantity]) for r in mine if r["status"] == "ok")
        style = dict(color=COLORS.get(prov), ls="--" if prov == "attention-cudnn" else "-")
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3, label=prov, **style)
        ooms = [r["case"]["nq"] for r in mine if r["status"] == "oom"]
        if ooms and quantity == "ms":
            ax.plot(ooms, [0.95] * len(ooms), "x", color=style["color"], transform=ax.get_xaxis_transform())
    if quantity == "ms":
        ax.set_yscale("log")
        if any(r["status"] == "oom" for r in recs):
            ax.plot([], [], "x", color="gray", label="out of memory")
    for i, tflops in enumerate(gemms if quantity == "tflops" else ()):
        ax.axhline(tflops, color="gray", ls=":", label=None if i else "bf16 GEMM")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="N = Nq = Nk", ylabel="TFLOP/s" if quantity == "tflops" else "ms")


def render(data: dict, out, with_plots: bool = True) -> list[Path]:
    """results.md (and the PNGs) into `out`; the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(markdown(data))
    try:
        return [out / "results.md", *(plots(data, out) if with_plots else [])]
    except ImportError as exc:  # matplotlib missing: the JSON and the tables are the record
        print(f"no plots: {exc}", flush=True)
        return [out / "results.md"]


def readme_block(path: str, sweeps: str | None, data: dict) -> str:
    start = f"<!-- bench:headline:start {path}" + (f" sweeps={sweeps}" if sweeps else "") + " -->"
    return f"{start}\n{headline(data, sweeps.split(',') if sweeps else None)}<!-- bench:headline:end -->"


def update_readme(readme: Path, json_path: Path, sweeps: str | None = None) -> None:
    """Rewrite README's headline blocks that name json_path (or its only block), each with its own
    sweeps, or with `sweeps` where exactly one block is rewritten."""
    text = readme.read_text()
    path = Path(os.path.relpath(json_path, readme.parent)).as_posix()
    blocks = list(README_BLOCK.finditer(text))
    named = [b for b in blocks if b["path"] == path] or (blocks if len(blocks) == 1 else [])
    if not named or (sweeps and len(named) > 1):
        markers = "'<!-- bench:headline:start ... -->' ... '<!-- bench:headline:end -->'"
        want = "one" if sweeps else "a"
        raise SystemExit(f"{readme}: expected {want} {markers} block (naming {path}), found {len(named)}")
    data = load(json_path)
    for b in reversed(named):  # later spans first, so earlier offsets stay valid
        text = text[: b.start()] + readme_block(path, sweeps or b["sweeps"], data) + text[b.end() :]
    readme.write_text(text)


def stale_readme_blocks(readme: Path) -> list[str]:
    """The JSON paths of README's headline blocks that differ from what their JSON generates."""
    fresh = lambda b: readme_block(b["path"], b["sweeps"], load(readme.parent / b["path"]))
    return [b["path"] for b in README_BLOCK.finditer(readme.read_text()) if b[0] != fresh(b)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/report.py", description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="results.json of benchmarks/bench.py; several are merged")
    p.add_argument("--out", help="folder for results.md and the PNGs (default: the JSON's folder)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--readme", help="rewrite this README's headline block from the JSON instead")
    p.add_argument("--paper", action="store_true", help="print the paper-comparison table of the JSON")
    p.add_argument(
        "--sweeps",
        help="with --readme: the sweeps the headline shows, e.g. n,decode or n:4K+16K,decode:16x32K",
    )
    args = p.parse_args(argv)
    paths = [Path(j) for j in args.json]
    if args.paper:
        print(paper_table(merge([load(path) for path in paths])), end="")
        return 0
    if args.readme:
        if len(paths) != 1:
            p.error("--readme takes one JSON (merge runs into one first)")
        update_readme(Path(args.readme), paths[0], args.sweeps)
        return 0
    if len(paths) > 1 and not args.out:
        p.error("merging runs needs --out, the folder of the merged results.json")
    data = merge([load(path) for path in paths])
    out = Path(args.out) if args.out else paths[0].parent
    if len(paths) > 1:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(data, indent=1))
    for path in render(data, out, with_plots=not args.no_plots):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
