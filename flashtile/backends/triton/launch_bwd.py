"""Allocation and grids of the backward kernel (``kernels/bwd.py``): one grid holding both
roles, dQ programs and dK/dV programs, group by group, so the second reads of every input hit
L2; two grids (dQ, which writes ``delta``, then dK/dV) for block-sparse masks.

A plain backward launches that one kernel and nothing else: no preprocess pass, no fills,
casts or copies.  The gradients are allocated in the layout of their inputs (``empty_like``),
so a ``q`` that is a transposed view (the SDPA layout) gets a ``dq`` that autograd hands to
the caller's tensor without a copy.  The byte counts are in ``flashtile.reference.algorithms``.
"""
from __future__ import annotations

import contextlib

import torch

from ..spec import AttnSpec
from .args import (alibi_args, bias_args, block_d, broadcast_strides, cdiv, dot_precision,
                   dropout_args, layout, lse_strides, scalar_args, seq_strides)
from .configs import get_config
from .fastlaunch import (PlanCache, empty, empty_like, launch, plan_roles, plans_enabled,
                         record_plan, recording, signature, zeros)
from .kernels.bwd import ROLES_BOTH, ROLES_DKDV, ROLES_DQ, attn_bwd_kernel
from .sparse_index import fit_block, sparse_args

# Launch plans of plain backward calls (no optional feature; fastlaunch.Plan), as the forward
# keeps them: at short sequences the launch's host work (config, ~70 arguments, direct-launch
# key) costs as much as its GPU time.  Inputs (do, q, k, v, out, lse), placed in the kernel
# parameters below even when one tensor is passed as two of them.
_plans = PlanCache()
_ROLES = {attn_bwd_kernel: plan_roles(attn_bwd_kernel, DO=0, Q=1, K=2, V=3, O=4, LSE=5)}
_two_grids = False  # two_grids(): process-wide, as configs.override (autograd's own thread)


@contextlib.contextmanager
def two_grids():
    """Inside the block every backward launches its two roles as two grids (the dQ grid, then
    the dK/dV grid), as a block-sparse call always does: the comparison point of the one-grid
    launch in benchmarks and tests."""
    global _two_grids
    old, _two_grids = _two_grids, True
    try:
        yield
    finally:
        _two_grids = old


