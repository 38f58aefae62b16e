"""Allocation and grids of the backward kernels: dQ (which also writes ``delta``), then dK/dV.

A plain backward launches these two kernels and nothing else: no preprocess pass, no fills,
casts or copies.  The gradients are allocated in the layout of their inputs (``empty_like``),
so a ``q`` that is a transposed view (the SDPA layout) gets a ``dq`` that autograd hands to
the caller's tensor without a copy.  The byte counts are in ``flashtile.reference.algorithms``.
"""
from __future__ import annotations

import torch

from ..spec import AttnSpec
from .args import (alibi_args, bias_args, block_d, broadcast_strides, cdiv, dot_precision,
                   dropout_args, layout, lse_strides, scalar_args, seq_strides)
from .configs import get_config
from .fastlaunch import (PlanCache, empty, empty_like, launch, plan_roles, plans_enabled,
                         record_plan, recording, signature)
from .kernels.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
from .sparse_index import fit_block, sparse_args

# Launch plans of plain backward calls (no optional feature; fastlaunch.Plan), as the forward
# keeps them: at short sequences the launches' host work (configs, ~60 arguments each,
# direct-launch keys) costs as much as their GPU time.  Inputs (do, q, k, v, out, lse), placed
# in the kernel parameters below even when one tensor is passed as two of them.
_plans = PlanCache()
_ROLES = {attn_bwd_dq_kernel: plan_roles(attn_bwd_dq_kernel, DO=0, Q=1, K=2, V=3, O=4, LSE=5),
          attn_bwd_dkdv_kernel: plan_roles(attn_bwd_dkdv_kernel, DO=0, Q=1, K=2, V=3, LSE=5)}


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
             rng_seed=None, block_mask=None, block_size=None, dbias=None, grad_dtype=None):
    """Returns ``(dq, dk, dv)`` (in ``grad_dtype``, default the inputs' dtypes); with ``dbias``
    (shaped like ``attn_bias``) also writes the gradient of the additive bias into it."""
    if not lse.is_contiguous():
        # the kernels index the contiguous ``delta`` buffer with lse's strides
        lse = lse.contiguous()
    plain = (alibi_slopes is None and cu_seqlens_q is None and attn_bias is None
             and rng_seed is None and block_mask is None and dbias is None and grad_dtype is None
             and do.stride(-1) == 1 and plans_enabled())
    if not plain:
        return _backward(do, q, k, v, out, lse, spec, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, attn_bias, rng_seed, block_mask, block_size,
                         dbias, grad_dtype)
    inputs = (do, q, k, v, out, lse)
    key = (signature(*inputs), q.dtype, q.device, spec)
    plan = _plans.get(key)
    if plan is not None:
        res = plan.run(inputs)
        if res is not None:
            return res
    with recording() as rec:
        grads = _backward(do, q, k, v, out, lse, spec)
    plan = record_plan(rec, inputs, grads, _ROLES)
    if plan is not None:
        _plans.put(key, plan)
    return grads


