"""Allocation and grids of the backward kernels: dQ (which also writes ``delta``), then dK/dV.

A plain backward launches these two kernels and nothing else: no preprocess pass, no fills,
casts or copies.  The gradients are allocated in the layout of their inputs (``empty_like``),
so a ``q`` that is a transposed view (the SDPA layout) gets a ``dq`` that autograd hands to
the caller's tensor without a copy.  The byte counts are in ``flashtile.reference.io_model``.
"""
from __future__ import annotations

import torch

from ..spec import AttnSpec
from . import launch_common
from .configs import get_config
from .kernels.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
from .launch_common import (launch, run_direct, alibi_args, bias_args, block_d, broadcast_strides,
                            cdiv, dot_precision, dropout_args, empty, fit_block, layout,
                            lse_strides, scalar_args, seq_strides, sparse_args)


# Launch plans of plain backward calls (no optional feature), as the forward keeps them
# (launch_common.PlanCache): at short sequences the three launches' host work (configs, ~60
# arguments each, direct-launch keys) costs as much as their GPU time.  A plan keeps each
# launch's grid, compiled kernel and argument list, with the positions where the call's tensors
# go; later calls allocate the outputs and launch.  (Two launches since delta moved into the
# dQ kernel's prologue.)
_plans = launch_common.PlanCache()
PLANS = True  # False: every call takes the full path (benchmarks/overhead.py compares the two)


# The tensors each backward kernel takes first, in order (the other tensor parameters are the
# optional features a plain call leaves None).
_ROLES = (("q", "k", "v", "do", "dq", "out", "lse", "delta"),
          ("q", "k", "v", "do", "dk", "dv", "lse", "delta"))


def _record(launched: list, tensors: dict):
    """The plan of one call from its direct launches, or None if an argument is not where
    ``_ROLES`` says (a tensor beyond them, or a role holding another tensor).  Positions are
    known by role, not found by identity, so ``flash_attn_func(x, x, x)`` records a plan that
    also serves a later call with three distinct tensors."""
    plan = []
    for (grid, (compiled, values)), roles in zip(launched, _ROLES):
        if any(values[i] is not tensors[name] for i, name in enumerate(roles)):
            return None
        if any(isinstance(a, torch.Tensor) for a in values[len(roles):]):
            return None
        plan.append((grid, compiled, [None] * len(roles) + list(values[len(roles):]),
                     list(enumerate(roles))))
    return plan


def _replay(plan, do, q, k, v, out, lse):
    """Run a recorded plan for new tensors; ``(dq, dk, dv)``."""
    tensors = dict(q=q, k=k, v=v, do=do, out=out, lse=lse,
                   dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v),
                   delta=torch.empty(lse.shape, dtype=torch.float32, device=lse.device))
    for grid, compiled, values, fill in plan:
        values = values.copy()
        for i, name in fill:
            values[i] = tensors[name]
        run_direct(compiled, grid, values, q.device.index)
    return tensors["dq"], tensors["dk"], tensors["dv"]


def _grad_like(x: torch.Tensor, dtype=None) -> torch.Tensor:
    """An output for the gradient of ``x`` with ``x``'s strides when ``x`` is dense (what
    autograd's accumulation wants: a gradient of another layout is copied into ``x``'s, one
    read and one write of the whole tensor), in ``dtype`` (default x's); NaN-filled under
    ``poison_outputs``."""
    g = torch.empty_like(x, dtype=dtype)
    return g.fill_(float("nan")) if launch_common._poison else g


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
             and do.stride(-1) == 1
             and PLANS and launch_common.plans_enabled())
    if plain:
        key = (launch_common.signature(do, q, k, v, out, lse), q.dtype, q.device, spec)
        plan = _plans.get(key)
        # a profiler hook asks every launch to take the full path (see run_direct)
        if plan is not None and launch_common._no_launch_hooks():
            return _replay(plan, do, q, k, v, out, lse)
    varlen, batch, sq, sk, nheads, nheads_k, head_dim = layout(q, k, cu_seqlens_q, max_seqlen_q,
                                                               max_seqlen_k)
    dq, dk, dv = (_grad_like(x, grad_dtype) for x in (q, k, v))
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

    launched = []
    common = dict(HEAD_DIM=head_dim, BLOCK_D=bd, DOT_PREC=prec, dropout_p=dropout_p,
                  dropout_scale=dropout_scale, **scalars)

    # dQ first: its prologue writes delta, which the dK/dV kernel reads.
    cfg = get_config("dq", head_dim, spec.causal, q.dtype, q.device, max(sq, sk))
    block_m, block_n = cfg.block_m, cfg.block_n
    bs_idx, bs_strides, bs_m, bs_n = sparse_args(block_mask, block_size, sq, sk, spec)
    if bs_idx is not None:
        block_m, block_n = fit_block(block_m, bs_m), fit_block(block_n, bs_n)
    grid = (cdiv(sq, block_m), batch * nheads)
    launched.append((grid, launch(attn_bwd_dq_kernel, grid, (
        q, k, v, do, dq, out, lse, delta, alibi, cu_seqlens_q, cu_seqlens_k, bias, seed, bs_idx,
        db_full, *seq_strides(q, varlen), *seq_strides(k, varlen), *seq_strides(v, varlen),
        *seq_strides(do, varlen), *seq_strides(dq, varlen), *seq_strides(out, varlen), lse_b,
        lse_h, stride_ab,
        *bias_strides, *db_strides, *bs_strides, bs_m, bs_n, sq, sk, nheads, group,
        spec.softmax_scale,
    ), dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **common))))
    cfg = get_config("dkdv", head_dim, spec.causal, q.dtype, q.device, max(sq, sk))
    block_m, block_n = cfg.block_m, cfg.block_n
    bs_idx, bs_strides, bs_m, bs_n = sparse_args(block_mask, block_size, sq, sk, spec, transpose=True)
    if bs_idx is not None:
        block_m, block_n = fit_block(block_m, bs_m), fit_block(block_n, bs_n)
    grid = (cdiv(sk, block_n), batch * nheads_k)
    launched.append((grid, launch(attn_bwd_dkdv_kernel, grid, (
        q, k, v, do, dk, dv, lse, delta, alibi, cu_seqlens_q, cu_seqlens_k, bias, seed, bs_idx,
        *seq_strides(q, varlen), *seq_strides(k, varlen), *seq_strides(v, varlen),
        *seq_strides(do, varlen), *seq_strides(dk, varlen), *seq_strides(dv, varlen), lse_b,
        lse_h, stride_ab, *bias_strides, *bs_strides, bs_m, bs_n, sq, sk, nheads_k, group,
        spec.softmax_scale,
    ), dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **common))))
    if db_full is not None and db_full is not dbias:
        dims = [d for d in range(4) if dbias.shape[d] == 1 and db_full.shape[d] != 1]
        dbias.copy_(db_full.sum(dim=dims, keepdim=True) if dims else db_full)
    if plain and all(lc is not None for _, lc in launched) and q.device.index is not None:
        plan = _record(launched, dict(q=q, k=k, v=v, do=do, out=out, lse=lse, dq=dq, dk=dk, dv=dv,
                                      delta=delta))
        if plan is not None:
            _plans.put(key, plan)
    return dq, dk, dv
