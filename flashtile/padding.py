"""Padding helpers for the varlen functions (flash-attn's ``bert_padding`` module).

``unpad_input`` packs the valid tokens of a padded batch for ``flash_attn_varlen_func``;
``pad_input`` scatters the packed result back::

    attention_mask (batch=2, seqlen=4)      packed rows (indices into batch*seqlen)
        1 1 1 0                                 0 1 2 | 4 5
        1 1 0 0          cu_seqlens = [0, 3, 5], max_seqlen = 3, seqused = [3, 2]

The index helpers ``index_first_axis``, ``index_put_first_axis`` and
``index_first_axis_residual`` are the gathers / scatters these use, with flash-attn's names and
arguments.  Everything is differentiable; padded positions come back as zeros.
"""
from __future__ import annotations

import torch

from ._validate import FlashtileInputError

__all__ = ["index_first_axis", "index_first_axis_residual", "index_put_first_axis",
           "pad_input", "unpad_input", "unpad_input_for_concatenated_sequences"]


def _check_indices(indices, n_rows: int | None, total: int | None, name: str = "indices"):
    """``indices``: integer ``(total,)`` tensor on the values' device with entries in
    ``[0, n_rows)``.  The range check reads the min and max once on the host (eager mode
    only: skipped while compiling or capturing a CUDA graph, where an out-of-range index
    still raises PyTorch's own index error instead of touching memory)."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{name} must be an int64 torch.Tensor of shape (total,), got "
                        f"{type(indices).__name__}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be int64 (or int32) positions in the flattened "
                        f"(batch * seqlen), got {str(indices.dtype).replace('torch.', '')}")
    if indices.dim() != 1 or (total is not None and indices.shape[0] != total):
        want = "(total,)" if total is None else f"(total,) = ({total},)"
        raise FlashtileInputError(f"{name} must have shape {want}, got {tuple(indices.shape)}")
    if n_rows is None or indices.numel() == 0 or torch.compiler.is_compiling():
        return
    if indices.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    lo, hi = (int(x) for x in torch.aminmax(indices))
    if lo < 0 or hi >= n_rows:
        bad = lo if lo < 0 else hi
        raise FlashtileInputError(f"{name} must be in [0, {n_rows}) (positions in the flattened "
                         f"(batch * seqlen) = {n_rows} rows), got {bad}")


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``input[indices]`` along the first axis: ``(n, ...)`` -> ``(len(indices), ...)``.
    The gradient is scattered back (summed where an index repeats)."""
    _check_indices(indices, input.shape[0], None)
    return input.index_select(0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor,
                         first_axis_dim: int) -> torch.Tensor:
    """A zero ``(first_axis_dim, ...)`` tensor with ``values`` written at rows ``indices``."""
    _check_indices(indices, int(first_axis_dim), values.shape[0])
    out = values.new_zeros(int(first_axis_dim), *values.shape[1:])
    return out.index_copy(0, indices.long(), values)


class _IndexFirstAxisResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, indices):
        ctx.save_for_backward(indices)
        ctx.first_shape = input.shape
        return input.index_select(0, indices), input.detach()

    @staticmethod
    def backward(ctx, grad_output, grad_residual):
        (indices,) = ctx.saved_tensors
        if grad_residual is None:
            grad_residual = grad_output.new_zeros(ctx.first_shape)
        return grad_residual.index_add(0, indices, grad_output), None


