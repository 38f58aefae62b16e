"""Triton kernels for attention against a KV cache (decode / speculative verification).

Four passes, one kernel source each; optional features are ``tl.constexpr`` flags that
``triton.heuristics`` derives from whether an argument is ``None`` (or from a scalar's value):

* :func:`_check_kernel` checks the index tensors' values (lengths against the capacity, leftpad,
  cache rows, pages of the pool) and writes an error record; the other kernels never turn a bad
  index into an address (they clamp or mask it), and the append writes nothing when the record
  holds an error, so bad input neither reads nor writes out of bounds, even inside a CUDA graph.
* :func:`_rotary_append_kernel` rotates q or the new k (RoPE at absolute positions) and writes
  the new k/v into the cache in place (contiguous or paged).
* :func:`_split_kv_kernel` (FlashDecoding): program ``(b, kv_head, split, m_block)`` streams
  one contiguous slice of the row's keys once for *all* query heads of the KV group and all
  query tokens, and writes a partial output plus its log-sum-exp.
* :func:`_combine_kernel` merges the per-split partials with the LSE combine.

Conventions are those of :mod:`flashtile.backends.spec` (bottom-right aligned windows, softcap
then ALiBi, natural-log lse, ``-inf`` / zero output for a row that sees no key).
"""
from __future__ import annotations

import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _first_bad(m_bad, o_idx, b_val, err, idx, val, CODE: tl.constexpr):
    """Keep the first error: when nothing is recorded yet (``err == 0``) and ``m_bad`` has a
    set entry, return ``(CODE, its smallest index, its value)``, else ``(err, idx, val)``."""
    o_first = tl.min(tl.where(m_bad, o_idx, 2147483647))
    b_hit = o_first != 2147483647
    b_val_first = tl.sum(tl.where(m_bad & (o_idx == o_first), b_val, 0))
    take = b_hit & (err == 0)
    return tl.where(take, CODE, err), tl.where(take, o_first, idx), tl.where(take, b_val_first, val)


