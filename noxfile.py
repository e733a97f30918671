"""nox sessions. `nox -s tests` is what CI runs (CPU only); the GPU sessions reuse the machine's
own CUDA torch and triton instead of installing a CPU build."""

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

# The CPU build that lies on these machines' disk; an unpinned resolve pulls gigabytes of CUDA.
TORCH_CPU = "torch==2.13.0"


@nox.session
def tests(session):
    """The CPU suite: reference, op, compile, errors, hypothesis, triton interpreter, bench smoke."""
    session.install(TORCH_CPU)
    session.install("-e", ".[test,triton,bench,cuda]")
    session.run("pytest", "-q", *session.posargs, env={"HYPOTHESIS_PROFILE": "ci", "PYTHONUNBUFFERED": "1"})


@nox.session(venv_params=["--system-site-packages"])
def tests_gpu(session):
    """Tests marked gpu, on a CUDA machine with torch and triton already installed."""
    session.install("--no-deps", "-e", ".")
    session.run("pytest", "-q", "-m", "gpu", *session.posargs)


@nox.session(venv_params=["--system-site-packages"])
def bench(session):
    """The harness on this machine's GPU (arguments after -- pass through), then the
    pytest-benchmark runs of the same providers."""
    session.install("--no-deps", "-e", ".")
    session.run("python", "benchmarks/bench.py", *session.posargs)
    session.run("pytest", "-q", "-m", "bench", "benchmarks", "--benchmark-only")


@nox.session
def lint(session):
    session.install("ruff")
    paths = ("streamkl", "tests", "benchmarks", "noxfile.py")
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session
def import_minimal(session):
    """Importing streamkl and running the reference needs torch alone."""
    session.install(TORCH_CPU)
    session.install("--no-deps", "-e", ".")
    session.run(
        "python",
        "-c",
        "import torch, streamkl; q = torch.randn(1, 2, 8, 16); "
        "print(streamkl.attn_kl(q, q, q.flip(2), q)); "
        "print(streamkl.available_backends(q, q, q, q))",
    )
