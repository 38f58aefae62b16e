"""The one description of an attention call that every backend receives.

Both backends implement the same two attention functions::

    forward(q, k, v, spec, *, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=None, max_seqlen_k=None, attn_bias=None, rng_seed=None,
            block_mask=None, block_size=None, block_table=None, out_dtype=None) -> (out, lse)
    backward(do, q, k, v, out, lse, spec, *, alibi_slopes=None, cu_seqlens_q=None,
             cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, attn_bias=None,
             rng_seed=None, block_mask=None, block_size=None, dbias=None,
             grad_dtype=None) -> (dq, dk, dv)

``out_dtype`` / ``grad_dtype``: the dtype of ``out`` / the gradients (default the inputs'; the
partial calls of ``flashtile.distributed.partial_attention`` ask for float32).

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

Partial calls (dense only): a block of queries and a block of keys cut from a longer sequence of
``seqlen_q_total`` queries and ``seqlen_k_total`` keys, local query ``i`` being global query
``q_offset + i`` and local key ``j`` global key ``k_offset + j``, batch entry ``b`` being global
entry ``batch_offset + b``.  Visibility, ALiBi distances and the dropout counter are those of the
global positions: ``shift = (Sk_total - Sq_total if bottom_right else 0) + q_offset - k_offset``
in the rule above, the ALiBi distance is ``|i + Sk_total - Sq_total + q_offset - k_offset - j|``
and the dropout counter ``(((batch_offset + b)*H_total + head_offset + h)*Sq_total + q_offset
+ i)*Sk_total + k_offset + j``.  ``head_offset`` / ``nheads_total`` (a slice of the heads) are
allowed with varlen too; the other fields are dense only.  The defaults (offsets 0, totals 0 meaning "the local lengths") are the plain
call.  ``flashtile.distributed.partial_attention`` exposes them.
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
    # partial calls (see the module docstring); the defaults are the plain call
    q_offset: int = 0
    k_offset: int = 0
    seqlen_q_total: int = 0
    seqlen_k_total: int = 0
    batch_offset: int = 0
    # dropout counters of a slice of the heads (any layout): local head h is global head
    # head_offset + h of nheads_total (0: the local count)
    head_offset: int = 0
    nheads_total: int = 0
    # the backward's gradients bitwise reproducible (flash-attn's ``deterministic``): on Hopper
    # the dQ kernel + dK/dV kernel instead of one kernel adding dQ with atomics
    deterministic: bool = False

    @property
    def causal(self) -> bool:
        return self.window_right == 0 and self.window_left < 0

    @property
    def has_window(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def is_partial(self) -> bool:
        """Offsets / global lengths of the positions or batch (dense calls only)."""
        return bool(self.q_offset or self.k_offset or self.seqlen_q_total or self.seqlen_k_total
                    or self.batch_offset)

    def totals(self, sq: int, sk: int) -> tuple[int, int]:
        """The (Sq, Sk) of the global sequence for local lengths ``sq``, ``sk``."""
        return self.seqlen_q_total or sq, self.seqlen_k_total or sk

    def shift(self, sq: int, sk: int) -> int:
        """The diagonal's shift for local lengths ``sq``, ``sk``: key ``j`` is on query ``i``'s
        diagonal when ``j = i + shift``."""
        gq, gk = self.totals(sq, sk)
        return (gk - gq if self.bottom_right else 0) + self.q_offset - self.k_offset

    def alibi_shift(self, sq: int, sk: int) -> int:
        """ALiBi distance of local ``(i, j)`` is ``|i + alibi_shift - j|`` (bottom-right)."""
        gq, gk = self.totals(sq, sk)
        return gk - gq + self.q_offset - self.k_offset


# AttnSpecs by the plain Python values they were made from (spec_of): a model's layers make
# the same one on every call, and building a frozen dataclass costs ~5 us of host time
_SPECS: dict = {}
_SPECS_SIZE = 256
# (a frozenset: its issuperset over the key's types runs in C, 3-4 us a call less than a
# Python loop over them; tuning log step 145)
_PLAIN = frozenset((float, int, bool, str, type(None)))


def spec_of(key: tuple, make) -> "AttnSpec":
    """``make()``, or the :class:`AttnSpec` that ``make`` returned before for a key of the same
    values of the same types (``1``, ``1.0`` and ``True`` are different keys: ``make`` may
    accept one and reject another).  ``key`` holds every value ``make`` reads; it is cached
    only when all are plain ``float``, ``int``, ``bool``, ``str`` or None, never while
    ``torch.compile`` traces (symbolic values, and no global state in the graph).  A ``make``
    that raises caches nothing."""
    if torch.compiler.is_compiling():
        return make()
    types = tuple(map(type, key))
    if not _PLAIN.issuperset(types):
        return make()
    full = (key, types)
    spec = _SPECS.get(full)
    if spec is None:
        spec = make()
        if len(_SPECS) >= _SPECS_SIZE:
            _SPECS.clear()
        _SPECS[full] = spec
    return spec


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
