"""The sweeps of issue 3 as data: shapes, providers, modes and env variants, per preset.

Presets: "full" (the published grid), "quick" (the main sweeps sized to fit one ~8 minute
H200 run, long context included), "smoke" (tiny, CPU, seconds; run by CI).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .flops import SETTINGS

K = 1024
SWEEPS = ("n", "decode", "bwd-strategy", "shapes", "long")


@dataclass(frozen=True)
class Case:
    sweep: str
    b: int
    h: int
    nq: int
    nk: int
    d1: int
    d2: int
    causal: bool
    dtype: str
    hk1: int | None = None
    hk2: int | None = None
    label: str = ""

    @property
    def key(self) -> str:
        gqa = f" hk={self.hk1 or self.h}/{self.hk2 or self.h}" if (self.hk1 or self.hk2) else ""
        return (
            f"{self.sweep} b={self.b} h={self.h}{gqa} nq={self.nq} nk={self.nk} "
            f"d={self.d1}/{self.d2} causal={int(self.causal)} {self.dtype}"
        )

    @property
    def logits(self) -> int:
        """Entries of one Nq x Nk logits matrix over batch and heads: what dense baselines
        materialize, so what their memory grows with."""
        return self.b * self.h * self.nq * self.nk


@dataclass
class Sweep:
    name: str
    cases: list[Case]
    providers: list[str]  # provider names (or "streamkl" for all backends)
    modes: list[tuple[str, str | None]]  # (mode, setting): ("fwd", None), ("bwd", "q2k2")
    variants: dict[str, list[tuple[str, dict]]] = field(default_factory=dict)  # provider -> [(label, env)]
    max_call_s: float = 10.0  # skip a provider whose projected call exceeds this
    # per-provider mode restrictions, e.g. {"torch.compile": [("fwd", None), ("bwd", "q2k2")]}
    provider_modes: dict[str, list[tuple[str, str | None]]] = field(default_factory=dict)
    provider_max_n: dict[str, int] = field(default_factory=dict)  # e.g. {"streamkl-reference": 8192}
    provider_only_n: dict[str, list[int]] = field(default_factory=dict)  # {"torch.compile": [8192]}
    description: str = ""


def _causals(causal: str) -> list[bool]:
    return {"0": [False], "1": [True], "both": [False, True]}[str(causal)]


# STREAMKL_TRITON_SPLIT_K: off | N (force N key splits) | auto (the backend's rule)
def split_k_variants(counts: list[int]) -> list[tuple[str, dict]]:
    return (
        [("split_k=off", {"STREAMKL_TRITON_SPLIT_K": "off"})]
        + [(f"split_k={n}", {"STREAMKL_TRITON_SPLIT_K": str(n)}) for n in counts]
        + [("split_k=auto", {"STREAMKL_TRITON_SPLIT_K": "auto"})]
    )


BWD = [
    ("bwd=fused", {"STREAMKL_TRITON_BWD": "fused"}),
    ("bwd=separate", {"STREAMKL_TRITON_BWD": "separate"}),
    ("bwd=auto", {"STREAMKL_TRITON_BWD": "auto"}),
]


@dataclass
class Geometry:
    """The knobs every sweep shares, from the command line."""

    b: int = 1
    h: int = 32
    d: int = 128
    dtype: str = "bfloat16"
    causal: str = "both"
    sizes: list[int] | None = None  # overrides the n sweep (and long, if alone)
    long_sizes: list[int] | None = None
    decode_nq: list[int] | None = None
    decode_nk: list[int] | None = None
    bwd_sizes: list[int] | None = None
    settings: list[str] | None = None


def build(preset: str, sweeps: list[str], g: Geometry) -> list[Sweep]:
    """The sweeps of a preset, with command-line geometry applied."""
    if preset == "smoke":
        return _smoke(sweeps, g)
    full = preset == "full"
    settings = g.settings or list(SETTINGS)
    bwd_modes = [("bwd", s) for s in settings]
    out: list[Sweep] = []
    causals = _causals(g.causal)
    geo = dict(b=g.b, h=g.h, d1=g.d, d2=g.d, dtype=g.dtype)
    for name in sweeps:
        if name == "n":
            sizes = g.sizes or (
                [4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K, 256 * K, 512 * K]
                if full
                else [4 * K, 8 * K, 16 * K, 32 * K]
            )
            cases = [Case("n", nq=n, nk=n, causal=c, **geo) for c in causals for n in sizes]
            out.append(
                Sweep(
                    "n",
                    cases,
                    ["streamkl", "torch", "torch.compile", "gemm"],
                    [("fwd", None), *bwd_modes],
                    # quick: each torch.compile graph costs 10-30 s of compilation, so it is compiled
                    # at 8K only (the issue's comparison point; the dense formula runs out of memory
                    # past 8K-16K anyway), forward and setting 1; the reference stops at 8K
                    provider_modes={} if full else {"torch.compile": [("fwd", None), ("bwd", "q2k2")]},
                    provider_only_n={} if full or g.sizes else {"torch.compile": [8 * K]},
                    provider_max_n={} if full else {"streamkl-reference": 8 * K},
                    max_call_s=120.0 if full else 10.0,
                    description="sequence length N = Nq = Nk; forward and backward per gradient "
                    "setting; peak extra memory",
                )
            )
        elif name == "decode":
            nqs = g.decode_nq or ([1, 2, 4, 8, 16, 32, 64, 128, 256] if full else [1, 16, 64, 256])
            nks = g.decode_nk or ([32 * K, 64 * K, 128 * K] if full else [32 * K, 128 * K])
            dc = causals if (full or g.causal != "both") else [True]
            cases = [Case("decode", nq=nq, nk=nk, causal=c, **geo) for c in dc for nk in nks for nq in nqs]
            out.append(
                Sweep(
                    "decode",
                    cases,
                    ["streamkl", "torch"] + (["torch.compile"] if full else []),
                    [("fwd", None)],
                    variants={"streamkl-triton": split_k_variants([4, 16, 64] if full else [8, 32])},
                    max_call_s=5.0,
                    description="small Nq against long Nk, forward, Triton split-K off / forced "
                    "counts / auto (STREAMKL_TRITON_SPLIT_K)",
                )
            )
        elif name == "bwd-strategy":
            selfs = g.bwd_sizes or (
                [1 * K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K] if full else [2 * K, 8 * K, 32 * K]
            )
            cross_nq = [16, 64, 256, 1 * K, 4 * K] if full else [256, 2 * K]
            cases = [Case("bwd-strategy", nq=n, nk=n, causal=c, **geo) for c in causals for n in selfs]
            if not g.bwd_sizes:
                cases += [
                    Case("bwd-strategy", nq=nq, nk=32 * K, causal=c, label="cross", **geo)
                    for c in causals
                    for nq in cross_nq
                ]
            modes = bwd_modes if full else [("bwd", s) for s in settings if s in ("q2k2", "all")] or bwd_modes
            out.append(
                Sweep(
                    "bwd-strategy",
                    cases,
                    ["streamkl-triton"],
                    modes,
                    variants={"streamkl-triton": BWD},
                    max_call_s=10.0,
                    description="fused versus separate Triton backward across Nq (STREAMKL_TRITON_BWD)",
                )
            )
        elif name == "shapes":
            n = (g.sizes or [8 * K])[0]
            d, h = g.d, g.h
            shapes = [
                ("D1=D, D2=D/2", dict(d1=d, d2=d // 2)),
                ("D1=D/2, D2=D", dict(d1=d // 2, d2=d)),
                ("GQA H/Hk=4", dict(hk1=max(1, h // 4), hk2=max(1, h // 4))),
                ("GQA teacher 4, student 8", dict(hk1=max(1, h // 4), hk2=max(1, h // 8))),
                ("MQA", dict(hk1=1, hk2=1)),
                ("D2=D/2 + GQA", dict(d2=d // 2, hk1=max(1, h // 4), hk2=max(1, h // 8))),
            ]
            if not full:
                shapes = shapes[:3] + shapes[5:]
            cases = []
            for c in causals:
                for label, kw in shapes:
                    base = dict(geo, **{k: v for k, v in kw.items() if k in ("d1", "d2")})
                    cases.append(
                        Case(
                            "shapes",
                            nq=n,
                            nk=n,
                            causal=c,
                            label=label,
                            hk1=kw.get("hk1"),
                            hk2=kw.get("hk2"),
                            **base,
                        )
                    )
            out.append(
                Sweep(
                    "shapes",
                    cases,
                    ["streamkl", "torch", "gemm"] + (["torch.compile"] if full else []),
                    [("fwd", None), ("bwd", "all")] + ([("bwd", "q2k2")] if full else []),
                    max_call_s=10.0,
                    description="D1 != D2 and GQA/MQA shapes",
                )
            )
        elif name == "long":
            sizes = g.long_sizes or [128 * K, 512 * K, 1024 * K]
            lc = [True] if g.causal == "both" else causals
            cases = [Case("long", nq=n, nk=n, causal=c, **geo) for c in lc for n in sizes]
            modes = ([("fwd", None)] if full else []) + [("fwd+bwd", "q2k2")]
            out.append(
                Sweep(
                    "long",
                    cases,
                    ["streamkl", "torch", "gemm"] + (["torch.compile"] if full else []),
                    modes,
                    max_call_s=240.0,
                    description="long context: forward+backward (teacher fixed) at 128K-1M tokens; "
                    "dense baselines are expected to run out of memory",
                )
            )
        else:
            raise ValueError(f"unknown sweep {name!r}; expected one of {', '.join(SWEEPS)}")
    return out


def _smoke(sweeps: list[str], g: Geometry) -> list[Sweep]:
    """Every sweep in miniature, on CPU in seconds: the harness cannot rot unnoticed."""
    small = Geometry(
        b=1,
        h=2,
        d=16,
        dtype="float32",
        causal=g.causal,
        sizes=g.sizes or [64, 128],
        long_sizes=g.long_sizes or [256],
        decode_nq=g.decode_nq or [1, 8],
        decode_nk=g.decode_nk or [128],
        bwd_sizes=g.bwd_sizes or [64],
        settings=g.settings or ["q2k2", "all"],
    )
    built = build("quick", sweeps, small)
    for sw in built:
        sw.max_call_s = 5.0
        if sw.name == "shapes":  # D1 != D2 alone, and D1 != D2 with GQA, causal or not
            labels = {"D1=D, D2=D/2", "D2=D/2 + GQA"}
            sw.cases = [c for c in sw.cases if c.label in labels]
        sw.cases = [replace(c, hk1=c.hk1 and max(1, c.hk1), hk2=c.hk2 and max(1, c.hk2)) for c in sw.cases]
        if sw.name == "bwd-strategy":
            # on CPU the Triton backend runs only under TRITON_INTERPRET=1; the reference is
            # timed beside it so the variant machinery is exercised either way
            sw.providers = ["streamkl-triton", "streamkl-reference"]
            sw.cases = [c for c in sw.cases if c.label != "cross"] + [
                replace(sw.cases[0], nq=8, nk=64, label="cross")
            ]
    return built
