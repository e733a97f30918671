"""The benchmark harness (python -m streamkl.bench) on CPU: the smoke run, the report, the FLOP
count, and that failures, OOMs, budgets and projections are recorded rather than fatal."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamkl.bench import cli, providers, report
from streamkl.bench.flops import attn_kl_flops, visible_pairs
from streamkl.bench.timing import env_vars
from streamkl.testing import visible_mask


@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 7), (5, 5), (7, 3), (3, 7), (64, 128), (128, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_visible_pairs_counts_the_mask(nq, nk, causal):
    assert visible_pairs(nq, nk, causal) == int(visible_mask(nq, nk, causal).sum())


def test_flop_count_definition():
    b, h, n, d = 1, 32, 8192, 128
    fwd = attn_kl_flops(b, h, n, n, d, d, False, "fwd")
    assert fwd == 4 * b * h * n * n * d
    assert attn_kl_flops(b, h, n, n, d, d, True, "fwd") == 2 * b * h * (n * (n + 1) // 2) * 2 * d
    assert attn_kl_flops(b, h, n, n, d, d, False, "bwd", "q2k2") == 2 * fwd  # four GEMMs
    assert attn_kl_flops(b, h, n, n, d, d, False, "bwd", "q1k1") == 2 * fwd
    assert attn_kl_flops(b, h, n, n, d, d, False, "bwd", "all") == 3 * fwd  # six GEMMs
    assert attn_kl_flops(b, h, n, n, d, d, False, "fwd+bwd", "q2k2") == 3 * fwd
    # D1 != D2: each GEMM counts its own head dim
    assert attn_kl_flops(1, 1, 4, 4, 64, 32, False, "fwd") == 2 * 16 * 96
    assert attn_kl_flops(1, 1, 4, 4, 64, 32, False, "bwd", "q2k2") == 2 * 16 * 96 + 4 * 16 * 32
    with pytest.raises(ValueError):
        attn_kl_flops(1, 1, 4, 4, 8, 8, False, "bwd")


def test_env_vars_sets_and_restores(monkeypatch):
    monkeypatch.setenv("STREAMKL_TRITON_SPLIT_K", "auto")
    monkeypatch.delenv("STREAMKL_TRITON_BWD", raising=False)
    with env_vars({"STREAMKL_TRITON_SPLIT_K": "0", "STREAMKL_TRITON_BWD": "fused"}):
        assert os.environ["STREAMKL_TRITON_SPLIT_K"] == "0"
        assert os.environ["STREAMKL_TRITON_BWD"] == "fused"
    assert os.environ["STREAMKL_TRITON_SPLIT_K"] == "auto"
    assert "STREAMKL_TRITON_BWD" not in os.environ


def _ok(results, **match):
    return [r for r in results if r["status"] == "ok" and all(r.get(k) == v for k, v in match.items())]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        # tests/test_triton.py sets TRITON_INTERPRET=1 for the whole session; interpreted
        # kernels would turn this seconds-long run into minutes
        mp.delenv("TRITON_INTERPRET", raising=False)
        assert cli.main(["--smoke", "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_smoke_writes_json_with_real_numbers(smoke_run):
    out, data = smoke_run
    meta = data["meta"]
    for key in ("date", "argv", "versions", "git", "device"):
        assert key in meta
    assert meta["versions"]["torch"] and meta["device"]["type"] == "cpu"
    assert data["gemm_yardstick"]["tflops"] > 0
    results = data["results"]
    assert {r["sweep"] for r in results} == {"n", "decode", "bwd-strategy", "shapes", "long"}
    for provider in ("streamkl-reference", "torch", "torch.compile", "gemm"):
        ok = _ok(results, provider=provider)
        assert ok, f"no successful measurement for {provider}"
        for r in ok:
            assert math.isfinite(r["ms"]) and r["ms"] > 0 and r["tflops"] > 0
    for mode in ("fwd", "bwd", "fwd+bwd"):
        assert _ok(results, provider="streamkl-reference", mode=mode)
    checked = [r for r in results if r["status"] == "ok" and "kl_err" in r.get("check", {})]
    assert checked and all(r["check"]["kl_ok"] for r in checked)
    assert all(r["check"].get("grad_ok", True) for r in checked)
    assert any(r["check"].get("grad_err") for r in checked)
    assert all(r.get("compile_s", 0) > 0 for r in _ok(results, provider="torch.compile"))
    # GPU-only backends are recorded as such, never as errors
    assert not [r for r in results if r["status"] == "error"]
    triton = [r for r in results if r["provider"] == "streamkl-triton"]
    assert triton and all(r["status"] == "unsupported" for r in triton)


def test_smoke_writes_markdown_and_plots(smoke_run):
    out, data = smoke_run
    md = (out / "results.md").read_text()
    assert "| N | causal | PyTorch ms | torch.compile ms | streamkl-reference ms" in md
    assert "vs PyTorch" in md and "vs torch.compile" in md and "% of GEMM" in md
    row = next(line for line in md.splitlines() if line.startswith("| 64 | no |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[4]) > 0 and cells[5].endswith("x")
    for name in ("latency_vs_n.png", "memory_vs_n.png", "ablations.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_rerenders_from_json(smoke_run, tmp_path, capsys):
    out, _ = smoke_run
    assert report.main([str(out / "results.json"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "results.md").read_text() == (out / "results.md").read_text()
    assert (tmp_path / "latency_vs_n.png").exists()


def test_report_merges_runs(smoke_run, tmp_path):
    out, data = smoke_run
    other = json.loads(json.dumps(data))
    other["meta"]["argv"] = ["python -m streamkl.bench", "--sweep", "long"]
    other["meta"]["git"] = {"commit": "abc1234", "source": "--commit"}
    other["results"] = [r for r in other["results"] if r["sweep"] == "long"]
    for r in other["results"]:
        r["ms"] = r.get("ms", 1.0) * 2
    (tmp_path / "long.json").write_text(json.dumps(other))
    assert (
        report.main(
            [
                str(out / "results.json"),
                str(tmp_path / "long.json"),
                "--out",
                str(tmp_path / "merged"),
                "--no-plots",
            ]
        )
        == 0
    )
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert len(merged["results"]) == len(data["results"])
    assert len(merged["meta"]["merged_runs"]) == 2
    long_ok = [r for r in merged["results"] if r["sweep"] == "long" and r["status"] == "ok"]
    assert long_ok and all(r in other["results"] for r in long_ok)
    md = (tmp_path / "merged" / "results.md").read_text()
    assert "--sweep long" in md
    commit_row = next(line for line in md.splitlines() if line.startswith("| commit |"))
    assert "abc1234" in commit_row, "a merged report names every run's commit"


def test_report_merge_keeps_a_measurement_over_a_later_skip(smoke_run, tmp_path):
    out, data = smoke_run
    later = json.loads(json.dumps(data))
    measured = [r for r in later["results"] if r["status"] == "ok"]
    for r in measured:
        r.update(status="skipped", reason="time budget of 1 s spent")
        r.pop("ms", None)
    (tmp_path / "later.json").write_text(json.dumps(later))
    assert (
        report.main(
            [
                str(out / "results.json"),
                str(tmp_path / "later.json"),
                "--out",
                str(tmp_path / "merged"),
                "--no-plots",
            ]
        )
        == 0
    )
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert sum(r["status"] == "ok" for r in merged["results"]) == len(measured) > 0


def test_oom_and_errors_are_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    real_dense = providers.dense_fp32

    def dense_that_runs_out(q1, k1, q2, k2, causal):
        if q1.shape[2] >= 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return real_dense(q1, k1, q2, k2, causal)

    def broken_streamkl(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(providers, "dense_fp32", dense_that_runs_out)
    monkeypatch.setattr(providers, "_call_streamkl", broken_streamkl)
    argv = [
        "--smoke",
        "--sweep",
        "n",
        "--sizes",
        "32,64,128",
        "--causal",
        "0",
        "--settings",
        "q2k2",
        "--providers",
        "streamkl-reference,torch,gemm",
        "--no-plots",
        "--out",
        str(tmp_path),
    ]
    # --smoke runs every sweep; restrict to n through the sweep list
    assert (
        cli.main(
            [a for a in argv if a != "--smoke"]
            + ["--device", "cpu", "--dtype", "float32", "--compile-backend", "aot_eager"]
        )
        == 0
    )
    data = json.loads((tmp_path / "results.json").read_text())
    res = {(r["provider"], r["mode"], r["case"]["nq"]): r for r in data["results"]}
    assert res[("torch", "fwd", 32)]["status"] == "ok"
    assert res[("torch", "fwd", 64)]["status"] == "oom"
    assert not res[("torch", "fwd", 64)].get("implied")
    assert res[("torch", "fwd", 128)]["status"] == "oom" and res[("torch", "fwd", 128)]["implied"]
    assert res[("torch", "bwd", 128)]["status"] == "oom"
    assert res[("streamkl-reference", "fwd", 32)]["status"] == "error"
    assert "kernel exploded" in res[("streamkl-reference", "fwd", 32)]["reason"]
    assert res[("gemm", "fwd", 128)]["status"] == "ok"
    md = (tmp_path / "results.md").read_text()
    assert "OOM" in md and "kernel exploded" in md


def test_budget_and_projection_skip(tmp_path):
    argv = [
        "--sweep",
        "n",
        "--sizes",
        "32,256",
        "--causal",
        "0",
        "--settings",
        "q2k2",
        "--providers",
        "streamkl-reference,torch",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--max-call-reference-s",
        "1e-9",
        "--no-plots",
        "--out",
        str(tmp_path / "a"),
    ]
    assert cli.main(argv) == 0
    data = json.loads((tmp_path / "a" / "results.json").read_text())
    ref = {(r["mode"], r["case"]["nq"]): r for r in data["results"] if r["provider"] == "streamkl-reference"}
    assert ref[("fwd", 32)]["status"] == "ok"
    assert ref[("fwd", 256)]["status"] == "skipped" and "projected" in ref[("fwd", 256)]["reason"]
    argv = argv[:-1] + [str(tmp_path / "b"), "--time-budget", "0"]
    assert cli.main(argv) == 0
    data = json.loads((tmp_path / "b" / "results.json").read_text())
    assert data["results"] and all(r["status"] == "skipped" for r in data["results"])
    assert (tmp_path / "b" / "results.md").exists()


def test_quick_preset_plan(capsys):
    """The preset the H200 run uses: every sweep of the issue, at the issue's shapes."""
    from streamkl.bench.sweeps import Geometry, build

    plan = {
        sw.name: sw for sw in build("quick", ["n", "decode", "bwd-strategy", "shapes", "long"], Geometry())
    }
    n = plan["n"]
    assert {(c.nq, c.causal) for c in n.cases} == {
        (k * 1024, c) for k in (4, 8, 16, 32) for c in (False, True)
    }
    assert all((c.b, c.h, c.d1, c.d2, c.dtype) == (1, 32, 128, 128, "bfloat16") for c in n.cases)
    assert [m for m in n.modes] == [("fwd", None), ("bwd", "q2k2"), ("bwd", "q1k1"), ("bwd", "all")]
    assert {"streamkl", "torch", "torch.compile", "gemm"} <= set(n.providers)
    decode = plan["decode"]
    assert min(c.nq for c in decode.cases) == 1 and max(c.nq for c in decode.cases) == 256
    assert {c.nk for c in decode.cases} == {32 * 1024, 128 * 1024}
    envs = [env["STREAMKL_TRITON_SPLIT_K"] for _, env in decode.variants["streamkl-triton"]]
    assert envs[0] == "off" and envs[-1] == "auto"
    envs = [env["STREAMKL_TRITON_BWD"] for _, env in plan["bwd-strategy"].variants["streamkl-triton"]]
    assert envs == ["fused", "separate", "auto"]
    shapes = plan["shapes"].cases
    assert any(c.d1 != c.d2 for c in shapes) and any(c.hk1 and c.hk1 < c.h for c in shapes)
    assert [c.nq for c in plan["long"].cases] == [128 * 1024, 512 * 1024, 1024 * 1024]
    assert all(c.causal for c in plan["long"].cases)
    assert cli.main(["--sweep", "all", "--quick", "--device", "cpu", "--dry-run"]) == 0
    assert "split_k=auto" in capsys.readouterr().out