@triton.heuristics(
    {
        "HAS_LEFTPAD": lambda a: a["leftpad_ptr"] is not None,
        "HAS_BATCH_IDX": lambda a: a["batch_idx_ptr"] is not None,
        "PAGED": lambda a: a["block_table_ptr"] is not None,
    }
)
@triton.jit
def _check_kernel(
    err_ptr, seqlens_ptr, leftpad_ptr, batch_idx_ptr, block_table_ptr,
    batch, stride_btb, n_cols, seqlen_new, capacity, cache_rows, num_blocks, rotary_need,
    PAGE_SIZE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    PAGED: tl.constexpr,
):
    """One program: the error record ``err = (code, index, value)`` (int32) of a decode call.

    Codes, the first that applies to the lowest row (rows are scanned in order):
    1 ``seqlens[b] < 0``; 2 ``seqlens[b] + seqlen_new > capacity``; 3 ``leftpad[b]`` outside
    ``[0, seqlens[b]]``; 4 ``batch_idx[b]`` outside ``[0, cache_rows)``; 5 a ``block_table``
    entry the call reads or writes (pages ``leftpad[b] // PAGE_SIZE`` up to
    ``ceil((seqlens[b] + seqlen_new) / PAGE_SIZE)``) outside ``[0, num_blocks)``, index
    ``b * n_cols + column``; 6 ``seqlens[b] + rotary_need > seqlen_ro`` is reported as
    ``seqlens[b] > rotary_need`` (the launcher passes ``rotary_need = seqlen_ro - span``, the
    longest cache that the rotary tables cover, or ``2**30`` without rotary).  ``0``: all good.
    Every program of the append kernel reads ``code`` and writes nothing when it is set.
    """
    err = tl.full([], 0, tl.int32)
    idx = tl.full([], 0, tl.int32)
    val = tl.full([], 0, tl.int32)
    for b0 in range(0, batch, BLOCK_B):
        o_b = b0 + tl.arange(0, BLOCK_B)  # [BLOCK_B]
        m_b = o_b < batch
        b_len = tl.load(seqlens_ptr + o_b, mask=m_b, other=0)  # [BLOCK_B]
        err, idx, val = _first_bad(m_b & (b_len < 0), o_b, b_len, err, idx, val, 1)
        err, idx, val = _first_bad(m_b & (b_len > capacity - seqlen_new), o_b, b_len, err, idx,
                                   val, 2)
        if HAS_LEFTPAD:
            b_pad = tl.load(leftpad_ptr + o_b, mask=m_b, other=0)  # [BLOCK_B]
            err, idx, val = _first_bad(m_b & ((b_pad < 0) | (b_pad > b_len)), o_b, b_pad, err,
                                       idx, val, 3)
        else:
            b_pad = tl.zeros([BLOCK_B], dtype=tl.int32)
        if HAS_BATCH_IDX:
            b_row = tl.load(batch_idx_ptr + o_b, mask=m_b, other=0)  # [BLOCK_B]
            err, idx, val = _first_bad(m_b & ((b_row < 0) | (b_row >= cache_rows)), o_b, b_row,
                                       err, idx, val, 4)
        err, idx, val = _first_bad(m_b & (b_len > rotary_need), o_b, b_len, err, idx, val, 6)
        if PAGED:
            b_first = tl.maximum(b_pad, 0) // PAGE_SIZE  # [BLOCK_B]
            b_last = (tl.minimum(tl.maximum(b_len, 0) + seqlen_new, capacity) + PAGE_SIZE - 1) \
                // PAGE_SIZE  # [BLOCK_B]
            for c0 in range(0, n_cols, BLOCK_C):
                o_c = c0 + tl.arange(0, BLOCK_C)  # [BLOCK_C]
                m_used = (m_b[:, None] & (o_c[None, :] >= b_first[:, None])
                          & (o_c[None, :] < b_last[:, None]) & (o_c[None, :] < n_cols))
                p_bt = block_table_ptr + o_b[:, None].to(tl.int64) * stride_btb + o_c[None, :]
                b_page = tl.load(p_bt, mask=m_used, other=0)  # [BLOCK_B, BLOCK_C]
                o_flat = o_b[:, None] * n_cols + o_c[None, :]  # [BLOCK_B, BLOCK_C]
                err, idx, val = _first_bad(m_used & ((b_page < 0) | (b_page >= num_blocks)),
                                           o_flat, b_page, err, idx, val, 5)
    tl.store(err_ptr, err)
    tl.store(err_ptr + 1, idx)
    tl.store(err_ptr + 2, val)


