"""Two trees' benchmark side by side in one session: the product's own benchmarks/bench.py run
from each tree in turn (A, B, A, B, ... so clock drift under load hits both alike), then one
table of each case's median time per tree and the ratio B / A, with the GEMM yardstick of each
run beside it.

    git worktree add /tmp/base <commit>          # or any copy of the tree to compare against
    python lab/ab_bench.py --a /tmp/base --b . --rounds 2 --out /tmp/ab -- \
        --sweep n,decode --sizes 4k,16k --decode-nq 16,1 --decode-nk 32k,128k --causal both \
        --providers streamkl-cuda,streamkl-triton

Everything after `--` goes to bench.py unchanged. Writes <out>/<tree>_<round>/results.json
and <out>/ab.json, <out>/ab.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def _run(tree: Path, out: Path, bench_args: list[str], commit: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "benchmarks/bench.py", *bench_args, "--out", str(out), "--no-plots"]
    cmd += ["--commit", commit] if commit else []
    print("+", " ".join(cmd), f"(in {tree})", flush=True)
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    return json.loads((out / "results.json").read_text())


def _key(rec: dict) -> tuple:
    return rec["case_key"], rec["mode"], rec["provider"]


def main() -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--a", type=Path, required=True, help="the baseline tree")
    parser.add_argument("--b", type=Path, required=True, help="the candidate tree")
    parser.add_argument("--a-commit", help="A's commit, recorded where its copy has no .git")
    parser.add_argument("--b-commit", help="B's commit, likewise")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args, rest = parser.parse_known_args()
    bench_args = rest[1:] if rest[:1] == ["--"] else rest
    times: dict[tuple, dict[str, list[float]]] = {}
    gemm: dict[str, list] = {"a": [], "b": []}
    for r in range(args.rounds):
        for name, tree, commit in (("a", args.a, args.a_commit), ("b", args.b, args.b_commit)):
            data = _run(tree.resolve(), (args.out / f"{name}_{r}").resolve(), bench_args, commit)
            gemm[name].append(data["runs"][0].get("gemm"))
            for rec in data["records"]:
                if rec.get("kind") == "streamkl" and rec.get("status") == "ok":
                    times.setdefault(_key(rec), {"a": [], "b": []})[name].append(rec["ms"])
    rows = []
    for (case, mode, provider), t in sorted(times.items()):
        if t["a"] and t["b"]:
            a, b = statistics.median(t["a"]), statistics.median(t["b"])
            rows.append(dict(case=case, mode=mode, provider=provider, a_ms=t["a"], b_ms=t["b"], ratio=b / a))
    (args.out / "ab.json").write_text(json.dumps(dict(rows=rows, gemm=gemm, bench_args=bench_args), indent=1))
    lines = ["| case | mode | provider | A ms (runs) | B ms (runs) | B / A |", "|---|---|---|---|---|---|"]
    for row in rows:
        a = ", ".join(f"{x:.3f}" for x in row["a_ms"])
        b = ", ".join(f"{x:.3f}" for x in row["b_ms"])
        head = f"| {row['case']} | {row['mode']} | {row['provider']}"
        lines.append(f"{head} | {a} | {b} | {row['ratio']:.3f} |")
    (args.out / "ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
