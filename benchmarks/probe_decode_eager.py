"""Host time of one eager decode call on the GPU machine (GPU): ``python benchmarks/probe_decode_eager.py``.

Batch 1, 16K cache, 32/8 heads, d=128, bf16.  Enqueues 200 eager ``flash_attn_with_kvcache``
calls back to back (fewer than fill the launch queue, so the CPU never waits for the GPU) and
prints the wall time per call, with eager launch plans (``flashtile.decode.EAGER_PLANS``) on and
off, alternating in one process, and then after a CUDA graph of the same call is captured.
"""
import time

import torch

import flashtile
import flashtile.decode
from flashtile.bench_decode import capture

H, HK, D, CACHE, DT = 32, 8, 128, 16384, torch.bfloat16
q = torch.randn(1, 1, H, D, device="cuda", dtype=DT)
kc, vc = (torch.randn(1, CACHE, HK, D, device="cuda", dtype=DT) for _ in range(2))
lens = torch.full((1,), CACHE, dtype=torch.int32, device="cuda")


def call():
    return flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)


def host_us(n=200, reps=5):
    best = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        best.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return min(best), sorted(best)[len(best) // 2]


for _ in range(10):
    call()
for _ in range(3):
    for plans in (True, False):
        flashtile.decode.EAGER_PLANS = plans
        print("host us per eager call, plans %s (min, median): %.1f %.1f" % ((plans,) + host_us()), flush=True)
flashtile.decode.EAGER_PLANS = True
graph, _ = capture(call)
graph.replay()
print("after a graph capture: %.1f %.1f" % host_us(), flush=True)
