"""Allocation and grid of the forward kernel."""
from __future__ import annotations

import torch

from ..spec import AttnSpec
from . import launch_sm90
from .args import (alibi_args, bias_args, block_d, cdiv, dot_precision, dropout_args, layout,
                   lse_strides, scalar_args, seq_strides)
from .configs import get_config
from .fastlaunch import (PlanCache, empty, launch, plan_roles, plans_enabled, record_plan,
                         recording, signature)
from .kernels.fwd import attn_fwd_kernel
from .sparse_index import fit_block, sparse_args

# Launch plans of plain calls (no optional feature; fastlaunch.Plan): a short-sequence forward
# costs as much host time as GPU time, most of it rebuilding the same ~60 kernel arguments from
# the same shapes.  Inputs (q, k, v); q, k and v go to the kernel parameters below even when
# one tensor is passed as two of them.
_plans = PlanCache()
_ROLES = {attn_fwd_kernel: plan_roles(attn_fwd_kernel, Q=0, K=1, V=2)}


def forward(q, k, v, spec: AttnSpec, *, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=None, max_seqlen_k=None, attn_bias=None, rng_seed=None,
            block_mask=None, block_size=None, block_table=None, out_dtype=None):
    """``(out, lse)``.  With ``block_table`` (varlen only) ``k``/``v`` are page pools
    ``(num_blocks, page_size, Hk, D)`` read through the table inside the kernel.  ``out`` is in
    ``out_dtype`` (default q's; partial calls ask for float32)."""
    no_feature = (alibi_slopes is None and cu_seqlens_q is None and attn_bias is None
                  and rng_seed is None and block_mask is None and block_table is None
                  and out_dtype is None)
    if no_feature:
        res = launch_sm90.planned_forward(q, k, v, spec)
        if res is not None:
            return res
        # (head dims between 64 and 256 other than those: at the next width, zeros past the
        # head's last column, launch_sm90.padded_width)
        if launch_sm90.eligible(q, k, v, spec, padded=True):
            return launch_sm90.forward(q, k, v, spec)
    elif (attn_bias is not None and alibi_slopes is None and cu_seqlens_q is None
          and rng_seed is None and block_mask is None and block_table is None
          and out_dtype is None and q.dim() == 4 and launch_sm90.on_hopper(q)):
        # a padded batch's key mask: the Hopper kernels read it (launch_sm90.key_mask), through
        # the plan of an earlier call like this one where there is one
        mask = launch_sm90.key_mask_of(attn_bias, q.shape[0], k.shape[1])
        if mask is not None:
            res = launch_sm90.planned_forward(q, k, v, spec, mask)
            if res is not None:
                return res
            if launch_sm90.eligible(q, k, v, spec, padded=True):
                return launch_sm90.forward(q, k, v, spec, key_mask=mask)
    elif (block_mask is not None and alibi_slopes is None and cu_seqlens_q is None
          and attn_bias is None and rng_seed is None and block_table is None
          and out_dtype is None and q.dim() == 4 and launch_sm90.on_hopper(q)):
        # a block mask of whole tiles: the Hopper forward walks each row's list of blocks
        # (the lists are cached per mask), through the plan of an earlier call like this one
        # where there is one
        sparse = sparse_args(block_mask, block_size, q.shape[1], k.shape[1], spec)
        res = launch_sm90.planned_forward(q, k, v, spec, sparse=sparse)
        if res is not None:
            return res
        if launch_sm90.sparse_eligible(q, k, v, spec, block_size):
            return launch_sm90.forward(q, k, v, spec, sparse=sparse)
    elif (cu_seqlens_q is not None and block_table is None and alibi_slopes is None
          and attn_bias is None and rng_seed is None and block_mask is None
          and out_dtype is None and launch_sm90.on_hopper(q)):
        # packed sequences: the Hopper forward takes each one's rows from the cumulative
        # lengths (the int32 the kernel reads), through the plan of an earlier call like this
        # one where there is one
        packed = launch_sm90.packed_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        res = launch_sm90.planned_forward(q, k, v, spec, varlen=packed)
        if res is not None:
            return res
        if launch_sm90.varlen_eligible(q, k, v, spec, padded=True):
            return launch_sm90.forward(q, k, v, spec, varlen=packed)
    if not (no_feature and plans_enabled()):
        return _forward(q, k, v, spec, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, attn_bias, rng_seed, block_mask, block_size, block_table,
                        out_dtype)
    key = (signature(q, k, v), q.dtype, q.device, spec)
    plan = _plans.get(key)
    if plan is not None:
        res = plan.run((q, k, v))
        if res is not None:
            return res
    with recording() as rec:
        out, lse = _forward(q, k, v, spec)
    plan = record_plan(rec, (q, k, v), (out, lse), _ROLES)
    if plan is not None:
        _plans.put(key, plan)
    return out, lse


