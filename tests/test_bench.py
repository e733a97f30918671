"""The benchmark harness (benchmarks/bench.py, providers.py, report.py) on CPU: the smoke run
with every provider that runs here, the report from JSON, merged runs, failures recorded rather
than fatal, the FLOP count, the README's generated headline, and what every result records; the
host-cost table (benchmarks/overhead.py) from its JSON; benchmarks/ on streamkl's public API."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import streamkl
from benchmarks import bench, overhead, providers, report
from benchmarks.providers import Case, Provider, attn_kl_flops, visible_pairs
from streamkl.testing import visible_mask

ROOT = Path(__file__).resolve().parents[1]
CPU_PROVIDERS = (
    "streamkl-reference",
    "torch-bf16",
    "torch.compile-bf16",
    "torch-fp32",
    "torch.compile-fp32",
    "sdpa-trick-flash",
)
EXACT = ("streamkl-reference", "torch-fp32", "torch.compile-fp32")
# what every result records to be reproduced: when, the command, the commit, the card, the software
RECORDED = (
    "date", "argv", "commit", "dirty", "device", "capability", "python", "torch", "triton", "cuda_python",
    "nvrtc", "cuda", "cudnn", "driver",
)  # fmt: skip
# the product's benchmark and its providers: the files that must use streamkl's public API only
PRODUCT = (
    "__init__.py",
    "bench.py",
    "providers.py",
    "report.py",
    "sdpa_trick.py",
    "fla_kl.py",
    "indexer_bench.py",
    "indexer_providers.py",
    "overhead.py",
    "test_speed.py",
)


@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 7), (5, 5), (7, 3), (3, 7), (64, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_visible_pairs_counts_the_mask(nq, nk, causal):
    assert visible_pairs(nq, nk, causal) == int(visible_mask(nq, nk, causal).sum())


def test_flop_count_definition():
    b, h, n, d = 1, 32, 8192, 128
    case = Case(b, h, n, n, d, d, False, "bfloat16")
    fwd = attn_kl_flops(case, "fwd")
    assert fwd == 4 * b * h * n * n * d  # two GEMMs over every pair
    assert attn_kl_flops(case, "train") == 3 * fwd  # plus S1, S2 recomputed, dq2, dk2
    causal = Case(b, h, n, n, d, d, True, "bfloat16")
    assert attn_kl_flops(causal, "fwd") == 4 * b * h * (n * (n + 1) // 2) * d  # visible pairs only
    # D1 != D2: each GEMM counts its own head dim; the gradients are the student's (D2)
    mixed = Case(1, 1, 4, 4, 64, 32, False, "float32")
    assert attn_kl_flops(mixed, "fwd") == 2 * 16 * 96
    assert attn_kl_flops(mixed, "train") == 2 * (2 * 16 * 96) + 4 * 16 * 32
    with pytest.raises(ValueError):
        attn_kl_flops(mixed, "bwd")


def test_sizes_and_sweeps_from_the_command_line():
    assert bench._sizes("4k, 8K,1m,96") == [4096, 8192, 2**20, 96]
    args = bench.parser().parse_args(["--sweep", "all", "--sizes", "1k", "--causal", "1"])
    args.dtype = "bfloat16"
    sweeps = {s.name: s for s in bench.build_sweeps(list(bench.SWEEPS), args)}
    assert [c.nq for c in sweeps["n"].cases] == [1024] and all(c.causal for c in sweeps["n"].cases)
    assert {c.label for c in sweeps["shapes"].cases} >= {"D2=D/2", "GQA H/4"}
    assert sweeps["long"].providers == bench.STREAMKL_NAMES and sweeps["long"].modes == ("train",)
    with pytest.raises(SystemExit):
        bench.main(["--sweep", "nonsense"])


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


def _ok(records, **match):
    return [r for r in records if r["status"] == "ok" and all(r[k] == v for k, v in match.items())]


def test_smoke_run_measures_every_cpu_provider(smoke_run):
    _, data = smoke_run
    env = data["runs"][0]["environment"]
    for key in RECORDED:
        assert key in env, key
    assert env["torch"] == torch.__version__ and env["argv"][1:] == ["--smoke", "--out", env["argv"][-1]]
    records = data["records"]
    assert {r["sweep"] for r in records} == set(bench.SWEEPS)
    assert not [r for r in records if r["status"] == "error"]
    for name in CPU_PROVIDERS:
        for mode in ("fwd", "train"):
            ok = _ok(records, provider=name, mode=mode)
            assert ok, f"no measurement of {name} {mode}"
            for r in ok:
                assert math.isfinite(r["ms"]) and r["ms"] > 0 and r["tflops"] > 0, r
                assert r["first_call_s"] > 0 and r["timer"].startswith("torch.utils.benchmark")
                err = r["error"]
                assert set(err) >= ({"kl", "dq2", "dk2"} if mode == "train" else {"kl"}), err
                if name in EXACT:  # float32 arithmetic; bf16 inputs get bf16 gradients
                    grad_budget = 1e-5 if r["case"]["dtype"] == "float32" else 1e-2
                    assert err["kl"] < 1e-5 and max(err.get("dq2", 0), err.get("dk2", 0)) < grad_budget, r
                elif r["case"]["dtype"] == "bfloat16":  # plausible for bf16 products: not zero, not wild
                    assert 1e-5 < err["kl"] < 5e-2, r
    # what cannot run here says why, in the record
    for name in ("streamkl-cuda", "streamkl-triton", "sdpa-trick-cudnn", "attention-cudnn", "fla-fused-kl"):
        recs = [r for r in records if r["provider"] == name]
        assert recs and all(r["status"] == "n/a" and r["reason"] for r in recs), name
    assert data["runs"][0]["gemm"] == {"start": None, "end": None}  # the yardstick is CUDA's


def test_smoke_run_writes_markdown_and_plots(smoke_run):
    out, data = smoke_run
    md = (out / "results.md").read_text()
    assert "## Headline" in md and "fastest baseline" in md and "fp32 baselines" in md
    for sweep in bench.SWEEPS:
        assert f"## Sweep `{sweep}`" in md
    # the headline names the fastest non-fp32 baseline of the same case, and its speed-up
    row = next(line for line in md.splitlines() if line.startswith("| n | 128 full bf16 | fwd |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    base = [r for r in _ok(data["records"], sweep="n", mode="fwd", kind="baseline") if r["case"]["nq"] == 128]
    fastest = min((r for r in base if not r["case"]["causal"]), key=lambda r: r["ms"])
    assert cells[6] == fastest["provider"] and cells[9].endswith("x")
    assert "torch-fp32" in cells[10] and "torch.compile-fp32" in cells[10]
    for name in ("tflops_vs_n.png", "time_vs_n.png", "error_vs_time.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_renders_a_yardstick_record(smoke_run, tmp_path):
    """A yardstick (the cuDNN attention forward, CUDA only) is timed but never checked: its
    record has no error, and the tables and plots still render."""
    _, data = smoke_run
    data = copy.deepcopy(data)
    timed = next(r for r in data["records"] if r["status"] == "ok" and r["mode"] == "fwd")
    yardstick = {k: v for k, v in timed.items() if k != "error"}
    data["records"].append({**yardstick, "provider": "attention-cudnn", "kind": "yardstick"})
    assert "attention-cudnn" in report.markdown(data)
    assert [p.name for p in report.plots(data, tmp_path)][-1] == "error_vs_time.png"


def test_report_rerenders_from_json(smoke_run, tmp_path):
    out, _ = smoke_run
    assert report.main([str(out / "results.json"), "--out", str(tmp_path), "--no-plots"]) == 0
    assert (tmp_path / "results.md").read_text() == (out / "results.md").read_text()


def test_report_merges_runs(smoke_run, tmp_path):
    out, data = smoke_run
    later = json.loads(json.dumps(data))
    later["runs"][0]["environment"].update(commit="abc1234", dirty=False)
    first = next(r for r in later["records"] if r["status"] == "ok")
    gone = next(r for r in later["records"] if r["status"] == "ok" and r is not first)
    first["ms"] = 1234.5
    gone.update(status="n/a", reason="not started: --max-seconds 1 spent")
    later["records"] = [first, gone]
    (tmp_path / "later.json").write_text(json.dumps(later))
    merged_dir = tmp_path / "merged"
    assert (
        report.main([str(out / "results.json"), str(tmp_path / "later.json"), "--out", str(merged_dir)]) == 0
    )
    merged = json.loads((merged_dir / "results.json").read_text())
    assert len(merged["runs"]) == 2 and len(merged["records"]) == len(data["records"])

    def find(rec):
        key = (rec["sweep"], rec["case_key"], rec["provider"], rec["mode"])
        return next(
            r for r in merged["records"] if (r["sweep"], r["case_key"], r["provider"], r["mode"]) == key
        )

    assert find(first)["ms"] == 1234.5 and find(first)["run"] == 1  # a later measurement wins
    assert find(gone)["status"] == "ok" and find(gone)["run"] == 0  # a later n/a does not
    md = (merged_dir / "results.md").read_text()
    assert "`abc1234`" in md and "1,234" in md
    other = json.loads(json.dumps(data))
    other["runs"][0]["environment"]["device"] = "NVIDIA H200"
    with pytest.raises(ValueError, match="different devices"):
        report.merge([data, other])


def _raising(exc: BaseException):
    calls = []

    def make(case):
        def fn(*inputs):
            calls.append(case.nq)
            raise exc

        return fn

    return make, calls


def test_failures_are_recorded_and_the_run_goes_on(tmp_path):
    oom, oom_calls = _raising(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 TiB"))
    broken, broken_calls = _raising(RuntimeError("the kernel fell over"))
    exact = next(p for p in providers.all_providers("aot_eager") if p.name == "torch-fp32")
    provs = [
        Provider("fake-oom", "baseline", "runs out", oom),
        Provider("fake-error", "baseline", "fails", broken),
    ]
    provs.append(exact)
    cases = [Case(1, 1, n, n, 8, 8, False, "float32") for n in (16, 32)]
    run = {
        "environment": bench.environment(torch.device("cpu"), ["test"], commit="0" * 40),
        "config": {"providers": {p.name: p.what for p in provs}, "sweeps": {"n": "N"}},
    }
    runner = bench.Runner(
        torch.device("cpu"), provs, tmp_path, bench.Options(min_run_time=0.001), run, log=str
    )
    data = runner.run([bench.Sweep("n", "N", cases)])
    got = {(r["provider"], r["case"]["nq"], r["mode"]): r for r in data["records"]}
    assert len(got) == 12
    assert (
        got["fake-oom", 16, "fwd"]["status"] == "oom"
        and "Tried to allocate" in got["fake-oom", 16, "fwd"]["reason"]
    )
    assert got["fake-oom", 32, "fwd"]["status"] == "oom" and oom_calls == [16]  # larger: not tried
    assert got["fake-error", 16, "fwd"]["status"] == got["fake-error", 32, "fwd"]["status"] == "error"
    assert broken_calls == [16, 32]  # tried again: an error is no reason to skip
    assert "the kernel fell over" in got["fake-error", 32, "fwd"]["traceback"]
    assert got["fake-oom", 16, "train"]["status"] == "n/a"  # no training step
    assert all(got["torch-fp32", n, m]["status"] == "ok" for n in (16, 32) for m in ("fwd", "train"))
    assert json.loads((tmp_path / "results.json").read_text()) == data
    md = report.markdown(data)
    assert "| 16 full fp32 | fake-oom | OOM |" in md and "## Errors" in md and "the kernel fell over" in md
    plots = [p.name for p in report.plots(data, tmp_path)]
    assert plots == ["tflops_vs_n.png", "time_vs_n.png", "error_vs_time.png"]
    # --max-seconds: nothing starts once it is spent, and each measurement says so
    late = bench.Runner(
        torch.device("cpu"), [exact], tmp_path / "late", bench.Options(max_seconds=0), run, str
    )
    records = late.run([bench.Sweep("n", "N", cases)])["records"]
    assert {r["status"] for r in records} == {"n/a"} and "--max-seconds" in records[0]["reason"]


def test_readme_headline_blocks_match_their_json():
    """Every headline block in README.md is the table its named JSON generates."""
    assert report.stale_readme_blocks(ROOT / "README.md") == []


def test_paper_table_sets_streamkl_against_the_papers_baselines():
    """report.paper_table: per case and mode, streamkl's fastest backend over torch.compile's and
    FLA's times from the same run, a baseline that did not run shown with its reason, and the
    paper's claimed forward range by mask (none for a training step)."""

    def rec(provider, kind, causal, mode, ms=None, status="ok", reason=None):
        case = dict(b=1, h=32, nq=4096, nk=4096, d1=128, d2=128, causal=causal, dtype="bfloat16", label="")
        r = dict(sweep="n", case=case, case_key=f"4K causal={int(causal)}", provider=provider, kind=kind,
                 mode=mode, status=status, ms=ms)  # fmt: skip
        return r if reason is None else dict(r, reason=reason)

    records = [
        rec("streamkl-cuda", "streamkl", False, "fwd", 1.0),
        rec("streamkl-triton", "streamkl", False, "fwd", 1.5),
        rec("torch.compile-bf16", "baseline", False, "fwd", 3.0),
        rec("fla-fused-kl", "baseline", False, "fwd", 5.0),
        rec("streamkl-triton", "streamkl", True, "train", 2.0),
        rec("torch.compile-bf16", "baseline", True, "train", 9.0),
        rec("fla-fused-kl", "baseline", True, "train", status="n/a", reason="no causal mask: FLA has none"),
    ]
    lines = report.paper_table(dict(records=records)).splitlines()
    assert lines[0].startswith("| sweep | case | mode | streamkl, ms | torch.compile, ms")
    assert lines[2] == "| n | 4K full bf16 | fwd | cuda 1.00 | 3.00 | 3.00x | 5.00 | 5.00x | 2.4-3.7x |"
    causal = "| n | 4K causal bf16 | train | triton 2.00 | 9.00 | 4.50x | n/a (no causal mask) | — | — |"
    assert lines[3] == causal
    assert len(lines) == 4


