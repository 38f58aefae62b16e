"""Batch-1, 16K decode without a pipelined key loop (GPU):
``python benchmarks/probe_decode_oneshot.py OUT.json``.

``probe_decode_stripped.py`` found every split kernel with a software-pipelined key loop (the
library's, and a probe kernel with no features, with or without the attention math, through
pointers or tensor descriptors) at 27.5-28.5 us against 24.9 us for a plain read that loads
8 KB per program in one go.  This probe times the structures without such a loop, same shapes
and timing as there (batch 1, nheads 32 / 8, d=128, bf16, full 16K cache, CUDA-graph replays,
L2 emptied by a read):

- ``split_only`` / ``split+combine``: the library's kernels at ``num_stages=1`` (loads straight
  to registers) with one or two tiles per split (``BLOCK_N`` 64-256, up to 128 splits);
- ``prefetch``: a probe kernel that loads the next tile's K/V into registers before it works on
  the current one (a loop, but no shared-memory pipeline), over tiles, warps and splits;
- ``stripped`` at ``num_stages=1`` (from ``probe_decode_stripped.py``), with and without math.
"""
import itertools
import json
import sys
import time

import torch
import triton
import triton.language as tl

import flashtile
import flashtile.decode
from flashtile.backends.triton import launch_decode
from flashtile.bench_decode import graph_ms, plain_read

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from probe_decode_stripped import stripped_fn  # noqa: E402

flashtile.decode.EAGER_PLANS = False


@triton.jit
def _prefetch_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, n_keys, stride_ks, stride_kh, n_splits, scale,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """FlashDecoding split of one KV head over full tiles (the recurrence of
    ``probe_decode_stripped._stripped_kernel``), the next tile's K and V loaded into registers
    while the current one is used."""
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
    b_k_next = tl.load(p_k, mask=(lo < hi), other=0.0)  # [BLOCK_N, BLOCK_D]
    b_v_next = tl.load(p_v, mask=(lo < hi), other=0.0)  # [BLOCK_N, BLOCK_D]
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BLOCK_M]
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M]
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # [BLOCK_M, BLOCK_D]
    for i_tile in range(lo, hi):
        b_k = b_k_next
        b_v = b_v_next
        p_k += BLOCK_N * stride_ks
        p_v += BLOCK_N * stride_ks
        b_k_next = tl.load(p_k, mask=(i_tile + 1 < hi), other=0.0)
        b_v_next = tl.load(p_v, mask=(i_tile + 1 < hi), other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale  # [BLOCK_M, BLOCK_N]
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))  # [BLOCK_M]
        b_p = tl.exp2(b_s - b_m_new[:, None])  # [BLOCK_M, BLOCK_N]
        b_alpha = tl.exp2(b_m - b_m_new)  # [BLOCK_M]
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
        b_m = b_m_new
    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]  # [BLOCK_M, BLOCK_D]
    o_row = i_split * (tl.num_programs(0) * GROUP) + i_hk * GROUP + o_m  # [BLOCK_M]
    tl.store(o_ptr + o_row[:, None] * BLOCK_D + o_d[None, :], b_o, mask=m_m[:, None])
    tl.store(lse_ptr + o_row, b_m + tl.log2(b_l), mask=m_m)


def prefetch_fn(q, kc, vc, splits, block_n, warps):
    _, s, hk, d = kc.shape
    group = q.shape[2] // hk
    o = torch.empty(splits, hk * group, d, device=q.device, dtype=torch.float32)
    lse = torch.empty(splits, hk * group, device=q.device, dtype=torch.float32)

    def fn():
        _prefetch_kernel[(hk, splits)](q, kc, vc, o, lse, s, hk * d, d, splits, d ** -0.5 * 1.4426950408889634,
                                       GROUP=group, BLOCK_M=16, BLOCK_N=block_n, BLOCK_D=d, num_warps=warps,
                                       num_stages=1)
    return fn, o, lse


def main(path):
    h, hk, d, dt, cache = 32, 8, 128, torch.bfloat16, 16384
    rows = []
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"), command="python benchmarks/probe_decode_oneshot.py OUT.json")

    def save():
        with open(path, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)

    def add(**r):
        if r.get("ms"):
            r["GBps"] = nbytes / r["ms"] / 1e6
        rows.append(r)
        print(json.dumps(r), flush=True)

    def timed(impl, make, **cfg):
        try:
            ms = graph_ms(make())
        except Exception as exc:  # an invalid config: record and go on
            ms = None
            print(impl, cfg, type(exc).__name__, str(exc)[:300], file=sys.stderr)
        add(impl=impl, ms=ms, **cfg)

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
    fn, o, lse = prefetch_fn(q, kc, vc, 16, 64, 4)
    fn()
    w = torch.softmax(lse * 0.6931471805599453, 0)
    add(impl="prefetch_check", max_abs_err=float(((w[..., None] * o).sum(0).view(1, 1, h, d) - ref.float()).abs().max()))
    save()

    for block_n, warps in itertools.product((32, 64, 128), (2, 4, 8)):
        for splits in (16, 32, 64, 128):
            timed("prefetch", lambda: prefetch_fn(q, kc, vc, splits, block_n, warps)[0],
                  block_n=block_n, warps=warps, splits=splits)
        save()
    for math, block_n, warps in itertools.product((1, 0), (64, 128, 256), (4, 8)):
        for splits in (64, 128, 256):
            if 16384 // block_n < splits:
                continue
            timed("stripped_stages1", lambda: stripped_fn(q, kc, vc, splits, block_n, warps, 1, 0, math)[0],
                  math=math, block_n=block_n, warps=warps, splits=splits)
        save()

    real_attn_config, real_merge = launch_decode._attn_config, launch_decode._merge
    for block_n, warps in itertools.product((64, 128, 256), (4, 8)):
        launch_decode._attn_config = lambda *a, bn=block_n, w=warps: (16, bn, 128, w, 1)
        launch_decode._plan.cache_clear()
        for splits in (32, 64, 128):
            for combine in (False, True):
                launch_decode._merge = real_merge if combine else (lambda *a: None)
                timed("split+combine" if combine else "split_only",
                      lambda: (lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                                         num_splits=splits)),
                      block_n=block_n, warps=warps, stages=1, splits=splits)
        save()
    launch_decode._merge = real_merge
    launch_decode._attn_config = real_attn_config
    launch_decode._plan.cache_clear()
    save()
    for impl in ("prefetch", "stripped_stages1", "split_only", "split+combine"):
        best = sorted((r for r in rows if r["impl"] == impl and r.get("ms")), key=lambda r: r["ms"])[:5]
        print("best", impl, json.dumps(best), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "probe_decode_oneshot.json")
