"""Rotary position embeddings (RoPE) as ``flash_attn_with_kvcache`` applies them.

The Triton decode path rotates inside ``_rotary_append_kernel``
(``flashtile/backends/triton/kernels/decode.py``); this is the PyTorch form, used by the torch
backend and as the reference in tests.
"""
from __future__ import annotations

import torch

__all__ = ["apply_rotary"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool = True) -> torch.Tensor:
    """Rotate the first ``rotary_dim = 2 * cos.shape[1]`` channels of ``x`` (RoPE).

    ``x``: ``(B, T, H, D)``; ``cos``/``sin``: ``(seqlen_ro, rotary_dim / 2)``; ``positions``:
    integer ``(B, T)``, the absolute position of each token.  With ``c = cos[pos, i]``,
    ``s = sin[pos, i]``, interleaved rotates pairs ``(x[2i], x[2i+1])``, GPT-NeoX style pairs
    ``(x[i], x[i + rotary_dim/2])``: ``(a, b) -> (a c - b s, b c + a s)``.  Computed in float32,
    returned in ``x``'s dtype; channels past ``rotary_dim`` are unchanged.
    """
    rd = 2 * int(cos.shape[1])
    positions = positions.to(device=cos.device, dtype=torch.int64)
    c = cos[positions].float().unsqueeze(2)  # (B, T, 1, rd/2)
    s = sin[positions].float().unsqueeze(2)
    xf = x.float()
    xr = xf[..., :rd]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    else:
        a, b = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return torch.cat([rot, xf[..., rd:]], dim=-1).to(x.dtype)
