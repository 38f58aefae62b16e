"""Kernels of a batch-1 decode step for Nsight Compute (GPU).

    ncu --clock-control none -k regex:"_read_kernel|_split_kv_kernel|_combine_kernel" \
        --launch-skip 3 --launch-count 3 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis python benchmarks/ncu_decode.py

Batch 1, 16K cache, nheads 32 / nheads_k 8, d=128, bf16: a plain read of the K/V cache's bytes
(``bench_decode.plain_read``) and flashtile's split-KV kernel and combine, each run 4 times.
"""
import torch

import flashtile
from flashtile.bench_decode import plain_read

H, HK, D, CACHE, DT = 32, 8, 128, 16384, torch.bfloat16
q = torch.randn(1, 1, H, D, device="cuda", dtype=DT)
kc, vc = (torch.randn(1, CACHE, HK, D, device="cuda", dtype=DT) for _ in range(2))
lens = torch.full((1,), CACHE, dtype=torch.int32, device="cuda")
read = plain_read(torch.randn(2 * kc.numel(), device="cuda", dtype=DT))
for _ in range(4):
    read()
    flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
torch.cuda.synchronize()