def test_paper_comparison_table_matches_its_json():
    """docs/paper_comparison.md's table is what report.paper_table makes of the JSON it names."""
    text = (ROOT / "docs" / "paper_comparison.md").read_text()
    block = re.search(r"<!-- bench:paper:start (\S+) -->\n(.*?)<!-- bench:paper:end -->", text, re.S)
    assert block, "docs/paper_comparison.md: no bench:paper block"
    assert block[2] == report.paper_table(report.load(ROOT / "docs" / block[1]))


def test_readme_block_is_generated_from_the_json_it_names(smoke_run, tmp_path):
    out, data = smoke_run
    run_json = tmp_path / "docs" / "run" / "results.json"
    run_json.parent.mkdir(parents=True)
    shutil.copy(out / "results.json", run_json)
    readme = tmp_path / "README.md"
    block = "<!-- bench:headline:start placeholder.json -->\nold table\n<!-- bench:headline:end -->"
    readme.write_text(f"# project\n\n{block}\n\nafter\n")
    assert report.main([str(run_json), "--readme", str(readme), "--sweeps", "n"]) == 0
    text = readme.read_text()
    assert text.startswith(
        "# project\n\n<!-- bench:headline:start docs/run/results.json sweeps=n -->\n| sweep |"
    )
    assert text.endswith("<!-- bench:headline:end -->\n\nafter\n") and "old table" not in text
    rows = [line for line in text.splitlines() if line.startswith("| n |")]
    assert len(rows) == len(
        {(r["case_key"], r["mode"]) for r in _ok(data["records"], sweep="n", kind="streamkl")}
    )
    assert "| decode |" not in text
    assert report.stale_readme_blocks(readme) == []
    readme.write_text(re.sub(r"\| (\d+\.\d+)x \|", "| 99.00x |", text, count=1))  # a figure copied by hand
    assert report.stale_readme_blocks(readme) == ["docs/run/results.json"]
    assert report.main([str(run_json), "--readme", str(readme)]) == 0  # rewritten, sweeps kept
    assert readme.read_text() == text


