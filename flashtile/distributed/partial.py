"""Partial attention: one block of queries against one block of keys, cut from a longer sequence.

Local query ``i`` is global query ``q_offset + i`` and local key ``j`` global key ``k_offset + j``
of a sequence of ``seqlen_q_total`` queries and ``seqlen_k_total`` keys.  Causal and sliding
window masks, ALiBi distances and the dropout keep mask are those of the global positions, so
the partials of any split of the keys merge (``flashtile.merge_attention_states``) into the
output of the one call on the whole sequence, dropout included bit for bit.

    out, lse = partial_attention(q, k, v, q_offset=..., k_offset=..., seqlen_q_total=S,
                                 seqlen_k_total=S, causal=True)

``out`` is float32 ``(B, Sq, H, D)`` normalised over the block's visible keys, ``lse`` float32
``(B, H, Sq)`` (``-inf`` for a row that sees none of them).  :func:`partial_attention_backward`
takes the *merged* output and LSE of the whole row (so the probabilities it recomputes are the
global ones) and returns this block's share of the gradients, by default in float32 so that the
shares of many blocks add up without rounding.
"""
from __future__ import annotations

import math

import torch

from .. import backends
from ..backends.spec import AttnSpec

__all__ = ["partial_attention", "partial_attention_backward", "partial_spec"]


def _check_int(name: str, value, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def partial_spec(q: torch.Tensor, k: torch.Tensor, *, q_offset: int = 0, k_offset: int = 0,
                 seqlen_q_total: int | None = None, seqlen_k_total: int | None = None,
                 softmax_scale: float | None = None, causal: bool = False,
                 window_size=(-1, -1), softcap: float = 0.0, dropout_p: float = 0.0,
                 batch_offset: int = 0, head_offset: int = 0,
                 nheads_total: int | None = None) -> AttnSpec:
    """The :class:`~flashtile.backends.spec.AttnSpec` of a partial call (validated)."""
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor (batch, seqlen, heads, headdim), got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    sq, sk, nheads = q.shape[1], k.shape[1], q.shape[2]
    q_offset = _check_int("q_offset", q_offset)
    k_offset = _check_int("k_offset", k_offset)
    tq = sq + q_offset if seqlen_q_total is None else _check_int("seqlen_q_total", seqlen_q_total)
    tk = sk + k_offset if seqlen_k_total is None else _check_int("seqlen_k_total", seqlen_k_total)
    if q_offset + sq > tq:
        raise ValueError(f"q_offset + seqlen_q = {q_offset + sq} exceeds seqlen_q_total = {tq}")
    if k_offset + sk > tk:
        raise ValueError(f"k_offset + seqlen_k = {k_offset + sk} exceeds seqlen_k_total = {tk}")
    _check_int("batch_offset", batch_offset)
    _check_int("head_offset", head_offset)
    ht = nheads + head_offset if nheads_total is None else _check_int("nheads_total", nheads_total)
    if head_offset + nheads > ht:
        raise ValueError(f"head_offset + nheads = {head_offset + nheads} exceeds nheads_total = {ht}")
    wl, wr = (int(w) for w in window_size)
    if causal:
        wr = 0
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0, got {softcap}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return AttnSpec(scale, wl, wr, True, float(softcap), float(dropout_p), q_offset, k_offset,
                    tq, tk, batch_offset, head_offset, ht)


def _impl(q):
    return backends.get(backends.select(q.device))


def _kw(alibi_slopes, rng_seed, spec):
    kw = dict(alibi_slopes=alibi_slopes)
    if spec.dropout_p > 0:
        if rng_seed is None:
            raise ValueError("dropout_p > 0 needs rng_seed (an int64 tensor of shape (1,), "
                             "e.g. flashtile.rng.draw_seed(device))")
        kw["rng_seed"] = rng_seed
    return kw


def partial_attention(q, k, v, *, q_offset: int = 0, k_offset: int = 0,
                      seqlen_q_total: int | None = None, seqlen_k_total: int | None = None,
                      softmax_scale: float | None = None, causal: bool = False,
                      window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                      dropout_p: float = 0.0, rng_seed=None, batch_offset: int = 0,
                      head_offset: int = 0, nheads_total: int | None = None):
    """``(out, lse)`` of queries ``q`` ``(B, Sq, H, D)`` over keys/values ``k``/``v``
    ``(B, Sk, Hk, D)`` placed at the global offsets (see the module docstring).

    ``seqlen_*_total`` default to ``offset + local length``; the bottom-right diagonal (causal,
    windows, ALiBi) is that of the global lengths.  ``batch_offset`` / ``head_offset`` /
    ``nheads_total`` place the batch entries and heads in the dropout counters of a larger
    call.  ``out`` is float32; ``lse`` float32 ``(B, H, Sq)``.
    """
    spec = partial_spec(q, k, q_offset=q_offset, k_offset=k_offset, seqlen_q_total=seqlen_q_total,
                        seqlen_k_total=seqlen_k_total, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, dropout_p=dropout_p,
                        batch_offset=batch_offset, head_offset=head_offset,
                        nheads_total=nheads_total)
    return _impl(q).forward(q, k, v, spec, out_dtype=torch.float32,
                            **_kw(alibi_slopes, rng_seed, spec))


def partial_attention_backward(do, q, k, v, out, lse, *, q_offset: int = 0, k_offset: int = 0,
                               seqlen_q_total: int | None = None,
                               seqlen_k_total: int | None = None,
                               softmax_scale: float | None = None, causal: bool = False,
                               window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                               dropout_p: float = 0.0, rng_seed=None, batch_offset: int = 0,
                               head_offset: int = 0, nheads_total: int | None = None,
                               grad_dtype: torch.dtype | None = torch.float32):
    """``(dq, dk, dv)``: this block's share of the gradients, given ``out``/``lse`` of the whole
    row (merged over every key block) and its output gradient ``do``.  Summing the shares of
    all blocks gives the gradients of the whole call.  In ``grad_dtype`` (float32 by default;
    None: the inputs' dtypes)."""
    spec = partial_spec(q, k, q_offset=q_offset, k_offset=k_offset, seqlen_q_total=seqlen_q_total,
                        seqlen_k_total=seqlen_k_total, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, dropout_p=dropout_p,
                        batch_offset=batch_offset, head_offset=head_offset,
                        nheads_total=nheads_total)
    # the kernels index lse and their own (B, H, Sq) buffers with one set of strides
    lse = lse.contiguous()
    return _impl(q).backward(do, q, k, v, out, lse, spec, grad_dtype=grad_dtype,
                             **_kw(alibi_slopes, rng_seed, spec))
