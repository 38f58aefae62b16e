"""Context-parallel attention over ``torch.distributed`` (see ``docs/features.md``).

``shard`` / ``unshard`` split a sequence over the ranks of a process group and back;
``context_parallel_attn`` (and its varlen form) computes attention on the shards, forward and
backward, equal to one ``flash_attn_func`` call on the whole sequence; ``partial_attention`` is
the kernels' entry point for one block of queries against one block of keys at global offsets.

Partial attention
-----------------
One block of queries against one block of keys, cut from a longer sequence.

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

Context parallelism
-------------------
Each rank holds a shard of the sequence (:func:`shard`): ``contiguous`` (rank ``r`` holds chunk
``r`` of ``R``) or ``zigzag`` (the sequence cut in ``2R`` chunks, rank ``r`` holds chunks ``r``
and ``2R - 1 - r``, so that under a causal mask every rank has the same work).  A shard is made
of *pieces*, ``(local_start, global_start, length)``.

Every mode computes, for the rank's query pieces, partial attentions against key pieces with
the global offsets (:func:`partial_attention`), so masks, ALiBi and dropout are those of
the whole sequence, and merges them in float32 (``flashtile.merge_attention_states``).  A pair
of pieces that needs no global position (no dropout or ALiBi, and every key visible to every
query, or the pieces' diagonal the plain call's, as on a causal diagonal) runs as a plain call
instead, so on Hopper it takes the sm_90 kernels: its output and gradient shares come in the
inputs' dtype and are merged and summed in float32 (as ring-flash-attention and PyTorch's
``context_parallel`` do); neighbouring pairs run as one call where they can (:func:`_pairs`):

``ring``      K/V travel around the ring with ``batch_isend_irecv``, the next exchange posted
              before the current block is computed; the backward sends the float32 dK/dV
              accumulators around with the K/V, and they arrive home after ``R`` hops.
              Collectives per call: forward ``R - 1`` exchanges, backward ``2R - 1``.
``allgather`` K/V all-gathered (one ``all_gather_into_tensor``) and put in global order; the
              backward gathers them again and reduce-scatters the float32 dK/dV (one
              ``reduce_scatter_tensor``).
``ulysses``   one ``all_to_all_single`` turns sequence shards of all heads into the whole
              sequence of ``H / R`` heads, attention runs locally, a second one turns the output
              back (the backward likewise, twice).  Needs ``H`` and ``Hk`` divisible by ``R``.

Varlen: the packed sequence of documents (global ``cu_seqlens``) is what is sharded; a document
may cross any shard boundary.  Each (query piece, key piece) pair is cut along the documents, one
partial call per document it meets, with the document's index and ``max_seqlen`` in the dropout
counters, exactly as ``flash_attn_varlen_func`` on the whole packed sequence.  On the Triton
kernels the plain calls of a step's documents (one spec, query and key rows that follow one
another) run as one packed call, each document's pair one of its sequences (:func:`_launches`).

With dropout, rank 0 of the group draws the seed (every rank draws one, so their generators stay
in step) and broadcasts it: one more collective in the forward.

Under ``torch.compile`` the forward and the backward are custom ops
(``flashtile::context_parallel_fwd`` / ``_bwd``), so ``fullgraph=True`` takes a call whole (the
group travels by name); an eager call runs the same functions through an autograd Function.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import backends
from ._tensor_cache import TensorCache
from .backends.spec import AttnSpec
from .rng import draw_seed

__all__ = ["LAYOUTS", "MODES", "context_parallel_attn", "context_parallel_varlen_attn",
           "partial_attention", "partial_attention_backward", "partial_spec", "shard",
           "unshard"]


# ---------------------------------------------------------------------------------------
# partial attention: one block pair at global offsets


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


def _partial_kw(alibi_slopes, rng_seed, spec):
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
                            **_partial_kw(alibi_slopes, rng_seed, spec))


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
                             **_partial_kw(alibi_slopes, rng_seed, spec))


# ---------------------------------------------------------------------------------------
# context parallelism

LAYOUTS = ("zigzag", "contiguous")
MODES = ("ring", "allgather", "ulysses")


# ---------------------------------------------------------------------------------------
# layouts


def _group_info(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashtile.distributed needs an initialised torch.distributed process "
                           "group (torch.distributed.init_process_group)")
    return dist.get_world_size(group), dist.get_rank(group)


def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def pieces(layout: str, world: int, rank: int, local_len: int) -> list[tuple[int, int, int]]:
    """``(local_start, global_start, length)`` of the pieces rank ``rank`` holds."""
    if layout == "contiguous":
        return [(0, rank * local_len, local_len)]
    c = local_len // 2
    return [(0, rank * c, c), (c, (2 * world - 1 - rank) * c, c)]


def _check_divisible(n: int, world: int, layout: str, what: str) -> None:
    parts = world * (2 if layout == "zigzag" else 1)
    if n % parts:
        raise ValueError(f"{what} ({n}) must be divisible by {parts} for layout={layout!r} over "
                         f"{world} ranks")


def shard(x: torch.Tensor, group=None, layout: str = "zigzag", seq_dim: int = 1) -> torch.Tensor:
    """This rank's shard of the whole sequence ``x`` (along ``seq_dim``): chunk ``r`` of ``R``
    (``contiguous``) or chunks ``r`` and ``2R - 1 - r`` of ``2R`` (``zigzag``)."""
    _check_layout(layout)
    world, rank = _group_info(group)
    n = x.shape[seq_dim]
    _check_divisible(n, world, layout, f"x.shape[{seq_dim}]")
    local = n // world
    return torch.cat([x.narrow(seq_dim, g, ln) for _, g, ln in pieces(layout, world, rank, local)],
                     dim=seq_dim)


def unshard(x: torch.Tensor, group=None, layout: str = "zigzag", seq_dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard ``x`` (an all-gather; not differentiable)."""
    _check_layout(layout)
    world, _ = _group_info(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return _to_global(parts, layout, world, seq_dim)


def _to_global(parts, layout: str, world: int, seq_dim: int) -> torch.Tensor:
    """Concatenate per-rank shards ``parts[src]`` in global sequence order."""
    local = parts[0].shape[seq_dim]
    chunks = []
    for src in range(world):
        for l0, g0, ln in pieces(layout, world, src, local):
            chunks.append((g0, parts[src].narrow(seq_dim, l0, ln)))
    chunks.sort(key=lambda t: t[0])
    return torch.cat([c for _, c in chunks], dim=seq_dim)


def _to_shards(x: torch.Tensor, layout: str, world: int, seq_dim: int) -> torch.Tensor:
    """``(R, ...)``: the shard of every rank, stacked (the inverse of :func:`_to_global`)."""
    local = x.shape[seq_dim] // world
    return torch.stack([torch.cat([x.narrow(seq_dim, g, ln)
                                   for _, g, ln in pieces(layout, world, src, local)], dim=seq_dim)
                        for src in range(world)])


# ---------------------------------------------------------------------------------------
# the local work: partial calls over pieces (and documents)


@dataclasses.dataclass
class _Cfg:
    world: int
    rank: int
    group: object
    layout: str
    mode: str
    causal: bool
    scale: float
    window: tuple[int, int]
    softcap: float
    dropout_p: float
    alibi: torch.Tensor | None
    seed: torch.Tensor | None
    docs: tuple  # (batch_offset, start, end) in the packed / whole sequence
    total: int  # dropout counter length (S dense, max_seqlen varlen)
    varlen: bool = False
    # the documents' plain calls of a step joined into packed calls (_launches): with the
    # Triton kernels, not on the torch engine, where a plain causal or full call is PyTorch's
    # fused CPU kernel and a packed one adds its buffers and copies (1.3-1.6x the separate
    # calls' time at 6-24 documents of 20-300 tokens)
    join: bool = False
    head_offset: int = 0
    nheads_total: int | None = None

    @property
    def bounds(self) -> tuple[int, int]:
        """``(wl, wr)``: query ``a`` sees key ``c`` iff ``a - wl <= c <= a + wr`` (a negative
        bound is none; causal is ``wr = 0``)."""
        return self.window[0], 0 if self.causal else self.window[1]


def _calls(cfg: _Cfg, q_pieces, k_pieces):
    """Partial calls ``(q_local, nq, k_local, nk, q_offset, k_offset, batch_offset)`` that hold
    a visible pair: every (query piece, key piece, document) intersection, cut to the keys its
    queries can see."""
    wl, wr = cfg.bounds
    for ql, qg, qn in q_pieces:
        for kl, kg, kn in k_pieces:
            for b_off, d0, d1 in cfg.docs:
                a0, a1 = max(qg, d0), min(qg + qn, d1)
                c0, c1 = max(kg, d0), min(kg + kn, d1)
                # query a sees key c iff a - wl <= c <= a + wr (the diagonal of equal
                # lengths): the keys no query of the pair sees are left out (a causal query
                # piece over the whole sequence then ends on its diagonal: a plain call)
                if wr >= 0:
                    c1 = min(c1, a1 + wr)
                if wl >= 0:
                    c0 = max(c0, a0 - wl)
                if a0 >= a1 or c0 >= c1:
                    continue
                yield ql + a0 - qg, a1 - a0, kl + c0 - kg, c1 - c0, a0 - d0, c0 - d0, b_off


def _kw(cfg: _Cfg, q_off, k_off, b_off):
    alibi = cfg.alibi
    if alibi is not None and alibi.dim() == 2 and cfg.varlen:
        alibi = alibi[b_off:b_off + 1]  # the document's row
    return dict(q_offset=q_off, k_offset=k_off, seqlen_q_total=cfg.total,
                seqlen_k_total=cfg.total, softmax_scale=cfg.scale, causal=cfg.causal,
                window_size=cfg.window, softcap=cfg.softcap, alibi_slopes=alibi,
                dropout_p=cfg.dropout_p, rng_seed=cfg.seed,
                batch_offset=b_off,
                head_offset=cfg.head_offset, nheads_total=cfg.nheads_total)


def _plain_spec(cfg: _Cfg, nq: int, nk: int, q_off: int, k_off: int) -> AttnSpec | None:
    """The spec of a plain call (no offsets) that computes the pair of pieces exactly as its
    partial call would, or None.  Without dropout (whose counters are the global positions) and
    ALiBi, the mask is all a pair's positions change: a pair whose every query sees every key
    is a call without a mask, and one whose diagonal is the plain call's (global shift
    ``q_off - k_off`` equal to the bottom-right ``nk - nq``: the equal pieces on a causal
    diagonal) keeps the window.  The plain calls take every kernel a single-device call
    takes (on Hopper the sm_90 kernels, which have no offsets), with the inputs' dtype out."""
    if cfg.dropout_p or cfg.alibi is not None:
        return None
    wl, wr = cfg.bounds
    if (wr < 0 or k_off + nk - 1 <= q_off + wr) and (wl < 0 or k_off >= q_off + nq - 1 - wl):
        return AttnSpec(cfg.scale, softcap=cfg.softcap)
    if q_off - k_off == nk - nq:
        return AttnSpec(cfg.scale, wl, wr, True, cfg.softcap)
    return None


def _pairs(cfg: _Cfg, q_pieces, k_pieces):
    """:func:`_calls` with each one's plain spec (or None), neighbouring plain calls of one
    document joined into one call: two that see every key (their positions no longer matter;
    the zigzag layout's two query pieces over one key piece, or one query piece over both key
    pieces), and one query piece's keys that it sees all of followed by its diagonal with no
    left window edge (the zigzag ring's own step: the later query piece over both key pieces
    is one bottom-right causal call)."""
    out = []
    for call in _calls(cfg, q_pieces, k_pieces):
        spec = _plain_spec(cfg, call[1], call[3], call[4], call[5])
        if out and spec is not None and out[-1][1] is not None and out[-1][0][6] == call[6] \
                and not out[-1][1].has_window:
            (ql, nq, kl, nk, q_off, k_off, b_off), prev = out[-1]
            keys_follow = (ql, nq) == call[0:2] and kl + nk == call[2]
            if not spec.has_window:
                if (kl, nk) == call[2:4] and ql + nq == call[0]:
                    out[-1] = ((ql, nq + call[1], kl, nk, q_off, k_off, b_off), prev)
                    continue
                if keys_follow:
                    out[-1] = ((ql, nq, kl, nk + call[3], q_off, k_off, b_off), prev)
                    continue
            elif keys_follow and spec.window_left < 0 and call[3] >= call[1]:
                # row i sees key j <= i + nk + (nk' - nq) + wr: every earlier key and the
                # diagonal's as before
                out[-1] = ((ql, nq, kl, nk + call[3], q_off, k_off, b_off), spec)
                continue
        out.append((call, spec))
    return out


def _launches(cfg: _Cfg, q_pieces, k_pieces):
    """:func:`_pairs` as ``(call, spec, lens)``: ``lens`` None for one pair, or for a packed
    call (``cfg.varlen`` and ``cfg.join``) ``(lengths_q, lengths_k)`` of the documents' plain
    calls it joins, ``call`` then their rows (each document's pair one sequence, bottom-right as
    its own plain call): runs of calls of one spec whose query rows and key rows each follow the
    previous call's, so that a step over many documents is one launch a spec, not one a
    document."""
    out, runs = [], {}
    join = cfg.varlen and cfg.join
    for call, spec in _pairs(cfg, q_pieces, k_pieces):
        run = runs.get(spec) if join and spec is not None else None
        if run is not None:
            (ql, nq, kl, nk, *offs), _, lens = out[run]
            if ql + nq == call[0] and kl + nk == call[2]:
                lens = lens or ([nq], [nk])
                out[run] = ((ql, nq + call[1], kl, nk + call[3], *offs), spec,
                            (lens[0] + [call[1]], lens[1] + [call[3]]))
                continue
        if join and spec is not None:
            runs[spec] = len(out)
        out.append((call, spec, None))
    return out


@functools.lru_cache(maxsize=256)  # (a step's calls repeat their lengths)
def _cumulative(lens: tuple, device) -> torch.Tensor:
    """int32 cumulative lengths of ``lens`` on ``device``."""
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def _packed_kw(lens, device) -> dict:
    """The varlen arguments of a packed call of documents of ``lens`` (:func:`_launches`)."""
    return dict(cu_seqlens_q=_cumulative(tuple(lens[0]), device),
                cu_seqlens_k=_cumulative(tuple(lens[1]), device),
                max_seqlen_q=max(lens[0]), max_seqlen_k=max(lens[1]))


def _block_forward(cfg: _Cfg, q, k, v, spec, q_off: int, k_off: int, b_off: int, lens=None):
    """``(out, lse)`` of one pair of pieces: the plain call of ``spec`` (``out`` in q's
    dtype; with ``lens`` the packed call of :func:`_launches`, on the rows of batch entry 0),
    or the partial call at the global offsets (float32)."""
    if lens is not None:
        out, lse = _impl(q).forward(q[0], k[0], v[0], spec, **_packed_kw(lens, q.device))
        return out[None], lse[None]
    if spec is not None:
        return _impl(q).forward(q, k, v, spec)
    return partial_attention(q, k, v, **_kw(cfg, q_off, k_off, b_off))


def _block_backward(cfg: _Cfg, do, q, k, v, out, lse, spec, q_off: int, k_off: int,
                    b_off: int, lens=None):
    """One pair of pieces' share of the gradients (as :func:`_block_forward` computes it)."""
    if lens is not None:
        grads = _impl(q).backward(do[0], q[0], k[0], v[0], out[0], lse[0].contiguous(), spec,
                                  **_packed_kw(lens, q.device))
        return tuple(g[None] for g in grads)
    if spec is not None:
        return _impl(q).backward(do, q, k, v, out, lse.contiguous(), spec)
    return partial_attention_backward(do, q, k, v, out, lse, **_kw(cfg, q_off, k_off, b_off))


def _merge(acc_o, acc_l, o, lse, first: bool):
    """Fold a block's ``(o, lse)`` into the float32 accumulators in place (``first``: rows no
    block has reached yet, a copy): ``l = log(e^acc_l + e^lse)``, ``acc_o = e^(acc_l - l)
    acc_o + e^(lse - l) o``; a row that has seen no key on either side stays 0 / -inf."""
    if first:
        acc_o.copy_(o)
        acc_l.copy_(lse)
        return
    new = torch.logaddexp(acc_l, lse)
    safe = torch.where(new == float("-inf"), 0.0, new)  # exp(-inf - -inf) would be NaN

    def weight(x):  # (B, H, S) -> (B, S, H, 1)
        return torch.exp(x - safe).transpose(1, 2).unsqueeze(-1)
    acc_o.mul_(weight(acc_l)).addcmul_(o, weight(lse))
    acc_l.copy_(new)


def _attend(cfg, q, k, v, q_pieces, k_pieces, acc_o, acc_l, seen: list):
    """Merge the partials of ``q``'s pieces over ``k``/``v``'s pieces into the float32
    accumulators ``acc_o`` ``(B, Sq, H, D)`` / ``acc_l`` ``(B, H, Sq)``; ``seen`` holds the row
    ranges merged so far (the caller's, across calls)."""
    for (ql, nq, kl, nk, q_off, k_off, b_off), spec, lens in _launches(cfg, q_pieces,
                                                                       k_pieces):
        o, lse = _block_forward(cfg, q[:, ql:ql + nq], k[:, kl:kl + nk], v[:, kl:kl + nk],
                                spec, q_off, k_off, b_off, lens)
        first = all(ql + nq <= a or b <= ql for a, b in seen)
        _merge(acc_o[:, ql:ql + nq], acc_l[:, :, ql:ql + nq], o, lse, first)
        seen.append((ql, ql + nq))


def _attend_bwd(cfg, do, q, k, v, out, lse, q_pieces, k_pieces, dq, dk, dv):
    """Add the gradient shares of the pairs of pieces into the float32 ``dq``/``dk``/``dv``."""
    for (ql, nq, kl, nk, q_off, k_off, b_off), spec, lens in _launches(cfg, q_pieces,
                                                                       k_pieces):
        rq, rk = slice(ql, ql + nq), slice(kl, kl + nk)
        g_q, g_k, g_v = _block_backward(cfg, do[:, rq], q[:, rq], k[:, rk], v[:, rk],
                                        out[:, rq], lse[:, :, rq], spec, q_off, k_off, b_off,
                                        lens)
        dq[:, rq] += g_q
        dk[:, rk] += g_k
        dv[:, rk] += g_v


def _whole(cfg: _Cfg, n: int):
    """The plain spec of a call over the whole local sequence (a dense sequence, no feature
    that needs the partial call), or None."""
    return _plain_spec(cfg, n, n, 0, 0) if len(cfg.docs) == 1 and cfg.docs[0][1:] == (0, n) \
        else None


def _empty_acc(q):
    B, S, H, D = q.shape
    return (torch.zeros((B, S, H, D), dtype=torch.float32, device=q.device),
            torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device))


