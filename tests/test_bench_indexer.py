"""indexer_kl's benchmark (benchmarks/indexer_bench.py, indexer_providers.py) on CPU at tiny sizes: the
providers agree with the float64 oracle (tests/indexer_oracle.py), the inputs are what they claim (top-k
sets of distinct visible keys, the teacher's lse over them), the FLOP count, the reasons recorded where a
provider cannot run a case, the smoke run and its report, and the CLI's defaults (DeepSeek-V3.2's shapes)."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch

from benchmarks import bench, indexer_bench, report
from benchmarks.indexer_providers import (
    IndexerCase,
    IndexerInputs,
    all_providers,
    indexer_kl_flops,
    make_inputs,
    megatron_indexer_kl,
    teacher_lse,
    topk_sets,
)
from benchmarks.providers import Provider, Unsupported
from tests.indexer_oracle import admitted_mask, dense_indexer_kl
from tests.indexer_oracle import megatron_indexer_kl as oracle_megatron

TINY = dict(b=1, h=4, hk=1, g=3, d=16, di=8, scale=0.3)
PROVIDERS = {p.name: p for p in all_providers("aot_eager", head_chunk=3)}


def _case(n=24, topk=0, dtype="float32", **kw):
    return IndexerCase(nq=n, nk=n, causal=True, dtype=dtype, topk=topk, **{**TINY, **kw})


def test_flops_count_the_admitted_pairs():
    """Teacher 2*H*D once per admitted pair; student 2*G*Di once in a forward, four times in a step."""
    n, k = 4096, 2048
    dense = IndexerCase(1, 128, 1, 64, n, n, 576, 128, True, "bfloat16", scale=192**-0.5)
    pairs = n * (n + 1) // 2
    assert dense.pairs == pairs
    assert indexer_kl_flops(dense, "fwd") == pairs * (2 * 128 * 576 + 2 * 64 * 128)
    assert indexer_kl_flops(dense, "train") == pairs * (2 * 128 * 576 + 4 * 2 * 64 * 128)
    sparse = dataclasses.replace(dense, topk=k)
    assert sparse.pairs == k * (k + 1) // 2 + (n - k) * k  # rows that see fewer than K keys take them all
    assert sparse.rows_seen == n
    with pytest.raises(ValueError):
        indexer_kl_flops(dense, "bwd")


@pytest.mark.parametrize("nq,nk,causal", [(24, 24, True), (10, 30, True), (30, 10, True), (12, 20, False)])
def test_topk_sets_are_distinct_keys_the_row_sees(nq, nk, causal):
    case = IndexerCase(1, 2, 1, 2, nq, nk, 8, 8, causal, "float32", topk=6)
    topk = topk_sets(case, "cpu", seed=3)
    assert topk.shape == (1, nq, 6) and topk.dtype == torch.int32
    seen = admitted_mask(1, nq, nk, causal)
    for i in range(nq):
        row = topk[0, i][topk[0, i] >= 0].long()
        assert len(set(row.tolist())) == len(row) == min(6, int(seen[0, i].sum())), (i, row)
        assert seen[0, i, row].all(), i
    assert case.pairs == int(admitted_mask(1, nq, nk, causal, topk).sum())


@pytest.mark.parametrize("hk", [1, 2])
@pytest.mark.parametrize("topk", [0, 6])
def test_teacher_lse_is_each_heads_over_the_admitted_keys(hk, topk):
    case = _case(topk=topk, hk=hk)
    q, k, qi, ki, w, lse, top = make_inputs(case, "cpu", seed=1)
    _, want, _, _ = dense_indexer_kl(q, k, qi, ki, w, topk=top, scale=case.logit_scale)
    torch.testing.assert_close(lse.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(teacher_lse(q, k, case.logit_scale, True, top), lse)


@pytest.mark.parametrize("hk", [1, 2])
@pytest.mark.parametrize("topk", [0, 6])
@pytest.mark.parametrize("head_chunk", [None, 3])
def test_megatron_formula_is_megatrons(hk, topk, head_chunk):
    """In float32 the formula (eager, head-chunked) is the oracle's Megatron formula (the 1e-10 in
    both logs), whose distance to the exact KL tests/test_indexer_kl.py bounds."""
    case = _case(topk=topk, hk=hk)
    q, k, qi, ki, w, _, top = make_inputs(case, "cpu", seed=2)
    got = megatron_indexer_kl(
        q, k, qi, ki, w, top, scale=case.logit_scale, causal=True, head_chunk=head_chunk
    )
    want, _, _ = oracle_megatron(q, k, qi, ki, w, topk=top, scale=case.logit_scale)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)


def _oracle(case, inputs):
    """The float64 definition's per-row KL and the mean loss's gradients to qi, ki, w."""
    q, k, qi, ki, w, _, top = inputs
    leaves = [t.detach().double().requires_grad_() for t in (qi, ki, w)]
    kl, _, _, _ = dense_indexer_kl(q, k, *leaves, topk=top, scale=case.logit_scale)
    return kl, torch.autograd.grad(kl.mean(), leaves)


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("topk", [0, 6], ids=["dense", "sparse"])
@pytest.mark.parametrize(
    "name,lse",
    [
        ("streamkl-reference", "given"),
        ("streamkl-reference", "computed"),
        ("megatron-eager", "given"),  # the formula has no lse input: one case each
        ("megatron-compile", "given"),
        ("megatron-head-chunked", "given"),
    ],
)
def test_providers_agree_with_the_float64_oracle(name, topk, lse):
    """Each provider's forward (per-row KL) and training step (the mean KL, its gradients) in bf16
    against the float64 definition: within bf16's rounding of the logits and of the gradients."""
    case = _case(topk=topk, dtype="bfloat16", lse=lse)
    inputs = make_inputs(case, "cpu", seed=4)
    prov = PROVIDERS[name]
    assert prov.why_not(case, inputs) is None
    kl, grads = _oracle(case, inputs)
    got = prov.fwd(case)(*inputs)
    assert got.shape == (1, case.nq) and got.dtype == torch.float32
    assert (got.double() - kl).abs().max().item() < 2e-2
    loss, *got_grads = prov.train(case)(*inputs)
    assert abs(loss.item() - kl.mean().item()) < 1e-2
    for g, want, t in zip(got_grads, grads, inputs[2:5]):
        assert g.shape == t.shape and _rel(g, want) < 3e-2, (name, _rel(g, want))