def test_headline_keeps_the_sizes_it_names(smoke_run):
    _, data = smoke_run
    n_sizes = {report.case_name(r["case"]).split()[0] for r in _ok(data["records"], sweep="n")}
    size = sorted(n_sizes)[0]
    table = report.headline(data, [f"n:{size}", "decode"])
    n_rows = [line for line in table.splitlines() if line.startswith("| n |")]
    assert n_rows and all(line.startswith(f"| n | {size} ") for line in n_rows)
    assert "| decode |" in table and "| shapes |" not in table
    assert report.headline(data, ["n"]).count("| n |") > len(n_rows) or len(n_sizes) == 1


def test_readme_blocks_naming_one_json_keep_their_own_sweeps(smoke_run, tmp_path):
    out, _ = smoke_run
    run_json = tmp_path / "run.json"
    shutil.copy(out / "results.json", run_json)
    readme = tmp_path / "README.md"
    blocks = [
        f"<!-- bench:headline:start run.json sweeps={s} -->\nold\n<!-- bench:headline:end -->"
        for s in ("n", "decode")
    ]
    readme.write_text(f"{blocks[0]}\n\nbetween\n\n{blocks[1]}\n")
    assert report.main([str(run_json), "--readme", str(readme)]) == 0
    first, second = readme.read_text().split("between")
    assert "| n |" in first and "| decode |" not in first and "old" not in first
    assert "| decode |" in second and "| n |" not in second and "old" not in second
    assert report.stale_readme_blocks(readme) == []
    with pytest.raises(SystemExit):  # one --sweeps for two blocks: ambiguous
        report.main([str(run_json), "--readme", str(readme), "--sweeps", "n"])


