"""Decode-step cost of ``flash_attn_with_kvcache``'s index checks on a CUDA GPU.

Times one decode step (append one token, attend; bf16, 32 query / 8 KV heads, d=128) eager
(host wall time per step, launch plans on: what a host-bound decode loop sees) and replayed
from a CUDA graph (GPU time per step), with the checks on (the default: check kernel plus
read-back) and off (``FLASHTILE_CHECK_INDICES=0``: guards only), interleaved round by round in
one process.  Prints medians over the rounds.

    PYTHONPATH=. python tests/gpu/decode_check_timing.py
    # the same steps on another checkout (e.g. one without the checks), all rows as "on":
    cd /path/to/other/checkout && PYTHONPATH=. python /path/to/decode_check_timing.py --old
"""
import os
import statistics
import sys
import time

import torch

import flashtile

dev, dt = "cuda", torch.bfloat16
H, HK, D = 32, 8, 128
ROUNDS, STEPS = 9, 200


def setup(B, L, paged):
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=g)
    q, k, v = r(B, 1, H, D), r(B, 1, HK, D), r(B, 1, HK, D)
    if paged:
        P = 64
        n = B * (L // P)
        kc, vc = r(n, P, HK, D), r(n, P, HK, D)
        bt = torch.randperm(n, device=dev, generator=g).to(torch.int32).reshape(B, L // P)
    else:
        kc, vc, bt = r(B, L, HK, D), r(B, L, HK, D), None
    lens = torch.full((B,), L - 1, dtype=torch.int32, device=dev)
    return lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,
                                                     block_table=bt, causal=True)


def set_checks(on):
    if on:
        os.environ.pop("FLASHTILE_CHECK_INDICES", None)
    else:
        os.environ["FLASHTILE_CHECK_INDICES"] = "0"


def eager_us(step):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / STEPS * 1e6


def graph_us(graph):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(STEPS):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / STEPS * 1e3


modes = [True] if "--old" in sys.argv else [True, False]
print(f"{'config':<22} {'mode':<4} {'eager us/step':>14} {'graph us/step':>14}")
for B, L, paged in ((1, 16384, False), (8, 16384, True), (64, 4096, True), (64, 16384, False)):
    step = setup(B, L, paged)
    graphs = {}
    for on in modes:
        set_checks(on)
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        graphs[on] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[on]):
            step()
    res = {on: ([], []) for on in modes}
    for _ in range(ROUNDS):
        for on in modes:
            set_checks(on)
            res[on][0].append(eager_us(step))
            res[on][1].append(graph_us(graphs[on]))
    for on in modes:
        e, g = statistics.median(res[on][0]), statistics.median(res[on][1])
        print(f"B{B} L{L} {'paged' if paged else 'contig':<7} {'on' if on else 'off':<4} {e:14.1f} {g:14.1f}")
set_checks(True)