def _forward(q, k, v, spec: AttnSpec, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
             max_seqlen_q=None, max_seqlen_k=None, attn_bias=None, rng_seed=None,
             block_mask=None, block_size=None, block_table=None, out_dtype=None):
    varlen, batch, sq, sk, nheads, nheads_k, head_dim = layout(q, k, cu_seqlens_q, max_seqlen_q,
                                                               max_seqlen_k)
    if block_table is not None:
        # (page, slot, head) strides take the places of (batch, position, head)
        nheads_k, page_size = k.shape[2], k.shape[1]
        k_strides, v_strides = tuple(k.stride()[:3]), tuple(v.stride()[:3])
        if block_table.stride(-1) != 1:
            block_table = block_table.contiguous()
        stride_bt = block_table.stride(0)
    else:
        page_size, stride_bt = 1, 0
        k_strides, v_strides = seq_strides(k, varlen), seq_strides(v, varlen)
    out = empty(q.shape, out_dtype or q.dtype, q.device)
    lse_shape = (nheads, q.shape[0]) if varlen else (batch, nheads, sq)
    lse = empty(lse_shape, torch.float32, q.device)
    if out.numel() == 0 or batch == 0 or sq == 0:
        if lse.numel():
            lse.fill_(float("-inf"))
        return out.zero_(), lse
    cfg = get_config("fwd", head_dim, spec.causal, q.dtype, q.device, max(sq, sk))
    block_m, block_n = cfg.block_m, cfg.block_n
    alibi, stride_ab = alibi_args(alibi_slopes, batch)
    bias, bias_strides = bias_args(attn_bias)
    seed, dropout_p, dropout_scale = dropout_args(spec, rng_seed)
    bs_idx, bs_strides, bs_m, bs_n = sparse_args(block_mask, block_size, sq, sk, spec)
    if bs_idx is not None:
        block_m, block_n = fit_block(block_m, bs_m), fit_block(block_n, bs_n)
    grid = (cdiv(sq, block_m), batch * nheads)
    q_strides, o_strides = seq_strides(q, varlen), seq_strides(out, varlen)
    lse_b, lse_h = lse_strides(lse, varlen)
    launch(
        attn_fwd_kernel, grid,
        Q=q, K=k, V=v, O=out, LSE=lse, ALIBI=alibi, CU_Q=cu_seqlens_q, CU_K=cu_seqlens_k,
        BIAS=bias, RNG=seed, BS_IDX=bs_idx, BLOCK_TABLE=block_table,
        stride_qb=q_strides[0], stride_qm=q_strides[1], stride_qh=q_strides[2],
        stride_kb=k_strides[0], stride_kn=k_strides[1], stride_kh=k_strides[2],
        stride_vb=v_strides[0], stride_vn=v_strides[1], stride_vh=v_strides[2],
        stride_ob=o_strides[0], stride_om=o_strides[1], stride_oh=o_strides[2],
        stride_lb=lse_b, stride_lh=lse_h, stride_ab=stride_ab,
        stride_biasb=bias_strides[0], stride_biash=bias_strides[1],
        stride_biasm=bias_strides[2], stride_biasn=bias_strides[3],
        stride_bsb=bs_strides[0], stride_bsh=bs_strides[1], stride_bsr=bs_strides[2],
        bs_m=bs_m, bs_n=bs_n, stride_btb=stride_bt,
        seqlen_q=sq, seqlen_k=sk, H=nheads, GROUP=nheads // nheads_k,
        dropout_p=dropout_p, dropout_scale=dropout_scale,
        **scalar_args(spec, sq, sk, nheads),
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=block_m, BLOCK_N=block_n,
        PAGE_SIZE=page_size, DOT_PREC=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse
