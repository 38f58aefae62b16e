"""Would tensor descriptors (the copy engine) or Hopper warp specialisation speed up the forward?
(GPU): ``python benchmarks/probe_fwd_tma.py OUT.json``.

d=128, bf16, batch 2, 16 heads, N=8192 (16K tokens, the sweep's shape), non-causal.  A probe
forward kernel with none of the library's features (full tiles only, no masks) reads Q/K/V
through pointers or through host-made tensor descriptors, with and without
``tl.range(..., warp_specialize=True)``, over a few tile shapes; the library's forward, SDPA's
cuDNN and FA2 backends are timed in the same run (``triton.testing.do_bench``, median).  The
pointer variant against the library's kernel says what the features cost; the descriptor
variants against the pointer one say what the copy engine would bring.
"""
import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

import flashtile


@triton.jit
def _fwd_probe(Q, K, V, O, q_desc, k_desc, v_desc, o_desc, N, H, stride_n, qk_scale,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
               USE_DESC: tl.constexpr, WS: tl.constexpr):
    """Non-causal forward over full tiles: ``m' = max(m, rowmax s)``, ``l' = l 2^(m - m') +
    rowsum 2^(s - m')``, ``acc' = acc 2^(m - m') + P V``; ``o = acc / l``.  Tensors are
    ``(B, N, H, D)`` viewed as ``[B * N, H * D]``."""
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    row0 = i_b * N + i_m * BLOCK_M
    col = i_h * D
    o_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    o_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    o_d = tl.arange(0, D)  # [D]
    if USE_DESC:
        b_q = q_desc.load([row0, col])  # [BLOCK_M, D]
    else:
        b_q = tl.load(Q + (row0 + o_m[:, None]).to(tl.int64) * stride_n + col + o_d[None, :])
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BLOCK_M]
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M]
    b_acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)  # [BLOCK_M, D]
    for start in tl.range(0, N, BLOCK_N, warp_specialize=WS):
        if USE_DESC:
            b_k = k_desc.load([i_b * N + start, col])  # [BLOCK_N, D]
        else:
            b_k = tl.load(K + (i_b * N + start + o_n[:, None]).to(tl.int64) * stride_n + col + o_d[None, :])
        b_s = tl.dot(b_q, tl.trans(b_k)) * qk_scale  # [BLOCK_M, BLOCK_N]
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))  # [BLOCK_M]
        b_p = tl.math.exp2(b_s - b_m_new[:, None])  # [BLOCK_M, BLOCK_N]
        b_alpha = tl.math.exp2(b_m - b_m_new)  # [BLOCK_M]
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        if USE_DESC:
            b_v = v_desc.load([i_b * N + start, col])  # [BLOCK_N, D]
        else:
            b_v = tl.load(V + (i_b * N + start + o_n[:, None]).to(tl.int64) * stride_n + col + o_d[None, :])
        b_acc = b_acc * b_alpha[:, None]
        b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc)
        b_m = b_m_new
    b_o = (b_acc / b_l[:, None]).to(O.dtype.element_ty)  # [BLOCK_M, D]
    if USE_DESC:
        o_desc.store([row0, col], b_o)
    else:
        tl.store(O + (row0 + o_m[:, None]).to(tl.int64) * stride_n + col + o_d[None, :], b_o)


def probe_fn(q, k, v, o, block_m, block_n, warps, stages, desc, ws):
    b, n, h, d = q.shape
    views = [t.view(b * n, h * d) for t in (q, k, v, o)]
    if desc:
        descs = [TensorDescriptor(t, [b * n, h * d], [h * d, 1], [bs, d])
                 for t, bs in zip(views, (block_m, block_n, block_n, block_m))]
    else:
        descs = [None] * 4
    grid = (n // block_m, b * h)
    scale = d ** -0.5 * 1.4426950408889634
    return lambda: _fwd_probe[grid](q, k, v, o, *descs, n, h, h * d, scale, BLOCK_M=block_m, BLOCK_N=block_n,
                                    D=d, USE_DESC=desc, WS=ws, num_warps=warps, num_stages=stages)


def main(path):
    b, n, h, d, dt = 2, 8192, 16, 128, torch.bfloat16
    flops = 4 * b * h * n * n * d
    rows = []
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"), command="python benchmarks/probe_fwd_tma.py OUT.json",
                shape=dict(batch=b, seqlen=n, nheads=h, headdim=d, dtype="bfloat16", causal=False))

    def add(impl, fn, **cfg):
        try:
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            r = dict(impl=impl, ms=ms, tflops=flops / ms / 1e9, **cfg)
        except Exception as exc:  # an invalid config: record and go on
            r = dict(impl=impl, ms=None, error=f"{type(exc).__name__}: {str(exc)[:300]}", **cfg)
        rows.append(r)
        print(json.dumps(r), flush=True)

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=dt) for _ in range(3))
    ref = flashtile.flash_attn_func(q, k, v)
    add("flashtile", lambda: flashtile.flash_attn_func(q, k, v))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    for name, backend in (("sdpa_cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                          ("sdpa_flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION)):
        with torch.nn.attention.sdpa_kernel(backend):
            add(name, lambda: F.scaled_dot_product_attention(qt, kt, vt))
    o = torch.empty_like(q)
    for desc, ws in ((0, False), (1, False), (1, True)):
        for block_m, block_n, warps, stages in itertools.product((128,), (64, 128), (4, 8), (2, 3, 4)):
            if block_n == 128 and stages > 3:
                continue
            cfg = dict(desc=desc, ws=ws, block_m=block_m, block_n=block_n, warps=warps, stages=stages)
            fn = probe_fn(q, k, v, o, block_m, block_n, warps, stages, desc, ws)
            try:
                o.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                err = float((o.float() - ref.float()).abs().max())
            except Exception as exc:
                rows.append(dict(impl="probe", ms=None, error=f"{type(exc).__name__}: {str(exc)[:300]}", **cfg))
                print(json.dumps(rows[-1]), flush=True)
                continue
            add("probe", fn, max_abs_err_vs_flashtile=err, **cfg)
        with open(path, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
    best = sorted((r for r in rows if r.get("ms")), key=lambda r: r["ms"])[:8]
    print("best", json.dumps(best), flush=True)
    with open(path, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "probe_fwd_tma.json")