def test_streamkl_triton_runs_or_says_why_not():
    """The triton provider: where the backend runs indexer_kl (here, Triton's interpreter), it agrees
    with the oracle; where it does not, its first call raises Unsupported with the library's reason
    (recorded n/a by the harness), never an error."""
    case = _case(n=16, topk=6)
    inputs = make_inputs(case, "cpu", seed=5)
    prov = PROVIDERS["streamkl-triton"]
    try:
        got = prov.fwd(case)(*inputs)
    except Unsupported as exc:
        assert str(exc).startswith("backend not available: backend 'triton' cannot run these inputs"), exc
        return
    kl, grads = _oracle(case, inputs)
    assert (got.double() - kl).abs().max().item() < 1e-4
    _, *got_grads = prov.train(case)(*inputs)
    assert all(_rel(g, want) < 1e-4 for g, want in zip(got_grads, grads))


def test_baselines_say_why_they_do_not_run(monkeypatch):
    """Float32 inputs (the formula's GEMMs are 16-bit), and on a GPU a case whose least memory
    exceeds the device's: refused before it runs, with the sizes; the reference past 2^33 logits."""
    case = _case(dtype="float32")
    inputs = make_inputs(case, "cpu")
    for name in ("megatron-eager", "megatron-compile", "megatron-head-chunked"):
        assert "16-bit" in PROVIDERS[name].why_not(case, inputs)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=141 * 2**30)
    )
    on_gpu = IndexerInputs(*(SimpleNamespace(is_cuda=True, device="cuda") for _ in range(7)))
    deepseek = IndexerCase(1, 128, 1, 64, 0, 0, 576, 128, True, "bfloat16", scale=192**-0.5)
    at = lambda n: dataclasses.replace(deepseek, nq=n * 1024, nk=n * 1024)
    fits = {  # provider: (largest size let through, first refused), in K tokens
        "megatron-eager": (8, 16),  # (B, H, Sq, Sk) bf16 + float32: 48 GiB at 8K, 192 GiB at 16K
        "megatron-compile": (16, 32),  # (B, H, Sq, Sk) bf16: 64 GiB at 16K, 256 GiB at 32K
        "megatron-head-chunked": (16, 32),  # (B, G, Sq, Sk) bf16 + float32: 96 GiB at 16K
        "streamkl-reference": (8, 16),  # up to 2^33 teacher logits on a GPU
    }
    for name, (ok, refused) in fits.items():
        assert PROVIDERS[name].why_not(at(ok), on_gpu) is None, name
        reason = PROVIDERS[name].why_not(at(refused), on_gpu)
        assert reason and ("does not fit" in reason or "2^33" in reason), (name, reason)
    assert "GiB" in PROVIDERS["megatron-eager"].why_not(at(16), on_gpu)


