"""Optimized backends. Each subpackage exposes the same three functions and imports its optional
dependency (triton, cuda-python) only inside them, so importing streamkl needs torch alone.

    supports(q1, k1, q2, k2, cu_seqlens) -> str | None
        None when the backend can run these (already validated) inputs, else the reason it cannot.

    forward(q1, k1, q2, k2, *, causal, scale1, scale2, cu_seqlens, max_seqlen)
        -> (kl, lse1, lse2), each (B, H, Nq) float32 (float64 for float64 inputs), fresh and
        contiguous.
        Rows that see no key: kl = 0, lse = -inf.

    backward(grad_kl, q1, k1, q2, k2, kl, lse1, lse2, *, causal, scale1, scale2,
             cu_seqlens, max_seqlen, needs) -> (dq1, dk1, dq2, dk2)
        grad_kl is (B, H, Nq) in the dtype of kl, contiguous; needs is a 4-tuple of bools; a
        gradient that is not needed is None, the others have their input's shape and dtype
        (contiguous).

A backend whose backward does not exist yet sets `BACKWARD = "<name>"`: the op layer then runs
that backend's `backward` on its forward's (kl, lse1, lse2), so `supports` must admit only
inputs the named backend runs too.

A backend that is slower than the next one in streamkl._dispatch.BACKENDS on part of what it
supports defines `auto_declines(q1, k1, q2, k2, cu_seqlens) -> str | None`, saying where: there
it runs when named, and `auto` passes it by.

A new backend is such a package plus one line in streamkl._dispatch.BACKENDS; tests/test_backends.py
then runs the whole contract (docs/contract.md) on it, on every device its `supports` accepts.

Inputs arrive validated by streamkl._checks (shapes, dtypes, devices, cu_seqlens values) with
scale1/scale2 resolved to floats and, for packed sequences (B == 1, Nq == Nk == total tokens),
max_seqlen resolved to a host int. Any strides: backends must not copy whole inputs.
"""