@triton.heuristics(
    {
        "HAS_ROTARY": lambda a: a["cos_ptr"] is not None,
        "HAS_Y": lambda a: a["y_ptr"] is not None,
        "HAS_BATCH_IDX": lambda a: a["batch_idx_ptr"] is not None,
        "PAGED": lambda a: a["block_table_ptr"] is not None,
        "HAS_ERR": lambda a: a["err_ptr"] is not None,
    }
)
@triton.jit
def _rotary_append_kernel(
    x_ptr, y_ptr, xo_ptr, yo_ptr,
    cos_ptr, sin_ptr, seqlens_ptr, batch_idx_ptr, block_table_ptr, err_ptr,
    stride_xb, stride_xs, stride_xh,
    stride_yb, stride_ys, stride_yh,
    stride_xob, stride_xos, stride_xoh,
    stride_yob, stride_yos, stride_yoh,
    stride_cos, stride_sin, stride_btb,
    nheads, head_dim, seqlen_ro, capacity, cache_rows, num_blocks,
    ROTARY_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    TO_CACHE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_ROTARY: tl.constexpr,
    HAS_Y: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    PAGED: tl.constexpr,
    HAS_ERR: tl.constexpr,
):
    """Rotate ``x[b, t]`` (all heads) and store it; copy ``y[b, t]`` alongside.

    Position of token ``t`` of row ``b``: ``pos = seqlens[b] + t`` (``seqlens[b]`` when not
    ``PER_TOKEN``).  With ``f = rotary_dim / 2`` frequencies, ``c = cos[pos, i]``,
    ``s = sin[pos, i]``:

      interleaved (pairs ``2i, 2i+1``): ``x'[2i] = x[2i] c - x[2i+1] s``,
                                          ``x'[2i+1] = x[2i+1] c + x[2i] s``
      GPT-NeoX (halves ``i, i+f``):      ``x'[i] = x[i] c - x[i+f] s``,
                                          ``x'[i+f] = x[i+f] c + x[i] s``

    channels ``>= rotary_dim`` are copied.  ``TO_CACHE``: the destination slot is cache
    position ``seqlens[b] + t`` of cache row ``batch_idx[b]`` (or ``b``), through the block
    table when ``PAGED``; otherwise the destination is ``xo[b, t]`` with its own strides.
    Nothing is written outside the cache, whatever the index tensors hold: positions outside
    ``[0, capacity)``, cache rows outside ``[0, cache_rows)`` and pages outside
    ``[0, num_blocks)`` are not written, positions outside ``[0, seqlen_ro)`` are not rotated,
    and with ``TO_CACHE`` nothing at all is written when the error record ``err_ptr[0]``
    (:func:`_check_kernel`, launched first; ``err_ptr`` is None when the checks are off) is set.
    """
    i_t = tl.program_id(0)
    i_b = tl.program_id(1)
    i_hb = tl.program_id(2)

    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    o_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_h = o_h < nheads
    m_d = o_d < head_dim
    m_hd = m_h[:, None] & m_d[None, :]  # [BLOCK_H, BLOCK_D]

    cache_len = tl.load(seqlens_ptr + i_b)
    p_x = x_ptr + i_b.to(tl.int64) * stride_xb + i_t * stride_xs + o_h[:, None] * stride_xh  # [BLOCK_H, 1]
    b_x = tl.load(p_x + o_d[None, :], mask=m_hd, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]

    if HAS_ROTARY:
        if PER_TOKEN:
            pos = cache_len + i_t
        else:
            pos = cache_len
        m_rot = o_d < ROTARY_DIM  # [BLOCK_D]
        if INTERLEAVED:
            o_pair = o_d ^ 1  # [BLOCK_D] partner channel inside the (2i, 2i+1) pair
            o_freq = o_d // 2  # [BLOCK_D]
            b_sign = tl.where(o_d % 2 == 0, -1.0, 1.0)  # [BLOCK_D]
        else:
            first = o_d < ROTARY_DIM // 2
            o_pair = tl.where(first, o_d + ROTARY_DIM // 2, o_d - ROTARY_DIM // 2)  # [BLOCK_D]
            o_freq = tl.where(first, o_d, o_d - ROTARY_DIM // 2)  # [BLOCK_D]
            b_sign = tl.where(first, -1.0, 1.0)  # [BLOCK_D]
        m_cs = m_rot & (pos >= 0) & (pos < seqlen_ro)
        # cos = 1, sin = 0 outside the rotary channels leaves those channels unchanged
        b_cos = tl.load(cos_ptr + pos * stride_cos + o_freq, mask=m_cs, other=1.0).to(tl.float32)  # [BLOCK_D]
        b_sin = tl.load(sin_ptr + pos * stride_sin + o_freq, mask=m_cs, other=0.0).to(tl.float32)  # [BLOCK_D]
        b_xp = tl.load(p_x + o_pair[None, :], mask=m_h[:, None] & m_rot[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
        b_x = b_x * b_cos[None, :] + b_xp.to(tl.float32) * (b_sign * b_sin)[None, :]

    if TO_CACHE:
        pos_w = cache_len + i_t
        m_pos = (pos_w >= 0) & (pos_w < capacity)
        if HAS_ERR:
            m_pos = m_pos & (tl.load(err_ptr) == 0)
        if PAGED:
            page = tl.load(block_table_ptr + i_b.to(tl.int64) * stride_btb + pos_w // PAGE_SIZE,
                           mask=m_pos, other=0).to(tl.int64)
            m_pos = m_pos & (page >= 0) & (page < num_blocks)
            o_xo = page * stride_xob + (pos_w % PAGE_SIZE) * stride_xos
            o_yo = page * stride_yob + (pos_w % PAGE_SIZE) * stride_yos
        else:
            if HAS_BATCH_IDX:
                row = tl.load(batch_idx_ptr + i_b).to(tl.int64)
                m_pos = m_pos & (row >= 0) & (row < cache_rows)
            else:
                row = i_b.to(tl.int64)
            o_xo = row * stride_xob + pos_w.to(tl.int64) * stride_xos
            o_yo = row * stride_yob + pos_w.to(tl.int64) * stride_yos
        m_w = m_hd & m_pos
    else:
        m_w = m_hd
        o_xo = i_b.to(tl.int64) * stride_xob + i_t * stride_xos
        o_yo = i_b.to(tl.int64) * stride_yob + i_t * stride_yos

    p_xo = xo_ptr + o_xo + o_h[:, None] * stride_xoh + o_d[None, :]  # [BLOCK_H, BLOCK_D]
    tl.store(p_xo, b_x.to(xo_ptr.dtype.element_ty), mask=m_w)
    if HAS_Y:
        p_y = y_ptr + i_b.to(tl.int64) * stride_yb + i_t * stride_ys + o_h[:, None] * stride_yh + o_d[None, :]
        b_y = tl.load(p_y, mask=m_hd, other=0.0)  # [BLOCK_H, BLOCK_D]
        p_yo = yo_ptr + o_yo + o_h[:, None] * stride_yoh + o_d[None, :]  # [BLOCK_H, BLOCK_D]
        tl.store(p_yo, b_y.to(yo_ptr.dtype.element_ty), mask=m_w)


@triton.heuristics(
    {
        "HAS_LEFTPAD": lambda a: a["leftpad_ptr"] is not None,
        "HAS_BATCH_IDX": lambda a: a["batch_idx_ptr"] is not None,
        "PAGED": lambda a: a["block_table_ptr"] is not None,
        "HAS_ALIBI": lambda a: a["alibi_ptr"] is not None,
        "HAS_TREE": lambda a: a["tree_ptr"] is not None,
        "HAS_SOFTCAP": lambda a: a["softcap"] > 0.0,
        "LOCAL": lambda a: a["window_left"] >= 0 or a["window_right"] >= 0,
    }
)
@triton.jit
def _split_kv_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    seqlens_ptr, leftpad_ptr, batch_idx_ptr, block_table_ptr, alibi_ptr, tree_ptr,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_osplit, stride_ob, stride_os, stride_oh,
    stride_lsplit, stride_lb, stride_lh,
    stride_btb, stride_ab, stride_tb, stride_tq,
    seqlen_q, seqlen_new, nheads_k, capacity, head_dim, cache_rows, num_blocks,
    softmax_scale, softcap, window_left, window_right, n_splits,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    PAGED: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_TREE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    LOCAL: tl.constexpr,
):
    """One split of FlashDecoding for one (batch row, KV head, block of query rows).

    Rows of the program pack ``(token t, head-in-group g)`` as ``r = t * GROUP + g``, so the
    ``GROUP`` query heads sharing KV head ``hk`` (heads ``hk * GROUP + g``) and all query
    tokens reuse each K/V tile loaded from HBM.

    Keys of row ``b``: cache positions ``[start, end)`` with ``start = leftpad[b]`` and
    ``end = seqlens[b] + seqlen_new``; ``n = end - start`` keys, key ``j = pos - start``.
    Query ``t`` (of ``sq``) sees ``j`` when, with ``shift = n - sq`` (bottom-right alignment),
    ``j >= t + shift - window_left`` (``window_left >= 0``),
    ``j <= t + shift + window_right`` (``window_right >= 0``) and, with a tree mask,
    ``j < n - sq or tree[b, t, j - (n - sq)]``.

    Scores ``s = softcap * tanh(scale * q.k / softcap) - slope_h * |t + shift - j|``; the
    program streams its tiles of keys with the online softmax (base 2):
    ``m' = max(m, max_j s_j)``, ``l' = l 2^(m - m') + sum_j 2^(s_j - m')``,
    ``acc' = acc 2^(m - m') + sum_j 2^(s_j - m') v_j`` (``s`` pre-multiplied by log2 e) and
    stores ``o = acc / l`` and ``lse = (m + log2 l) ln 2`` (natural log; ``-inf`` and ``o = 0``
    when it saw no key).  The split owns tiles ``[lo + i * per, lo + (i + 1) * per)`` of the
    ``BLOCK_N``-aligned tiles covering the keys any of its rows can see.
    """
    i_bh = tl.program_id(0)
    i_split = tl.program_id(1)
    i_m = tl.program_id(2)
    i_b = i_bh // nheads_k
    i_hk = i_bh % nheads_k
    i_b64 = i_b.to(tl.int64)

    # Guards: whatever the index tensors hold, no key outside the cache is read (lengths and
    # leftpad are clamped to [0, capacity], cache rows and pages to the pool); bad values are
    # reported by _check_kernel's record, these only keep the reads in bounds.
    cache_len = tl.maximum(tl.load(seqlens_ptr + i_b), 0)
    end = tl.minimum(cache_len + seqlen_new, capacity)
    if HAS_LEFTPAD:
        start = tl.minimum(tl.maximum(tl.load(leftpad_ptr + i_b), 0), end)
    else:
        start = 0
    n_keys = end - start
    shift = n_keys - seqlen_q

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] packed (token, head-in-group) rows
    o_t = o_m // GROUP  # [BLOCK_M] query token
    o_h = i_hk * GROUP + o_m % GROUP  # [BLOCK_M] query head
    m_m = o_t < seqlen_q  # [BLOCK_M]
    o_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_d = o_d < head_dim  # [BLOCK_D]

    # keys any row of this program can see (relative indices), narrowed by the window
    lo = 0
    hi = n_keys
    if LOCAL:
        t_first = (i_m * BLOCK_M) // GROUP
        t_last = tl.minimum((i_m * BLOCK_M + BLOCK_M - 1) // GROUP, seqlen_q - 1)
        lo = tl.where(window_left >= 0, tl.maximum(t_first + shift - window_left, 0), 0)
        hi = tl.where(window_right >= 0, tl.minimum(t_last + shift + window_right + 1, n_keys), n_keys)
    kv_lo = start + lo
    kv_hi = tl.maximum(start + hi, kv_lo)
    tile_lo = kv_lo // BLOCK_N
    tile_hi = (kv_hi + BLOCK_N - 1) // BLOCK_N
    per_split = (tile_hi - tile_lo + n_splits - 1) // n_splits
    my_lo = tile_lo + i_split * per_split
    my_hi = tl.minimum(my_lo + per_split, tile_hi)

    p_q = q_ptr + i_b64 * stride_qb + o_t[:, None] * stride_qs + o_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    if HAS_ALIBI:
        b_slope = tl.load(alibi_ptr + i_b64 * stride_ab + o_h, mask=m_m, other=0.0).to(tl.float32)  # [BLOCK_M]
    if PAGED:
        p_bt = block_table_ptr + i_b64 * stride_btb  # pages are looked up in the loop
    else:
        if HAS_BATCH_IDX:
            cache_row = tl.minimum(tl.maximum(tl.load(batch_idx_ptr + i_b).to(tl.int64), 0),
                                   cache_rows - 1)
        else:
            cache_row = i_b64
        o_k_row = cache_row * stride_kb
        o_v_row = cache_row * stride_vb
    o_kh = i_hk * stride_kh
    o_vh = i_hk * stride_vh

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BLOCK_M] running max (base 2)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M] running sum
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # [BLOCK_M, BLOCK_D]

    for i_tile in range(my_lo, my_hi):
        o_n = i_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] absolute cache positions
        m_n = (o_n >= kv_lo) & (o_n < kv_hi)  # [BLOCK_N]
        if PAGED:
            if PAGE_SIZE % BLOCK_N == 0:
                # the tile lies in one page: one scalar lookup, and addresses as regular as a
                # contiguous cache's, so the pipeliner runs the K/V loads ahead as it does there.
                # The page holds at least one key the row can see, so its entry is a valid one.
                page = tl.load(p_bt + (i_tile * BLOCK_N) // PAGE_SIZE).to(tl.int64)
                page = tl.minimum(tl.maximum(page, 0), num_blocks - 1)
                o_in = (i_tile * BLOCK_N) % PAGE_SIZE + tl.arange(0, BLOCK_N)  # [BLOCK_N]
                o_k = page * stride_kb + o_in * stride_ks  # [BLOCK_N]
                o_v = page * stride_vb + o_in * stride_vs  # [BLOCK_N]
            else:
                b_page = tl.load(p_bt + o_n // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)  # [BLOCK_N]
                b_page = tl.minimum(tl.maximum(b_page, 0), num_blocks - 1)
                o_k = b_page * stride_kb + (o_n % PAGE_SIZE) * stride_ks  # [BLOCK_N]
                o_v = b_page * stride_vb + (o_n % PAGE_SIZE) * stride_vs  # [BLOCK_N]
        else:
            o_k = o_k_row + o_n.to(tl.int64) * stride_ks  # [BLOCK_N]
            o_v = o_v_row + o_n.to(tl.int64) * stride_vs  # [BLOCK_N]
        m_nd = m_n[:, None] & m_d[None, :]  # [BLOCK_N, BLOCK_D]
        b_k = tl.load(k_ptr + o_k[:, None] + o_kh + o_d[None, :], mask=m_nd, other=0.0)  # [BLOCK_N, BLOCK_D]

        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * softmax_scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both tails, no overflow to nan
            b_s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * (b_s / softcap)) + 1.0))
        o_j = o_n - start  # [BLOCK_N] key index within the row
        if HAS_ALIBI:
            b_dist = tl.abs(o_t[:, None] + shift - o_j[None, :]).to(tl.float32)  # [BLOCK_M, BLOCK_N]
            b_s = b_s - b_slope[:, None] * b_dist
        m_vis = m_m[:, None] & m_n[None, :]  # [BLOCK_M, BLOCK_N]
        if LOCAL:
            o_diag = o_t[:, None] + shift  # [BLOCK_M, 1] key aligned with each query
            m_vis = m_vis & ((window_left < 0) | (o_j[None, :] >= o_diag - window_left))
            m_vis = m_vis & ((window_right < 0) | (o_j[None, :] <= o_diag + window_right))
        if HAS_TREE:
            o_c = o_j - (n_keys - seqlen_q)  # [BLOCK_N] tree column; < 0 for older cache keys
            m_c = (o_c >= 0) & m_n  # [BLOCK_N]
            p_tree = tree_ptr + i_b64 * stride_tb + o_t[:, None] * stride_tq + o_c[None, :]
            b_tree = tl.load(p_tree, mask=m_m[:, None] & m_c[None, :], other=0)  # [BLOCK_M, BLOCK_N]
            m_vis = m_vis & ((o_c[None, :] < 0) | (b_tree != 0))
        b_s = tl.where(m_vis, b_s * _LOG2E, float("-inf"))  # [BLOCK_M, BLOCK_N]

        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))  # [BLOCK_M]
        # a row that has seen nothing yet keeps max -inf; subtract 0 so exp2 gives 0, not nan
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # [BLOCK_M]
        b_p = tl.exp2(b_s - b_m_use[:, None])  # [BLOCK_M, BLOCK_N]
        b_alpha = tl.exp2(b_m - b_m_use)  # [BLOCK_M]
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_v = tl.load(v_ptr + o_v[:, None] + o_vh + o_d[None, :], mask=m_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        b_m = b_m_new

    b_seen = b_l > 0.0  # [BLOCK_M]
    b_l_safe = tl.where(b_seen, b_l, 1.0)  # [BLOCK_M]
    b_o = b_acc / b_l_safe[:, None]  # [BLOCK_M, BLOCK_D] zero where nothing was seen
    b_lse = tl.where(b_seen, (b_m + tl.log2(b_l_safe)) * _LN2, float("-inf"))  # [BLOCK_M]

    p_o = (o_ptr + i_split * stride_osplit + i_b64 * stride_ob + o_t[:, None] * stride_os
           + o_h[:, None] * stride_oh + o_d[None, :])  # [BLOCK_M, BLOCK_D]
    tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
    p_lse = lse_ptr + i_split * stride_lsplit + i_b64 * stride_lb + o_h * stride_lh + o_t  # [BLOCK_M]
    tl.store(p_lse, b_lse, mask=m_m)


@triton.jit
def _combine_kernel(
    op_ptr, lp_ptr, o_ptr, lse_ptr,
    stride_ops, stride_opb, stride_opm, stride_oph,
    stride_lps, stride_lpb, stride_lph,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    seqlen_q, nheads, n_splits, head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merge ``n_splits`` partial results of one (batch, token, head) row.

    Partials ``(o_i, lse_i)`` with ``o_i`` normalised over its own keys:
    ``lse = log sum_i exp(lse_i)`` and ``o = sum_i exp(lse_i - lse) o_i``.  Computed with
    ``M = max_i lse_i`` (``0`` when every ``lse_i = -inf``) as ``lse = M + log sum_i exp(lse_i - M)``;
    a row whose every split saw nothing gets ``lse = -inf`` and ``o = 0``, and an empty split
    contributes nothing even if its ``o_i`` were garbage.
    """
    i_row = tl.program_id(0)
    i_h = i_row % nheads
    i_bt = i_row // nheads
    i_t = i_bt % seqlen_q
    i_b = (i_bt // seqlen_q).to(tl.int64)

    o_s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    o_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_s = o_s < n_splits
    m_d = o_d < head_dim

    p_lp = lp_ptr + o_s * stride_lps + i_b * stride_lpb + i_h * stride_lph + i_t  # [BLOCK_S]
    b_lse_i = tl.load(p_lp, mask=m_s, other=float("-inf"))  # [BLOCK_S]
    b_max = tl.max(b_lse_i, 0)
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_w = tl.exp(b_lse_i - b_max)  # [BLOCK_S] 0 for empty splits
    b_sum = tl.sum(b_w, 0)
    b_any = b_sum > 0.0
    b_w = b_w / tl.where(b_any, b_sum, 1.0)  # [BLOCK_S]
    b_lse = tl.where(b_any, b_max + tl.log(tl.where(b_any, b_sum, 1.0)), float("-inf"))

    p_op = (op_ptr + o_s[:, None] * stride_ops + i_b * stride_opb + i_t * stride_opm + i_h * stride_oph
            + o_d[None, :])  # [BLOCK_S, BLOCK_D]
    b_op = tl.load(p_op, mask=m_s[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_D]
    b_o = tl.sum(tl.where(b_w[:, None] > 0.0, b_w[:, None] * b_op, 0.0), 0)  # [BLOCK_D]

    p_o = o_ptr + i_b * stride_ob + i_t * stride_om + i_h * stride_oh + o_d  # [BLOCK_D]
    tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_d)
    tl.store(lse_ptr + i_b * stride_lb + i_h * stride_lh + i_t, b_lse)