def test_unsupported_is_recorded_not_an_error(tmp_path):
    """A provider whose first call raises Unsupported is n/a with the message; the run goes on."""

    def refuse(case):
        def fn(*inputs):
            raise Unsupported("backend not available: it does not implement indexer_kl")

        return fn

    provs = [Provider("fake", "streamkl", "refuses", refuse, refuse), PROVIDERS["megatron-eager"]]
    run = {
        "environment": bench.environment(torch.device("cpu"), ["test"], commit="0" * 40),
        "config": {"providers": {p.name: p.what for p in provs}, "sweeps": {"dense": ""}},
    }
    runner = bench.Runner(
        torch.device("cpu"),
        provs,
        tmp_path,
        bench.Options(min_run_time=0.001),
        run,
        str,
        op=indexer_bench.op(),
    )
    pieces = [bench.Sweep("dense", "", [_case(n=n, dtype="bfloat16")]) for n in (24, 16)]  # run 24 first
    data = runner.run(pieces)
    got = {(r["provider"], r["case"]["nq"], r["mode"]): r for r in data["records"]}
    assert all(got["fake", n, m]["status"] == "n/a" for n in (16, 24) for m in ("fwd", "train"))
    assert got["fake", 16, "fwd"]["reason"] == "backend not available: it does not implement indexer_kl"
    assert all(got["megatron-eager", n, m]["status"] == "ok" for n in (16, 24) for m in ("fwd", "train"))
    assert {r["op"] for r in data["records"]} == {"indexer_kl"}
    # a sweep run in pieces is reported by size
    md = report.markdown(data)
    assert md.index("| 16 causal bf16 | megatron-eager |") < md.index("| 24 causal bf16 | megatron-eager |")


def test_check_beyond_the_whole_case_budget_names_what_it_left_out():
    """Past the whole-case budget the training step's loss and dki are not checked ("—"), dqi and
    dw are, on the last rows: a row's dqi and dw depend on that row alone."""
    case = _case(n=20, dtype="bfloat16")
    inputs = make_inputs(case, "cpu", seed=6)
    step = PROVIDERS["streamkl-reference"].train(case)(*inputs)
    whole = indexer_bench.IndexerReference(case, inputs, rows=5, full_logits=case.logits).errors(
        step, "train"
    )
    part = indexer_bench.IndexerReference(case, inputs, rows=5, full_logits=0).errors(step, "train")
    assert "all rows" in whole["reference"] and None not in (whole["kl"], whole["dki"])
    assert "last 5 rows" in part["reference"] and part["kl"] is None and part["dki"] is None
    assert "dki" in part["unchecked"] and part["dqi"] < 1e-2 and part["dw"] < 1e-2
    cell = report.error_cell({"error": part})
    assert cell.split(" / ")[0] == "—" and cell.split(" / ")[2] == "—" and cell.count(" / ") == 3