def test_harness_lives_outside_the_package():
    """The wheel carries no harness, and streamkl (python -m streamkl included) imports none of it."""
    assert not (ROOT / "streamkl" / "bench").exists()
    for path in (ROOT / "streamkl").rglob("*.py"):
        assert not re.search(r"^\s*(from|import)\s+benchmarks\b", path.read_text(), re.M), path


def test_decode_forward_is_set_against_the_copy_bandwidth(smoke_run):
    """The bytes a forward must move (inputs once, the KL written) over its time, against the run's
    copy yardstick: a column of the decode forward table only, "—" where a run has no yardstick."""
    case = Case(2, 4, 3, 1000, 64, 32, False, "bfloat16", hk1=2, hk2=1)
    assert providers.attn_kl_bytes(case) == 2 * (2 * (4 * 3 * 96 + 1000 * (2 * 64 + 32))) + 4 * 2 * 4 * 3
    _, data = smoke_run
    data = copy.deepcopy(data)
    assert data["runs"][0]["copy"] is None and "| — |" in report.markdown(data)  # CPU: no yardstick
    data["runs"][0]["copy"] = {"bytes": 2**31, "ms": 1.0, "gbps": 4000.0}
    decode = [r for r in data["records"] if r["sweep"] == "decode" and r["status"] == "ok"]
    for r in decode:
        r.update(bytes=2 * 10**9, ms=1.0)  # 2 TB/s against 4 TB/s
    text = report.markdown(data)
    section = text[text.index("## Sweep `decode`") :]
    forward, train = section.split("### training")[:2]
    assert "% of copy" in forward and "| 50% |" in forward and "% of copy" not in train
    assert "% of copy" not in text[text.index("## Sweep `n`") : text.index("## Sweep `decode`")]


