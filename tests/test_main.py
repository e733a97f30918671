"""python -m streamkl: the main job prints one row per backend; a row that runs is checked, KL and
gradients, against the dense formula in float64; `auto` runs and names its pick; Nk = 0 runs;
--help shows the defaults; bad arguments end in a usage error (exit status 2, no traceback); a
backend that cannot run is one row saying why, and the exit status is 1 when it was named."""

import os
import re
import subprocess
import sys

import pytest
import torch

from streamkl import __main__ as cli
from streamkl import _dispatch
from streamkl.__main__ import main
from streamkl.testing import dense_attn_kl, make_inputs

SMALL = ["--heads", "2", "--seqlen", "16", "--dim", "8", "--device", "cpu"]
HEADER = ["backend", "kl", "err", "grad", "err", "check", "fwd", "ms", "fwd+bwd", "ms", "extra", "MiB"]


@pytest.fixture(autouse=True)
def _no_triton_interpreter(monkeypatch):
    """Triton runs CPU tensors only under TRITON_INTERPRET (slow): here it is a backend that
    cannot run, as on a user's CPU machine."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _table(out):
    """The table's lines, header first, without the notes under it."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["backend"])
    names = ("auto", *_dispatch.BACKENDS)
    return [lines[start]] + [
        line for line in lines[start + 1 :] if line.split(maxsplit=1)[0].rstrip(":") in names
    ]


def _row(out, label):
    """The cells of the table row whose backend column starts with `label`."""
    (line,) = [line for line in _table(out)[1:] if line.strip().startswith(label)]
    return line.strip()[len(label) :].split()


def _reference_module():
    return _dispatch.implementation("reference", "attn_kl")


def test_main_job_prints_one_checked_row_per_backend(capsys):
    assert main(["--heads", "2", "--seqlen", "24", "--nk", "40", "--dim", "16", "--causal"]) == 0
    out = capsys.readouterr().out
    table = _table(out)
    assert table[0].split() == HEADER
    assert [line.split()[0] for line in table[1:]] == list(_dispatch.BACKENDS)  # one row each
    kl_err, grad_err, check, fwd_ms, fwd_bwd_ms, extra = _row(out, "reference")
    assert check == "ok"
    assert float(kl_err) <= cli.kl_tolerance(torch.float32)
    assert float(grad_err) <= cli.grad_tolerance(torch.float32)
    assert float(fwd_ms) > 0 and float(fwd_bwd_ms) > 0 and float(extra) >= 0
    assert _row(out, "triton")[:2] == ["not", "run:"] and _row(out, "cuda")[:2] == ["not", "run:"]
    assert "attn_kl's default (auto) runs these inputs on: reference" in out


def test_help_lists_options_with_their_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    options = capsys.readouterr().out.split("\noptions:\n", 1)[1]
    entries = {e.split()[0]: " ".join(e.split()) for e in re.split(r"\n  (?=-)", options)}
    defaults = cli._parser().parse_args([])
    for option in ("--batch", "--heads", "--seqlen", "--dim", "--dtype", "--device"):
        assert f"(default: {getattr(defaults, option[2:])})" in entries[option], entries[option]
    assert "default: --heads" in entries["--heads-kv"] and "if different from --seqlen" in entries["--nk"]
    for option in ("--causal", "--backend"):
        assert option in entries


