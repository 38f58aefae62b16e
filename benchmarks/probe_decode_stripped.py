"""Where the batch-1, 16K split kernel loses to a plain read (GPU):
``python benchmarks/probe_decode_stripped.py OUT.json``.

Batch 1, nheads 32 / nheads_k 8, d=128, bf16, one query token, a full 16K cache; every timing
is a CUDA-graph replay timed as ``python -m flashtile.bench decode`` times it (median, L2
emptied by a read before each replay).  Rows:

- ``read_same_bytes``: the plain read of the same bytes (the floor);
- ``flashtile``: the library's call (split + combine) with its default plan;
- ``split_only``: the library's split kernel (combine skipped) over warps 1-8, key tiles,
  pipeline stages and split counts;
- ``stripped``: a probe-only split kernel with none of the library kernel's features (no
  masks, no paging, no lengths: the cache is full and a whole number of tiles), either doing
  the attention math (``math=1``) or only summing the tiles (``math=0``), reading K/V through
  pointers (``desc=0``) or through host-made tensor descriptors, i.e. the copy engine
  (``desc=1``).  It says how far the same one-program-per-SM structure can get, and what the
  masks, the math and the load path each cost.
"""
import itertools
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import flashtile
import flashtile.decode
from flashtile.backends.triton import launch_decode
from flashtile.bench_decode import graph_ms, plain_read

# the launch internals are patched below: replaying a recorded eager call would bypass that
flashtile.decode.EAGER_PLANS = False


@triton.jit
def _stripped_kernel(q_ptr, k_ptr, v_ptr, k_desc, v_desc, o_ptr, lse_ptr,
                     n_keys, stride_ks, stride_kh, n_splits, scale,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, USE_DESC: tl.constexpr, MATH: tl.constexpr):
    """FlashDecoding split of one KV head, full tiles only: ``m' = max(m, max_j s_j)``,
    ``l' = l 2^(m - m') + sum_j 2^(s_j - m')``, ``acc' = acc 2^(m - m') + P V``; or, without
    ``MATH``, ``acc' = acc + sum_j (k_j + v_j)`` (the same loads, almost no arithmetic)."""
    i_hk = tl.program_id(0)
    i_split = tl.program_id(1)
    n_tiles = n_keys // BLOCK_N
    per = (n_tiles + n_splits - 1) // n_splits
    lo = i_split * per
    hi = tl.minimum(lo + per, n_tiles)

    o_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_m = o_m < GROUP
    o_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    o_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    b_q = tl.load(q_ptr + (i_hk * GROUP + o_m[:, None]) * BLOCK_D + o_d[None, :], mask=m_m[:, None], other=0.0)
    p_k = k_ptr + (lo * BLOCK_N + o_n[:, None]).to(tl.int64) * stride_ks + i_hk * stride_kh + o_d[None, :]
    p_v = v_ptr + (lo * BLOCK_N + o_n[:, None]).to(tl.int64) * stride_ks + i_hk * stride_kh + o_d[None, :]

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BLOCK_M]
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M]
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # [BLOCK_M, BLOCK_D]
    for i_tile in range(lo, hi):
        if USE_DESC:
            b_k = k_desc.load([i_tile * BLOCK_N, i_hk * BLOCK_D])  # [BLOCK_N, BLOCK_D]
        else:
            b_k = tl.load(p_k)  # [BLOCK_N, BLOCK_D]
        if MATH:
            b_s = tl.dot(b_q, tl.trans(b_k)) * scale  # [BLOCK_M, BLOCK_N]
            b_m_new = tl.maximum(b_m, tl.max(b_s, 1))  # [BLOCK_M]
            b_p = tl.exp2(b_s - b_m_new[:, None])  # [BLOCK_M, BLOCK_N]
            b_alpha = tl.exp2(b_m - b_m_new)  # [BLOCK_M]
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            if USE_DESC:
                b_v = v_desc.load([i_tile * BLOCK_N, i_hk * BLOCK_D])  # [BLOCK_N, BLOCK_D]
            else:
                b_v = tl.load(p_v)  # [BLOCK_N, BLOCK_D]
            b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
            b_m = b_m_new
        else:
            if USE_DESC:
                b_v = v_desc.load([i_tile * BLOCK_N, i_hk * BLOCK_D])  # [BLOCK_N, BLOCK_D]
            else:
                b_v = tl.load(p_v)  # [BLOCK_N, BLOCK_D]
            b_acc += tl.sum(b_k.to(tl.float32) + b_v.to(tl.float32), 0)[None, :]
        p_k += BLOCK_N * stride_ks
        p_v += BLOCK_N * stride_ks

    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]  # [BLOCK_M, BLOCK_D]
    o_row = i_split * (tl.num_programs(0) * GROUP) + i_hk * GROUP + o_m  # [BLOCK_M]
    tl.store(o_ptr + o_row[:, None] * BLOCK_D + o_d[None, :], b_o, mask=m_m[:, None])
    tl.store(lse_ptr + o_row, b_m + tl.log2(b_l), mask=m_m)


