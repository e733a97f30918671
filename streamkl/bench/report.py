"""Markdown tables and PNG plots from a results.json (data first, rendering second).

python -m streamkl.bench.report docs/benchmarks/<run>/results.json [--out DIR] [--no-plots]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

STREAMKL_ORDER = ("streamkl-cuda", "streamkl-triton", "streamkl-reference")
BASELINE_ORDER = ("torch", "torch.compile", "gemm")
SETTING_TITLE = {
    "q2k2": "setting 1 (teacher fixed: dq2, dk2)",
    "q1k1": "setting 2 (target fixed: dq1, dk1)",
    "all": "both settings (all four gradients)",
}


# ----------------------------------------------------------------------------- formatting
def _ms(x) -> str:
    if x is None:
        return "—"
    if x < 1:
        return f"{x:.3f}"
    if x < 100:
        return f"{x:.2f}"
    return f"{x:,.0f}"


def _mem(b) -> str:
    if b is None:
        return "—"
    if b < 2**20:
        return f"{b / 2**10:.0f} KiB"
    if b < 2**30:
        return f"{b / 2**20:.1f} MiB"
    return f"{b / 2**30:.2f} GiB"


def _n(n: int) -> str:
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


def _tf(x) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.3g}"


def _x(num, den) -> str:
    if num is None or den is None or num <= 0:
        return "—"
    return f"{den / num:.1f}x"


def _table(header: list[str], rows: list[list[str]]) -> str:
    if not rows:
        return "_no data_\n"
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


class Results:
    def __init__(self, data: dict):
        self.data = data
        self.results = data.get("results", [])
        y = data.get("gemm_yardstick") or {}
        self.gemm_tflops = y.get("tflops")

    def get(self, sweep, provider, case_filter, mode, setting=None, variant=""):
        for r in self.results:
            if (
                r["sweep"] == sweep
                and r["provider"] == provider
                and r["mode"] == mode
                and r.get("setting") == setting
                and (r.get("variant") or "") == variant
                and case_filter(r["case"])
            ):
                return r
        return None

    def providers(self, sweep, ok_only=True):
        seen = []
        for r in self.results:
            if r["sweep"] == sweep and (r["status"] == "ok" or not ok_only) and r["provider"] not in seen:
                seen.append(r["provider"])
        order = {p: i for i, p in enumerate(STREAMKL_ORDER + BASELINE_ORDER)}
        return sorted(seen, key=lambda p: order.get(p, 99))

    def cell(self, r, what="ms") -> str:
        if r is None:
            return "—"
        st = r["status"]
        if st == "ok":
            if what == "ms":
                txt = _ms(r["ms"])
                chk = r.get("check") or {}
                if chk.get("kl_ok") is False or chk.get("grad_ok") is False:
                    txt += " (!)"
                return txt
            if what == "mem":
                return _mem(r.get("mem_extra_bytes"))
            if what == "tflops":
                return _tf(r["tflops"]) if r.get("tflops") is not None else "—"
            if what == "frac":
                return (
                    f"{100 * r['tflops'] / self.gemm_tflops:.0f}%"
                    if r.get("tflops") and self.gemm_tflops
                    else "—"
                )
        if st == "oom":
            return "OOM"
        if st == "unsupported":
            return "n/a"
        if st == "skipped":
            return "skip"
        return "error"

    @staticmethod
    def ms(r):
        return r["ms"] if r is not None and r["status"] == "ok" else None


# ----------------------------------------------------------------------------- markdown
def render_markdown(data: dict) -> str:
    R = Results(data)
    meta = data.get("meta", {})
    dev = meta.get("device", {})
    parts = [f"# streamkl benchmarks: {dev.get('name', '?')}, {meta.get('date', '?')}\n"]
    parts.append(_header(data))
    parts.append(_summary(R))
    primaries = [p for p in STREAMKL_ORDER if p in R.providers("n")]
    if primaries:
        parts.append("## Sequence length (sweep `n`)\n")
        c0 = next((r["case"] for r in R.results if r["sweep"] == "n"), {})
        y0 = data.get("gemm_yardstick") or {}
        parts.append(
            f"B={c0.get('b')}, H={c0.get('h')}, D={c0.get('d1')}, {c0.get('dtype')}, "
            "Nq = Nk = N. Speed-up = baseline time / streamkl time. TFLOP/s on the "
            "count of `streamkl/bench/flops.py`; % of GEMM = fraction of the "
            f"{y0.get('m', '?')}^3 GEMM measured in this run; OOM = out of memory "
            "(at this N or a smaller one); skip = projected too slow or out of time "
            "budget; (!) = failed its correctness check.\n"
        )
        for prov in primaries:
            parts.append(_speed_table(R, "n", prov, "fwd", None, "Forward"))
            for setting in ("q2k2", "q1k1", "all"):
                if any(r["sweep"] == "n" and r.get("setting") == setting for r in R.results):
                    parts.append(
                        _speed_table(R, "n", prov, "bwd", setting, f"Backward, {SETTING_TITLE[setting]}")
                    )
        parts.append(_memory_table(R, "n"))
    parts.append(_decode_table(R))
    parts.append(_bwd_strategy_table(R))
    parts.append(_shapes_table(R))
    parts.append(_long_table(R))
    parts.append(_compile_table(R))
    parts.append(_check_table(R))
    parts.append(_failures(R))
    parts.append(_all_results(R))
    return "\n".join(p for p in parts if p)


def _summary(R) -> str:
    """A few sentences read off the tables: the headline speed-ups, where the dense baselines
    run out of memory, the long-context figures, and anything that failed."""
    lines = []
    prim = next(
        (p for p in STREAMKL_ORDER if p in R.providers("n") and p != "streamkl-reference"), None
    ) or next((p for p in STREAMKL_ORDER if p in R.providers("n")), None)
    if prim:
        for mode, setting, what in (("fwd", None, "forward"), ("bwd", "q2k2", "backward (setting 1)")):
            for causal in (False, True):
                best = None
                for _c, nq, _nk, _ in _cases(R, "n"):
                    f = _same_nc(nq, causal)
                    s = R.ms(R.get("n", prim, f, mode, setting))
                    c = R.ms(R.get("n", "torch.compile", f, mode, setting))
                    t = R.ms(R.get("n", "torch", f, mode, setting))
                    if s and (c or t):
                        best = (nq, s, c, t, R.get("n", prim, f, mode, setting))
                if best:
                    nq, sm, cm, tm, rec = best
                    vs = ", ".join(
                        x
                        for x in (
                            f"{cm / sm:.1f}x torch.compile" if cm else "",
                            f"{tm / sm:.1f}x PyTorch" if tm else "",
                        )
                        if x
                    )
                    frac = f" ({R.cell(rec, 'frac')} of the GEMM)" if R.gemm_tflops else ""
                    lines.append(
                        f"- {prim} {what}, {'causal' if causal else 'non-causal'}, "
                        f"N={_n(nq)} (largest N with a baseline): {_ms(sm)} ms, {vs}; "
                        f"{R.cell(rec, 'tflops')} TFLOP/s{frac}."
                    )
    for base in ("torch", "torch.compile"):
        ooms = [
            r for r in R.results if r["provider"] == base and r["status"] == "oom" and not r.get("implied")
        ]
        if ooms:
            first = min(ooms, key=lambda r: r["case"]["nq"] * r["case"]["nk"])
            c = first["case"]
            lines.append(
                f"- {base} first ran out of memory at Nq={_n(c['nq'])}, Nk={_n(c['nk'])} "
                f"({first['mode']}{' ' + first['setting'] if first.get('setting') else ''}, "
                f"sweep {first['sweep']}); larger problems are recorded as OOM untried."
            )
    for r in R.results:
        if r["sweep"] == "long" and r["status"] == "ok" and r["provider"].startswith("streamkl"):
            c = r["case"]
            lines.append(
                f"- {r['provider']} {r['mode']}{' ' + r['setting'] if r.get('setting') else ''} "
                f"at {_n(c['nq'])} tokens{' causal' if c['causal'] else ''}: {_ms(r['ms'])} ms, "
                f"peak extra memory {_mem(r.get('mem_extra_bytes'))}."
            )
    counts = defaultdict(int)
    for r in R.results:
        counts[r["status"]] += 1
    bad = sum(
        1
        for r in R.results
        if r["status"] == "ok"
        and ((r.get("check") or {}).get("kl_ok") is False or (r.get("check") or {}).get("grad_ok") is False)
    )
    lines.append(
        "- measurements: "
        + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        + f"; {bad} over the error budget."
    )
    return "## Summary\n\n" + "\n".join(lines) + "\n"


def _header(data: dict) -> str:
    meta, cfg = data.get("meta", {}), data.get("config", {})
    dev, ver, git = meta.get("device", {}), meta.get("versions", {}), meta.get("git", {})
    y0, y1 = data.get("gemm_yardstick") or {}, data.get("gemm_yardstick_end") or {}
    if dev.get("type") == "cuda":
        sm = str(dev.get("capability", "")).replace(".", "")
        devtxt = (
            f"{dev.get('name')} ({dev.get('sm_count')} SMs, sm_{sm}, "
            f"{_mem(dev.get('total_memory_bytes'))}, L2 {_mem(dev.get('l2_cache_bytes'))}, "
            f"driver {dev.get('driver')}, CUDA {dev.get('cuda_runtime')})"
        )
    else:
        devtxt = f"CPU: {dev.get('name')} ({dev.get('threads')} threads)"
    sw = ", ".join(f"{k} {v}" for k, v in ver.items() if k != "torch_runtime")
    gemm = "—"
    if y0.get("tflops"):
        gemm = f"{y0['m']}^3 {y0['dtype']}: {_tf(y0['tflops'])} TFLOP/s at the start"
        if y1.get("tflops"):
            gemm += f", {_tf(y1['tflops'])} at the end"
        gemm += f" ({y0.get('timer')})"
    commit = git.get("commit") or "unknown"
    if git.get("dirty"):
        commit += " (with uncommitted changes)"
    preset = (
        f"{cfg.get('preset')} (sweeps {', '.join(cfg.get('sweeps', []))}); "
        f"time budget {cfg.get('time_budget_s')} s; ran {meta.get('elapsed_s')} s"
        + ("; **stopped by the hard timeout**" if meta.get("hard_timeout") else "")
    )
    merged = meta.get("merged_runs") or []
    if merged:  # one row per run: its own commit, date and GEMM; the header's are the first run's

        def _run(m):
            gem = f", GEMM {_tf(m['gemm_tflops'])} TFLOP/s" if m.get("gemm_tflops") else ""
            return (
                f"`{' '.join(m.get('argv') or [])}` (commit `{(m.get('git') or {}).get('commit')}`, "
                f"{m.get('time_utc')}{gem})"
            )

        commits = dict.fromkeys(str((m.get("git") or {}).get("commit")) for m in merged)
        commit = ", ".join(commits)
        command = "<br>".join(_run(m) for m in merged)
        preset = f"{len(merged)} runs merged (python -m streamkl.bench.report); the first: {preset}"
    else:
        commit = f"`{commit}`"
        command = "`" + " ".join(meta.get("argv", [])) + "`"
    rows = [
        ["device", devtxt],
        ["software", f"python {meta.get('python')}, {sw}"],
        ["commit", commit],
        [
            "date",
            meta.get("time_utc", "?")
            if not merged
            else " to ".join(
                dict.fromkeys(
                    [
                        min(m.get("time_utc") or "?" for m in merged),
                        max(m.get("time_utc") or "?" for m in merged),
                    ]
                )
            ),
        ],
        ["command", command],
        ["preset", preset],
        ["GEMM yardstick", gemm],
        [
            "baselines",
            f"`torch`: streamkl.testing.dense_attn_kl in float32 (TF32 "
            f"{'on' if cfg.get('tf32') else 'off'}), both Nq x Nk matrices "
            f"materialized; `torch.compile`: the same function, backend "
            f"{cfg.get('compile_backend')}, static shapes, compile time excluded from "
            "timing and reported below; `gemm`: a square GEMM of the same FLOPs",
        ],
        [
            "timing",
            "median; warm-up excluded; L2 flushed (do_bench) and inputs rotated when a "
            "set fits in L2; every provider checked against a reference before timing",
        ],
        [
            "memory",
            "peak allocated during one call minus what was allocated before it, minus "
            "the outputs and gradients it returns",
        ],
    ]
    return _table(["", ""], rows)


def _same_nc(n, causal):
    return lambda c: c["nq"] == n and c["nk"] == n and c["causal"] == causal


def _cases(R: Results, sweep: str):
    seen = []
    for r in R.results:
        if r["sweep"] == sweep:
            c = r["case"]
            key = (c["causal"], c["nq"], c["nk"], c.get("label", ""))
            if key not in seen:
                seen.append(key)
    return sorted(seen)


def _speed_table(R, sweep, prov, mode, setting, title) -> str:
    rows = []
    for causal, nq, _nk, _ in _cases(R, sweep):
        f = _same_nc(nq, causal)
        s = R.get(sweep, prov, f, mode, setting)
        if s is None:
            continue
        t = R.get(sweep, "torch", f, mode, setting)
        c = R.get(sweep, "torch.compile", f, mode, setting)
        gm = R.get(sweep, "gemm", f, mode, setting)
        rows.append(
            [
                _n(nq),
                "yes" if causal else "no",
                R.cell(t),
                R.cell(c),
                R.cell(s),
                _x(R.ms(s), R.ms(t)),
                _x(R.ms(s), R.ms(c)),
                R.cell(s, "tflops"),
                R.cell(s, "frac"),
                R.cell(gm),
            ]
        )
    if not rows:
        return ""
    return f"### {title}: {prov}\n\n" + _table(
        [
            "N",
            "causal",
            "PyTorch ms",
            "torch.compile ms",
            f"{prov} ms",
            "vs PyTorch",
            "vs torch.compile",
            "TFLOP/s",
            "% of GEMM",
            "GEMM same FLOPs ms",
        ],
        rows,
    )


def _memory_table(R, sweep) -> str:
    provs = [p for p in R.providers(sweep, ok_only=False) if p != "gemm"]
    modes = []
    for r in R.results:
        if r["sweep"] == sweep and (r["mode"], r.get("setting")) not in modes:
            modes.append((r["mode"], r.get("setting")))
    if not any(r["sweep"] == sweep and r.get("mem_extra_bytes") is not None for r in R.results):
        return "### Peak extra memory\n\n_not tracked on this device (CUDA only)_\n"
    provs = [
        p
        for p in provs
        if any(r["sweep"] == sweep and r["provider"] == p and r["status"] in ("ok", "oom") for r in R.results)
    ]
    rows = []
    for causal, nq, _nk, _ in _cases(R, sweep):
        for mode, setting in modes:
            cells = [R.cell(R.get(sweep, p, _same_nc(nq, causal), mode, setting), "mem") for p in provs]
            if all(c == "—" for c in cells):
                continue
            rows.append(
                [_n(nq), "yes" if causal else "no", mode + (f" {setting}" if setting else ""), *cells]
            )
    if not rows:
        return ""
    return (
        "### Peak extra memory\n\nBeyond inputs, outputs and gradients (forward: no "
        "gradients required; bwd: a whole forward + backward of that setting).\n\n"
        + _table(["N", "causal", "mode", *provs], rows)
    )


def _variant_rows(R, sweep, key_fn):
    groups = defaultdict(dict)
    order = []
    for r in R.results:
        if r["sweep"] != sweep:
            continue
        k = key_fn(r)
        if k not in groups:
            order.append(k)
        name = r["provider"] + (f" [{r['variant']}]" if r.get("variant") else "")
        groups[k][name] = r
    cols = []
    for r in R.results:
        if r["sweep"] == sweep:
            name = r["provider"] + (f" [{r['variant']}]" if r.get("variant") else "")
            if name not in cols:
                cols.append(name)
    return order, groups, cols


def _decode_table(R) -> str:
    if not any(r["sweep"] == "decode" for r in R.results):
        return ""
    order, groups, cols = _variant_rows(
        R, "decode", lambda r: (r["case"]["causal"], r["case"]["nk"], r["case"]["nq"])
    )
    rows = []
    for k in sorted(order):
        g = groups[k]
        off = R.ms(g.get("streamkl-triton [split_k=off]"))
        forced = [
            (name, R.ms(r))
            for name, r in g.items()
            if name.startswith("streamkl-triton [split_k=") and name.split("=")[1][:-1].isdigit() and R.ms(r)
        ]
        best = min(forced, key=lambda t: t[1]) if forced else None
        auto = R.ms(g.get("streamkl-triton [split_k=auto]"))
        rows.append(
            [
                _n(k[2]),
                _n(k[1]),
                "yes" if k[0] else "no",
                *[R.cell(g.get(c)) for c in cols],
                (f"{_x(best[1], off)} ({best[0].split('=')[1][:-1]} splits)" if best and off else "—"),
                _x(auto, off),
            ]
        )
    return (
        "## Decode: small Nq, long Nk (sweep `decode`)\n\nForward ms. Split-K set by "
        "`STREAMKL_TRITON_SPLIT_K` (off, a forced number of key splits, or auto = the "
        "backend's rule); speed-ups are over split-K off.\n\n"
        + _table(["Nq", "Nk", "causal", *cols, "best forced split", "auto"], rows)
    )


def _bwd_strategy_table(R) -> str:
    if not any(r["sweep"] == "bwd-strategy" for r in R.results):
        return ""
    order, groups, cols = _variant_rows(
        R,
        "bwd-strategy",
        lambda r: (r["case"]["causal"], r["case"]["nk"], r["case"]["nq"], r.get("setting") or ""),
    )
    rows = []
    for k in sorted(order):
        g = groups[k]
        fused = g.get("streamkl-triton [bwd=fused]")
        sep = g.get("streamkl-triton [bwd=separate]")
        auto = g.get("streamkl-triton [bwd=auto]")
        pick = "—"
        if R.ms(auto) and R.ms(fused) and R.ms(sep):
            pick = "fused" if abs(R.ms(auto) - R.ms(fused)) <= abs(R.ms(auto) - R.ms(sep)) else "separate"
        rows.append(
            [
                _n(k[2]),
                _n(k[1]),
                "yes" if k[0] else "no",
                k[3],
                *[R.cell(g.get(c)) for c in cols],
                _x(R.ms(fused), R.ms(sep)),
                pick,
            ]
        )
    return (
        "## Fused versus separate backward (sweep `bwd-strategy`)\n\nBackward ms via "
        "`STREAMKL_TRITON_BWD`; 'fused speed-up' = separate / fused; 'auto ~' = the strategy "
        "whose time auto's is closest to.\n\n"
        + _table(["Nq", "Nk", "causal", "setting", *cols, "fused speed-up", "auto ~"], rows)
    )


def _shapes_table(R) -> str:
    if not any(r["sweep"] == "shapes" for r in R.results):
        return ""
    order, groups, cols = _variant_rows(
        R,
        "shapes",
        lambda r: (r["case"].get("label", ""), r["case"]["causal"], r["mode"], r.get("setting") or ""),
    )
    prim = next((p for p in STREAMKL_ORDER if p in R.providers("shapes")), None)
    rows = []
    for k in order:
        g = groups[k]
        c = next(iter(g.values()))["case"]
        shape = (
            f"{k[0]}: H={c['h']}, Hk={c.get('hk1') or c['h']}/{c.get('hk2') or c['h']}, "
            f"D={c['d1']}/{c['d2']}, N={_n(c['nq'])}"
        )
        extra = []
        if prim:
            s = g.get(prim)
            extra = [R.cell(s, "tflops"), R.cell(s, "frac"), _x(R.ms(s), R.ms(g.get("torch")))]
        rows.append(
            [
                shape,
                "yes" if k[1] else "no",
                k[2] + (f" {k[3]}" if k[3] else ""),
                *[R.cell(g.get(c)) for c in cols],
                *extra,
            ]
        )
    head = ["shape", "causal", "mode", *cols]
    if prim:
        head += [f"{prim} TFLOP/s", "% of GEMM", "vs PyTorch"]
    return "## D1 != D2 and GQA (sweep `shapes`)\n\nms per call.\n\n" + _table(head, rows)


def _long_table(R) -> str:
    rs = [r for r in R.results if r["sweep"] == "long"]
    if not rs:
        return ""
    rows = []
    for r in rs:
        c = r["case"]
        rows.append(
            [
                _n(c["nq"]),
                "yes" if c["causal"] else "no",
                r["mode"] + (f" {r['setting']}" if r.get("setting") else ""),
                r["provider"],
                R.cell(r),
                R.cell(r, "tflops"),
                R.cell(r, "frac"),
                R.cell(r, "mem"),
                (r.get("timer") or r.get("reason") or "")[:90],
            ]
        )
    c0 = rs[0]["case"]
    return (
        "## Long context (sweep `long`)\n\n"
        f"B={c0['b']}, H={c0['h']}, D={c0['d1']}, {c0['dtype']}, Nq = Nk = N; fwd+bwd = one "
        "forward and one backward (q2k2: the teacher fixed); peak extra memory beyond inputs, "
        "output and gradients.\n\n"
        + _table(
            [
                "N",
                "causal",
                "mode",
                "provider",
                "ms",
                "TFLOP/s",
                "% of GEMM",
                "peak extra memory",
                "timer / reason",
            ],
            rows,
        )
    )


def _compile_table(R) -> str:
    rs = [r for r in R.results if r["provider"] == "torch.compile" and r["status"] == "ok"]
    if not rs:
        return ""
    rows = [
        [
            r["sweep"],
            _n(r["case"]["nq"]),
            _n(r["case"]["nk"]),
            "yes" if r["case"]["causal"] else "no",
            r["mode"] + (f" {r['setting']}" if r.get("setting") else ""),
            f"{r.get('compile_s') or 0:.1f}",
            _ms(r["ms"]),
        ]
        for r in rs
    ]
    return (
        "## torch.compile: compile time\n\nWall time of the first call (compilation "
        "included; dynamo reset before each measurement), excluded from the timings.\n\n"
        + _table(["sweep", "Nq", "Nk", "causal", "graph", "first call s", "steady ms"], rows)
    )


def _check_table(R) -> str:
    agg = {}
    for r in R.results:
        chk = r.get("check")
        if r["status"] != "ok" or not chk or "kl_err" not in chk:
            continue
        a = agg.setdefault(r["provider"], {"n": 0, "fail": 0, "kl": 0.0, "grad": 0.0, "refs": set()})
        a["n"] += 1
        a["kl"] = max(a["kl"], chk["kl_err"])
        a["grad"] = max([a["grad"], *chk.get("grad_err", {}).values()])
        a["refs"].add(chk["reference"].split(" (")[0])
        if chk.get("kl_ok") is False or chk.get("grad_ok") is False:
            a["fail"] += 1
    if not agg:
        return ""
    rows = [
        [p, a["n"], f"{a['kl']:.2e}", f"{a['grad']:.2e}", a["fail"], ", ".join(sorted(a["refs"]))]
        for p, a in agg.items()
    ]
    return (
        "## Correctness checks\n\nEach measurement's first call against a reference on the "
        "last query rows (budgets: KL per row relative to max(1,|ref|); "
        "gradients relative norm).\n\n"
        + _table(["provider", "checked", "max KL err", "max grad err", "over budget", "reference"], rows)
    )


def _failures(R) -> str:
    rs = [r for r in R.results if r["status"] == "error"]
    if not rs:
        return ""
    rows = [
        [
            r["sweep"],
            r["case_key"],
            r["provider"] + (f" [{r['variant']}]" if r.get("variant") else ""),
            r["mode"] + (f" {r['setting']}" if r.get("setting") else ""),
            (r.get("reason") or "").splitlines()[0][:160].replace("|", "/"),
        ]
        for r in rs
    ]
    return "## Errors\n\n" + _table(["sweep", "case", "provider", "mode", "error"], rows)


def _all_results(R) -> str:
    rows = []
    for r in R.results:
        c = r["case"]
        gqa = c.get("hk1") or c.get("hk2")
        shape = (
            f"{_n(c['nq'])}x{_n(c['nk'])} H={c['h']}"
            + (f"/{c.get('hk1') or c['h']}/{c.get('hk2') or c['h']}" if gqa else "")
            + f" D={c['d1']}/{c['d2']}"
            + (" causal" if c["causal"] else "")
        )
        chk = r.get("check") or {}
        err = f"{chk['kl_err']:.1e}" if "kl_err" in chk else "—"
        if chk.get("grad_err"):
            err += " / " + f"{max(chk['grad_err'].values()):.1e}"
        rows.append(
            [
                r["sweep"],
                shape,
                r["provider"] + (f" [{r['variant']}]" if r.get("variant") else ""),
                r["mode"] + (f" {r['setting']}" if r.get("setting") else ""),
                R.cell(r),
                R.cell(r, "tflops"),
                R.cell(r, "frac"),
                R.cell(r, "mem"),
                err,
                r["status"]
                if r["status"] == "ok"
                else f"{r['status']}: {(r.get('reason') or '')[:80]}".replace("|", "/"),
            ]
        )
    return (
        "## All measurements\n\n<details><summary>"
        + f"{len(rows)} rows</summary>\n\n"
        + _table(
            [
                "sweep",
                "shape",
                "provider",
                "mode",
                "ms",
                "TFLOP/s",
                "% GEMM",
                "extra mem",
                "err KL / grad",
                "status",
            ],
            rows,
        )
        + "\n</details>\n"
    )


# ----------------------------------------------------------------------------- plots
_COLORS = {
    "streamkl-cuda": "tab:red",
    "streamkl-triton": "tab:blue",
    "streamkl-reference": "tab:cyan",
    "torch": "tab:orange",
    "torch.compile": "tab:green",
    "gemm": "tab:gray",
}
_EXTRA = ["tab:purple", "tab:brown", "tab:pink", "tab:olive", "black", "gold", "navy", "lime"]


def _color(name: str, _seen: dict = {}) -> str:  # noqa: B006 - a deliberate per-process cache
    base = name.split(" [")[0]
    if name == base and base in _COLORS:
        return _COLORS[base]
    if name not in _seen:
        _seen[name] = _EXTRA[len(_seen) % len(_EXTRA)]
    return _seen[name]


def render_plots(data: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    R = Results(data)
    written = []
    title = f"{data.get('meta', {}).get('device', {}).get('name', '?')}"
    for what, fname, ylabel in (
        ("ms", "latency_vs_n.png", "ms"),
        ("mem", "memory_vs_n.png", "peak extra memory (GiB)"),
    ):
        fig = _grid_plot(plt, R, "n", what, ylabel, title)
        p = out / fname
        fig.savefig(p, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(p)
    fig = _ablation_plot(plt, R, title)
    p = out / "ablations.png"
    fig.savefig(p, dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append(p)
    return written


def _series(R, sweep, provider, variant, mode, setting, causal, what):
    xs, ys, oom = [], [], None
    for r in R.results:
        c = r["case"]
        if (r["sweep"], r["provider"], r.get("variant") or "", r["mode"], r.get("setting"), c["causal"]) != (
            sweep,
            provider,
            variant,
            mode,
            setting,
            causal,
        ):
            continue
        if r["status"] == "oom":
            oom = c["nq"] if oom is None else min(oom, c["nq"])
        if r["status"] != "ok":
            continue
        y = r["ms"] if what == "ms" else r.get("mem_extra_bytes")
        if y is None or (what == "mem" and provider == "gemm"):
            continue
        xs.append(c["nq"])
        ys.append(y if what == "ms" else y / 2**30)
    pts = sorted(zip(xs, ys))
    return [p[0] for p in pts], [p[1] for p in pts], oom


def _grid_plot(plt, R, sweep, what, ylabel, title):
    modes, causals, lines = [], [], []
    for r in R.results:
        if r["sweep"] != sweep:
            continue
        m = (r["mode"], r.get("setting"))
        if m not in modes:
            modes.append(m)
        if r["case"]["causal"] not in causals:
            causals.append(r["case"]["causal"])
        ln = (r["provider"], r.get("variant") or "")
        if ln not in lines:
            lines.append(ln)
    causals.sort()
    if not modes:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.text(0.5, 0.5, f"no '{sweep}' sweep in this run", ha="center", va="center")
        ax.axis("off")
        return fig
    fig, axes = plt.subplots(
        len(causals), len(modes), figsize=(4.2 * len(modes), 3.4 * len(causals)), squeeze=False
    )
    any_data = False
    for i, causal in enumerate(causals):
        for j, (mode, setting) in enumerate(modes):
            ax = axes[i][j]
            for prov, var in lines:
                xs, ys, oom = _series(R, sweep, prov, var, mode, setting, causal, what)
                label = prov + (f" [{var}]" if var else "") + (f" (OOM from {_n(oom)})" if oom else "")
                if xs:
                    any_data = True
                    ax.plot(
                        xs,
                        ys,
                        marker="o",
                        ms=3,
                        label=label,
                        color=_color(prov + (f" [{var}]" if var else "")),
                        ls="--" if prov == "gemm" else "-",
                    )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(
                f"{mode}{' ' + setting if setting else ''}, {'causal' if causal else 'non-causal'}",
                fontsize=9,
            )
            ax.set_xlabel("N (tokens)", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=6)
            else:
                ax.text(
                    0.5,
                    0.5,
                    "no data" + (" (memory is tracked on CUDA only)" if what == "mem" else ""),
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    fontsize=8,
                )
    fig.suptitle(
        f"streamkl {'latency' if what == 'ms' else 'peak extra memory'} vs N — {title}"
        + ("" if any_data else " (no data)"),
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def _ablation_plot(plt, R, title):
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    # decode: ms vs Nq, one line per (variant, Nk, causal)
    ax = axes[0]
    groups = defaultdict(list)
    for r in R.results:
        if r["sweep"] == "decode" and r["status"] == "ok":
            c = r["case"]
            name = r["provider"] + (f" [{r['variant']}]" if r.get("variant") else "")
            groups[(name, c["nk"], c["causal"])].append((c["nq"], r["ms"]))
    for (name, nk, causal), pts in sorted(groups.items()):
        pts.sort()
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            ms=3,
            label=f"{name} Nk={_n(nk)}{' causal' if causal else ''}",
        )
    _style(ax, "decode: forward ms vs Nq", "Nq", "ms")
    # bwd strategy: ms vs Nq
    ax = axes[1]
    groups = defaultdict(list)
    for r in R.results:
        if r["sweep"] == "bwd-strategy" and r["status"] == "ok":
            c = r["case"]
            kind = "cross" if c.get("label") == "cross" else "self"
            groups[(r.get("variant") or r["provider"], r.get("setting"), kind, c["causal"])].append(
                (c["nq"], r["ms"])
            )
    for (var, setting, kind, causal), pts in sorted(groups.items(), key=str):
        pts.sort()
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            ms=3,
            ls="-" if kind == "self" else ":",
            label=f"{var} {setting} {kind}{' causal' if causal else ''}",
        )
    _style(ax, "backward strategy: ms vs Nq", "Nq", "ms")
    # long: ms vs N
    ax = axes[2]
    groups = defaultdict(list)
    for r in R.results:
        if r["sweep"] == "long" and r["status"] == "ok":
            c = r["case"]
            groups[(r["provider"], r["mode"], r.get("setting"))].append((c["nq"], r["ms"]))
    for (prov, mode, setting), pts in sorted(groups.items(), key=str):
        pts.sort()
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            ms=3,
            color=_color(prov),
            ls="--" if prov == "gemm" else "-",
            label=f"{prov} {mode} {setting or ''}",
        )
    _style(ax, "long context: ms vs N", "N", "ms")
    fig.suptitle(f"streamkl ablations — {title}", fontsize=10)
    fig.tight_layout()
    return fig


def _style(ax, title, xlabel, ylabel):
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    if ax.lines:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.legend(fontsize=5.5)
        ax.grid(True, which="both", alpha=0.3)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


# ----------------------------------------------------------------------------- entry points
def merge(runs: list[dict]) -> dict:
    """One result set from several runs on the same device: the first run's header, every
    run's measurements (a later run's record replaces an earlier one of the same key), and
    each run's command, commit and date under meta.merged_runs. A later run's skip (out of its
    time budget) is not a measurement: it does not replace an earlier record."""
    if len(runs) == 1:
        return runs[0]
    data = json.loads(json.dumps(runs[0]))
    names = {str(r.get("meta", {}).get("device", {}).get("name")) for r in runs}
    if len(names) > 1:
        raise SystemExit(f"refusing to merge runs from different devices: {sorted(names)}")
    merged: dict = {}
    for run in runs:
        for r in run.get("results", []):
            key = (
                r["sweep"],
                r.get("case_key"),
                r["provider"],
                r.get("variant"),
                r["mode"],
                r.get("setting"),
            )
            if r.get("status") == "skipped" and key in merged:
                continue
            merged[key] = r
    data["results"] = list(merged.values())
    data["meta"]["merged_runs"] = [
        {
            "argv": r["meta"].get("argv"),
            "git": r["meta"].get("git"),
            "time_utc": r["meta"].get("time_utc"),
            "gemm_tflops": (r.get("gemm_yardstick") or {}).get("tflops"),
        }
        for r in runs
    ]
    return data


def render(data: dict, out: Path, plots: bool = True, log=print) -> list[Path]:
    """Write results.md (and the PNG plots) into `out`; returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    md = out / "results.md"
    md.write_text(render_markdown(data))
    written.append(md)
    if plots:
        try:
            written += render_plots(data, out)
        except Exception as exc:  # plots are a convenience; the table and JSON are the record
            log(f"plots failed: {type(exc).__name__}: {exc}")
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m streamkl.bench.report",
        description="Re-render results.md and the plots from a results.json.",
    )
    p.add_argument(
        "json",
        nargs="+",
        help="results.json written by python -m streamkl.bench; several (runs on one "
        "device, e.g. the quick sweeps and a separate long-context run) are merged",
    )
    p.add_argument("--out", help="folder for results.md and PNGs (default: the first JSON's folder)")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    paths = [Path(j) for j in args.json]
    data = merge([json.loads(path.read_text()) for path in paths])
    out = Path(args.out) if args.out else paths[0].parent
    if len(paths) > 1:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(data, indent=1))
    written = render(data, out, plots=not args.no_plots)
    for w in written:
        print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
