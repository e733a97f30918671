"""python -m streamkl: the main job runs, checks every backend it can and prints the table."""

import pytest

from streamkl.__main__ import main


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