def stripped_fn(q, kc, vc, splits, block_n, warps, stages, desc, math):
    _, s, hk, d = kc.shape
    group = q.shape[2] // hk
    o = torch.empty(splits, hk * group, d, device=q.device, dtype=torch.float32)
    lse = torch.empty(splits, hk * group, device=q.device, dtype=torch.float32)
    k2, v2 = kc.view(s, hk * d), vc.view(s, hk * d)
    kd = TensorDescriptor(k2, [s, hk * d], [hk * d, 1], [block_n, d]) if desc else None
    vd = TensorDescriptor(v2, [s, hk * d], [hk * d, 1], [block_n, d]) if desc else None
    grid = (hk, splits)

    def fn():
        _stripped_kernel[grid](q, kc, vc, kd, vd, o, lse, s, hk * d, d, splits, d ** -0.5 * 1.4426950408889634,
                               GROUP=group, BLOCK_M=16, BLOCK_N=block_n, BLOCK_D=d, USE_DESC=desc, MATH=math,
                               num_warps=warps, num_stages=stages)
    return fn, o, lse


def main(path):
    h, hk, d, dt, cache = 32, 8, 128, torch.bfloat16, 16384
    rows = []
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"), command="python benchmarks/probe_decode_stripped.py OUT.json")

    def save():
        with open(path, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)

    def add(**r):
        if r.get("ms"):
            r["GBps"] = nbytes / r["ms"] / 1e6
        rows.append(r)
        print(json.dumps(r), flush=True)

    # triton allocates a scratch buffer for descriptors made in a kernel; host-made ones need none,
    # but set one anyway so a lowering that wants scratch does not fail
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    q = torch.randn(1, 1, h, d, device="cuda", dtype=dt)
    kc, vc = (torch.randn(1, cache, hk, d, device="cuda", dtype=dt) for _ in range(2))
    lens = torch.full((1,), cache, dtype=torch.int32, device="cuda")
    nbytes = 2 * kc.numel() * kc.element_size()
    src = torch.randn(nbytes // 2, device="cuda", dtype=dt)
    add(impl="read_same_bytes", ms=graph_ms(plain_read(src)))
    del src
    ref = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    add(impl="flashtile", splits=launch_decode.default_num_splits(q, hk, cache),
        ms=graph_ms(lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)))
    save()

    # the stripped kernel: check its math once against the library, then time it
    for desc in (0, 1):
        fn, o, lse = stripped_fn(q, kc, vc, 16, 64, 4, 3, desc, 1)
        fn()
        w = torch.softmax(lse * 0.6931471805599453, 0)  # [splits, h] weights of the partials
        got = (w[..., None] * o).sum(0).view(1, 1, h, d)
        add(impl="stripped_check", desc=desc, max_abs_err=float((got - ref.float()).abs().max()))
    save()
    for desc, math, warps, block_n, stages in itertools.product((0, 1), (1, 0), (2, 4, 8), (64, 128), (2, 3, 4)):
        if block_n * stages > 384:
            continue
        for splits in (16, 32, 64):
            try:
                fn, _, _ = stripped_fn(q, kc, vc, splits, block_n, warps, stages, desc, math)
                ms = graph_ms(fn)
            except Exception as exc:  # an invalid config: record and go on
                ms = None
                print(type(exc).__name__, str(exc)[:300], file=sys.stderr)
            add(impl="stripped", desc=desc, math=math, warps=warps, block_n=block_n, stages=stages,
                splits=splits, ms=ms)
        save()

    # the library's split kernel alone, including warps 1 and 2 that earlier sweeps left out
    real_attn_config, real_merge = launch_decode._attn_config, launch_decode._merge
    launch_decode._merge = lambda *a: None
    for warps, block_n, stages in itertools.product((1, 2, 4), (16, 32, 64), (2, 3, 4)):
        launch_decode._attn_config = lambda *a, bn=block_n, st=stages, w=warps: (16, bn, 128, w, st)
        launch_decode._plan.cache_clear()
        for splits in (16, 32, 64, 128):
            try:
                ms = graph_ms(lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                                        num_splits=splits))
            except Exception as exc:
                ms = None
                print(type(exc).__name__, str(exc)[:300], file=sys.stderr)
            add(impl="split_only", warps=warps, block_n=block_n, stages=stages, splits=splits, ms=ms)
        save()
    launch_decode._merge = real_merge
    launch_decode._attn_config = real_attn_config
    launch_decode._plan.cache_clear()
    save()
    for impl in ("stripped", "split_only"):
        best = sorted((r for r in rows if r["impl"] == impl and r.get("ms")), key=lambda r: r["ms"])[:6]
        print("best", impl, json.dumps(best), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "probe_decode_stripped.json")