def _backward(do, q, k, v, out, lse, spec: AttnSpec, alibi_slopes=None, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, attn_bias=None,
              rng_seed=None, block_mask=None, block_size=None, dbias=None, grad_dtype=None):
    varlen, batch, sq, sk, nheads, nheads_k, head_dim = layout(q, k, cu_seqlens_q, max_seqlen_q,
                                                               max_seqlen_k)
    # the gradients in their inputs' layouts: what autograd's accumulation wants (a gradient
    # of another layout is copied into the input's, one read and one write of the whole tensor)
    dq, dk, dv = (empty_like(x, grad_dtype) for x in (q, k, v))
    if batch == 0 or sq == 0 or sk == 0 or q.numel() == 0 or k.numel() == 0:
        if dbias is not None:
            dbias.zero_()
        return dq.zero_(), dk.zero_(), dv.zero_()
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = empty(lse.shape, torch.float32, lse.device)  # written by the dQ kernel
    group = nheads // nheads_k
    bd = block_d(head_dim)
    prec = dot_precision(q.dtype)
    scalars = scalar_args(spec, sq, sk, nheads)
    alibi, stride_ab = alibi_args(alibi_slopes, batch)
    lse_b, lse_h = lse_strides(lse, varlen)
    bias, bias_strides = bias_args(attn_bias)
    seed, dropout_p, dropout_scale = dropout_args(spec, rng_seed)
    db_full = _dbias_target(dbias, (batch, nheads, sq, sk))
    db_strides = (0, 0, 0, 0) if db_full is None else broadcast_strides(db_full)

    q_st, k_st, v_st = seq_strides(q, varlen), seq_strides(k, varlen), seq_strides(v, varlen)
    do_st = seq_strides(do, varlen)
    common = dict(
        Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, ALIBI=alibi, CU_Q=cu_seqlens_q,
        CU_K=cu_seqlens_k, BIAS=bias, RNG=seed,
        stride_qb=q_st[0], stride_qm=q_st[1], stride_qh=q_st[2],
        stride_kb=k_st[0], stride_kn=k_st[1], stride_kh=k_st[2],
        stride_vb=v_st[0], stride_vn=v_st[1], stride_vh=v_st[2],
        stride_dob=do_st[0], stride_dom=do_st[1], stride_doh=do_st[2],
        stride_lb=lse_b, stride_lh=lse_h, stride_ab=stride_ab,
        stride_biasb=bias_strides[0], stride_biash=bias_strides[1],
        stride_biasm=bias_strides[2], stride_biasn=bias_strides[3],
        seqlen_q=sq, seqlen_k=sk, GROUP=group, scale=spec.softmax_scale,
        dropout_p=dropout_p, dropout_scale=dropout_scale, **scalars,
        HEAD_DIM=head_dim, BLOCK_D=bd, DOT_PREC=prec)

    # dQ first: its prologue writes delta, which the dK/dV kernel reads.
    cfg = get_config("dq", head_dim, spec.causal, q.dtype, q.device, max(sq, sk))
    block_m, block_n = cfg.block_m, cfg.block_n
    bs_idx, bs_strides, bs_m, bs_n = sparse_args(block_mask, block_size, sq, sk, spec)
    if bs_idx is not None:
        block_m, block_n = fit_block(block_m, bs_m), fit_block(block_n, bs_n)
    grid = (cdiv(sq, block_m), batch * nheads)
    dq_st, o_st = seq_strides(dq, varlen), seq_strides(out, varlen)
    launch(
        attn_bwd_dq_kernel, grid, **common, DQ=dq, O=out, BS_IDX=bs_idx, DBIAS=db_full,
        stride_dqb=dq_st[0], stride_dqm=dq_st[1], stride_dqh=dq_st[2],
        stride_ob=o_st[0], stride_om=o_st[1], stride_oh=o_st[2],
        stride_dbb=db_strides[0], stride_dbh=db_strides[1], stride_dbm=db_strides[2],
        stride_dbn=db_strides[3],
        stride_bsb=bs_strides[0], stride_bsh=bs_strides[1], stride_bsr=bs_strides[2],
        bs_m=bs_m, bs_n=bs_n, H=nheads, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    cfg = get_config("dkdv", head_dim, spec.causal, q.dtype, q.device, max(sq, sk))
    block_m, block_n = cfg.block_m, cfg.block_n
    bs_idx, bs_strides, bs_m, bs_n = sparse_args(block_mask, block_size, sq, sk, spec,
                                                 transpose=True)
    if bs_idx is not None:
        block_m, block_n = fit_block(block_m, bs_m), fit_block(block_n, bs_n)
    grid = (cdiv(sk, block_n), batch * nheads_k)
    dk_st, dv_st = seq_strides(dk, varlen), seq_strides(dv, varlen)
    launch(
        attn_bwd_dkdv_kernel, grid, **common, DK=dk, DV=dv, BS_IDX=bs_idx,
        stride_dkb=dk_st[0], stride_dkn=dk_st[1], stride_dkh=dk_st[2],
        stride_dvb=dv_st[0], stride_dvn=dv_st[1], stride_dvh=dv_st[2],
        stride_bsb=bs_strides[0], stride_bsh=bs_strides[1], stride_bsr=bs_strides[2],
        bs_m=bs_m, bs_n=bs_n, HK=nheads_k, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if db_full is not None and db_full is not dbias:
        dims = [d for d in range(4) if dbias.shape[d] == 1 and db_full.shape[d] != 1]
        dbias.copy_(db_full.sum(dim=dims, keepdim=True) if dims else db_full)
    return dq, dk, dv
