"""Context-parallel attention: one sequence split over the ranks of a process group.

Each rank holds a shard of the sequence (:func:`shard`): ``contiguous`` (rank ``r`` holds chunk
``r`` of ``R``) or ``zigzag`` (the sequence cut in ``2R`` chunks, rank ``r`` holds chunks ``r``
and ``2R - 1 - r``, so that under a causal mask every rank has the same work).  A shard is made
of *pieces*, ``(local_start, global_start, length)``.

Every mode computes, for the rank's query pieces, partial attentions against key pieces with
the global offsets (``flashtile.distributed.partial``), so masks, ALiBi and dropout are those of
the whole sequence, and merges them in float32 (``flashtile.merge_attention_states``):

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
counters, exactly as ``flash_attn_varlen_func`` on the whole packed sequence.

With dropout, rank 0 of the group draws the seed (every rank draws one, so their generators stay
in step) and broadcasts it: one more collective in the forward.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from ..rng import draw_seed
from .partial import partial_attention, partial_attention_backward

__all__ = ["shard", "unshard", "context_parallel_attn", "context_parallel_varlen_attn",
           "LAYOUTS", "MODES"]

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
    docs: list  # (batch_offset, start, end) in the packed / whole sequence
    total: int  # dropout counter length (S dense, max_seqlen varlen)
    varlen: bool = False
    head_offset: int = 0
    nheads_total: int | None = None


def _calls(cfg: _Cfg, q_pieces, k_pieces):
    """Partial calls ``(q_local, nq, k_local, nk, q_offset, k_offset, batch_offset)`` that hold
    a visible pair: every (query piece, key piece, document) intersection."""
    wl, wr = cfg.window
    if cfg.causal:
        wr = 0
    for ql, qg, qn in q_pieces:
        for kl, kg, kn in k_pieces:
            for b_off, d0, d1 in cfg.docs:
                a0, a1 = max(qg, d0), min(qg + qn, d1)
                c0, c1 = max(kg, d0), min(kg + kn, d1)
                if a0 >= a1 or c0 >= c1:
                    continue
                # query a sees key c iff a - wl <= c <= a + wr (the diagonal of equal lengths)
                if wr >= 0 and c0 > a1 - 1 + wr:
                    continue
                if wl >= 0 and c1 - 1 < a0 - wl:
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


def _merge(acc_o, acc_l, o, lse):
    from .. import merge_attention_states
    m_o, m_l = merge_attention_states(acc_o, acc_l, o, lse)
    acc_o.copy_(m_o)
    acc_l.copy_(m_l)


def _attend(cfg, q, k, v, q_pieces, k_pieces, acc_o, acc_l):
    """Merge the partials of ``q``'s pieces over ``k``/``v``'s pieces into the float32
    accumulators ``acc_o`` ``(B, Sq, H, D)`` / ``acc_l`` ``(B, H, Sq)``."""
    for ql, nq, kl, nk, q_off, k_off, b_off in _calls(cfg, q_pieces, k_pieces):
        o, lse = partial_attention(q[:, ql:ql + nq], k[:, kl:kl + nk], v[:, kl:kl + nk],
                                   **_kw(cfg, q_off, k_off, b_off))
        _merge(acc_o[:, ql:ql + nq], acc_l[:, :, ql:ql + nq], o, lse)


def _attend_bwd(cfg, do, q, k, v, out, lse, q_pieces, k_pieces, dq, dk, dv):
    """Add the gradient shares of the pairs of pieces into the float32 ``dq``/``dk``/``dv``."""
    for ql, nq, kl, nk, q_off, k_off, b_off in _calls(cfg, q_pieces, k_pieces):
        rq, rk = slice(ql, ql + nq), slice(kl, kl + nk)
        g_q, g_k, g_v = partial_attention_backward(
            do[:, rq], q[:, rq], k[:, rk], v[:, rk], out[:, rq], lse[:, :, rq],
            **_kw(cfg, q_off, k_off, b_off))
        dq[:, rq] += g_q
        dk[:, rk] += g_k
        dv[:, rk] += g_v


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
    n = q.shape[1]
    q_pieces = pieces(cfg.layout, cfg.world, cfg.rank, n)
    kv = torch.stack([k, v])  # [2, B, S_loc, Hk, D]: one message per hop
    kv_next = torch.empty_like(kv) if cfg.world > 1 else None
    for t in range(cfg.world):
        reqs = _exchange(cfg, kv, kv_next) if t < cfg.world - 1 else None
        src = (cfg.rank - t) % cfg.world
        _attend(cfg, q, kv[0], kv[1], q_pieces, pieces(cfg.layout, cfg.world, src, n),
                acc_o, acc_l)
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
            acc_o, acc_l)
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
    R = cfg.world
    B, n = xs[0].shape[:2]
    D = xs[0].shape[-1]
    widths = [x.shape[2] // R for x in xs]
    # [R, B, S_loc, sum(widths), D]: block r goes to rank r
    send = torch.cat([x.reshape(B, n, R, w, D).permute(2, 0, 1, 3, 4)
                      for x, w in zip(xs, widths)], dim=3).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=cfg.group)
    whole = _to_global(list(recv.unbind(0)), cfg.layout, R, 1)  # [B, S, sum(widths), D]
    return list(whole.split(widths, dim=2))


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
    """``(out, saved)``: this rank's output shard and what the backward needs (the head-layout
    q, k, v, output and LSE)."""
    qh, kh, vh = _heads_to_seq(cfg, [q, k, v])
    lcfg = _ulysses_cfg(cfg, q.shape[2])
    acc_o, acc_l = _empty_acc(qh)
    whole = [(0, 0, qh.shape[1])]
    _attend(lcfg, qh, kh, vh, whole, whole, acc_o, acc_l)
    out_h = acc_o.to(q.dtype)
    (out,) = _seq_to_heads(cfg, [out_h])
    return out, (qh, kh, vh, out_h, acc_l)


def _ulysses_bwd(cfg, do, qh, kh, vh, out_h, lse_h):
    (doh,) = _heads_to_seq(cfg, [do])
    lcfg = _ulysses_cfg(cfg, do.shape[2])
    whole = [(0, 0, qh.shape[1])]
    dq = torch.zeros(qh.shape, dtype=torch.float32, device=qh.device)
    dk = torch.zeros(kh.shape, dtype=torch.float32, device=qh.device)
    dv = torch.zeros(vh.shape, dtype=torch.float32, device=qh.device)
    _attend_bwd(lcfg, doh, qh, kh, vh, out_h, lse_h, whole, whole, dq, dk, dv)
    return _seq_to_heads(cfg, [dq.to(qh.dtype), dk.to(kh.dtype), dv.to(vh.dtype)])


class _ContextParallelAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: _Cfg):
        with torch.no_grad():
            if cfg.mode == "ulysses":
                out, saved = _ulysses_fwd(cfg, q, k, v)
                ctx.save_for_backward(*saved)
            else:
                fwd = _ring_fwd if cfg.mode == "ring" else _allgather_fwd
                acc_o, lse = fwd(cfg, q, k, v)
                # the backward's delta = rowsum(dO * O) uses the output as returned, as the
                # single-device backward does
                out = acc_o.to(q.dtype)
                ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        return out

    @staticmethod
    def backward(ctx, do):
        cfg = ctx.cfg
        do = do.contiguous()
        with torch.no_grad():
            if cfg.mode == "ulysses":
                dq, dk, dv = _ulysses_bwd(cfg, do, *ctx.saved_tensors)
            else:
                q, k, v, out, lse = ctx.saved_tensors
                bwd = _ring_bwd if cfg.mode == "ring" else _allgather_bwd
                dq, dk, dv = bwd(cfg, do, q, k, v, out, lse)
                dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        return dq, dk, dv, None


# ---------------------------------------------------------------------------------------
# public functions


def _config(q, k, v, causal, softmax_scale, dropout_p, window_size, softcap, alibi_slopes,
            group, layout, mode, docs, total, batch):
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
    world, rank = _group_info(group)
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
    seed = None
    if dropout_p > 0:
        seed = draw_seed(q.device)  # every rank draws: generators stay in step
        if world > 1:
            dist.broadcast(seed, dist.get_global_rank(group, 0) if group is not None else 0,
                           group=group)
    return _Cfg(world, rank, group, layout, mode, bool(causal), scale, (wl, wr), float(softcap),
                float(dropout_p), alibi_slopes, seed, docs, total)


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
    total = q.shape[1] * _group_info(group)[0]
    cfg = _config(q, k, v, causal, softmax_scale, dropout_p, window_size, softcap, alibi_slopes,
                  group, layout, mode, [(0, 0, total)], total, q.shape[0])
    return _ContextParallelAttn.apply(q, k, v, cfg)


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
    world, _ = _group_info(group)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be (total_local, heads, headdim), got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-d int tensor (num_docs + 1,)")
    cu = [int(x) for x in cu_seqlens.tolist()]
    total = q.shape[0] * world
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the packed length {total} "
                         f"(total_local x world size), got {cu[0]}..{cu[-1]}")
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    if int(max_seqlen) < longest:
        raise ValueError(f"max_seqlen ({max_seqlen}) is shorter than the longest document "
                         f"({longest})")
    docs = [(d, a, b) for d, (a, b) in enumerate(zip(cu, cu[1:]))]
    cfg = _config(q[None], k[None], v[None], causal, softmax_scale, dropout_p, window_size,
                  softcap, alibi_slopes, group, layout, mode, docs, int(max_seqlen), len(cu) - 1)
    cfg.varlen = True
    return _ContextParallelAttn.apply(q[None], k[None], v[None], cfg)[0]
