"""Dense descriptions of the masks the kernels apply tile by tile.

These build ``(Sq, Sk)`` tensors and are meant for small sizes: ``return_attn_probs=True``,
tests, and documentation.  The kernels never materialise them.
"""
from __future__ import annotations

import torch

from .backends.spec import AttnSpec


def visible_mask(seqlen_q: int, seqlen_k: int, window_left: int = -1, window_right: int = -1,
                 bottom_right: bool = True, device=None) -> torch.Tensor:
    """Bool ``(seqlen_q, seqlen_k)``: True where query ``i`` may attend to key ``j``.

    ``causal=True`` is ``window_right=0``.  Bottom-right alignment (flash-attn) puts the last
    query on the last key; top-left (PyTorch SDPA) puts query 0 on key 0::

        causal, Sq=2, Sk=5, bottom-right      causal, Sq=2, Sk=5, top-left
            1 1 1 1 0                             1 0 0 0 0
            1 1 1 1 1                             1 1 0 0 0
    """
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    shift = seqlen_k - seqlen_q if bottom_right else 0
    vis = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_right >= 0:
        vis &= j <= i + shift + window_right
    if window_left >= 0:
        vis &= j >= i + shift - window_left
    return vis


def scores(q: torch.Tensor, k: torch.Tensor, spec: AttnSpec, alibi_slopes=None) -> torch.Tensor:
    """Masked float32 scores ``(B, H, Sq, Sk)`` for dense flash-layout ``q``/``k`` (GQA aware)."""
    batch, sq, nheads, _ = q.shape
    sk, nheads_k = k.shape[1], k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(nheads // nheads_k, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * spec.softmax_scale  # [B, H, Sq, Sk]
    if spec.softcap > 0:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    if alibi_slopes is not None:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        dist = (i + sk - sq - j).abs().float()
        slopes = alibi_slopes.float().reshape(-1, nheads, 1, 1)
        s = s - slopes * dist
    vis = visible_mask(sq, sk, spec.window_left, spec.window_right, spec.bottom_right, q.device)
    return s.masked_fill(~vis, float("-inf"))


def attention_probs(q, k, lse, spec: AttnSpec, alibi_slopes=None) -> torch.Tensor:
    """Normalised probabilities ``P = exp(s - lse)``, float32 ``(B, H, Sq, Sk)``; rows that see
    no key are all zero."""
    s = scores(q, k, spec, alibi_slopes)
    p = torch.exp(s - lse[..., None].float())
    return torch.nan_to_num(p, nan=0.0)