def index_first_axis_residual(input: torch.Tensor, indices: torch.Tensor):
    """``(input[indices], input)``: the gather and the input itself as a second output whose
    gradient adds to the gather's (for a residual branch that keeps every row)."""
    _check_indices(indices, input.shape[0], None)
    return _IndexFirstAxisResidual.apply(input, indices)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: torch.Tensor | None = None):
    """Pack the tokens where ``attention_mask`` (or ``unused_mask``) is nonzero.

    Arguments:
        hidden_states: ``(batch, seqlen, ...)``.
        attention_mask: ``(batch, seqlen)``, bool or integer, nonzero = valid token (valid
            tokens need not be contiguous; they are packed in order).
        unused_mask: None, or ``(batch, seqlen)``, nonzero = a slot that is allocated but
            unused (flash-attn >= 2.6): it is packed too, but not counted in ``seqused``.

    Returns:
        ``(hidden_unpad, indices, cu_seqlens, max_seqlen, seqused)``: ``hidden_unpad``
        ``(total, ...)`` the selected tokens in batch-major order; ``indices`` int64
        ``(total,)`` their positions in the flattened ``(batch * seqlen)``; ``cu_seqlens``
        int32 ``(batch + 1,)`` and ``max_seqlen`` (a Python int) over the selected tokens;
        ``seqused`` int32 ``(batch,)`` the number of valid (``attention_mask``) tokens of each
        sequence.
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        raise FlashtileInputError("hidden_states must be a tensor of shape (batch, seqlen, ...), got "
                         f"{tuple(getattr(hidden_states, 'shape', ()))}")
    batch_seqlen = tuple(hidden_states.shape[:2])
    for name, m in (("attention_mask", attention_mask), ("unused_mask", unused_mask)):
        if m is None and name == "unused_mask":
            continue
        if not isinstance(m, torch.Tensor) or tuple(m.shape) != batch_seqlen:
            raise FlashtileInputError(f"{name} must be a tensor of shape (batch, seqlen) = "
                             f"{batch_seqlen}, got {tuple(getattr(m, 'shape', ()))}")
    valid = attention_mask.bool()
    selected = valid if unused_mask is None else valid | unused_mask.bool()
    seqused = valid.sum(dim=-1, dtype=torch.int32)
    indices, cu_seqlens, max_seqlen = unpad_index(selected)
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat.index_select(0, indices), indices, cu_seqlens, max_seqlen, seqused


def unpad_index(selected: torch.Tensor):
    """``(indices, cu_seqlens, max_seqlen)`` of :func:`unpad_input` for a bool ``(batch,
    seqlen)`` mask of the tokens to pack (one host read: the longest length)."""
    seqlens = selected.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.zeros(seqlens.shape[0] + 1, dtype=torch.int32, device=selected.device)
    torch.cumsum(seqlens, dim=0, dtype=torch.int32, out=cu_seqlens[1:])
    return indices, cu_seqlens, int(seqlens.max()) if seqlens.numel() else 0


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor,
                                           attention_mask_in_length: torch.Tensor):
    """Pack rows that each hold several concatenated sequences.

    ``attention_mask_in_length`` ``(batch, seqlen)``: row ``b`` lists the lengths of the
    sequences packed one after another at the start of row ``b`` (zeros after them), e.g.
    ``[2, 3, 0, 0, 0, 0]`` holds a sequence of 2 tokens then one of 3.  Returns
    ``(hidden_unpad, indices, cu_seqlens, max_seqlen)`` with one ``cu_seqlens`` entry per
    sequence (so no attention crosses sequences within a row), as flash-attn's function.
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        raise FlashtileInputError("hidden_states must be a tensor of shape (batch, seqlen, ...), got "
                         f"{tuple(getattr(hidden_states, 'shape', ()))}")
    lengths = attention_mask_in_length
    if (not isinstance(lengths, torch.Tensor)
            or tuple(lengths.shape) != tuple(hidden_states.shape[:2])):
        raise FlashtileInputError("attention_mask_in_length must be a tensor of shape (batch, seqlen) = "
                         f"{tuple(hidden_states.shape[:2])}, got "
                         f"{tuple(getattr(lengths, 'shape', ()))}")
    seqlen = lengths.shape[1]
    used = torch.arange(seqlen, device=lengths.device)[None, :] < lengths.sum(-1, keepdim=True)
    flat_lengths = lengths.flatten()
    seqlens = flat_lengths[flat_lengths != 0].to(torch.int32)
    indices = torch.nonzero(used.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.zeros(seqlens.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(seqlens, dim=0, dtype=torch.int32, out=cu_seqlens[1:])
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat.index_select(0, indices), indices, cu_seqlens, max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int,
              seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: ``(total, ...)`` -> ``(batch, seqlen, ...)`` with zeros
    at the padded positions.  ``indices`` (int64 or int32 ``(total,)``) must lie in
    ``[0, batch * seqlen)``; this is checked (one host read of their min and max, in eager
    mode) and a bad one raises a ``ValueError`` naming ``indices``."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1:
        raise FlashtileInputError("hidden_states must be a tensor of shape (total, ...), got "
                         f"{tuple(getattr(hidden_states, 'shape', ()))}")
    out = index_put_first_axis(hidden_states, indices, int(batch) * int(seqlen))
    return out.view(int(batch), int(seqlen), *hidden_states.shape[1:])