def test_runs_table_names_the_software_and_card(smoke_run):
    """The runs table shows every version a run recorded, and the card with its compute capability."""
    _, data = smoke_run
    data = copy.deepcopy(data)
    env = data["runs"][0]["environment"]
    env.update(device="NVIDIA H200", capability="9.0", driver="580.1", nvrtc="13.5", cuda_python="13.5.0")
    md = report.markdown(data)
    assert "Device: NVIDIA H200 (sm 9.0)." in md
    row = next(line for line in md.splitlines() if f"`{env['argv'][0]}" in line)
    for key, name in report.SOFTWARE.items():
        if env.get(key) is not None:
            assert f"{name} {env[key]}" in row, (name, row)
    assert "driver 580.1" in row and "NVRTC 13.5" in row and "cuda-python 13.5.0" in row


def test_benchmarks_hold_the_product_benchmark_only():
    """Probes, tuners and breakdowns that need streamkl's internals live in lab/, not here."""
    assert sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")) == sorted(PRODUCT)


@pytest.mark.parametrize("name", PRODUCT)
def test_benchmarks_use_the_public_api_only(name):
    """The product's benchmark imports streamkl as a user does: the package, streamkl.testing."""
    source = (ROOT / "benchmarks" / name).read_text()
    public = {"streamkl", "streamkl.testing"}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names if a.name.split(".")[0] == "streamkl"]
            assert set(mods) <= public, (name, mods)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "streamkl":
            assert node.module in public, (name, node.module)
            assert not [a.name for a in node.names if a.name.startswith("_")], (name, node.module)
    assert not re.search(r"\bstreamkl\.(_\w+|backends|reference|ops|distributed)\b", source), name


@pytest.fixture(scope="module")
def overhead_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("overhead")
    assert overhead.main(["--no-compile", "--calls", "1", "--repeats", "1", "--out", str(out)]) == 0
    return out, json.loads((out / "overhead.json").read_text())


