"""The cuda backend's run-time compiler: NVRTC for sm_90a without a GPU, the disk cache (one
compile across processes, atomic files, keyed on everything that changes the cubin), ptxas's
resource report, and compile errors that carry the options and NVRTC's log."""

import multiprocessing
import os
import re
import shutil

import pytest

pytest.importorskip("cuda.core")

from streamkl.backends.cuda import _jit  # noqa: E402

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(BLOCK) scale_rows(float* x, float a, int n) {
  int i = blockIdx.x * BLOCK + threadIdx.x;
  if (i < n) x[i] *= a;
}
"""


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMKL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_jit, "_BUILT", {})  # each test starts with nothing in memory
    return tmp_path


def _compiles(monkeypatch):
    calls = []
    original = _jit._compile

    def counted(*args):
        calls.append(args[1])
        return original(*args)

    monkeypatch.setattr(_jit, "_compile", counted)
    return calls


def test_builds_for_sm90a_and_reads_the_resource_report(monkeypatch, _cache):
    calls = _compiles(monkeypatch)
    build = _jit.compile_kernel(SOURCE, "scale_rows", {"BLOCK": 128})
    assert build.cubin[:4] == b"\x7fELF" and not build.from_cache and calls == ["scale_rows"]
    assert 0 < build.registers <= 255 and build.spill_bytes == 0 and build.stack_bytes == 0
    assert "-arch=sm_90a" in build.options and "-DBLOCK=128" in build.options
    assert sorted(p.suffix for p in (_cache / "cubin").iterdir()) == [".cubin", ".json", ".lock"]


def test_second_call_comes_from_the_disk_cache(monkeypatch):
    first = _jit.compile_kernel(SOURCE, "scale_rows", {"BLOCK": 64})
    assert _jit.compile_kernel(SOURCE, "scale_rows", {"BLOCK": 64}) is first  # in memory
    monkeypatch.setattr(_jit, "_BUILT", {})  # a new process: only the disk cache remains
    calls = _compiles(monkeypatch)
    again = _jit.compile_kernel(SOURCE, "scale_rows", {"BLOCK": 64})
    assert calls == [] and again.from_cache and again.cubin == first.cubin
    assert (again.registers, again.spill_bytes) == (first.registers, first.spill_bytes)


def test_key_covers_constants_source_and_kernel_headers(monkeypatch, tmp_path):
    base = _jit.build_key(SOURCE, "scale_rows", {"BLOCK": 64})
    assert _jit.build_key(SOURCE, "scale_rows", {"BLOCK": 128}) != base
    assert _jit.build_key(SOURCE + "\n", "scale_rows", {"BLOCK": 64}) != base
    assert _jit.build_key(SOURCE, "scale_rows", {"BLOCK": 64}, arch="sm_100a") != base
    headers = tmp_path / "kernels"
    headers.mkdir()
    (headers / "common.cuh").write_text("#define X 1\n")
    monkeypatch.setattr(_jit, "KERNELS", headers)
    with_header = _jit.build_key(SOURCE, "scale_rows", {"BLOCK": 64})
    (headers / "common.cuh").write_text("#define X 2\n")
    assert _jit.build_key(SOURCE, "scale_rows", {"BLOCK": 64}) != with_header


def test_key_covers_every_file_the_forward_includes(monkeypatch, tmp_path):
    """The shipped kernel's key changes with any of its sources: kl_fwd.cu and each header it
    includes (NVRTC resolves them in the same folder)."""
    from streamkl.backends.cuda import _launch

    kernels = tmp_path / "kernels"
    shutil.copytree(_jit.KERNELS, kernels)
    monkeypatch.setattr(_jit, "KERNELS", kernels)
    consts = _launch.shipped_instantiations()[0]
    main = (kernels / _launch.SOURCE_FILE).read_text()
    included = set(re.findall(r'#include "([^"]+)"', main))
    for path in kernels.glob("*.cuh"):
        included |= set(re.findall(r'#include "([^"]+)"', path.read_text()))
    assert included <= {p.name for p in kernels.iterdir()}
    keys = {_jit.build_key(main, _launch.ENTRY, consts)}
    for name in sorted(included):
        with open(kernels / name, "a") as f:
            f.write("// edited\n")
        keys.add(_jit.build_key((kernels / _launch.SOURCE_FILE).read_text(), _launch.ENTRY, consts))
    assert len(keys) == len(included) + 1


def _compile_in_child(block):
    build = _jit.compile_kernel(SOURCE, "scale_rows", {"BLOCK": block})
    return build.from_cache, len(build.cubin)


def test_processes_compiling_the_same_build_compile_it_once(_cache):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        results = pool.map(_compile_in_child, [96, 96, 96])
    assert sum(not cached for cached, _ in results) == 1  # the others waited and read it
    assert len({size for _, size in results}) == 1
    assert not [p for p in os.listdir(_cache / "cubin") if p.endswith(".tmp")]


def test_compile_error_names_options_and_log():
    with pytest.raises(RuntimeError, match=r"(?s)could not compile broken .*-arch=sm_90a.*-DBLOCK=32.*error"):
        _jit.compile_kernel('extern "C" __global__ void broken( { }', "broken", {"BLOCK": 32})
