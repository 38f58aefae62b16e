"""Padding helpers for the varlen functions (flash-attn's ``bert_padding`` conventions).

``unpad_input`` packs the valid tokens of a padded batch for ``flash_attn_varlen_func``;
``pad_input`` scatters the packed result back::

    attention_mask (batch=2, seqlen=4)      packed rows (indices into batch*seqlen)
        1 1 1 0                                 0 1 2 | 4 5
        1 1 0 0          cu_seqlens = [0, 3, 5], max_seqlen = 3, seqused = [3, 2]

Both are differentiable (gather / scatter); padded positions come back as zeros.
"""
from __future__ import annotations

import torch

__all__ = ["unpad_input", "pad_input"]


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor):
    """Pack the tokens where ``attention_mask`` is nonzero.

    Arguments:
        hidden_states: ``(batch, seqlen, ...)``.
        attention_mask: ``(batch, seqlen)``, bool or integer, nonzero = valid token (valid
            tokens need not be contiguous; they are packed in order).

    Returns:
        ``(hidden_unpad, indices, cu_seqlens, max_seqlen, seqused)``: ``hidden_unpad``
        ``(total, ...)`` the valid tokens in batch-major order; ``indices`` int64 ``(total,)``
        their positions in the flattened ``(batch * seqlen)``; ``cu_seqlens`` int32
        ``(batch + 1,)``; ``max_seqlen`` a Python int; ``seqused`` int32 ``(batch,)`` the
        number of valid tokens of each sequence.
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        raise ValueError("hidden_states must be a tensor of shape (batch, seqlen, ...), got "
                         f"{tuple(getattr(hidden_states, 'shape', ()))}")
    if (not isinstance(attention_mask, torch.Tensor)
            or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2])):
        raise ValueError("attention_mask must be a tensor of shape (batch, seqlen) = "
                         f"{tuple(hidden_states.shape[:2])}, got "
                         f"{tuple(getattr(attention_mask, 'shape', ()))}")
    valid = attention_mask.bool()
    seqused = valid.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(valid.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.zeros(seqused.shape[0] + 1, dtype=torch.int32, device=valid.device)
    torch.cumsum(seqused, dim=0, dtype=torch.int32, out=cu_seqlens[1:])
    max_seqlen = int(seqused.max()) if seqused.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat.index_select(0, indices), indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int,
              seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: ``(total, ...)`` -> ``(batch, seqlen, ...)`` with zeros
    at the padded positions."""
    if indices.dim() != 1 or indices.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"indices must have shape (total,) = ({hidden_states.shape[0]},), got "
                         f"{tuple(indices.shape)}")
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_copy(0, indices, hidden_states)
    return out.view(batch, seqlen, *hidden_states.shape[1:])
