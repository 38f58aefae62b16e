"""Kernel arguments of an attention call: strides of the two layouts, the scalar arguments,
and the arguments of the optional features (ALiBi, bias / mask, dropout)."""
from __future__ import annotations

import torch

from ..spec import AttnSpec
from .kernels.common import LOG2E as _LOG2E

# The kernels' constant as a host float: the scale folds it in before the launch.
LOG2E = float(_LOG2E.value)


def seq_strides(x: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, position, head) strides; a packed varlen tensor has no batch stride."""
    st = x.stride()
    return (0, st[0], st[1]) if varlen else (st[0], st[1], st[2])


def lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    """(batch, head) strides of lse: ``(B, H, Sq)`` dense, ``(H, total_q)`` varlen."""
    if varlen:
        return 0, lse.stride(0)
    return lse.stride(0), lse.stride(1)


def scalar_args(spec: AttnSpec, seqlen_q: int = 0, seqlen_k: int = 0, nheads: int = 0) -> dict:
    """Scores in base 2: ``log2(e)`` is folded into the scale (or into the softcap).  The
    partial-call frame (``spec.py``) goes in as runtime scalars: global offsets and the global
    lengths (``seqlen_*``, the call's own or ``max_seqlen_*``, by default), so every offset
    runs the same compiled kernel."""
    total_q, total_k = spec.totals(int(seqlen_q), int(seqlen_k))
    if spec.softcap > 0:
        qk_scale = spec.softcap * LOG2E
        softcap_scale = spec.softmax_scale / spec.softcap
    else:
        qk_scale = spec.softmax_scale * LOG2E
        softcap_scale = 1.0
    return dict(
        qk_scale=qk_scale, softcap_scale=softcap_scale,
        window_left=max(spec.window_left, 0), window_right=max(spec.window_right, 0),
        BOTTOM_RIGHT=spec.bottom_right, HAS_LEFT=spec.window_left >= 0,
        HAS_RIGHT=spec.window_right >= 0, HAS_SOFTCAP=spec.softcap > 0,
        q_offset=spec.q_offset, k_offset=spec.k_offset, seqlen_q_total=total_q,
        seqlen_k_total=total_k, batch_offset=spec.batch_offset, head_offset=spec.head_offset,
        nheads_total=spec.nheads_total or nheads,
    )


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products: users who pay for fp32 expect fp32 accuracy.
    return "ieee" if dtype == torch.float32 else "tf32"


def block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def alibi_args(alibi_slopes, batch: int):
    if alibi_slopes is None:
        return None, 0
    return alibi_slopes, (alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layout(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
    """(varlen, batch, seqlen_q, seqlen_k, H, Hk, D) of a call."""
    varlen = cu_seqlens_q is not None
    if varlen:
        batch = cu_seqlens_q.shape[0] - 1
        return True, batch, int(max_seqlen_q), int(max_seqlen_k), q.shape[1], k.shape[1], q.shape[2]
    return False, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]


def broadcast_strides(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of ``x`` with 0 on every size-1 dim, so it indexes like its broadcast."""
    return tuple(0 if n == 1 else st for n, st in zip(x.shape, x.stride()))


def bias_args(attn_bias):
    """(tensor the kernel reads, its 4 broadcast strides) for a ``(B|1, H|1, Sq|1, Sk|1)`` bias
    or bool mask.  A bool mask is read through a uint8 view (same storage, same strides)."""
    if attn_bias is None:
        return None, (0, 0, 0, 0)
    t = attn_bias.view(torch.uint8) if attn_bias.dtype == torch.bool else attn_bias
    return t, broadcast_strides(t)


def dropout_args(spec: AttnSpec, rng_seed):
    """(seed tensor or None, dropout_p, 1 / (1 - p)) for the kernels."""
    if spec.dropout_p <= 0:
        return None, 0.0, 1.0
    if rng_seed is None:
        raise ValueError("dropout_p > 0 needs rng_seed (an int64 tensor of shape (1,))")
    return rng_seed, float(spec.dropout_p), 1.0 / (1.0 - spec.dropout_p)
