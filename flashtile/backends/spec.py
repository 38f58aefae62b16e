"""The one description of an attention call that every backend receives.

Both backends implement the same two functions::

    forward(q, k, v, spec, *, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=None, max_seqlen_k=None, attn_bias=None, rng_seed=None,
            block_mask=None, block_size=None) -> (out, lse)
    backward(do, q, k, v, out, lse, spec, *, alibi_slopes=None, cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, attn_bias=None,
             rng_seed=None, block_mask=None, block_size=None, dbias=None) -> (dq, dk, dv)

Optional features (each may be combined with every other):
  attn_bias   bool mask (True = visible) or additive float bias ``(B|1, H|1, Sq|1, Sk|1)``
              (query heads; positions local to the sequence for varlen), added to the score
              in natural-log units; ``backward`` writes ``dS`` (the gradient w.r.t. the
              score, before softcap's factor) summed to the bias's shape into ``dbias``.
  rng_seed    int64 ``(1,)`` tensor, required when ``spec.dropout_p > 0``: element
              ``(b, h, i, j)`` is kept iff ``tl.rand(seed, ((b*H + h)*Sq + i)*Sk + j) >= p``
              (``Sq``/``Sk`` = ``max_seqlen_*`` for varlen); see ``flashtile.rng``.  Kept
              probabilities (after normalisation) are scaled by ``1 / (1 - p)``.
  block_mask  bool ``(B|1, H|1, ceil(Sq/bm), ceil(Sk/bn))`` with ``block_size = (bm, bn)``
              (multiples of 16): key ``j`` is visible to query ``i`` only if its block is set.
  block_table forward only, varlen only: int32 ``(B, max_num_blocks)``; k/v are page pools
              ``(num_blocks, page_size, Hk, D)`` and key ``j`` of sequence ``b`` is
              ``k[block_table[b, j // page_size], j % page_size]`` (``cu_seqlens_k`` still
              gives the lengths).  ``flashtile.autograd`` calls ``backward`` on the gathered,
              packed keys/values and adds dK/dV back into the pages.

Layouts (flash-attn's):
  dense   q ``(B, Sq, H, D)``, k/v ``(B, Sk, Hk, D)``, out like q, lse float32 ``(B, H, Sq)``
  varlen  q ``(total_q, H, D)``, k/v ``(total_k, Hk, D)``, ``cu_seqlens_*`` int32 ``(B+1,)``,
          lse float32 ``(H, total_q)``
``H % Hk == 0``: query head ``h`` reads key/value head ``h // (H // Hk)``; dk/dv are summed over
the group.  ``lse`` is the natural-log log-sum-exp of the scaled (and soft-capped, biased)
scores of the keys a row sees; ``-inf`` for a row that sees no key, whose output is 0 and
whose gradients are 0.

Visibility of key ``j`` to query ``i`` in a sequence of ``sq`` queries and ``sk`` keys:
``shift = sk - sq`` when ``bottom_right`` else ``0``;
``j >= i + shift - window_left`` unless ``window_left < 0`` and
``j <= i + shift + window_right`` unless ``window_right < 0``.
Causal attention is ``window_right = 0``.

Score of a visible pair: ``s = scale * q.k``; with softcap ``c > 0``: ``s = c * tanh(s / c)``;
with ALiBi slopes: ``s -= slope[b, h] * |i + sk - sq - j|`` (always bottom-right distance, as
flash-attn).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch


@dataclasses.dataclass(frozen=True)
class AttnSpec:
    softmax_scale: float
    window_left: int = -1
    window_right: int = -1
    bottom_right: bool = True
    softcap: float = 0.0
    dropout_p: float = 0.0

    @property
    def causal(self) -> bool:
        return self.window_right == 0 and self.window_left < 0

    @property
    def has_window(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0


class KVCacheSpec(NamedTuple):
    """A validated ``flash_attn_with_kvcache`` call, as the decode backends receive it.

    Layouts (flash-attn's): ``q (B, Sq, H, D)``; the cache ``(B_cache, S_cache, Hk, D)`` or,
    with ``block_table (B, max_blocks)``, pages ``(num_blocks, page_size, Hk, D)``; new
    ``k``/``v`` ``(B, S_new, Hk, D)``; out ``(B, Sq, H, D)``, lse float32 ``(B, H, Sq)``.
    Keys of row ``b`` are cache positions ``[leftpad[b], cache_seqlens[b] + seqlen_new)``;
    visibility follows the window rule above with ``bottom_right`` alignment per row, and
    with a tree mask the ``Sq`` queries (the row's last ``Sq`` keys) see each other only where
    ``tree_mask[b, t, u]`` is set.
    """

    q: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    cache_seqlens: torch.Tensor  # int32 (B,)
    cache_batch_idx: Optional[torch.Tensor]
    cache_leftpad: Optional[torch.Tensor]
    block_table: Optional[torch.Tensor]
    tree_mask: Optional[torch.Tensor]  # bool (B|1, Sq, Sq)
    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    rotary_q_per_token: bool
    num_splits: int
    seqlen_new: int
    capacity: int
