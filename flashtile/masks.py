"""Dense descriptions of the masks the kernels apply tile by tile.

These build ``(Sq, Sk)`` tensors and are meant for small sizes: ``return_attn_probs=True``,
tests, and documentation.  The kernels never materialise them.
"""
from __future__ import annotations

import torch

from ._validate import FlashtileInputError
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


# ------------------------------------------------------------------------------------------
# tree masks (speculative decoding, ``flash_attn_with_kvcache(tree_mask=...)``)
# ------------------------------------------------------------------------------------------
MAX_PACKED_TREE = 64


def build_tree_mask(parents, *, packed: bool = False, device=None) -> torch.Tensor:
    """Attention mask of a draft-token tree: each node sees itself and its ancestors.

    ``parents``: sequence or integer tensor ``(n,)`` or ``(B, n)``; ``parents[i]`` is the index of
    node ``i``'s parent among the new tokens, ``-1`` for a root, and must be ``< i`` (nodes in
    topological order, as drafts are laid out).  Returns bool ``(n, n)`` / ``(B, n, n)`` with
    ``mask[i, j]`` True when node ``i`` may attend to node ``j``; with ``packed=True`` an int64
    ``(n,)`` / ``(B, n)`` bitmask instead (bit ``j`` of entry ``i``), which needs ``n <= 64``.

    Example (parents ``[-1, 0, 1, 1, 2, 2, 3, 3, 4]``): row 3 (``D``) is
    ``[1, 1, 0, 1, 0, 0, 0, 0, 0]``: D sees A, B and itself, not its sibling C.
    """
    p = torch.as_tensor(parents, device="cpu")
    if p.dtype.is_floating_point or p.dtype == torch.bool or p.dtype.is_complex:
        raise TypeError(f"build_tree_mask: parents must be integers, got {p.dtype}")
    if p.dim() not in (1, 2):
        raise FlashtileInputError(f"build_tree_mask: parents must have shape (n,) or (B, n), got {tuple(p.shape)}")
    batched = p.dim() == 2
    p = p.reshape(-1, p.shape[-1]).to(torch.int64)
    n = p.shape[1]
    idx = torch.arange(n)
    if ((p >= idx) | (p < -1)).any():
        raise FlashtileInputError("build_tree_mask: every parents[i] must be -1 (root) or an earlier node index < i")
    if packed and n > MAX_PACKED_TREE:
        raise FlashtileInputError(f"build_tree_mask: a packed mask holds at most {MAX_PACKED_TREE} nodes, got {n}")
    mask = torch.zeros(p.shape[0], n, n, dtype=torch.bool)
    for i in range(n):
        mask[:, i, i] = True
        par = p[:, i]
        has = par >= 0
        if has.any():
            rows = torch.nonzero(has).flatten()
            mask[rows, i] |= mask[rows, par[rows]]
    if packed:
        weights = torch.ones(n, dtype=torch.int64) << idx  # bit j; 1 << 63 wraps to the sign bit
        out = (mask.to(torch.int64) * weights).sum(-1)
    else:
        out = mask
    if not batched:
        out = out[0]
    return out.to(device) if device is not None else out


def unpack_tree_mask(packed: torch.Tensor, seqlen_q: int) -> torch.Tensor:
    """int64 ``(B|1, Sq)`` bitmask -> bool ``(B|1, Sq, Sq)`` (device ops only, capturable)."""
    bits = torch.arange(seqlen_q, device=packed.device, dtype=torch.int64)
    return ((packed.unsqueeze(-1) >> bits) & 1).bool()