def test_cli_defaults_are_deepseek_v32():
    args = indexer_bench.parser().parse_args(["--sizes", "4k,16k"])
    args.dtype = "bfloat16"
    sweeps = {s.name: s for s in indexer_bench.build_sweeps(["dense", "sparse"], args)}
    for name, topk in (("dense", 0), ("sparse", 2048)):
        cases = sweeps[name].cases
        assert [c.nq for c in cases] == [c.nk for c in cases] == [4096, 16384]
        for c in cases:
            assert (c.b, c.h, c.hk, c.d, c.g, c.di, c.topk, c.causal, c.lse) == (
                1, 128, 1, 576, 64, 128, topk, True, "given",
            )  # fmt: skip
            assert math.isclose(c.logit_scale, 192**-0.5)
    assert indexer_bench.parser().parse_args([]).sweep == "dense,sparse"
    assert [c.nq for c in indexer_bench.build_sweeps(["dense"], args)[0].cases] == [4096, 16384]
    args = indexer_bench.parser().parse_args(["--lse", "computed", "--causal", "both", "--sizes", "1k"])
    args.dtype = "bfloat16"
    cases = indexer_bench.build_sweeps(["dense"], args)[0].cases
    assert [(c.causal, c.lse) for c in cases] == [(True, "computed"), (False, "computed")]
    # a sweep's own sizes, in the order run; a sweep split in pieces to put what matters first
    names = indexer_bench.parse_sweeps("dense:16k+4k,sparse:64k,dense:8k")
    args = indexer_bench.parser().parse_args(["--dtype", "bfloat16"])
    pieces = [(s.name, [c.nq // 1024 for c in s.cases]) for s in indexer_bench.build_sweeps(names, args)]
    assert pieces == [("dense", [16, 4]), ("sparse", [64]), ("dense", [8])]
    bad_sweeps = (["--sweep", "nonsense"], ["--sweep", "dense:4q"], ["--sweep", "n:4k"])
    for bad in (*bad_sweeps, ["--kv-heads", "3"], ["--providers", "nobody", "--smoke"]):
        with pytest.raises(SystemExit):
            indexer_bench.main(bad)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("indexer_bench")
    assert indexer_bench.main(["--smoke", "--out", str(out), "--no-plots"]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_smoke_run_records_every_provider(smoke_run):
    out, data = smoke_run
    run = data["runs"][0]
    assert (
        run["config"]["op"] == "indexer_kl" and run["environment"]["argv"][0] == "benchmarks/indexer_bench.py"
    )
    for key in ("date", "commit", "device", "torch", "triton", "cuda", "driver"):
        assert key in run["environment"], key
    records = data["records"]
    assert {r["sweep"] for r in records} == {"dense", "sparse"} and not [
        r for r in records if r["status"] == "error"
    ]
    for name in ("streamkl-reference", "megatron-eager", "megatron-compile", "megatron-head-chunked"):
        for mode in ("fwd", "train"):
            ok = [r for r in records if (r["provider"], r["mode"], r["status"]) == (name, mode, "ok")]
            assert ok, (name, mode)
            for r in ok:
                assert r["tflops"] > 0 and r["flops"] == indexer_kl_flops(IndexerCase(**r["case"]), mode)
                err = r["error"]
                assert set(err) >= ({"kl", "dqi", "dki", "dw"} if mode == "train" else {"kl"}), err
                c, size = r["case"], getattr(torch, r["case"]["dtype"]).itemsize
                grads = (c["g"] * c["nq"] + c["nk"]) * c["di"] * size + c["g"] * c["nq"] * size
                assert r["out_bytes"] == (4 + grads if mode == "train" else 4 * c["nq"]), r  # loss or KL
                assert all(err[k] < 2e-2 for k in ("kl", "dqi", "dki", "dw") if k in err), r
    cuda = [r for r in records if r["provider"] == "streamkl-cuda"]
    assert cuda and all(r["status"] == "n/a" and "backend not available" in r["reason"] for r in cuda)
    fp32 = [r for r in records if r["case"]["dtype"] == "float32" and r["provider"].startswith("megatron")]
    assert fp32 and all(r["status"] == "n/a" and "16-bit" in r["reason"] for r in fp32)
    md = (out / "results.md").read_text()
    assert md == report.markdown(data) and "# streamkl benchmarks (indexer_kl)" in md
    assert "KL / dqi / dki / dw" in md and "G=3, Di=16" in md and "64 causal bf16 top-16" in md
    assert "lse computed" in md and "## Not run" in md
    assert "| peak extra MiB | beyond outputs MiB | error |" in md  # the gradients apart (on CUDA)
