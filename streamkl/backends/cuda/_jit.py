"""Run-time compilation of the cuda backend's kernels: NVRTC through cuda.core, for sm_90a.

A build is keyed on everything that changes its cubin: the kernel sources (every file under
kernels/, so an edited header invalidates what includes it), the entry point, the compile-time
constants (passed as -D macros; each instantiation is an `extern "C"` entry, so a cubin needs no
name mangling map), the options, the target and the NVRTC version. The cubin and a receipt (the
options and ptxas's resource report) go to a disk cache, written atomically and under a file
lock, so several processes that need the same build compile it once; loaded kernels stay in
memory for the life of the process. Compiling needs no GPU: CI builds every shipped kernel.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import io
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ... import _env

KERNELS = Path(__file__).parent / "kernels"
ARCH = "sm_90a"  # wgmma and setmaxnreg exist only on the arch-specific target
_OPTIONS = ("-std=c++17", "-default-device", "-lineinfo")


@dataclass(frozen=True)
class Build:
    """One compiled entry point: the cubin and what ptxas reported about it."""

    key: str
    entry: str
    cubin: bytes
    options: tuple[str, ...]
    log: str  # ptxas -v output
    registers: int
    spill_bytes: int  # spill stores + spill loads
    stack_bytes: int
    compile_seconds: float  # 0 when it came from the disk cache
    from_cache: bool


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return major, minor


def cache_dir() -> Path:
    """STREAMKL_CACHE_DIR, else $XDG_CACHE_HOME/streamkl, else ~/.cache/streamkl."""
    root = _env.cache_dir()
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "streamkl")
    return Path(root) / "cubin"


def _sources_digest() -> str:
    """Every kernel source and header under KERNELS (any of them may be #included), by path."""
    digest = hashlib.sha256()
    for path in sorted(KERNELS.rglob("*")):
        if path.suffix in (".cu", ".cuh"):
            digest.update(path.relative_to(KERNELS).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _macros(constants: dict[str, int | str]) -> tuple[str, ...]:
    return tuple(f"-D{name}={value}" for name, value in sorted(constants.items()))


def build_key(source: str, entry: str, constants: dict, arch: str = ARCH) -> str:
    """The cache key of one build (hex sha256)."""
    parts = {
        "source": hashlib.sha256(source.encode()).hexdigest(),
        "kernels": _sources_digest(),
        "entry": entry,
        "options": [*_OPTIONS, *_macros(constants)],
        "arch": arch,
        "nvrtc": list(nvrtc_version()),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def _resources(log: str, entry: str) -> dict[str, int]:
    """Registers, stack and spill bytes of `entry` from ptxas's -v report."""
    section = log.split(f"Function properties for {entry}", 1)[-1]
    found = {}
    for name, pattern in _PTXAS.items():
        match = pattern.search(section)
        if match is None:
            raise RuntimeError(f"ptxas reported no {name} for {entry}:\n{log}")
        found[name] = int(match.group(1))
    return found


def _compile(
    source: str, entry: str, constants: dict, arch: str
) -> tuple[bytes, tuple[str, ...], str, float]:
    from cuda.core import Program, ProgramOptions

    macros = [(name, str(value)) for name, value in sorted(constants.items())]
    options = ProgramOptions(
        arch=arch,
        std="c++17",
        device_as_default_execution_space=True,
        lineinfo=True,
        include_path=[str(KERNELS)],
        define_macro=macros,
        ptxas_options=["-v"],
        no_cache=True,  # NVRTC's own cache would hide ptxas's report on a hit
        name=f"{entry}.cu",
    )
    shown = (f"-arch={arch}", *_OPTIONS, *_macros(constants), f"-I{KERNELS}")
    log = io.StringIO()
    start = time.perf_counter()
    try:
        code = Program(source, "c++", options).compile("cubin", logs=log)
    except Exception as exc:  # NVRTC's error carries the whole compilation log
        raise RuntimeError(
            f"NVRTC could not compile {entry} with options {' '.join(shown)}:\n{exc}\n{log.getvalue()}"
        ) from exc
    return bytes(code.code), shown, log.getvalue(), time.perf_counter() - start


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _read(directory: Path, key: str, entry: str) -> Build | None:
    receipt, cubin = directory / f"{key}.json", directory / f"{key}.cubin"
    if not receipt.exists():  # written after the cubin, so its presence means both are whole
        return None
    meta = json.loads(receipt.read_text())
    options = tuple(meta["options"])
    resources = (meta["registers"], meta["spill_bytes"], meta["stack_bytes"])
    return Build(key, entry, cubin.read_bytes(), options, meta["log"], *resources, 0.0, True)


_BUILT: dict[tuple, Build] = {}


def compile_kernel(source: str, entry: str, constants: dict | None = None, arch: str = ARCH) -> Build:
    """The cubin of `entry` in `source` with `constants` as -D macros: from this process's
    memory, else from the disk cache when it holds this build, else compiled by NVRTC (once
    across processes) and stored there."""
    constants = dict(constants or {})
    memo = (source, entry, tuple(sorted(constants.items())), arch, str(cache_dir()))
    if memo in _BUILT:
        return _BUILT[memo]
    _BUILT[memo] = build = _build(source, entry, constants, arch)
    return build


def _build(source: str, entry: str, constants: dict, arch: str) -> Build:
    key = build_key(source, entry, constants, arch)
    directory = cache_dir()
    found = _read(directory, key, entry)
    if found is not None:
        return found
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be compiling the same build
        found = _read(directory, key, entry)
        if found is not None:
            return found
        cubin, shown, log, seconds = _compile(source, entry, constants, arch)
        res = _resources(log, entry)
        spills = res["spill_stores"] + res["spill_loads"]
        meta = dict(
            options=list(shown),
            log=log,
            registers=res["registers"],
            spill_bytes=spills,
            stack_bytes=res["stack"],
            entry=entry,
            nvrtc=list(nvrtc_version()),
        )
        _write_atomically(directory / f"{key}.cubin", cubin)
        _write_atomically(directory / f"{key}.json", json.dumps(meta, indent=1).encode())
    return Build(key, entry, cubin, shown, log, res["registers"], spills, res["stack"], seconds, False)


_LOADED: dict[tuple[str, int, str], object] = {}


def load(build: Build, device_index: int, entry: str | None = None):
    """The cuda.core Kernel of a build's entry point (default: the one it was compiled for, whose
    resources it reports; another kernel of the same source by name) on one device, loaded once
    per process."""
    entry = entry or build.entry
    kernel = _LOADED.get((build.key, device_index, entry))
    if kernel is None:
        from cuda.core import Device, ObjectCode

        Device(device_index).set_current()
        kernel = ObjectCode.from_cubin(build.cubin).get_kernel(entry)
        _LOADED[(build.key, device_index, entry)] = kernel
    return kernel
