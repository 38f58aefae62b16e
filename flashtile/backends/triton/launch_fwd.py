"""Allocation and grid of the forward kernel."""
from __future__ import annotations

import torch

from ..spec import AttnSpec
from . import launch_common, launch_sm90
from .configs import get_config
from .kernels.fwd import attn_fwd_kernel
from .launch_common import (launch, run_direct, alibi_args, bias_args, block_d, cdiv,
                            dot_precision, dropout_args,
                            empty, fit_block, layout, lse_strides, scalar_args, seq_strides,
                            sparse_args)


# Launch plans of plain calls (no optional feature, see launch_common.PlanCache).  A
# short-sequence forward costs as much host time as GPU time, and most of that host time
# rebuilds the same ~60 kernel arguments from the same shapes.  A plan keeps the grid, the
# compiled kernel and the arguments of the first call; later calls only allocate out / lse and
# put the five tensors in place.
_plans = launch_common.PlanCache()


def forward(q, k, v, spec: AttnSpec, *, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=None, max_seqlen_k=None, attn_bias=None, rng_seed=None,
            block_mask=None, block_size=None, block_table=None, out_dtype=None):
    """``(out, lse)``.  With ``block_table`` (varlen only) ``k``/``v`` are page pools
    ``(num_blocks, page_size, Hk, D)`` read through the table inside the kernel.  ``out`` is in
    ``out_dtype`` (default q's; partial calls ask for float32)."""
    no_feature = (alibi_slopes is None and cu_seqlens_q is None and attn_bias is None
                  and rng_seed is None and block_mask is None and block_table is None
                  and out_dtype is None)
    if no_feature and launch_sm90.eligible(q, k, v, spec):
        return launch_sm90.forward(q, k, v, spec)
    plain = no_feature and launch_common.plans_enabled()
    if plain:
        key = (launch_common.signature(q, k, v), q.dtype, q.device, spec)
        plan = _plans.get(key)
        if plan is not None:
            grid, compiled, values, lse_shape = plan
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
            values = values.copy()
            values[:5] = q, k, v, out, lse
            if run_direct(compiled, grid, values, q.device.index):
                return out, lse
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
    launched = launch(attn_fwd_kernel, grid, (
        q, k, v, out, lse, alibi, cu_seqlens_q, cu_seqlens_k, bias, seed, bs_idx, block_table,
        *seq_strides(q, varlen), *k_strides, *v_strides,
        *seq_strides(out, varlen), *lse_strides(lse, varlen), stride_ab, *bias_strides,
        *bs_strides, bs_m, bs_n, stride_bt, sq, sk, nheads, nheads // nheads_k,
    ), dict(dropout_p=dropout_p, dropout_scale=dropout_scale, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
            BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=page_size, DOT_PREC=dot_precision(q.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **scalar_args(spec, sq, sk, nheads)))
    if plain and launched is not None and q.device.index is not None:
        compiled, values = launched
        # q, k, v, out, lse are the kernel's first five arguments; a new call replaces them
        _plans.put(key, (grid, compiled, [None] * 5 + list(values[5:]), lse.shape))
    return out, lse
