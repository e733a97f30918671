"""Did a source edit change the generated code? Compiles every triton kernel specialization the
launchers pick on an H200 (tests/test_triton_sm90.py, `specializations`) for sm_90 on this
machine (no GPU needed), and saves per specialization its TTIR, TTGIR and PTX; `compare` reads
two such saves and reports, per specialization, whether the TTGIR and the PTX are the same once
source locations, debug sections, comments and value names are left out.

    TRITON_INTERPRET=0 python lab/triton/ptx_compare.py save /tmp/ptx_before   # the tree before
    TRITON_INTERPRET=0 python lab/triton/ptx_compare.py save /tmp/ptx_after    # after the edit
    python lab/triton/ptx_compare.py compare /tmp/ptx_before /tmp/ptx_after

Value names are left out because Triton names TTGIR values after the Python variables they come
from (`%t1 = tt.dot ...`): renaming a variable, or folding `s1 = dot; t1 = s1 * c` into one
line, changes the names but not the code. Each TTGIR is compared after numbering its value
names in order of first use, so a reordered instruction still shows as a difference.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

KINDS = ("ttgir", "ptx")


def save(out: Path) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run with TRITON_INTERPRET=0: interpreter kernels cannot be compiled")
    # a cache of its own, so every specialization is compiled by this tree's sources
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="ptx_compare_"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests import test_triton_sm90 as sm90

    out.mkdir(parents=True, exist_ok=True)
    meta = {}
    for spec in sm90.specializations():
        compiled = sm90.compile_for_hopper(spec)
        for kind in ("ttir", *KINDS):
            (out / f"{spec.name}.{kind}").write_text(compiled.asm[kind])
        meta[spec.name] = dict(
            shared=compiled.metadata.shared, histogram=sm90.instruction_histogram(compiled)
        )
        print(f"{spec.name}: {meta[spec.name]}", flush=True)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def _drop_locations(text: str) -> str:
    """MLIR text without `loc(...)` attributes (nested parentheses included) and #loc lines."""
    out, i = [], 0
    while True:
        j = text.find(" loc(", i)
        if j < 0:
            out.append(text[i:])
            break
        out.append(text[i:j])
        depth, k = 0, j + 4
        while True:
            depth += {"(": 1, ")": -1}.get(text[k], 0)
            k += 1
            if depth == 0:
                break
        i = k
    return "\n".join(line for line in "".join(out).splitlines() if not line.startswith("#loc"))


_NAME = re.compile(r"%[\w.$]+")
_RESULTS = re.compile(r"^\s*((?:%[\w.$]+(?::\d+)?, )*%[\w.$]+(?::\d+)?) = ")


def _number_names(text: str) -> str:
    """Every SSA value name (`%t1`, `%42`, `%arg3`) replaced by %v<k>, k counting definitions in
    order: values named after Python variables and numbered ones then read alike. A name MLIR
    reuses in a sibling region is a new definition there, so uses map to the latest one."""
    current: dict[str, str] = {}
    count = 0
    out = []
    for line in text.splitlines():
        m = _RESULTS.match(line)
        results = {t.group(0) for t in _NAME.finditer(m.group(1))} if m else set()
        pieces, i = [], 0
        for t in _NAME.finditer(line):
            name, after = t.group(0), line[t.end() : t.end() + 3]
            # a result, a loop or iter_args variable (`%x = ...`), a block or function argument
            # (`%x: type`), else a use
            if name in results or after.startswith((" = ", ": ")):
                current[name] = f"%v{count}"
                count += 1
            pieces.append(line[i : t.start()] + current.get(name, name))
            i = t.end()
        out.append("".join(pieces) + line[i:])
    return "\n".join(out)


def normalized(text: str, kind: str) -> str:
    if kind == "ttgir":
        return _number_names(_drop_locations(text))
    # ptx: the code before the debug sections, without .loc/.file lines and comments
    text = text.split(".section\t.debug", 1)[0]
    lines = []
    for line in text.splitlines():
        line = line.split("//", 1)[0].rstrip()
        if line and not line.lstrip().startswith((".loc", ".file")):
            lines.append(line)
    return "\n".join(lines)


def compare(a: Path, b: Path) -> int:
    names = sorted({p.stem for p in a.glob("*.ptx")} | {p.stem for p in b.glob("*.ptx")})
    differing = 0
    for name in names:
        verdicts = []
        for kind in KINDS:
            fa, fb = a / f"{name}.{kind}", b / f"{name}.{kind}"
            if not (fa.exists() and fb.exists()):
                verdicts.append(f"{kind} only in {'the first' if fa.exists() else 'the second'}")
                continue
            na, nb = normalized(fa.read_text(), kind), normalized(fb.read_text(), kind)
            if na == nb:
                verdicts.append(f"{kind} same ({na.count(chr(10)) + 1} lines)")
                continue
            diff = list(difflib.unified_diff(na.splitlines(), nb.splitlines(), lineterm="", n=0))
            verdicts.append(f"{kind} DIFFERS ({sum(1 for d in diff if d[:1] in '+-') - 2} lines)")
        if any("same" not in v for v in verdicts):
            differing += 1
        print(f"{name:55s} " + "; ".join(verdicts))
    print(f"{len(names) - differing} of {len(names)} specializations the same, {differing} differ")
    return 1 if differing else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("save", help="compile every specialization and save its IR").add_argument("out", type=Path)
    c = sub.add_parser("compare", help="compare two saves")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = p.parse_args()
    if args.cmd == "save":
        save(args.out)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