def test_overhead_on_cpu_measures_the_reference_and_says_cudnn_is_unavailable(overhead_run):
    out, data = overhead_run
    assert data["schema"] == overhead.SCHEMA
    assert {k: data["config"][k] for k in ("b", "h", "n", "d")} == overhead.SHAPE
    assert data["config"]["causal"] is True and data["config"]["backends"] == ["reference"]
    assert all(key in data["environment"] for key in RECORDED)
    assert data["cudnn"]["status"] == "n/a" and "CUDA" in data["cudnn"]["reason"]
    rows = {(r["row"], r["mode"]): r for r in data["rows"]}
    assert set(rows) == {("reference: streamkl.attn_kl eager", mode) for mode in overhead.MODES}
    assert all(r["us"] > 0 and r["vs_cudnn"] is None and r["backend"] == "reference" for r in rows.values())
    md = (out / "overhead.md").read_text()
    assert md == overhead.markdown(data)
    assert "cuDNN attention: not measured" in md and "no ratios" in md
    assert "| reference: streamkl.attn_kl eager |" in md and "benchmarks/overhead.py --no-compile" in md


def test_overhead_table_gives_each_row_over_the_cudnn_call(overhead_run):
    """Ratios are the row's time over the cuDNN call's of the same mode, in the JSON and the table."""
    _, data = overhead_run
    ours = [r for r in data["rows"] if r["backend"] == "reference"]
    cudnn = [dict(r, row=overhead.CUDNN, backend=None, us=r["us"] / (i + 2)) for i, r in enumerate(ours)]
    rows = overhead.with_ratios(cudnn + ours)
    data = dict(data, cudnn={"status": "ok", "reason": None}, rows=rows)
    by_mode = {r["mode"]: r["us"] for r in cudnn}
    md = overhead.markdown(data)
    for r in rows:
        assert r["vs_cudnn"] == round(r["us"] / by_mode[r["mode"]], 3)
    line = next(x for x in md.splitlines() if x.startswith("| reference: streamkl.attn_kl eager |"))
    assert line.endswith(" | ".join(f"{r['vs_cudnn']:.2f}x" for r in rows if r["backend"]) + " |")
    assert "no ratios" not in md and f"| {overhead.CUDNN} |" in md


def test_overhead_cli_prints_json_and_renders_it(overhead_run, capsys):
    out, data = overhead_run
    assert overhead.main(["--render", str(out / "overhead.json")]) == 0
    assert capsys.readouterr().out == overhead.markdown(data)
    assert overhead.main(["--no-compile", "--calls", "1", "--repeats", "1", "--json", "-"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["schema"] == overhead.SCHEMA and len(printed["rows"]) == len(overhead.MODES)
    with pytest.raises(SystemExit):
        overhead.main(["--calls", "0"])
    with pytest.raises(SystemExit):
        overhead.parser().parse_args(["--help"])
    assert overhead.GPU_COMMAND in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["fwd", "train"])
def test_fla_provider_computes_each_heads_mean_kl(mode):
    """fla-fused-kl's per-(batch, head) mapping (FLA under the Triton interpreter, float32) gives
    each head's mean over its rows of attn_kl's KL, and the gradients of their sum, on GQA inputs
    with D1 != D2; causal cases are refused with the reason."""
    pytest.importorskip("fla", reason="fla-core (the bench extra) is not installed")
    from benchmarks import fla_kl

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("FLA's kernels run on a CPU only under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    case = Case(nq=6, nk=9, causal=False, b=1, h=2, d1=8, d2=16, hk1=1, hk2=2, dtype="float32")
    inputs = case.inputs(torch.device("cpu"), seed=0)
    assert fla_kl.unsupported(case, inputs) is None
    assert "non-causal" in fla_kl.unsupported(dataclasses.replace(case, causal=True), inputs)
    errors = fla_kl.check(case, inputs, mode, rows=case.nq)
    assert errors["kl"] < 1e-5, errors
    if mode == "train":
        assert errors["dq2"] < 1e-4 and errors["dk2"] < 1e-4, errors
    q1, k1, q2, k2 = inputs
    want = streamkl.attn_kl(q1, k1, q2, k2, backend="reference").mean(-1)
    torch.testing.assert_close(fla_kl.fwd(case)(*inputs), want, rtol=1e-5, atol=1e-6)
