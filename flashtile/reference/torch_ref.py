"""The torch oracle: plain attention with materialised scores, in float64 by default.

Tests compare flashtile against ``reference(..., dtype=torch.float64)`` and use the same function
in the input dtype (softmax in float32) as the error baseline of flash-attn's rule.
``flashtile.reference.naive`` is the same maths in NumPy (forward and analytic backward).

Layout is flash-attn's dense one: q ``(B, Sq, H, D)``, k/v ``(B, Sk, Hk, D)`` with
``H % Hk == 0``; visibility, softcap and ALiBi follow ``flashtile.backends.spec``.
"""
from __future__ import annotations

import torch

from ..backends.spec import AttnSpec
from ..masks import visible_mask

__all__ = ["reference", "rope", "scores"]


def scores(q, k, spec: AttnSpec, alibi_slopes=None, dtype=torch.float64, attn_bias=None):
    """Scaled (soft-capped, ALiBi-shifted, biased) scores ``(B, H, Sq, Sk)``, ``-inf`` where a
    key is not visible. Computed in ``dtype``; scaled and masked in at least float32."""
    nheads, nheads_k = q.shape[2], k.shape[2]
    sq, sk = q.shape[1], k.shape[1]
    qd = q.to(dtype).transpose(1, 2)
    kd = k.to(dtype).transpose(1, 2).repeat_interleave(nheads // nheads_k, dim=1)
    s = torch.matmul(qd, kd.transpose(-1, -2))
    soft_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    s = s.to(soft_dtype) * spec.softmax_scale
    if spec.softcap > 0:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    if alibi_slopes is not None:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s - alibi_slopes.to(soft_dtype).reshape(-1, nheads, 1, 1) * (i + sk - sq - j).abs()
    if attn_bias is not None:
        if attn_bias.dtype == torch.bool:
            s = s.masked_fill(~attn_bias, float("-inf"))
        else:
            s = s + attn_bias.to(soft_dtype)
    vis = visible_mask(sq, sk, spec.window_left, spec.window_right, spec.bottom_right, q.device)
    return s.masked_fill(~vis, float("-inf"))


def reference(q, k, v, spec: AttnSpec, alibi_slopes=None, dtype=torch.float64, attn_bias=None,
              keep=None):
    """Plain attention in ``dtype`` (softmax in at least float32); dense flash layout.

    ``attn_bias``: bool mask (True = attend) or additive float bias broadcastable to
    ``(B, H, Sq, Sk)`` (differentiable).  ``keep``: bool dropout keep mask ``(B, H, Sq, Sk)``;
    kept probabilities are scaled by ``1 / (1 - spec.dropout_p)``.  Rows that see no key give
    0 and zero gradients.
    """
    nheads, nheads_k = q.shape[2], k.shape[2]
    s = scores(q, k, spec, alibi_slopes, dtype, attn_bias)
    vd = v.to(dtype).transpose(1, 2).repeat_interleave(nheads // nheads_k, dim=1)
    seen = (s > float("-inf")).any(dim=-1, keepdim=True)
    p = torch.softmax(torch.where(seen, s, torch.zeros_like(s)), dim=-1) * seen
    if keep is not None:
        p = p * keep.to(p.dtype) / (1.0 - spec.dropout_p)
    out = torch.matmul(p.to(dtype), vd)
    return out.transpose(1, 2)


def rope(x, cos, sin, positions, interleaved=True):
    """Rotary embedding of ``x`` ``(B, T, H, D)`` at integer ``positions`` ``(B, T)``, in float32.

    ``cos``/``sin`` are ``(max_pos, R / 2)``: the first ``R`` channels rotate, the rest pass
    through. Interleaved (GPT-J) rotates pairs ``(2i, 2i + 1)``; otherwise (GPT-NeoX) the pairs
    are ``(i, i + R / 2)``.
    """
    half = cos.shape[1]
    rd = 2 * half
    c = cos.float()[positions][:, :, None, :]  # [B, T, 1, R/2]
    s = sin.float()[positions][:, :, None, :]
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0:rd:2], xf[..., 1:rd:2]
        rot = torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)
    else:
        a, b = xf[..., :half], xf[..., half:rd]
        rot = torch.cat([a * c - b * s, a * s + b * c], -1)
    return torch.cat([rot, xf[..., rd:]], -1)