# ---------------------------------------------------------------------------------------
# communication


def _peer(cfg: _Cfg, delta: int) -> int:
    return dist.get_global_rank(cfg.group, (cfg.rank + delta) % cfg.world) \
        if cfg.group is not None else (cfg.rank + delta) % cfg.world


def _exchange(cfg: _Cfg, send: torch.Tensor, recv: torch.Tensor):
    """Post send-to-next / receive-from-previous as one batch; returns the requests."""
    ops = [dist.P2POp(dist.isend, send, _peer(cfg, 1), cfg.group),
           dist.P2POp(dist.irecv, recv, _peer(cfg, -1), cfg.group)]
    return dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


# ---------------------------------------------------------------------------------------
# modes


def _ring_fwd(cfg, q, k, v):
    acc_o, acc_l = _empty_acc(q)
    seen = []
    n = q.shape[1]
    q_pieces = pieces(cfg.layout, cfg.world, cfg.rank, n)
    kv = torch.stack([k, v])  # [2, B, S_loc, Hk, D]: one message per hop
    kv_next = torch.empty_like(kv) if cfg.world > 1 else None
    for t in range(cfg.world):
        reqs = _exchange(cfg, kv, kv_next) if t < cfg.world - 1 else None
        src = (cfg.rank - t) % cfg.world
        _attend(cfg, q, kv[0], kv[1], q_pieces, pieces(cfg.layout, cfg.world, src, n),
                acc_o, acc_l, seen)
        if reqs is not None:
            _wait(reqs)
            kv, kv_next = kv_next, kv
    return acc_o, acc_l


