"""python -m streamkl: the main job runs, checks every backend it can and prints the table; bad
arguments end in a usage error (exit status 2, no traceback); a backend named with --backend that
cannot run here makes the exit status 1."""

import subprocess
import sys

import pytest
import torch

from streamkl.__main__ import main

SMALL = ["--heads", "2", "--seqlen", "16", "--dim", "8"]


def test_main_job_prints_a_checked_table(capsys):
    assert main(["--heads", "2", "--seqlen", "64", "--dim", "16", "--causal"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("backend"))
    assert header.split() == ["backend", "max", "err", "check", "fwd", "ms", "fwd+bwd", "ms", "extra", "MiB"]
    reference = next(line for line in out.splitlines() if line.lstrip().startswith("reference"))
    name, err, check, fwd_ms, fwd_bwd_ms, extra = reference.split()
    assert check == "ok" and float(err) < 1e-4 and float(fwd_ms) > 0 and float(fwd_bwd_ms) > 0
    assert float(extra) >= 0


def test_main_job_help_lists_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--seqlen", "--dtype", "--causal", "--backend", "--heads-kv"):
        assert option in out


def test_table_says_what_extra_memory_measures(capsys):
    assert main([*SMALL, "--backend", "reference", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "extra MiB: peak bytes allocated during one forward+backward beyond the inputs" in out
    assert "call returns (kl, lse1, lse2 and the four gradients)" in out


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
        ("--nk", "0"),
        ("--nk", "-1"),
        ("--heads", "0"),
        ("--batch", "0"),
        ("--dim", "0"),
        ("--dim2", "-2"),
        ("--heads-kv", "0"),
    ],
)
def test_sizes_below_one_are_usage_errors(capsys, option, value):
    _usage_error(capsys, [*SMALL, option, value], option, "must be a positive integer")


def test_heads_kv_must_divide_heads(capsys):
    _usage_error(capsys, ["--heads", "4", "--heads-kv", "3", "--seqlen", "8"], "3 does not divide --heads 4")


def test_cuda_device_without_a_gpu_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _usage_error(capsys, [*SMALL, "--device", "cuda"], "--device", "no CUDA GPU")


# ids: conftest skips a test whose keywords include "gpu" on a machine without one
@pytest.mark.parametrize("device", ["gpu", "meta", ""], ids=["not_a_device", "meta", "empty"])
def test_unknown_device_is_a_usage_error(capsys, device):
    _usage_error(capsys, [*SMALL, "--device", device], "--device", "expected cpu, cuda or cuda:N")


def test_named_backend_that_cannot_run_fails(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # triton runs CPU tensors only under it
    assert main([*SMALL, "--device", "cpu", "--backend", "triton"]) == 1
    captured = capsys.readouterr()
    assert "triton: not run: " in captured.out
    assert "backend 'triton' cannot run here: triton backend runs CUDA tensors" in captured.err
    assert "Traceback" not in captured.err


def test_named_backend_that_cannot_run_fails_next_to_one_that_runs(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main([*SMALL, "--device", "cpu", "--backend", "reference", "--backend", "triton"]) == 1
    out = capsys.readouterr().out
    reference = next(line for line in out.splitlines() if line.lstrip().startswith("reference"))
    assert reference.split()[2] == "ok"


def test_backends_that_cannot_run_are_listed_without_failing(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main([*SMALL, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "  cuda: not run: " in out and "  triton: not run: " in out


def test_command_line_prints_no_traceback_and_imports_no_bench():
    """The real entry point, in a fresh interpreter: a bad argument gives the usage error, and the
    job never imports the benchmark harness (benchmarks/)."""
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
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_a_forward_only_backend_runs_with_the_backward_it_borrows(capsys, monkeypatch):
    """A backend without a backward of its own (the cuda one) gets a row: its forward, timed with
    the backward it names."""
    from streamkl import _dispatch

    cuda, reference = _dispatch.module("cuda"), _dispatch.module("reference")
    monkeypatch.setattr(cuda, "supports", lambda *args, **kwargs: None)
    monkeypatch.setattr(cuda, "forward", reference.forward)
    monkeypatch.setattr(cuda, "BACKWARD", "reference")
    assert main([*SMALL, "--device", "cpu", "--backend", "cuda"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "cuda (+reference backward)" in line)
    assert " ok " in row
