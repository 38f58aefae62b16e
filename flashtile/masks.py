"""Dense descriptions of the masks the kernels apply tile by tile.

These build ``(Sq, Sk)`` tensors and are meant for small sizes: ``return_attn_probs=True``,
tests, and documentation.  The kernels never materialise them.
"""
from __future__ import annotations

import torch

from .backends.spec import AttnSpec
from .rng import keep_mask


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


def attention_probs_varlen(q, k, lse, spec: AttnSpec, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, alibi_slopes=None) -> torch.Tensor:
    """Packed layouts: float32 ``(batch, H, max_seqlen_q, max_seqlen_k)``; sequence ``b`` fills
    the top-left ``(len_q[b], len_k[b])`` corner, the rest is 0."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    batch, nheads = len(cq) - 1, q.shape[1]
    probs = torch.zeros(batch, nheads, max_seqlen_q, max_seqlen_k, dtype=torch.float32,
                        device=q.device)
    for b in range(batch):
        (q0, q1), (k0, k1) = (cq[b], cq[b + 1]), (ck[b], ck[b + 1])
        if q1 == q0:
            continue
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[b:b + 1] if alibi_slopes.dim() == 2 else alibi_slopes
        probs[b, :, :q1 - q0, :k1 - k0] = attention_probs(q[None, q0:q1], k[None, k0:k1],
                                                          lse[None, :, q0:q1], spec, slopes)[0]
    return probs


def sign_dropped(probs: torch.Tensor, rng_seed, dropout_p: float) -> torch.Tensor:
    """flash-attn's ``S_dmask``: ``probs`` ``(B, H, Sq, Sk)`` with the sign flipped where dropout
    dropped the element, so ``S_dmask >= 0`` is the keep mask and ``S_dmask.abs()`` is P.

    ``Sq``/``Sk`` are the counter strides of :mod:`flashtile.rng` (``max_seqlen_*`` for
    varlen).  A dropped element whose probability is exactly 0 gives ``-0.0``, which compares
    ``>= 0``: entries that are exactly 0 count as kept (they contribute nothing either way).
    """
    if dropout_p <= 0:
        return probs
    batch, nheads, sq, sk = probs.shape
    keep = keep_mask(int(rng_seed.reshape(-1)[0]), dropout_p, batch, nheads, sq, sk,
                     device=probs.device)
    return torch.where(keep, probs, -probs)