def test_table_says_what_each_column_measures(capsys):
    assert main([*SMALL, "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert "kl err: max over rows of |kl - ref| / max(1, |ref|)" in out
    assert "grad err: the largest of ||dx - ref|| / ||ref|| over dq1, dk1, dq2, dk2" in out
    assert "ref: the dense formula in float64 (streamkl.testing.dense_attn_kl), gradients by autograd" in out
    tol = (
        f"kl err <= {cli.kl_tolerance(torch.float32):g} and grad err <= {cli.grad_tolerance(torch.float32):g}"
    )
    assert tol in out
    assert "extra MiB: peak bytes allocated during one forward+backward beyond the inputs" in out
    assert "call returns (kl, lse1, lse2 and the four gradients)" in out


def test_auto_runs_and_names_the_backend_it_picks(capsys):
    assert main([*SMALL, "--backend", "auto"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "auto: reference")[2] == "ok"
    assert len(_table(out)) == 2


def test_no_keys_is_a_run_whose_kl_and_gradients_are_zero(capsys):
    """Nk = 0: every row sees no key; the reference KL and gradients are 0, so the errors are
    the backend's values themselves."""
    assert main([*SMALL, "--nk", "0", "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert "Nk=0" in out
    kl_err, grad_err, check = _row(out, "reference")[:3]
    assert check == "ok" and float(kl_err) == 0.0 and float(grad_err) == 0.0


@pytest.mark.parametrize("which", ["kl", "dq1", "dk1", "dq2", "dk2"])
def test_check_fails_a_backend_whose_kl_or_one_gradient_is_off(capsys, monkeypatch, which):
    """Each of the five outputs is checked: one off by 1% fails the row and the exit status."""
    impl = _reference_module()
    forward, backward = impl.forward, impl.backward
    index = ["kl", "dq1", "dk1", "dq2", "dk2"].index(which)

    def kl_off(spec, inputs):
        kl, lse1, lse2 = forward(spec, inputs)
        return kl * 1.01, lse1, lse2

    def grad_off(spec, inputs, stats, grad):
        grads = list(backward(spec, inputs, stats, grad))
        grads[index - 1] = grads[index - 1] * 1.01
        return tuple(grads)

    if which == "kl":
        monkeypatch.setattr(impl, "forward", kl_off)
    else:
        monkeypatch.setattr(impl, "backward", grad_off)
    assert main([*SMALL, "--backend", "reference"]) == 1
    assert _row(capsys.readouterr().out, "reference")[2] == "FAIL"


def test_dense_check_by_chunks_is_the_dense_formula(monkeypatch):
    """The check's reference runs per batch, per group of heads sharing key heads and per chunk
    of query rows (bounded memory); it equals the dense formula on the whole tensors."""
    monkeypatch.setattr(cli, "_DENSE_CHUNK_BYTES", 1)  # one query row per chunk
    for nq, nk, causal in ((5, 7, True), (7, 3, True), (6, 6, False), (4, 0, True)):
        inputs = make_inputs(b=2, h=4, nq=nq, nk=nk, d1=8, d2=4, hk1=2, hk2=1, dtype=torch.float64)
        grad = torch.randn(2, 4, nq, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        kl, grads = cli._dense_reference(inputs, causal, 0.4, 0.6, grad)
        leaves = [t.clone().requires_grad_() for t in inputs]
        whole = dense_attn_kl(*leaves, causal=causal, scale1=0.4, scale2=0.6)
        expected = torch.autograd.grad(whole, leaves, grad, allow_unused=True) if whole.requires_grad else ()
        torch.testing.assert_close(kl, whole.detach(), rtol=1e-12, atol=1e-12)
        for got, ref, t in zip(grads, expected or [None] * 4, inputs):
            ref = torch.zeros_like(t) if ref is None else ref
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def _usage_error(capsys, argv, *words):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m streamkl") and "python -m streamkl: error:" in err
    assert "Traceback" not in err
    for word in words:
        assert word in err
    return err


@pytest.mark.parametrize(
    "option, value",
    [
        ("--seqlen", "0"),
        ("--seqlen", "-3"),
        ("--heads", "0"),
        ("--batch", "0"),
        ("--dim", "0"),
        ("--dim2", "-2"),
        ("--heads-kv", "0"),
    ],
)
def test_sizes_below_one_are_usage_errors(capsys, option, value):
    _usage_error(capsys, [*SMALL, option, value], option, "must be a positive integer")


def test_negative_key_count_is_a_usage_error(capsys):
    _usage_error(capsys, [*SMALL, "--nk", "-1"], "--nk", "must be a non-negative integer")


def test_unknown_backend_is_a_usage_error(capsys):
    _usage_error(capsys, [*SMALL, "--backend", "bogus"], "--backend", "invalid choice: 'bogus'", "'auto'")


def test_heads_kv_must_divide_heads(capsys):
    _usage_error(capsys, ["--heads", "4", "--heads-kv", "3", "--seqlen", "8"], "3 does not divide --heads 4")


def test_cuda_device_without_a_gpu_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _usage_error(capsys, [*SMALL, "--device", "cuda"], "--device", "no CUDA GPU")


# ids: conftest skips a test whose keywords include "gpu" on a machine without one
@pytest.mark.parametrize("device", ["gpu", "meta", ""], ids=["not_a_device", "meta", "empty"])
def test_unknown_device_is_a_usage_error(capsys, device):
    _usage_error(capsys, [*SMALL, "--device", device], "--device", "expected cpu, cuda or cuda:N")


def test_named_backend_that_cannot_run_is_one_row_and_fails(capsys):
    assert main([*SMALL, "--backend", "reference", "--backend", "triton"]) == 1
    captured = capsys.readouterr()
    assert _row(captured.out, "reference")[2] == "ok"
    assert " ".join(_row(captured.out, "triton")).startswith("not run: triton backend runs CUDA tensors")
    assert "backend 'triton' cannot run here: triton backend runs CUDA tensors" in captured.err
    assert "Traceback" not in captured.err


def test_a_backend_that_raises_fails_its_row_and_the_others_run(capsys, monkeypatch):
    cuda = _dispatch.implementation("cuda", "attn_kl")

    def broken(spec, inputs):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(cuda, "supports", lambda spec, inputs: None)
    monkeypatch.setattr(cuda, "forward", broken)
    assert main(SMALL) == 1
    captured = capsys.readouterr()
    assert " ".join(_row(captured.out, "cuda")).endswith("FAIL: RuntimeError: launch failed")
    assert _row(captured.out, "reference")[2] == "ok"
    assert "backend 'cuda' raised RuntimeError: launch failed" in captured.err


def test_a_forward_only_backend_runs_with_the_backward_it_borrows(capsys, monkeypatch):
    """A backend without a backward of its own (the cuda one) gets a row: its forward, checked
    and timed with the backward it names."""
    cuda, reference = _dispatch.implementation("cuda", "attn_kl"), _reference_module()
    monkeypatch.setattr(cuda, "supports", lambda spec, inputs: None)
    monkeypatch.setattr(cuda, "forward", reference.forward)
    monkeypatch.setattr(cuda, "backward_backend", "reference")
    # its own backward declines (on CPU tensors it could not run; the real forward refuses them)
    monkeypatch.setattr(cuda, "backward_declines", lambda spec, inputs: "borrowed for this test")
    assert main([*SMALL, "--backend", "cuda"]) == 0
    assert _row(capsys.readouterr().out, "cuda (+reference backward)")[2] == "ok"


def test_command_line_warns_nothing_and_imports_no_bench():
    """The real entry point, in a fresh interpreter with every warning an error: the main job
    runs (no torch NumPy warning, nothing else), a bad argument gives the usage error, and the
    job never imports the benchmark harness (benchmarks/)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-W", "error", "-m", "streamkl", "--heads", "1", "--seqlen", "8", "--dim", "8"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0 and run.stderr == "", run.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "streamkl", "--heads", "4", "--heads-kv", "3"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "usage:" in bad.stderr
    code = (
        "import sys; from streamkl.__main__ import main; "
        "assert main(['--heads', '2', '--seqlen', '8', '--dim', '8', '--device', 'cpu',"
        " '--backend', 'reference']) == 0; "
        "assert not [m for m in sys.modules if m.startswith(('benchmarks', 'streamkl.bench'))], sys.modules"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
