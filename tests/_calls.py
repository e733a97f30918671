"""A backend's attn_kl called the way the op calls it, for tests that look at one backend alone:
the spec is built by the op's own validation, then (spec, inputs) go to the backend."""

from __future__ import annotations

from streamkl import _checks, _dispatch
from streamkl._spec import AttnKLInputs, AttnKLStats


class BackendCalls:
    def __init__(self, name: str):
        self.impl = _dispatch.implementation(name, "attn_kl")

    @staticmethod
    def _spec(q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens, needs=None, max_seqlen=None):
        call = dict(causal=causal, scale1=scale1, scale2=scale2, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        spec = _checks.attn_kl_spec(q1, k1, q2, k2, **call)
        return spec if needs is None else spec.with_needs(needs)

    def supports(self, q1, k1, q2, k2, cu_seqlens=None):
        spec = self._spec(q1, k1, q2, k2, False, None, None, cu_seqlens)
        return self.impl.supports(spec, AttnKLInputs(q1, k1, q2, k2, cu_seqlens))

    def forward(self, q1, k1, q2, k2, *, causal, scale1, scale2, cu_seqlens=None, max_seqlen=None):
        spec = self._spec(q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens, None, max_seqlen)
        return self.impl.forward(spec, AttnKLInputs(q1, k1, q2, k2, cu_seqlens))

    def backward(self, grad, q1, k1, q2, k2, kl, lse1, lse2, *, causal, scale1, scale2, cu_seqlens=None,
                 max_seqlen=None, needs=(True, True, True, True)):  # fmt: skip
        spec = self._spec(q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens, needs, max_seqlen)
        inputs = AttnKLInputs(q1, k1, q2, k2, cu_seqlens)
        stats = AttnKLStats(kl, lse1, lse2)
        return _dispatch.backward_of(self.impl, spec, inputs).backward(spec, inputs, stats, grad)


reference = BackendCalls("reference")
triton = BackendCalls("triton")