def test_triton_provider_under_the_interpreter(tmp_path):
    """The Triton backend through the harness (env variants included), on CPU tensors, in a
    fresh `python -m streamkl.bench` process: Triton must see TRITON_INTERPRET=1 before import."""
    pytest.importorskip("triton")
    argv = [
        "--sweep",
        "n,decode",
        "--device",
        "cpu",
        "--heads",
        "1",
        "--dim",
        "16",
        "--sizes",
        "32",
        "--causal",
        "1",
        "--settings",
        "q2k2",
        "--decode-nq",
        "1",
        "--decode-nk",
        "64",
        "--providers",
        "streamkl-triton",
        "--no-plots",
        "--out",
        str(tmp_path),
    ]
    root = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "streamkl.bench", *argv],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert {(r["sweep"], r["mode"], r["variant"]) for r in results if r["status"] == "ok"} == {
        ("n", "fwd", ""),
        ("n", "bwd", ""),
        ("decode", "fwd", "split_k=off"),
        ("decode", "fwd", "split_k=8"),
        ("decode", "fwd", "split_k=32"),
        ("decode", "fwd", "split_k=auto"),
    }
    assert all(r["check"]["kl_ok"] and r["check"].get("grad_ok", True) for r in results)


def test_rel_err_in_chunks_matches_the_dense_formula():
    """The bench checks 1M-token gradients with streamkl.testing.rel_err: it works in slices so
    no float64 copy of a whole gradient is made, and must equal the one-shot formula."""
    from streamkl.testing import rel_err

    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 3, 257, 16, generator=gen)
    x = (ref + 1e-2 * torch.randn(ref.shape, generator=gen)).to(torch.bfloat16)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # permuted strides, as (B,N,H,D) inputs
    dense = ((x.double() - ref.double()).norm() / ref.double().norm()).item()
    for chunk in (1, 100, 4096, 1 << 24):
        assert math.isclose(rel_err(x, ref, chunk_elems=chunk), dense, rel_tol=1e-9)
    assert rel_err(torch.zeros(4), torch.zeros(4)) == 0.0
    assert rel_err(torch.ones(4), torch.zeros(4)) == 2.0  # ||x|| when the reference is zero
    assert rel_err(torch.tensor(3.0), torch.tensor(2.0)) == 0.5
    with pytest.raises(ValueError, match="shapes differ"):
        rel_err(torch.zeros(3), torch.zeros(4))


def test_a_first_call_past_single_shot_is_not_repeated_for_memory(tmp_path):
    """With nothing to project from (the first size of a sweep), a first call that already took
    --single-shot-s gives the memory figure itself: at 1M tokens a second 100 s call is waste."""
    argv = [
        "--sweep",
        "n",
        "--sizes",
        "32",
        "--causal",
        "0",
        "--settings",
        "q2k2",
        "--providers",
        "streamkl-reference",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--no-plots",
        "--repeats",
        "1",
    ]
    assert cli.main(argv + ["--single-shot-s", "1e-9", "--out", str(tmp_path / "long")]) == 0
    assert cli.main(argv + ["--out", str(tmp_path / "short")]) == 0
    fwd = {}
    for name in ("long", "short"):
        data = json.loads((tmp_path / name / "results.json").read_text())
        fwd[name] = next(r for r in data["results"] if r["mode"] == "fwd")
        assert fwd[name]["status"] == "ok" and fwd[name]["check"]["kl_ok"]
    assert fwd["long"].get("mem_from") == "first call"
    assert "mem_from" not in fwd["short"]  # short calls measure memory on a call of their own
