"""nox sessions. `nox -s tests` is what CI runs (CPU only); the GPU sessions reuse the machine's
own CUDA torch and triton instead of installing a CPU build."""

import os

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"

# The CPU build that lies on these machines' disk; an unpinned resolve pulls gigabytes of CUDA.
TORCH_CPU = "torch==2.13.0"
# The oldest torch pyproject.toml admits, CPU build, from PyTorch's own index.
TORCH_MIN_CPU = "torch==2.11.0+cpu"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@nox.session
def tests(session):
    """The CPU suite: reference, op, compile, errors, hypothesis, triton interpreter, bench smoke;
    one pytest-xdist worker per core (the triton interpreter and the gloo ranks are single
    processes, so two cores run it in three quarters of the time)."""
    session.install(TORCH_CPU)
    session.install("-e", ".[test,triton,bench,cuda]")
    env = {"HYPOTHESIS_PROFILE": "ci", "PYTHONUNBUFFERED": "1"}
    session.run("pytest", "-q", "-n", "auto", *session.posargs, env=env)


@nox.session
def tests_torch_min(session):
    """The CPU suite on the oldest torch pyproject.toml admits (not a default session: it fetches
    torch from PyTorch's CPU index)."""
    session.install(TORCH_MIN_CPU, "--extra-index-url", TORCH_CPU_INDEX)
    session.install("-e", ".[test,triton,bench,cuda]")
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
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
    paths = [
        p for p in ("streamkl", "tests", "benchmarks", "lab", "examples", "noxfile.py") if os.path.exists(p)
    ]
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


@nox.session
def package(session):
    """The wheel carries what runs from it: py.typed, the LICENSE and every CUDA kernel source."""
    out = session.create_tmp()
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, ".")
    session.run("python", "-c", _WHEEL_CHECK, out)


# Run by `package`: every .cu/.cuh under the cuda backend's kernels/ must be in the wheel.
_WHEEL_CHECK = """
import pathlib, sys, zipfile
(wheel,) = pathlib.Path(sys.argv[1]).glob("streamkl-*.whl")
names = set(zipfile.ZipFile(wheel).namelist())
kernels = pathlib.Path("streamkl/backends/cuda/kernels")
want = {p.as_posix() for p in kernels.rglob("*") if p.suffix in (".cu", ".cuh")} | {"streamkl/py.typed"}
missing = sorted(want - names) + ([] if any(n.endswith("licenses/LICENSE") for n in names) else ["LICENSE"])
assert not missing, f"{wheel.name} lacks {missing}"
print(wheel.name, "carries", len(want), "package files and the LICENSE")
"""
