"""Did a source edit change the machine code? Compiles every shipped instantiation of the cuda
forward (streamkl/backends/cuda/_launch.py, shipped_instantiations) with this tree's sources,
from scratch (a fresh cache directory), and saves per instantiation the SASS of the cubin (both
entry points, every instruction with its encoding and control bits, as `cuobjdump -sass` prints
it) and ptxas's resources. `compare` reads two such saves and reports, per instantiation,
whether the SASS is identical, and the resources side by side. Needs no GPU.

    python lab/cuda/sass_compare.py save /tmp/sass_before       # on the tree before an edit
    python lab/cuda/sass_compare.py save /tmp/sass_after        # after it
    python lab/cuda/sass_compare.py compare /tmp/sass_before /tmp/sass_after

cuobjdump comes from the CUDA toolkit on PATH or, failing that, triton's bundled copy.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton

        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    raise SystemExit("no cuobjdump: install the CUDA toolkit or triton")


def name(consts: dict) -> str:
    """An instantiation's name from the constants every version of the launcher sets."""
    dtype = "fp16" if consts["KL_FP16"] else "bf16"
    return f"{dtype}-d{consts['D1P']}x{consts['D2P']}" + ("-decode" if consts.get("DECODE") else "")


def sass(cubin: bytes, tool: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip()) + "\n"


def save(out: Path) -> int:
    # a cache of its own: every build compiled by this tree's NVRTC, none read from another run
    os.environ["STREAMKL_CACHE_DIR"] = tempfile.mkdtemp(prefix="sass_compare_")
    from streamkl.backends.cuda import _jit, _launch

    tool = cuobjdump()
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for consts in _launch.shipped_instantiations():
        build = _jit.compile_kernel(_launch.source(), _launch.ENTRY, consts)
        key = name(consts)
        (out / f"{key}.sass").write_text(sass(build.cubin, tool))
        summary[key] = dict(
            consts=consts,
            registers=build.registers,
            spill_bytes=build.spill_bytes,
            stack_bytes=build.stack_bytes,
            smem_bytes=_launch.smem_bytes(consts),
            serialized="serialized" in build.log,
            log=build.log,
        )
        print(f"{key}: {build.registers} registers, {build.spill_bytes} B spills, "
              f"{build.compile_seconds:.1f} s", flush=True)  # fmt: skip
    (out / "builds.json").write_text(json.dumps(summary, indent=1))
    return 0


def compare(a: Path, b: Path) -> int:
    before = json.loads((a / "builds.json").read_text())
    after = json.loads((b / "builds.json").read_text())
    if set(before) != set(after):
        print(f"different instantiations: only before {sorted(set(before) - set(after))}, "
              f"only after {sorted(set(after) - set(before))}")  # fmt: skip
    changed = 0
    print(f"{'instantiation':>20} {'SASS':>10} {'regs':>9} {'spills':>7} {'stack':>6} {'smem':>13}")
    for key in sorted(set(before) & set(after)):
        x, y = (a / f"{key}.sass").read_text(), (b / f"{key}.sass").read_text()
        same = x == y
        changed += not same
        pb, pa = before[key], after[key]
        regs, smem = f"{pb['registers']}/{pa['registers']}", f"{pb['smem_bytes']}/{pa['smem_bytes']}"
        verdict = "identical" if same else "DIFFERS"
        print(f"{key:>20} {verdict:>10} {regs:>9} {pa['spill_bytes']:>7} {pa['stack_bytes']:>6} {smem:>13}")
        if not same:
            diff = list(
                difflib.unified_diff(x.splitlines(), y.splitlines(), "before", "after", lineterm="", n=1)
            )
            more = f"\n... {len(diff) - 60} more diff lines" if len(diff) > 60 else ""
            print("\n".join(diff[:60]) + more)
    print(f"{changed} of {len(set(before) & set(after))} instantiations differ")
    return 1 if changed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("save").add_argument("out", type=Path)
    cmp = sub.add_parser("compare")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = ap.parse_args(argv)
    return save(args.out) if args.cmd == "save" else compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
