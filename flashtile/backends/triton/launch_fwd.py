"""Allocation and grid of the forward kernel."""
from __future__ import annotations

import torch

from ..spec import AttnSpec
from .configs import get_config
from .kernels.fwd import attn_fwd_kernel
from .launch_common import (alibi_args, block_d, cdiv, dot_precision, empty, launch, layout,
                            lse_strides, scalar_args, seq_strides)


def forward(q, k, v, spec: AttnSpec, *, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=None, max_seqlen_k=None):
    varlen, batch, sq, sk, nheads, nheads_k, head_dim = layout(q, k, cu_seqlens_q, max_seqlen_q,
                                                               max_seqlen_k)
    out = empty(q.shape, q.dtype, q.device)
    lse_shape = (nheads, q.shape[0]) if varlen else (batch, nheads, sq)
    lse = empty(lse_shape, torch.float32, q.device)
    if out.numel() == 0 or batch == 0 or sq == 0:
        if lse.numel():
            lse.fill_(float("-inf"))
        return out.zero_(), lse
    cfg = get_config("fwd", head_dim, spec.causal, q.dtype, q.device, max(sq, sk))
    alibi, stride_ab = alibi_args(alibi_slopes, batch)
    grid = (cdiv(sq, cfg.block_m), batch * nheads)
    launch(attn_fwd_kernel, grid, (
        q, k, v, out, lse, alibi, cu_seqlens_q, cu_seqlens_k,
        *seq_strides(q, varlen), *seq_strides(k, varlen), *seq_strides(v, varlen),
        *seq_strides(out, varlen), *lse_strides(lse, varlen), stride_ab,
        sq, sk, nheads, nheads // nheads_k,
    ), dict(HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, DOT_PREC=dot_precision(q.dtype), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **scalar_args(spec)))
    return out, lse