def _blocks(block_m: int, block_n: int, sparse) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of a role, fitted to the block-sparse mask's blocks when there is
    one (``sparse_args``)."""
    if sparse[0] is None:
        return block_m, block_n
    return fit_block(block_m, sparse[2]), fit_block(block_n, sparse[3])


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
        # a two-grid launch indexes its contiguous ``delta`` buffer with lse's strides
        lse = lse.contiguous()
    plain = (alibi_slopes is None and cu_seqlens_q is None and attn_bias is None
             and rng_seed is None and block_mask is None and dbias is None and grad_dtype is None
             and do.stride(-1) == 1 and plans_enabled())
    if not plain:
        return _backward(do, q, k, v, out, lse, spec, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                         max_seqlen_q, max_seqlen_k, attn_bias, rng_seed, block_mask, block_size,
                         dbias, grad_dtype)
    inputs = (do, q, k, v, out, lse)
    key = (signature(*inputs), q.dtype, q.device, spec, _two_grids)
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
    do_st, o_st = seq_strides(do, varlen), seq_strides(out, varlen)
    dq_st, dk_st, dv_st = seq_strides(dq, varlen), seq_strides(dk, varlen), seq_strides(dv, varlen)
    common = dict(
        Q=q, K=k, V=v, DO=do, O=out, DQ=dq, DK=dk, DV=dv, LSE=lse, ALIBI=alibi,
        CU_Q=cu_seqlens_q, CU_K=cu_seqlens_k, BIAS=bias, RNG=seed, DBIAS=db_full,
        stride_qb=q_st[0], stride_qm=q_st[1], stride_qh=q_st[2],
        stride_kb=k_st[0], stride_kn=k_st[1], stride_kh=k_st[2],
        stride_vb=v_st[0], stride_vn=v_st[1], stride_vh=v_st[2],
        stride_dob=do_st[0], stride_dom=do_st[1], stride_doh=do_st[2],
        stride_ob=o_st[0], stride_om=o_st[1], stride_oh=o_st[2],
        stride_dqb=dq_st[0], stride_dqm=dq_st[1], stride_dqh=dq_st[2],
        stride_dkb=dk_st[0], stride_dkn=dk_st[1], stride_dkh=dk_st[2],
        stride_dvb=dv_st[0], stride_dvn=dv_st[1], stride_dvh=dv_st[2],
        stride_lb=lse_b, stride_lh=lse_h, stride_ab=stride_ab,
        stride_biasb=bias_strides[0], stride_biash=bias_strides[1],
        stride_biasm=bias_strides[2], stride_biasn=bias_strides[3],
        stride_dbb=db_strides[0], stride_dbh=db_strides[1], stride_dbm=db_strides[2],
        stride_dbn=db_strides[3],
        seqlen_q=sq, seqlen_k=sk, HK=nheads_k, GROUP=group, scale=spec.softmax_scale,
        dropout_p=dropout_p, dropout_scale=dropout_scale, **scalars,
        HEAD_DIM=head_dim, BLOCK_D=bd, DOT_PREC=prec)
    seqlen = max(sq, sk)
    # written by the dQ programs, read by the dK/dV programs
    delta = empty(lse.shape, torch.float32, lse.device)
    cfg = None
    if block_mask is None and not _two_grids:
        cfg = get_config("bwd", head_dim, spec.causal, q.dtype, q.device, seqlen)
    if cfg is not None:
        # One grid: each group's dQ programs, then its dK/dV programs, which wait on the
        # group's counter for its delta (kernels/bwd.py).
        kv_m, kv_n = cfg.kv_blocks()
        grid = (group * cdiv(sq, cfg.block_m) + cdiv(sk, kv_n), batch * nheads_k)
        counters = zeros(1 + batch * nheads_k, torch.int32, q.device)
        launch(attn_bwd_kernel, grid, **common, DELTA=delta, CNT=counters, BS_IDX=None,
               stride_bsb=0, stride_bsh=0, stride_bsr=0, bs_m=0, bs_n=0,
               BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, KV_BLOCK_M=kv_m, KV_BLOCK_N=kv_n,
               ROLES=ROLES_BOTH, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        # Two grids, each role with its own blocks (block-sparse masks: each walks its lists);
        # the dQ grid writes delta, the dK/dV grid reads it.
        for roles, pass_, transpose in ((ROLES_DQ, "dq", False), (ROLES_DKDV, "dkdv", True)):
            cfg = get_config(pass_, head_dim, spec.causal, q.dtype, q.device, seqlen)
            bs_idx, bs_strides, bs_m, bs_n = sparse_args(block_mask, block_size, sq, sk, spec,
                                                         transpose=transpose)
            block_m, block_n = _blocks(cfg.block_m, cfg.block_n, (bs_idx, None, bs_m, bs_n))
            n = group * cdiv(sq, block_m) if roles == ROLES_DQ else cdiv(sk, block_n)
            launch(attn_bwd_kernel, (n, batch * nheads_k), **common, DELTA=delta, CNT=None,
                   BS_IDX=bs_idx, stride_bsb=bs_strides[0], stride_bsh=bs_strides[1],
                   stride_bsr=bs_strides[2], bs_m=bs_m, bs_n=bs_n, BLOCK_M=block_m,
                   BLOCK_N=block_n, KV_BLOCK_M=block_m, KV_BLOCK_N=block_n, ROLES=roles,
                   num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if db_full is not None and db_full is not dbias:
        dims = [d for d in range(4) if dbias.shape[d] == 1 and db_full.shape[d] != 1]
        dbias.copy_(db_full.sum(dim=dims, keepdim=True) if dims else db_full)
    return dq, dk, dv
