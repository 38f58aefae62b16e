"""Allocation and grids of the backward kernels (preprocess, dK/dV, dQ)."""
from __future__ import annotations

import torch

from ..spec import AttnSpec
from .configs import get_config
from .kernels.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from .launch_common import (launch, alibi_args, bias_args, block_d, broadcast_strides, cdiv,
                            dot_precision, dropout_args, empty, fit_block, layout, lse_strides,
                            scalar_args, seq_strides, sparse_args)


def _dbias_target(dbias, full_shape):
    """Where the dQ kernel writes dS: ``dbias`` itself when it has the full ``(B, H, Sq, Sk)``
    shape, else a float32 full-shape buffer reduced afterwards (B*H*Sq*Sk*4 bytes)."""
    if dbias is None:
        return None
    if tuple(dbias.shape) == tuple(full_shape):
        return dbias.zero_()
    return torch.zeros(full_shape, dtype=torch.float32, device=dbias.device)


def backward(do, q, k, v, out, lse, spec: AttnSpec, *, alibi_slopes=None, cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, attn_bias=None,
             rng_seed=None, block_mask=None, block_size=None, dbias=None):
    """Returns ``(dq, dk, dv)``; with ``dbias`` (shaped like ``attn_bias``) also writes the
    gradient of the additive bias into it."""
    varlen, batch, sq, sk, nheads, nheads_k, head_dim = layout(q, k, cu_seqlens_q, max_seqlen_q,
                                                               max_seqlen_k)
    dq = empty(q.shape, q.dtype, q.device)
    dk = empty(k.shape, k.dtype, k.device)
    dv = empty(v.shape, v.dtype, v.device)
    if batch == 0 or sq == 0 or sk == 0 or q.numel() == 0 or k.numel() == 0:
        if dbias is not None:
            dbias.zero_()
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
    bias, bias_strides = bias_args(attn_bias)
    seed, dropout_p, dropout_scale = dropout_args(spec, rng_seed)
    db_full = _dbias_target(dbias, (batch, nheads, sq, sk))
    db_strides = (0, 0, 0, 0) if db_full is None else broadcast_strides(db_full)

    pre = get_config("pre", head_dim, spec.causal, q.dtype, q.device)
    launch(attn_bwd_preprocess_kernel, (cdiv(sq, pre.block_m), batch * nheads), (
        out, do, lse, delta, lse2, cu_seqlens_q, *seq_strides(out, varlen), *seq_strides(do,
        varlen), lse_b, lse_h, sq, nheads,
    ), dict(HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_M=pre.block_m, num_warps=pre.num_warps))
    common = dict(HEAD_DIM=head_dim, BLOCK_D=bd, DOT_PREC=prec, dropout_p=dropout_p,
                  dropout_scale=dropout_scale, **scalars)

    cfg = get_config("dkdv", head_dim, spec.causal, q.dtype, q.device)
    block_m, block_n = cfg.block_m, cfg.block_n
    bs_idx, bs_strides, bs_m, bs_n = sparse_args(block_mask, block_size, sq, sk, spec, transpose=True)
    if bs_idx is not None:
        block_m, block_n = fit_block(block_m, bs_m), fit_block(block_n, bs_n)
    launch(attn_bwd_dkdv_kernel, (cdiv(sk, block_n), batch * nheads_k), (
        q, k, v, do, dk, dv, lse2, delta, alibi, cu_seqlens_q, cu_seqlens_k, bias, seed, bs_idx,
        *seq_strides(q, varlen), *seq_strides(k, varlen), *seq_strides(v, varlen),
        *seq_strides(do, varlen), *seq_strides(dk, varlen), *seq_strides(dv, varlen), lse_b,
        lse_h, stride_ab, *bias_strides, *bs_strides, bs_m, bs_n, sq, sk, nheads_k, group,
        spec.softmax_scale,
    ), dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common))
    cfg = get_config("dq", head_dim, spec.causal, q.dtype, q.device)
    block_m, block_n = cfg.block_m, cfg.block_n
    bs_idx, bs_strides, bs_m, bs_n = sparse_args(block_mask, block_size, sq, sk, spec)
    if bs_idx is not None:
        block_m, block_n = fit_block(block_m, bs_m), fit_block(block_n, bs_n)
    launch(attn_bwd_dq_kernel, (cdiv(sq, block_m), batch * nheads), (
        q, k, v, do, dq, lse2, delta, alibi, cu_seqlens_q, cu_seqlens_k, bias, seed, bs_idx,
        db_full, *seq_strides(q, varlen), *seq_strides(k, varlen), *seq_strides(v, varlen),
        *seq_strides(do, varlen), *seq_strides(dq, varlen), lse_b, lse_h, stride_ab,
        *bias_strides, *db_strides, *bs_strides, bs_m, bs_n, sq, sk, nheads, group,
        spec.softmax_scale,
    ), dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common))
    if db_full is not None and db_full is not dbias:
        dims = [d for d in range(4) if dbias.shape[d] == 1 and db_full.shape[d] != 1]
        dbias.copy_(db_full.sum(dim=dims, keepdim=True) if dims else db_full)
    return dq, dk, dv