def _ring_bwd(cfg, do, q, k, v, out, lse):
    n = q.shape[1]
    q_pieces = pieces(cfg.layout, cfg.world, cfg.rank, n)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    kv_next = torch.empty_like(kv) if cfg.world > 1 else None
    dkv_recv = torch.empty(kv.shape, dtype=torch.float32, device=q.device)
    dkv_reqs = None
    for t in range(cfg.world):
        kv_reqs = _exchange(cfg, kv, kv_next) if t < cfg.world - 1 else None
        src = (cfg.rank - t) % cfg.world
        # this block's dK/dV share, computed while the previous rank's accumulator arrives
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        _attend_bwd(cfg, do, q, kv[0], kv[1], out, lse, q_pieces,
                    pieces(cfg.layout, cfg.world, src, n), dq, dkv[0], dkv[1])
        if dkv_reqs is not None:
            _wait(dkv_reqs)
            dkv += dkv_recv
        if cfg.world > 1:
            # the accumulator of block ``src`` goes on to the next rank (home after R hops)
            dkv_send = dkv
            dkv_reqs = _exchange(cfg, dkv_send, dkv_recv)
        if kv_reqs is not None:
            _wait(kv_reqs)
            kv, kv_next = kv_next, kv
    if cfg.world > 1:
        _wait(dkv_reqs)
        dkv = dkv_recv
    return dq, dkv[0], dkv[1]


