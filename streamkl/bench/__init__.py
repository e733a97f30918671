"""Benchmarks of streamkl against PyTorch eager, torch.compile and a bf16 GEMM.

    python -m streamkl.bench --smoke                 # CPU, seconds (CI)
    python -m streamkl.bench --sweep all --quick     # one H200 run, about 8 minutes
    python -m streamkl.bench.report results.json     # re-render table and plots

Modules: `flops` (the one FLOP count), `sweeps` (what is measured), `providers` (who is
measured), `timing` (how), `runner` (the loop, failures, JSON), `report` (Markdown, PNG).
"""
