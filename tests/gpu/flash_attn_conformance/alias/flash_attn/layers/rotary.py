"""``flash_attn.layers.rotary.apply_rotary_emb``: rotary position embeddings (RoPE) in PyTorch.

flash-attn's tests use it to build the reference for ``flash_attn_with_kvcache(rotary_cos=...,
rotary_sin=...)``; this version is written independently of flashtile's own rotary code, so
the comparison checks flashtile against a second implementation.
"""
from __future__ import annotations

import torch


def _positions(batch: int, seqlen: int, seqlen_offsets, device) -> torch.Tensor:
    pos = torch.arange(seqlen, device=device)[None, :]
    if isinstance(seqlen_offsets, torch.Tensor):
        return pos + seqlen_offsets.to(device=device, dtype=torch.int64).reshape(-1, 1)
    return (pos + int(seqlen_offsets)).expand(batch, seqlen)


def _rotate(x, cos, sin, positions, interleaved: bool):
    """``x (..., T, H, D)`` with ``positions (..., T)``: the first ``2 * cos.shape[1]`` channels
    rotated, computed in float32 and returned in ``x``'s dtype."""
    rot = 2 * cos.shape[1]
    c = cos.float()[positions].unsqueeze(-2)  # (..., T, 1, rot / 2)
    s = sin.float()[positions].unsqueeze(-2)
    xf = x[..., :rot].float()
    if interleaved:  # pairs (x[2i], x[2i + 1])
        even, odd = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    else:  # GPT-NeoX halves (x[i], x[i + rot / 2])
        first, second = xf[..., : rot // 2], xf[..., rot // 2:]
        out = torch.cat((first * c - second * s, first * s + second * c), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rot:]), dim=-1)


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                     cu_seqlens=None, max_seqlen=None):
    """Rotate the first ``rotary_dim = 2 * cos.shape[1]`` channels of ``x``.

    ``x``: ``(batch, seqlen, nheads, headdim)``, or ``(total, nheads, headdim)`` with
    ``cu_seqlens`` int32 ``(batch + 1,)``; ``cos``/``sin``: ``(seqlen_ro, rotary_dim / 2)``;
    ``seqlen_offsets``: an int or an integer ``(batch,)`` tensor added to each token's
    position (its index in its sequence).  Returns the rotated tensor (``x`` itself, written
    in place, with ``inplace=True``).
    """
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        positions = _positions(batch, seqlen, seqlen_offsets, x.device)
        out = _rotate(x, cos, sin, positions, interleaved)
    else:
        cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
        lengths = cu[1:] - cu[:-1]
        seq_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device),
                                               lengths)
        local = torch.arange(x.shape[0], device=x.device) - cu[:-1][seq_of_token]
        if isinstance(seqlen_offsets, torch.Tensor):
            local = local + seqlen_offsets.to(device=x.device, dtype=torch.int64)[seq_of_token]
        else:
            local = local + int(seqlen_offsets)
        out = _rotate(x.unsqueeze(0), cos, sin, local.unsqueeze(0), interleaved).squeeze(0)
    if inplace:
        x.copy_(out)
        return x
    return out