def _gather_kv(cfg, k, v):
    """K/V of the whole sequence in global order, ``[2, B, S, Hk, D]``."""
    kv = torch.stack([k, v]).contiguous()
    # dim 0 of the output is the ranks' inputs concatenated (gloo wants no new dim)
    buf = torch.empty((cfg.world * 2,) + kv.shape[1:], dtype=kv.dtype, device=kv.device)
    dist.all_gather_into_tensor(buf, kv, group=cfg.group)
    return _to_global(list(buf.view((cfg.world,) + kv.shape).unbind(0)), cfg.layout,
                      cfg.world, 2)


def _allgather_fwd(cfg, q, k, v):
    acc_o, acc_l = _empty_acc(q)
    kv = _gather_kv(cfg, k, v)
    whole = [(0, 0, kv.shape[2])]
    _attend(cfg, q, kv[0], kv[1], pieces(cfg.layout, cfg.world, cfg.rank, q.shape[1]), whole,
            acc_o, acc_l, [])
    return acc_o, acc_l


def _allgather_bwd(cfg, do, q, k, v, out, lse):
    kv = _gather_kv(cfg, k, v)
    whole = [(0, 0, kv.shape[2])]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    _attend_bwd(cfg, do, q, kv[0], kv[1], out, lse,
                pieces(cfg.layout, cfg.world, cfg.rank, q.shape[1]), whole, dq, dkv[0], dkv[1])
    shards = _to_shards(dkv, cfg.layout, cfg.world, 2).contiguous()  # [R, 2, B, S_loc, Hk, D]
    mine = torch.empty(shards.shape[1:], dtype=torch.float32, device=q.device)
    dist.reduce_scatter_tensor(mine, shards.flatten(0, 1), group=cfg.group)
    return dq, mine[0], mine[1]


