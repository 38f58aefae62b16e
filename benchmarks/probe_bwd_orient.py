"""Does the dK/dV kernel pay for transposing register tiles? (GPU):
``python benchmarks/probe_bwd_orient.py OUT.json``.

The library's dK/dV loop computes ``S = Q K^T`` as ``[BLOCK_M, BLOCK_N]`` and then feeds
``P^T`` and ``dS^T`` to the dV and dK products, so both register tiles are transposed every
iteration.  Computing ``S^T = K Q^T`` (``[BLOCK_N, BLOCK_M]``) instead makes ``P^T`` and
``dS^T`` the products' first operands as they are; only operands loaded from memory are
transposed, which costs nothing.  Two probe kernels without the library's features (dense,
non-causal, full tiles, one query head per KV head) are timed in both orientations, d=128
bf16, 16K tokens x 16 heads at N=8K and N=512, over tile shapes, warps and stages; their outputs
are compared with each other.  The library's whole backward is timed alongside for scale.
"""
import itertools
import json
import sys
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

import flashtile
from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton import forward


@triton.jit
def _dkdv_probe(Q, K, V, DO, DK, DV, LSE2, DELTA, N, H, stride_n, qk_scale, scale,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``dV = sum_i P_i^T dO_i``, ``dK = scale * sum_i dS_i^T Q_i`` over every query tile ``i``,
    ``P = exp2(qk_scale * Q K^T - lse2)``, ``dS = P * (dO V^T - delta)``.  ``TRANSPOSED``
    computes the tiles as ``[BLOCK_N, BLOCK_M]`` from the start."""
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    base = (i_b * N).to(tl.int64) * stride_n + i_h * D
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    o_d = tl.arange(0, D)  # [D]
    b_k = tl.load(K + base + o_n[:, None] * stride_n + o_d[None, :])  # [BLOCK_N, D]
    b_v = tl.load(V + base + o_n[:, None] * stride_n + o_d[None, :])  # [BLOCK_N, D]
    b_dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)  # [BLOCK_N, D]
    b_dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)  # [BLOCK_N, D]
    p_l = LSE2 + i_bh * N
    p_dl = DELTA + i_bh * N
    for m0 in range(0, N, BLOCK_M):
        o_m = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        b_q = tl.load(Q + base + o_m[:, None] * stride_n + o_d[None, :])  # [BLOCK_M, D]
        b_do = tl.load(DO + base + o_m[:, None] * stride_n + o_d[None, :])  # [BLOCK_M, D]
        b_lse2 = tl.load(p_l + o_m)  # [BLOCK_M]
        b_delta = tl.load(p_dl + o_m)  # [BLOCK_M]
        if TRANSPOSED:
            b_st = tl.dot(b_k, tl.trans(b_q)) * qk_scale  # [BLOCK_N, BLOCK_M]
            b_pt = tl.math.exp2(b_st - b_lse2[None, :])  # [BLOCK_N, BLOCK_M]
            b_dv = tl.dot(b_pt.to(b_do.dtype), b_do, b_dv)
            b_dpt = tl.dot(b_v, tl.trans(b_do))  # [BLOCK_N, BLOCK_M]
            b_dst = b_pt * (b_dpt - b_delta[None, :])  # [BLOCK_N, BLOCK_M]
            b_dk = tl.dot(b_dst.to(b_q.dtype), b_q, b_dk)
        else:
            b_s = tl.dot(b_q, tl.trans(b_k)) * qk_scale  # [BLOCK_M, BLOCK_N]
            b_p = tl.math.exp2(b_s - b_lse2[:, None])  # [BLOCK_M, BLOCK_N]
            b_dv = tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, b_dv)
            b_dp = tl.dot(b_do, tl.trans(b_v))  # [BLOCK_M, BLOCK_N]
            b_ds = b_p * (b_dp - b_delta[:, None])  # [BLOCK_M, BLOCK_N]
            b_dk = tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q, b_dk)
    tl.store(DK + base + o_n[:, None] * stride_n + o_d[None, :], (b_dk * scale).to(DK.dtype.element_ty))
    tl.store(DV + base + o_n[:, None] * stride_n + o_d[None, :], b_dv.to(DV.dtype.element_ty))


def main(path):
    d, h, dt, tokens = 128, 16, torch.bfloat16, 16384
    rows = []
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"), command="python benchmarks/probe_bwd_orient.py OUT.json")

    def save():
        with open(path, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)

    for n in (8192, 512):
        b = tokens // n
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=dt) for _ in range(4))
        flops_dkdv = 8 * b * h * n * n * d  # four N x N x d products, 2 flops each
        # softmax statistics of the real attention so that P is well scaled
        out, lse = forward(q, k, v, AttnSpec(d ** -0.5, -1, -1))
        qf = q.detach().requires_grad_()
        out_f = flashtile.flash_attn_func(qf, k, v)
        lse2 = (lse.float() * 1.4426950408889634).contiguous()  # [b, h, n]
        delta = (do.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # [b, h, n]
        ms = do_bench(lambda: torch.autograd.grad(out_f, qf, do, retain_graph=True), warmup=25, rep=100,
                      return_mode="median")
        rows.append(dict(impl="flashtile_backward", n=n, batch=b, ms=ms))
        print(json.dumps(rows[-1]), flush=True)
        qk_scale = d ** -0.5 * 1.4426950408889634
        outs = {}
        for (bm, bn, warps, stages), tr in itertools.product(
                ((64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 1), (64, 128, 8, 2),
                 (32, 128, 4, 1), (32, 128, 4, 2), (128, 64, 8, 1), (128, 64, 8, 2), (128, 128, 8, 1)),
                (False, True)):
            dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
            fn = lambda: _dkdv_probe[(n // bn, b * h)](q, k, v, do, dk, dv, lse2, delta, n, h, h * d, qk_scale,  # noqa: E731
                                                       d ** -0.5, BLOCK_M=bm, BLOCK_N=bn, D=d, TRANSPOSED=tr,
                                                       num_warps=warps, num_stages=stages)
            cfg = dict(n=n, batch=b, block_m=bm, block_n=bn, warps=warps, stages=stages, transposed=tr)
            try:
                fn()
                torch.cuda.synchronize()
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                if "ref" not in outs:
                    outs["ref"] = (dk.float().clone(), dv.float().clone())
                err = max(float((dk.float() - outs["ref"][0]).abs().max()), float((dv.float() - outs["ref"][1]).abs().max()))
                rows.append(dict(impl="dkdv_probe", ms=ms, tflops=flops_dkdv / ms / 1e9, max_abs_diff_vs_first=err,
                                 finite=bool(torch.isfinite(dk).all() and torch.isfinite(dv).all()), **cfg))
            except Exception as exc:
                rows.append(dict(impl="dkdv_probe", ms=None, error=f"{type(exc).__name__}: {str(exc)[:200]}", **cfg))
            print(json.dumps(rows[-1]), flush=True)
            save()
        del q, k, v, do, qf, out, out_f
    save()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "probe_bwd_orient.json")
