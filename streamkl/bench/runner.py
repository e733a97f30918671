"""Runs sweeps x providers x modes, one measurement at a time, and records everything.

One measurement = (case, provider, variant, mode, setting). For each:
  1. skip rules, in order: the provider cannot run the inputs ("unsupported"); the run's time
     budget is spent; the provider ran out of memory on a problem with at most as many logits
     ("oom", implied); its projected time per call (from its largest measured call, scaled by
     FLOPs) is over the sweep's cap ("skipped");
  2. the first call, checked against a reference (the last `check_rows` query rows, see
     `Runner._reference`), which is also the warm-up (JIT, autotuning, torch.compile; its wall
     time is reported as `first_call_s`, the compile time for torch.compile);
  3. a call under `PeakMemory` (peak extra memory: peak allocated minus what was allocated
     before, minus the outputs and gradients handed back);
  4. the timing (`timing.bench`), inputs rotated over several sets when one set fits in L2.
Calls projected beyond `single_shot_s` are run once: that call is checked, timed (CUDA events)
and measured for memory; the kernels were compiled at the smaller sizes of the same sweep.
Any exception is recorded (OOM as "oom") and the run goes on; results are written to JSON after
every measurement, so a run killed from outside still leaves its data.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import timing
from .flops import SETTING_GRADS, attn_kl_flops
from .providers import GemmYardstick, Provider, discover
from .sweeps import Case, Sweep

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
}
SCHEMA = "streamkl-bench/1"


@dataclass
class RunConfig:
    device: str = "cuda"
    providers: list[str] | None = None  # None: what each sweep lists
    compile_backend: str = "inductor"
    timing: timing.TimingConfig = field(default_factory=timing.TimingConfig)
    time_budget_s: float = float("inf")  # stop starting measurements after this
    max_call_s_reference: float = 1.0  # cap for streamkl-reference (it is slow by design)
    single_shot_s: float = 20.0
    # calls at least this long measure peak memory on their first (checked) call rather than on
    # a call of their own: no runtime autotuning allocates there, and it saves a long call
    mem_from_first_call_s: float = 1.0
    check: bool = True
    check_rows: int = 1024
    l2_bytes: int | None = None  # None: the device's L2 (CPU: 32 MiB)
    max_input_sets: int = 8
    gemm_size: int = 8192
    gemm_max_size: int = 16384
    seed: int = 0


class Runner:
    def __init__(self, cfg: RunConfig, out_dir: Path, meta: dict, config_record: dict, log=print):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.out_dir = Path(out_dir)
        self.log = log
        self.t_start = time.perf_counter()
        self.results: list[dict] = []
        self.history: dict[str, list[tuple[int, float, str]]] = {}  # provider -> (flops, s, mode)
        self.oom_at: dict[tuple[str, str], int] = {}  # (provider, memclass) -> logits
        self.fatal: str | None = None
        self._inputs_key = None
        self._inputs = None
        self._ref_cache: dict = {}
        self.data = {
            "schema": SCHEMA,
            "meta": meta,
            "config": config_record,
            "gemm_yardstick": None,
            "gemm_yardstick_end": None,
            "results": self.results,
        }
        l2 = cfg.l2_bytes
        if l2 is None:
            l2 = meta.get("device", {}).get("l2_cache_bytes") or 32 * 2**20
        self.l2_bytes = int(l2)
        max_gemm = cfg.gemm_max_size if self.device.type == "cuda" else min(cfg.gemm_max_size, 1024)
        self.gemm = GemmYardstick(self.device, cfg.timing, self._bench, max_gemm)

    # ---------------------------------------------------------------- bookkeeping
    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def remaining(self) -> float:
        return self.cfg.time_budget_s - self.elapsed()

    def save(self) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.data["meta"]["elapsed_s"] = round(self.elapsed(), 3)
        path = self.out_dir / "results.json"
        tmp = self.out_dir / ".results.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default))
        os.replace(tmp, path)
        return path

    def _bench(self, fn, est_s):
        return timing.bench(fn, self.device, est_s, self.cfg.timing)

    # ---------------------------------------------------------------- yardstick
    def measure_gemm_yardstick(self, which: str = "gemm_yardstick") -> None:
        s = self.cfg.gemm_size if self.device.type == "cuda" else min(self.cfg.gemm_size, 512)
        try:
            res = dict(self.gemm.square(s, sustained=True))
            res["at_s"] = round(self.elapsed(), 1)
            self.data[which] = res
            self.log(f"[gemm] {s}^3 {res['dtype']}: {res['ms']:.3f} ms, {res['tflops']:.1f} TFLOP/s")
        except Exception as exc:
            self.data[which] = {"error": f"{type(exc).__name__}: {exc}"}
            self.log(f"[gemm] failed: {exc}")
        finally:
            timing.free_memory(self.device)
        self.save()

    # ---------------------------------------------------------------- inputs
    def inputs(self, case: Case) -> list[tuple[torch.Tensor, ...]]:
        """Random input sets for a case (several when one set fits in L2, cycled by timing)."""
        key = (case.b, case.h, case.hk1, case.hk2, case.nq, case.nk, case.d1, case.d2, case.dtype)
        if key == self._inputs_key:
            return self._inputs
        self._inputs = self._inputs_key = None
        self._ref_cache.clear()
        timing.free_memory(self.device)
        dtype = DTYPES[case.dtype]
        h = case.h
        hk1, hk2 = case.hk1 or h, case.hk2 or h
        shapes = [
            (case.b, h, case.nq, case.d1),
            (case.b, hk1, case.nk, case.d1),
            (case.b, h, case.nq, case.d2),
            (case.b, hk2, case.nk, case.d2),
        ]
        set_bytes = sum(math.prod(s) for s in shapes) * torch.empty((), dtype=dtype).element_size()
        n_sets = 1
        if set_bytes < self.l2_bytes:
            n_sets = int(min(self.cfg.max_input_sets, math.ceil(3 * self.l2_bytes / set_bytes)))
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.seed)
        sets = [
            tuple(torch.randn(s, generator=gen, device=self.device, dtype=dtype) for s in shapes)
            for _ in range(n_sets)
        ]
        self._inputs, self._inputs_key = sets, key
        return sets

    # ---------------------------------------------------------------- the sweep loop
    def run_sweeps(self, sweeps: list[Sweep]) -> None:
        for sw in sweeps:
            self.log(
                f"== sweep {sw.name} at {self.elapsed():.0f} s: {len(sw.cases)} cases ({sw.description})"
            )
            providers = discover(self.cfg.providers or sw.providers, self.cfg.compile_backend)
            if self.cfg.providers:  # an explicit --providers list is intersected with the sweep's
                allowed = {p.name for p in discover(sw.providers, self.cfg.compile_backend)}
                providers = [p for p in providers if p.name in allowed]
            all_modes = list(
                dict.fromkeys([*sw.modes, *(m for ms in sw.provider_modes.values() for m in ms)])
            )
            # mode-major inside a case: the reference for the check is computed once per mode
            for case in sw.cases:
                for mode, setting in all_modes:
                    for prov in providers:
                        if (mode, setting) not in sw.provider_modes.get(prov.name, sw.modes):
                            continue
                        for vlabel, env in sw.variants.get(prov.name) or [("", {})]:
                            p = prov.with_variant(vlabel, env) if vlabel else prov
                            self.measure(sw, case, p, mode, setting)
            self._inputs = self._inputs_key = None
            self._ref_cache.clear()
            timing.free_memory(self.device)

    # ---------------------------------------------------------------- one measurement
    def measure(self, sw: Sweep, case: Case, prov: Provider, mode: str, setting: str | None) -> dict:
        flops = attn_kl_flops(case.b, case.h, case.nq, case.nk, case.d1, case.d2, case.causal, mode, setting)
        rec = {
            "sweep": sw.name,
            "case": asdict(case),
            "case_key": case.key,
            "provider": prov.name,
            "variant": prov.variant,
            "env": prov.env,
            "mode": mode,
            "setting": setting,
            "flops": flops,
            "status": None,
        }
        t0 = time.perf_counter()
        try:
            self._measure(sw, case, prov, mode, setting, rec)
        except Exception as exc:  # noqa: BLE001 - a failure is a result, the run goes on
            self._record_failure(rec, prov, case, mode, exc)
        finally:
            rec["wall_s"] = round(time.perf_counter() - t0, 3)
            timing.free_memory(self.device)
        self.results.append(rec)
        self.save()
        self.log(_one_line(rec))
        return rec

    def _record_failure(self, rec, prov, case, mode, exc):
        if timing.is_oom(exc):
            rec["status"] = "oom"
            rec["reason"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            memclass = "fwd" if mode == "fwd" else "train"
            key = (prov.name, memclass)
            self.oom_at[key] = min(self.oom_at.get(key, case.logits), case.logits)
        else:
            rec["status"] = "error"
            rec["reason"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
            rec["traceback"] = traceback.format_exc(limit=8)[-4000:]
            if timing.is_fatal_cuda_error(exc):
                self.fatal = rec["reason"]

    def _skip_reason(self, sw: Sweep, case: Case, prov: Provider, mode: str, flops: int, rec: dict):
        if self.remaining() <= 0:
            return "skipped", f"time budget of {self.cfg.time_budget_s:g} s spent"
        classes = ["fwd"] if mode == "fwd" else ["fwd", "train"]
        for memclass in classes:
            at = self.oom_at.get((prov.name, memclass))
            if at is not None and case.logits >= at:
                rec["implied"] = True
                return "oom", (f"implied: out of memory ({memclass}) at {at} logits <= {case.logits} here")
        proj = self.project(prov.name, mode, flops)
        if proj is not None:
            rec["projected_s"] = round(proj, 4)
            cap = sw.max_call_s
            if prov.name == "streamkl-reference":
                cap = min(cap, self.cfg.max_call_s_reference)
            if proj > cap:
                return "skipped", f"projected {proj:.3g} s per call > cap {cap:g} s"
            total = self.projected_total(proj)
            if prov.name == "torch.compile":  # each measurement compiles afresh
                total += max(
                    [r.get("compile_s") or 0 for r in self.results if r["provider"] == "torch.compile"]
                    or [0.0]
                )
            if total > self.remaining():
                return "skipped", (
                    f"projected {total:.3g} s > {self.remaining():.3g} s left of the time budget"
                )
        return None

    def _long_call(self, rec) -> bool:
        """Known to take at least mem_from_first_call_s: from a projection of steady-state calls,
        or from a first call so long (single_shot_s, nothing to project from: the first size of
        a sweep) that a compilation inside it cannot be what made it long. A second call there
        would double the device time and, at 1M tokens, meet the memory of the checked first."""
        if rec.get("projected_s") is None and (rec.get("first_call_s") or 0.0) >= self.cfg.single_shot_s:
            return True
        return (rec.get("projected_s") or 0.0) >= self.cfg.mem_from_first_call_s

    def projected_total(self, call_s: float) -> float:
        """Seconds one measurement takes when a call takes call_s (see _run_fwd/_run_bwd)."""
        t = self.cfg.timing
        if call_s >= self.cfg.single_shot_s:
            return call_s
        if self.device.type == "cuda" and call_s <= t.event_threshold_s:
            # check + memory calls, then do_bench: 5 estimate calls, warm-up and rep windows
            return 7 * call_s + (t.warmup_ms + t.rep_ms) / 1e3 + 0.1
        reps = max(1, min(t.repeats, int(t.long_rep_budget_s // max(call_s, 1e-9))))
        extra = 1 if call_s < self.cfg.mem_from_first_call_s else 0
        return (1 + extra + reps) * call_s

    def project(self, provider: str, mode: str, flops: int) -> float | None:
        """Seconds per call, from this provider's largest measured call scaled by FLOPs (the same
        mode when there is one; otherwise any mode, doubled, a backward being slower)."""
        hist = self.history.get(provider, [])
        same = [h for h in hist if h[2] == mode]
        pool, factor = (same, 1.0) if same else (hist, 2.0 if mode != "fwd" else 1.0)
        if not pool:
            return None
        f, s, _ = max(pool, key=lambda h: h[0])
        return s * flops / max(f, 1) * factor

    def _measure(self, sw, case, prov, mode, setting, rec):
        flops = rec["flops"]
        if self.fatal:
            rec.update(
                status="error", reason=f"not run: an earlier CUDA error is sticky ({self.fatal[:200]})"
            )
            return
        if prov.kind == "gemm":
            if self.remaining() <= 0:
                rec.update(status="skipped", reason=f"time budget of {self.cfg.time_budget_s:g} s spent")
                return
            g = self.gemm.for_flops(flops)
            rec.update(
                status="ok",
                ms=g["scaled_ms"],
                gemm=g,
                timer=f"{g['m']}^3 {g['dtype']} GEMM, time scaled by FLOPs ({g['timer']})",
            )
            rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
            return
        max_n = sw.provider_max_n.get(prov.name)
        if max_n is not None and max(case.nq, case.nk) > max_n:
            rec.update(status="skipped", reason=f"this sweep runs {prov.name} up to N={max_n}")
            return
        only = sw.provider_only_n.get(prov.name)
        if only is not None and case.nq not in only:
            rec.update(status="skipped", reason=f"this sweep runs {prov.name} at N in {only} only")
            return
        sets = self.inputs(case)
        reason = prov.unsupported(sets[0])
        if reason is not None:
            rec.update(status="unsupported", reason=str(reason))
            return
        skip = self._skip_reason(sw, case, prov, mode, flops, rec)
        if skip is not None:
            rec["status"], rec["reason"] = skip
            return
        with timing.env_vars(prov.env):
            fn = prov.make(case.causal)
            single = (rec.get("projected_s") or 0.0) >= self.cfg.single_shot_s
            if mode == "fwd":
                self._run_fwd(fn, case, sets, rec, single)
            else:
                self._run_bwd(fn, case, sets, rec, mode, setting, single)
        rec["status"] = "ok"
        rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
        self.history.setdefault(prov.name, []).append((flops, rec["ms"] * 1e-3, mode))
        if prov.name == "torch.compile":
            rec["compile_s"] = rec.get("first_call_s")

    # forward: kl = fn(*inputs)
    def _run_fwd(self, fn, case, sets, rec, single):
        s0 = sets[0]
        if single:
            with timing.PeakMemory(self.device) as pm:
                kl, secs = timing.wall(lambda: fn(*s0), self.device)
            rec.update(
                ms=secs * 1e3,
                timer="single call, wall clock (synchronized)",
                reps=1,
                first_call_s=secs,
                mem_extra_bytes=pm.extra(timing.tensor_bytes(kl)),
            )
            self._check(rec, case, s0, kl, None, None, None)
            return
        with timing.PeakMemory(self.device) as pm:
            kl, secs = timing.wall(lambda: fn(*s0), self.device)
        rec["first_call_s"] = round(secs, 4)
        self._check(rec, case, s0, kl, None, None, None)
        secs2 = secs
        if self._long_call(rec):  # its first call's peak will do
            rec.update(mem_extra_bytes=pm.extra(timing.tensor_bytes(kl)), mem_from="first call")
            del kl
        else:
            del kl
            with timing.PeakMemory(self.device) as pm:
                kl, secs2 = timing.wall(lambda: fn(*s0), self.device)
            rec["mem_extra_bytes"] = pm.extra(timing.tensor_bytes(kl))
            del kl
        it = _cycle(sets)
        res = self._bench(lambda: fn(*next(it)), secs2)
        rec.update(res, n_input_sets=len(sets))

    # backward (mode "bwd": the backward alone; "fwd+bwd": both)
    def _run_bwd(self, fn, case, sets, rec, mode, setting, single):
        idx = SETTING_GRADS[setting]

        def leaves(s):
            return tuple(t.detach().requires_grad_(i in idx) for i, t in enumerate(s))

        gen = torch.Generator(device=self.device).manual_seed(self.cfg.seed + 1)
        gshape = (case.b, case.h, case.nq)
        gout = torch.randn(gshape, generator=gen, device=self.device, dtype=torch.float32)

        def fwd_bwd(s, g):
            x = leaves(s)
            kl = fn(*x)
            grads = torch.autograd.grad(kl, [x[i] for i in idx], g)
            return kl.detach(), grads

        if single:
            with timing.PeakMemory(self.device) as pm:
                if mode == "fwd+bwd":
                    (kl, grads), secs = timing.wall(lambda: fwd_bwd(sets[0], gout), self.device)
                else:  # the forward untimed, then one backward
                    x = leaves(sets[0])
                    out = fn(*x)
                    grads, secs = timing.wall(
                        lambda: torch.autograd.grad(out, [x[i] for i in idx], gout), self.device
                    )
                    kl = out.detach()
                    del out, x
            rec.update(
                ms=secs * 1e3,
                timer="single call, wall clock (synchronized)",
                reps=1,
                first_call_s=secs,
                mem_extra_bytes=pm.extra(timing.tensor_bytes((kl, grads))),
            )
            self._check(rec, case, sets[0], kl, grads, idx, gout, mask_rows=False)
            return
        # 1. the checked first call: upstream gradient only on the checked rows, so dk is exact
        rows = self._check_rows(case)
        gmask = torch.zeros_like(gout)
        gmask[..., case.nq - rows :] = gout[..., case.nq - rows :]
        with timing.PeakMemory(self.device) as pm:
            (kl, grads), secs = timing.wall(lambda: fwd_bwd(sets[0], gmask), self.device)
        rec["first_call_s"] = round(secs, 4)
        self._check(rec, case, sets[0], kl, grads, idx, gmask, mask_rows=True)
        secs2 = secs
        # 2. peak memory of a whole forward + backward (a long call: the first call's peak)
        if self._long_call(rec):
            rec.update(mem_extra_bytes=pm.extra(timing.tensor_bytes((kl, grads))), mem_from="first call")
            del kl, grads
        else:
            del kl, grads
            with timing.PeakMemory(self.device) as pm:
                (kl, grads), secs2 = timing.wall(lambda: fwd_bwd(sets[0], gout), self.device)
            rec["mem_extra_bytes"] = pm.extra(timing.tensor_bytes((kl, grads)))
            del kl, grads
        # 3. timing
        if mode == "fwd+bwd":
            it = _cycle(sets)
            res = self._bench(lambda: fwd_bwd(next(it), gout), secs2)
        else:
            graphs = []
            for s in sets:
                x = leaves(s)
                graphs.append((fn(*x), [x[i] for i in idx]))
            it = _cycle(graphs)

            def bwd():
                kl, req = next(it)
                return torch.autograd.grad(kl, req, gout, retain_graph=True)

            est = secs2
            res = self._bench(bwd, est)
            del graphs
        rec.update(res, n_input_sets=len(sets))

    # ---------------------------------------------------------------- for pytest-benchmark
    def prepare_call(self, case: Case, prov: Provider, mode: str, setting: str | None = None):
        """(call, flops): one device-synchronized call of `prov` on `case`, built from the same
        inputs, provider callables and FLOP count as the sweeps (benchmarks/test_speed.py times
        it with pytest-benchmark). mode "bwd" times the backward alone on a retained graph."""
        flops = attn_kl_flops(case.b, case.h, case.nq, case.nk, case.d1, case.d2, case.causal, mode, setting)
        s0 = self.inputs(case)[0]
        reason = prov.unsupported(s0)
        if reason is not None:
            raise RuntimeError(f"{prov.name} cannot run {case.key}: {reason}")
        fn = prov.make(case.causal)
        dev = self.device
        if mode == "fwd":

            def call():
                out = fn(*s0)
                timing.synchronize(dev)
                return out

            return call, flops
        idx = SETTING_GRADS[setting]
        x = tuple(t.detach().requires_grad_(i in idx) for i, t in enumerate(s0))
        req = [x[i] for i in idx]
        gen = torch.Generator(device=dev).manual_seed(self.cfg.seed + 1)
        gout = torch.randn((case.b, case.h, case.nq), generator=gen, device=dev)
        if mode == "fwd+bwd":

            def call():
                out = torch.autograd.grad(fn(*x), req, gout)
                timing.synchronize(dev)
                return out

            return call, flops
        kl = fn(*x)

        def call():
            out = torch.autograd.grad(kl, req, gout, retain_graph=True)
            timing.synchronize(dev)
            return out

        return call, flops

    # ---------------------------------------------------------------- correctness
    def _check_rows(self, case: Case) -> int:
        return max(1, min(case.nq, self.cfg.check_rows))

    def _reference(self, case: Case, s, idx, g, rows: int):
        """KL of the last `rows` query rows (and gradients for the upstream `g` restricted to
        them), from an independent computation: the dense float64 formula when it fits in a
        modest amount of memory, else streamkl's chunked reference backend (float32
        accumulation; float64 for float32 inputs). With bottom-right causal alignment the last
        `rows` rows of an (Nq, Nk) problem are exactly the (rows, Nk) problem."""
        # g's checked rows are the same seeded values for every provider; the inputs are shared
        # by cases that differ only in causal
        key = (rows, idx, case.causal)
        if key in self._ref_cache:
            return self._ref_cache[key]
        q1, k1, q2, k2 = s
        q1s, q2s = q1[:, :, -rows:], q2[:, :, -rows:]
        elems = case.b * case.h * rows * case.nk
        dense_limit = 2**27 if self.device.type == "cuda" else 2**22
        up = torch.float64 if (elems <= dense_limit or q1.dtype in (torch.float32, torch.float64)) else None
        x = [q1s, k1, q2s, k2]
        if up is not None:
            x = [t.to(up) for t in x]
        x = [t.detach().requires_grad_(idx is not None and i in idx) for i, t in enumerate(x)]
        if elems <= dense_limit:
            from streamkl.testing import dense_attn_kl

            name = "dense float64"
            kl = dense_attn_kl(*x, causal=case.causal, dtype=torch.float64)
        else:
            import streamkl

            name = f"streamkl-reference ({str(up or q1.dtype).replace('torch.', '')} inputs)"
            kl = streamkl.attn_kl(*x, causal=case.causal, backend="reference")
        grads = None
        if idx is not None:
            grads = torch.autograd.grad(kl, [x[i] for i in idx], g[..., -rows:].to(kl.dtype))
            grads = tuple(t.detach() for t in grads)
        out = (name, kl.detach(), grads)
        if case.logits > 2**31:  # references at long N are big: keep one
            self._ref_cache.clear()
        self._ref_cache[key] = out
        return out

    def _check(self, rec, case, s, kl, grads, idx, g, mask_rows=True):
        if not self.cfg.check:
            rec["check"] = {"skipped": "--no-check"}
            return
        rows = self._check_rows(case)
        try:
            name, rkl, rgrads = self._reference(case, s, idx, g, rows)
        except Exception as exc:  # the reference itself failed: say so, time anyway
            rec["check"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            if timing.is_oom(exc):
                timing.free_memory(self.device)
            return
        from streamkl.testing import grad_tolerance, kl_tolerance, rel_err

        dtype = DTYPES[case.dtype]
        kl_rows = kl[..., -rows:].double()
        err = ((kl_rows - rkl.double()).abs() / rkl.double().abs().clamp_min(1.0)).max().item()
        chk = {
            "reference": name,
            "rows": rows,
            "kl_err": err,
            "kl_tol": kl_tolerance(dtype),
            "finite": bool(torch.isfinite(kl).all().item()),
        }
        chk["kl_ok"] = bool(err <= chk["kl_tol"]) and chk["finite"]
        if grads is not None:
            names = ["dq1", "dk1", "dq2", "dk2"]
            gerr = {}
            for i, d, r in zip(idx, grads, rgrads):
                if i in (0, 2):  # dq: row-local, compare the checked rows
                    gerr[names[i]] = rel_err(d[:, :, -rows:], r)
                elif mask_rows or rows == case.nq:  # dk: exact only when g lives on those rows
                    gerr[names[i]] = rel_err(d, r)
            chk["grad_err"] = gerr
            chk["grad_tol"] = grad_tolerance(dtype)
            chk["grad_ok"] = all(v <= chk["grad_tol"] for v in gerr.values())
            if not mask_rows and rows < case.nq:
                chk["note"] = "single call with a full upstream gradient: dk not checked"
        rec["check"] = chk


def _cycle(items):
    while True:
        yield from items


def _json_default(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, torch.dtype):
        return str(obj).replace("torch.", "")
    return str(obj)


def _one_line(rec: dict) -> str:
    c = rec["case"]
    what = f"{rec['mode']}" + (f"[{rec['setting']}]" if rec.get("setting") else "")
    prov = rec["provider"] + (f" [{rec['variant']}]" if rec.get("variant") else "")
    shape = f"nq={c['nq']} nk={c['nk']} causal={int(c['causal'])}" + (
        f" {c['label']}" if c.get("label") else ""
    )
    if rec["status"] == "ok":
        mem = rec.get("mem_extra_bytes")
        memtxt = f" mem+{mem / 2**20:.1f}MiB" if mem is not None else ""
        chk = rec.get("check") or {}
        err = f" err={chk['kl_err']:.1e}" if "kl_err" in chk else ""
        if chk.get("grad_err"):
            err += f" grad_err={max(chk['grad_err'].values()):.1e}"
        bad = " CHECK-FAILED" if (chk.get("kl_ok") is False or chk.get("grad_ok") is False) else ""
        return (
            f"[{rec['sweep']}] {shape} {prov} {what}: {rec['ms']:.4g} ms "
            f"{rec.get('tflops', 0):.1f} TFLOP/s{memtxt}{err}{bad}"
        )
    return f"[{rec['sweep']}] {shape} {prov} {what}: {rec['status'].upper()} {rec.get('reason', '')[:160]}"


def log_to(stream=sys.stdout):
    def _log(msg: str) -> None:
        print(msg, file=stream, flush=True)

    return _log