def _heads_to_seq(cfg, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sequence shards of all heads -> the whole sequence of this rank's ``1/R`` of the heads,
    for several tensors in one all-to-all."""
    return _split_heads(cfg, _heads_to_seq_joined(cfg, xs), xs)


def _split_heads(cfg, joined: torch.Tensor, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`_heads_to_seq_joined`'s result as one tensor per one of ``xs`` (views)."""
    return list(joined.split([x.shape[2] // cfg.world for x in xs], dim=2))


def _heads_to_seq_joined(cfg, xs: list[torch.Tensor]) -> torch.Tensor:
    """:func:`_heads_to_seq`'s tensors side by side along the heads, ``[B, S, sum(widths), D]``
    (one tensor, as the custom op returns it)."""
    R = cfg.world
    B, n = xs[0].shape[:2]
    D = xs[0].shape[-1]
    widths = [x.shape[2] // R for x in xs]
    # [R, B, S_loc, sum(widths), D]: block r goes to rank r
    send = torch.cat([x.reshape(B, n, R, w, D).permute(2, 0, 1, 3, 4)
                      for x, w in zip(xs, widths)], dim=3).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=cfg.group)
    return _to_global(list(recv.unbind(0)), cfg.layout, R, 1)  # [B, S, sum(widths), D]


def _seq_to_heads(cfg, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inverse of :func:`_heads_to_seq`."""
    R = cfg.world
    widths = [x.shape[2] for x in xs]
    whole = torch.cat(xs, dim=2)  # [B, S, sum(widths), D]
    send = _to_shards(whole, cfg.layout, R, 1).contiguous()  # [R, B, S_loc, W, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=cfg.group)
    B, n, D = recv.shape[1], recv.shape[2], recv.shape[4]
    out, start = [], 0
    for w in widths:
        part = recv[:, :, :, start:start + w]  # [R(src), B, S_loc, w, D]
        out.append(part.permute(1, 2, 0, 3, 4).reshape(B, n, R * w, D))
        start += w
    return out


def _ulysses_cfg(cfg, nheads):
    per = nheads // cfg.world
    alibi = cfg.alibi
    if alibi is not None:
        alibi = alibi[..., cfg.rank * per:(cfg.rank + 1) * per]
    return dataclasses.replace(cfg, alibi=alibi, head_offset=cfg.rank * per,
                               nheads_total=nheads)


def _ulysses_fwd(cfg, q, k, v):
    """``(out, (qkv_h, out_h, lse_h))``: this rank's output shard and what the backward needs
    (the head-layout q, k, v side by side, output and LSE)."""
    qkv_h = _heads_to_seq_joined(cfg, [q, k, v])
    qh, kh, vh = _split_heads(cfg, qkv_h, [q, k, v])
    lcfg = _ulysses_cfg(cfg, q.shape[2])
    spec = _whole(lcfg, qh.shape[1])
    if spec is not None:
        # one plain call, its output as it is
        out_h, acc_l = _block_forward(lcfg, qh, kh, vh, spec, 0, 0, 0)
    else:
        acc_o, acc_l = _empty_acc(qh)
        whole = [(0, 0, qh.shape[1])]
        _attend(lcfg, qh, kh, vh, whole, whole, acc_o, acc_l, [])
        out_h = acc_o.to(q.dtype)
    (out,) = _seq_to_heads(cfg, [out_h])
    return out, (qkv_h, out_h, acc_l)


def _ulysses_bwd(cfg, do, qh, kh, vh, out_h, lse_h):
    (doh,) = _heads_to_seq(cfg, [do])
    lcfg = _ulysses_cfg(cfg, do.shape[2])
    spec = _whole(lcfg, qh.shape[1])
    if spec is not None:
        # the plain call's gradients, in the inputs' dtypes
        return _seq_to_heads(cfg, list(_block_backward(lcfg, doh, qh, kh, vh, out_h, lse_h,
                                                       spec, 0, 0, 0)))
    whole = [(0, 0, qh.shape[1])]
    dq = torch.zeros(qh.shape, dtype=torch.float32, device=qh.device)
    dk = torch.zeros(kh.shape, dtype=torch.float32, device=qh.device)
    dv = torch.zeros(vh.shape, dtype=torch.float32, device=qh.device)
    _attend_bwd(lcfg, doh, qh, kh, vh, out_h, lse_h, whole, whole, dq, dk, dv)
    return _seq_to_heads(cfg, [dq.to(qh.dtype), dk.to(kh.dtype), dv.to(vh.dtype)])


# Under torch.compile the forward and the backward are custom ops, so that ``fullgraph=True``
# sees one opaque call each: the collectives, the Python loops over pieces and the seed's
# broadcast run inside them.  The process group travels by name ("" for the default group).


def _group_name(group) -> str:
    return "" if group is None else group.group_name


def _group_of(name: str):
    return None if not name else dist.distributed_c10d._resolve_process_group(name)


_docs_read = TensorCache()  # a step's layers pass one cu_seqlens: one host read a step


def _docs(cu_seqlens, max_seqlen: int, total: int) -> tuple:
    """The documents ``(index, start, end)`` of a packed sequence of ``total`` tokens, checked
    (the cumulative lengths are read on the host, once while ``cu_seqlens`` is unchanged)."""
    return _docs_read.get(("docs", int(max_seqlen), total), (cu_seqlens,),
                          lambda: _read_docs(cu_seqlens, max_seqlen, total))


def _read_docs(cu_seqlens, max_seqlen: int, total: int) -> tuple:
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the packed length {total} "
                         f"(total_local x world size), got {cu[0]}..{cu[-1]}")
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    if int(max_seqlen) < longest:
        raise ValueError(f"max_seqlen ({max_seqlen}) is shorter than the longest document "
                         f"({longest})")
    return tuple((d, a, b) for d, (a, b) in enumerate(zip(cu, cu[1:])))


def _op_cfg(q, alibi_slopes, cu_seqlens, max_seqlen, group_name, layout, mode, causal,
            softmax_scale, window_left, window_right, softcap, dropout_p, seed) -> _Cfg:
    group = _group_of(group_name)
    world, rank = _group_info(group)
    total = q.shape[1] * world
    docs = ((0, 0, total),) if cu_seqlens is None else _docs(cu_seqlens, max_seqlen, total)
    cfg = _Cfg(world, rank, group, layout, mode, causal, softmax_scale,
               (window_left, window_right), softcap, dropout_p, alibi_slopes, seed, docs,
               total if cu_seqlens is None else int(max_seqlen))
    cfg.varlen = cu_seqlens is not None
    cfg.join = backends.select(q.device) != "torch"
    return cfg


def _own(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype``, contiguous, in storage of its own (an op's outputs may not share
    one)."""
    if x.dtype != dtype:
        return x.to(dtype, memory_format=torch.contiguous_format)
    if x._base is None and x.is_contiguous():
        return x  # a buffer of its own already
    return x.clone(memory_format=torch.contiguous_format)


def _cp_forward(q, k, v, alibi_slopes, cu_seqlens, max_seqlen, group_name, layout, mode, causal,
                softmax_scale, window_left, window_right, softcap, dropout_p):
    """``(cfg, (out, lse, seed, qkv_h, out_h))``: the call's configuration (its seed drawn) and
    this rank's output shard; the LSE (of the head layout for Ulysses); the dropout seed (empty
    without dropout); Ulysses' head-layout q, k, v side by side and output (empty for the other
    modes)."""
    cfg = _op_cfg(q, alibi_slopes, cu_seqlens, max_seqlen, group_name, layout, mode, causal,
                  softmax_scale, window_left, window_right, softcap, dropout_p, None)
    if dropout_p > 0:
        cfg.seed = draw_seed(q.device)  # every rank draws: generators stay in step
        if cfg.world > 1:
            dist.broadcast(cfg.seed, dist.get_global_rank(cfg.group, 0)
                           if cfg.group is not None else 0, group=cfg.group)
    with torch.no_grad():
        if mode == "ulysses":
            out, (qkv_h, out_h, lse) = _ulysses_fwd(cfg, q, k, v)
        else:
            fwd = _ring_fwd if mode == "ring" else _allgather_fwd
            acc_o, lse = fwd(cfg, q, k, v)
            # the backward's delta = rowsum(dO * O) uses the output as returned, as the
            # single-device backward does
            out = acc_o.to(q.dtype)
            qkv_h, out_h = q.new_empty((0,)), q.new_empty((0,))
    seed = cfg.seed if cfg.seed is not None else torch.empty(0, dtype=torch.int64,
                                                              device=q.device)
    return cfg, (out, lse, seed, qkv_h, out_h)


@torch.library.custom_op("flashtile::context_parallel_fwd", mutates_args=())
def _cp_fwd(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor],
            cu_seqlens: Optional[Tensor], max_seqlen: int, group_name: str, layout: str,
            mode: str, causal: bool, softmax_scale: float, window_left: int,
            window_right: int, softcap: float,
            dropout_p: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`_cp_forward` as an op (what ``torch.compile`` sees)."""
    _, (out, lse, seed, qkv_h, out_h) = _cp_forward(
        q, k, v, alibi_slopes, cu_seqlens, max_seqlen, group_name, layout, mode, causal,
        softmax_scale, window_left, window_right, softcap, dropout_p)
    # contiguous, as the fake op promises (Ulysses' all-to-all reshape and the CPU engine may
    # give other strides)
    return out.contiguous(), lse.contiguous(), seed, qkv_h, out_h.contiguous()


@_cp_fwd.register_fake
def _(q, k, v, alibi_slopes, cu_seqlens, max_seqlen, group_name, layout, mode, causal,
      softmax_scale, window_left, window_right, softcap, dropout_p):
    B, n, H, D = q.shape
    seed = q.new_empty((1 if dropout_p > 0 else 0,), dtype=torch.int64)
    if mode == "ulysses":
        R = _group_info(_group_of(group_name))[0]
        return (q.new_empty(q.shape), q.new_empty((B, H // R, n * R), dtype=torch.float32), seed,
                q.new_empty((B, n * R, (H + 2 * k.shape[2]) // R, D)),
                q.new_empty((B, n * R, H // R, D)))
    return (q.new_empty(q.shape), q.new_empty((B, H, n), dtype=torch.float32), seed,
            q.new_empty((0,)), q.new_empty((0,)))


def _cp_backward(cfg: _Cfg, do, q, k, v, out, lse, qkv_h, out_h):
    """``(dq, dk, dv)`` of this rank's shards (in q's, k's and v's dtypes), from
    :func:`_cp_forward`'s configuration and outputs."""
    do = do.contiguous()
    with torch.no_grad():
        if cfg.mode == "ulysses":
            qh, kh, vh = _split_heads(cfg, qkv_h, [q, k, v])
            dq, dk, dv = _ulysses_bwd(cfg, do, qh, kh, vh, out_h, lse)
        else:
            bwd = _ring_bwd if cfg.mode == "ring" else _allgather_bwd
            dq, dk, dv = bwd(cfg, do, q, k, v, out, lse)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("flashtile::context_parallel_bwd", mutates_args=())
def _cp_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seed: Tensor,
            qkv_h: Tensor, out_h: Tensor, alibi_slopes: Optional[Tensor],
            cu_seqlens: Optional[Tensor], max_seqlen: int, group_name: str, layout: str,
            mode: str, causal: bool, softmax_scale: float, window_left: int,
            window_right: int, softcap: float,
            dropout_p: float) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_cp_backward` as an op (the configuration rebuilt from the arguments)."""
    cfg = _op_cfg(q, alibi_slopes, cu_seqlens, max_seqlen, group_name, layout, mode, causal,
                  softmax_scale, window_left, window_right, softcap, dropout_p,
                  seed if dropout_p > 0 else None)
    dq, dk, dv = _cp_backward(cfg, do, q, k, v, out, lse, qkv_h, out_h)
    return _own(dq, q.dtype), _own(dk, k.dtype), _own(dv, v.dtype)


@_cp_bwd.register_fake
def _(do, q, k, v, out, lse, seed, qkv_h, out_h, alibi_slopes, cu_seqlens, max_seqlen,
      group_name, layout, mode, causal, softmax_scale, window_left, window_right, softcap,
      dropout_p):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _cp_setup_context(ctx, inputs, output):
    q, k, v, alibi_slopes, cu_seqlens = inputs[:5]
    out, lse, seed, qkv_h, out_h = output
    ctx.save_for_backward(q, k, v, out, lse, seed, qkv_h, out_h, alibi_slopes, cu_seqlens)
    ctx.params = inputs[5:]
    ctx.mark_non_differentiable(lse, seed, qkv_h, out_h)


def _cp_grads(ctx, dout, *unused):
    q, k, v, out, lse, seed, qkv_h, out_h, alibi_slopes, cu_seqlens = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _cp_bwd(dout, q, k, v, out, lse, seed, qkv_h, out_h, alibi_slopes, cu_seqlens,
                         *ctx.params)
    return (dq, dk, dv, None, None) + (None,) * len(ctx.params)


_cp_fwd.register_autograd(_cp_grads, setup_context=_cp_setup_context)


class _ContextParallelAttn(torch.autograd.Function):
    """The eager call: :func:`_cp_forward` and :func:`_cp_backward` without the dispatcher's
    round trip and the ops' copies, the backward on the forward's configuration (no second
    host read of ``cu_seqlens``; under ``torch.compile`` the ops run instead: :func:`_run`)."""

    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, cu_seqlens, *params):
        ctx.cfg, (out, lse, _, qkv_h, out_h) = _cp_forward(q, k, v, alibi_slopes, cu_seqlens,
                                                           *params)
        ctx.save_for_backward(q, k, v, out, lse, qkv_h, out_h)
        ctx.n_params = len(params)
        return out

    @staticmethod
    def backward(ctx, do):
        dq, dk, dv = _cp_backward(ctx.cfg, do, *ctx.saved_tensors)
        return (dq, dk, dv, None, None) + (None,) * ctx.n_params


def _run(q, k, v, alibi_slopes, cu_seqlens, max_seqlen: int, *args):
    """The output shard: through the custom op while ``torch.compile`` traces (one opaque call
    in the graph, ``fullgraph=True`` holds), else through the autograd Function."""
    if torch.compiler.is_compiling():
        return _cp_fwd(q, k, v, alibi_slopes, cu_seqlens, max_seqlen, *args)[0]
    return _ContextParallelAttn.apply(q, k, v, alibi_slopes, cu_seqlens, max_seqlen, *args)


# ---------------------------------------------------------------------------------------
# public functions


def _config(q, k, v, causal, softmax_scale, dropout_p, window_size, softcap, alibi_slopes,
            group, layout, mode, batch):
    """The call's arguments checked; the custom op's scalar arguments."""
    _check_layout(layout)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be (batch, seqlen_local, heads, headdim), got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, "
                         "local sequence length and head dim (self-attention shards)")
    H, Hk = q.shape[2], k.shape[2]
    if Hk == 0 or H % Hk:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hk})")
    world, _ = _group_info(group)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout='zigzag' needs an even local sequence length, got {q.shape[1]}")
    if mode == "ulysses" and (H % world or Hk % world):
        raise ValueError(f"mode='ulysses' needs heads ({H}) and key/value heads ({Hk}) divisible "
                         f"by the world size ({world})")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if alibi_slopes is not None:
        shape = tuple(alibi_slopes.shape)
        if shape not in ((H,), (batch, H)) or alibi_slopes.dtype != torch.float32:
            raise ValueError(f"alibi_slopes must be float32 ({H},) or ({batch}, {H}), got "
                             f"{alibi_slopes.dtype} {shape}")
    wl, wr = (int(w) for w in window_size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    # the op's arguments after alibi_slopes, cu_seqlens and max_seqlen
    return (_group_name(group), layout, mode, bool(causal), scale, wl, wr, float(softcap),
            float(dropout_p))


def context_parallel_attn(q, k, v, causal=False, softmax_scale=None, dropout_p=0.0,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, group=None,
                          layout="zigzag", mode="ring"):
    """Attention over a sequence sharded across ``group`` (default: the world).

    q: ``(batch, seqlen_local, nheads, headdim)``, this rank's shard (:func:`shard` with the same
    ``layout``); k, v: ``(batch, seqlen_local, nheads_k, headdim)``, ``nheads % nheads_k == 0``.
    Returns this rank's shard of the output, like q.  The result, its gradients and the dropout
    mask are those of ``flash_attn_func`` on the whole sequence (``seqlen_local * R``).
    ``mode``: ``"ring"``, ``"allgather"`` or ``"ulysses"`` (see the module docstring).
    """
    args = _config(q, k, v, causal, softmax_scale, dropout_p, window_size, softcap, alibi_slopes,
                   group, layout, mode, q.shape[0])
    return _run(q, k, v, alibi_slopes, None, 0, *args)


def context_parallel_varlen_attn(q, k, v, cu_seqlens, max_seqlen, causal=False,
                                 softmax_scale=None, dropout_p=0.0, window_size=(-1, -1),
                                 softcap=0.0, alibi_slopes=None, group=None, layout="zigzag",
                                 mode="ring"):
    """Varlen context-parallel attention: the packed sequence of documents is sharded.

    q: ``(total_local, nheads, headdim)``, this rank's shard (:func:`shard` with ``seq_dim=0``) of
    the packed ``(total, nheads, headdim)`` tensor; k, v likewise with ``nheads_k`` heads.
    ``cu_seqlens``: int32 ``(num_docs + 1,)`` of the *whole* packed sequence (the same on every
    rank; documents may cross shard boundaries), ``max_seqlen`` its longest document.  Returns
    this rank's shard of the output, equal (dropout included) to ``flash_attn_varlen_func`` on
    the whole packed sequence with ``cu_seqlens_q = cu_seqlens_k = cu_seqlens``.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be (total_local, heads, headdim), got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-d int tensor (num_docs + 1,)")
    # (the cumulative lengths themselves are checked inside the op, which reads them)
    args = _config(q[None], k[None], v[None], causal, softmax_scale, dropout_p, window_size,
                   softcap, alibi_slopes, group, layout, mode, cu_seqlens.shape[0] - 1)
    return _run(q[None], k[None], v[None], alibi_slopes, cu_seqlens, int(max_seqlen), *args)[0]
