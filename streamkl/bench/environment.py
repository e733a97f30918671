"""What a result file records about the machine and the software that produced it."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

_PACKAGES = (
    "torch",
    "triton",
    "cuda-python",
    "cuda-bindings",
    "cuda-core",
    "nvidia-cuda-nvrtc",
    "nvidia-cuda-nvrtc-cu12",
    "matplotlib",
    "numpy",
)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    except Exception:  # a broken install must not stop a benchmark run
        return None


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
        return out.stdout.strip()
    except Exception:
        return None


def git_commit(repo: Path | None = None, override: str | None = None) -> dict:
    """The commit of the checkout the package was imported from, read with git when it is
    there, else from .git files; `override` (``--commit``) wins, for copies without .git."""
    if override:
        return {"commit": override, "dirty": None, "source": "--commit"}
    if os.environ.get("STREAMKL_BENCH_COMMIT"):
        return {
            "commit": os.environ["STREAMKL_BENCH_COMMIT"],
            "dirty": None,
            "source": "STREAMKL_BENCH_COMMIT",
        }
    repo = repo or Path(__file__).resolve().parents[2]
    sha = _run(["git", "-C", str(repo), "rev-parse", "HEAD"])
    if sha:
        status = _run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"])
        return {"commit": sha, "dirty": bool(status), "source": "git"}
    head = repo / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref:"):
            ref_path = repo / ".git" / ref.split(" ", 1)[1]
            return {"commit": ref_path.read_text().strip(), "dirty": None, "source": ".git files"}
        return {"commit": ref, "dirty": None, "source": ".git files"}
    except OSError:
        return {"commit": None, "dirty": None, "source": "unknown (no .git; pass --commit)"}


def device_info(device: torch.device) -> dict:
    info: dict = {"type": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            sm_count=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            total_memory_bytes=props.total_memory,
            l2_cache_bytes=getattr(props, "L2_cache_size", None),
            cuda_runtime=torch.version.cuda,
        )
        smi = _run(
            [
                "nvidia-smi",
                f"--id={device.index or 0}",
                "--query-gpu=driver_version,clocks.max.sm,clocks.sm,power.limit,temperature.gpu",
                "--format=csv,noheader",
            ]
        )
        if smi:
            fields = [f.strip() for f in smi.split(",")]
            keys = ("driver", "max_sm_clock", "sm_clock_at_start", "power_limit", "temperature_at_start")
            info.update(dict(zip(keys, fields)))
        else:
            info["driver"] = None
    else:
        cpu = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        info.update(name=cpu, cores=os.cpu_count(), threads=torch.get_num_threads())
    return info


def clocks(device: torch.device) -> dict | None:
    """SM clock, power draw and temperature now (nvidia-smi), to see throttling over a run."""
    if device.type != "cuda":
        return None
    smi = _run(
        [
            "nvidia-smi",
            f"--id={device.index or 0}",
            "--query-gpu=clocks.sm,power.draw,temperature.gpu",
            "--format=csv,noheader",
        ]
    )
    if not smi:
        return None
    return dict(zip(("sm_clock", "power_draw", "temperature"), (f.strip() for f in smi.split(","))))


def device_slug(info: dict) -> str:
    """A short folder-friendly name: 'h200', 'h100-80gb-hbm3', 'cpu'."""
    if info.get("type") != "cuda":
        return "cpu"
    name = str(info.get("name", "gpu")).lower().replace("nvidia", "")
    slug = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return slug or "gpu"


def _tf32():
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except Exception:
        return None


def collect(device: torch.device, argv: list[str], commit: str | None = None) -> dict:
    now = _dt.datetime.now(_dt.timezone.utc)
    return {
        "date": now.strftime("%Y-%m-%d"),
        "time_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "argv": list(argv),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "versions": {name: _version(name) for name in _PACKAGES if _version(name) is not None}
        | {"torch_runtime": torch.__version__},
        "git": git_commit(override=commit),
        "device": device_info(device),
        "env": {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("STREAMKL_", "TRITON_", "CUDA_VISIBLE", "TORCHINDUCTOR_"))
        },
        "tf32_matmul": _tf32(),
    }
