"""The eager op's host cost at B=1, H=1, N=128 beside one cuDNN attention call, from one tree, and
a cProfile of 3000 no-grad forwards appended to <outdir>/<tag>_<backend>.prof.txt. Run it for two
trees in turn to compare a change's host cost (lab/notes/data/refactor_ab/host_interleaved.txt):

    for r in 1 2 3; do for t in /tmp/base .; do
        python lab/overhead/host_interleaved.py $t cuda $(basename $t) /tmp/prof; done; done

Host timings move by up to 2x between runs; the call counts in the profile do not.
"""

import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

tree, backend, tag, out = sys.argv[1:5]
sys.path.insert(0, tree)
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import streamkl  # noqa: E402  (from the tree given)

B, H, N, D = 1, 1, 128, 64


def _input(grad=False):
    return torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=grad)


q1, k1, q2, k2 = _input(), _input(), _input(True), _input(True)
q2n, k2n = q2.detach(), k2.detach()
q = _input()


def fwd_nograd():
    streamkl.attn_kl(q1, k1, q2n, k2n, causal=True, backend=backend)


def fwd():
    streamkl.attn_kl(q1, k1, q2, k2, causal=True, backend=backend)


def step():
    streamkl.attn_kl(q1, k1, q2, k2, causal=True, reduction="sum", backend=backend).backward()


def cudnn_fwd():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


def per_call_us(fn, calls=300, repeats=9):
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return round(statistics.median(times), 1)


res = {fn.__name__: per_call_us(fn) for fn in (cudnn_fwd, fwd_nograd, fwd, step)}
profile = cProfile.Profile()
profile.enable()
for _ in range(3000):
    fwd_nograd()
profile.disable()
torch.cuda.synchronize()
text = io.StringIO()
pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
print(tag, backend, res, flush=True)
with open(f"{out}/{tag}_{backend}.prof.txt", "a") as f:
    f.write(text.getvalue())
