"""Allocation and grids of the backward kernels (preprocess, dK/dV, dQ)."""
from __future__ import annotations

import torch

from ..spec import AttnSpec
from .configs import get_config
from .kernels.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from .launch_common import (alibi_args, block_d, cdiv, dot_precision, empty, launch, layout,
                            lse_strides, scalar_args, seq_strides)


def backward(do, q, k, v, out, lse, spec: AttnSpec, *, alibi_slopes=None, cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    varlen, batch, sq, sk, nheads, nheads_k, head_dim = layout(q, k, cu_seqlens_q, max_seqlen_q,
                                                               max_seqlen_k)
    dq = empty(q.shape, q.dtype, q.device)
    dk = empty(k.shape, k.dtype, k.device)
    dv = empty(v.shape, v.dtype, v.device)
    if batch == 0 or sq == 0 or sk == 0 or q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = empty(lse.shape, torch.float32, lse.device)
    lse2 = empty(lse.shape, torch.float32, lse.device)
    group = nheads // nheads_k
    bd = block_d(head_dim)
    prec = dot_precision(q.dtype)
    scalars = scalar_args(spec)
    alibi, stride_ab = alibi_args(alibi_slopes, batch)
    lse_b, lse_h = lse_strides(lse, varlen)

    pre = get_config("pre", head_dim, spec.causal, q.dtype, q.device)
    launch(attn_bwd_preprocess_kernel, (cdiv(sq, pre.block_m), batch * nheads), (
        out, do, lse, delta, lse2, cu_seqlens_q,
        *seq_strides(out, varlen), *seq_strides(do, varlen), lse_b, lse_h, sq, nheads,
    ), dict(HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_M=pre.block_m, num_warps=pre.num_warps))
    common = dict(HEAD_DIM=head_dim, BLOCK_D=bd, DOT_PREC=prec, **scalars)

    cfg = get_config("dkdv", head_dim, spec.causal, q.dtype, q.device)
    launch(attn_bwd_dkdv_kernel, (cdiv(sk, cfg.block_n), batch * nheads_k), (
        q, k, v, do, dk, dv, lse2, delta, alibi, cu_seqlens_q, cu_seqlens_k,
        *seq_strides(q, varlen), *seq_strides(k, varlen), *seq_strides(v, varlen),
        *seq_strides(do, varlen), *seq_strides(dk, varlen), *seq_strides(dv, varlen),
        lse_b, lse_h, stride_ab, sq, sk, nheads_k, group, spec.softmax_scale,
    ), dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **common))
    cfg = get_config("dq", head_dim, spec.causal, q.dtype, q.device)
    launch(attn_bwd_dq_kernel, (cdiv(sq, cfg.block_m), batch * nheads), (
        q, k, v, do, dq, lse2, delta, alibi, cu_seqlens_q, cu_seqlens_k,
        *seq_strides(q, varlen), *seq_strides(k, varlen), *seq_strides(v, varlen),
        *seq_strides(do, varlen), *seq_strides(dq, varlen),
        lse_b, lse_h, stride_ab, sq, sk, nheads, group, spec.softmax_scale,
    ), dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **common))
    return dq, dk, dv
