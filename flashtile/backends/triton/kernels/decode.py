"""Triton kernels for attention against a KV cache (decode, chunked prefill, speculative
verification).

Four passes, one kernel source each; optional features are ``tl.constexpr`` flags, derived by
``triton.heuristics`` from whether a pointer is None (or from a scalar's value), or passed by
the launcher (``CHECK``, ``TO_CACHE`` ...):

* :func:`_rotary_append_kernel` rotates q or the new k (RoPE at absolute positions) and writes
  the new k/v into the cache in place (contiguous or paged);
* :func:`_split_kv_kernel` (FlashDecoding): program ``(b, kv_head, split, m_block)`` streams one
  contiguous slice of the row's keys once for *all* query heads of the KV group and all query
  tokens, and writes a partial output plus its log-sum-exp;
* :func:`_combine_kernel` merges the per-split partials with the LSE combine;
* :func:`_check_kernel` checks the index tensors on its own (one program), for calls whose
  append is too large to carry the check (see below).

Index values.  Every kernel turns no index value into an address outside the cache: lengths and
leftpad are clamped to ``[0, capacity]``, cache rows and pages to the pool, and writes outside
it are masked off, whatever ``cache_seqlens``, ``cache_leftpad``, ``cache_batch_idx`` or
``block_table`` hold.  On top of these guards (``CHECK`` and the ``ERR`` / ``REC`` pointers; all
absent when the checks are off) the call's index values are checked on the device
(:func:`_index_error`) and the verdict is published (:func:`_record`):

* ``ERR``, one int32 in device memory, the code for the later kernels of the same call: the
  append writes nothing and the split-KV kernel writes NaN when it is set;
* ``REC``, the error record ``(status, index, value, -)`` for the host, in pinned host memory
  on a GPU (written through unified addressing, no copy): ``status`` is ``RECORD_DONE + code``
  once the check ran (``0`` until then).

Where the check runs (no extra launch in the common cases): in every program of the append
(each program decides the same verdict before writing anything; program 0 publishes it), or,
without an append, in one extra program of the split-KV kernel that runs alongside the
attention while each attention program checks the indices its row uses and writes NaN rows
when one is bad.

Conventions are those of :mod:`flashtile.backends.spec` (bottom-right aligned windows, softcap
then ALiBi, natural-log lse, ``-inf`` / zero output for a row that sees no key).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import LN2, LOG2E, tanh, visible

# status word of a written error record: RECORD_DONE + code (code 0: every index is valid)
RECORD_DONE = tl.constexpr(256)
# no rotary tables: the longest cache they would have to cover
NO_ROTARY = tl.constexpr(1 << 30)

# Flags of the index tensors and of the verdict's outputs, shared by the kernels that check.
INDEX_FLAGS = {
    "HAS_LEFTPAD": lambda a: a["LEFTPAD"] is not None,
    "HAS_BATCH_IDX": lambda a: a["BATCH_IDX"] is not None,
    "PAGED": lambda a: a["BLOCK_TABLE"] is not None,
    "HAS_ERR": lambda a: a["ERR"] is not None,
    "HAS_REC": lambda a: a["REC"] is not None,
}
APPEND_FLAGS = {
    **INDEX_FLAGS,
    "HAS_ROTARY": lambda a: a["COS"] is not None,
    "HAS_Y": lambda a: a["Y"] is not None,
}
SPLIT_FLAGS = {
    **INDEX_FLAGS,
    "HAS_ALIBI": lambda a: a["ALIBI"] is not None,
    "HAS_TREE": lambda a: a["TREE"] is not None,
    "HAS_SOFTCAP": lambda a: a["softcap"] > 0.0,
    "HAS_LEFT": lambda a: a["window_left"] >= 0,
    "HAS_RIGHT": lambda a: a["window_right"] >= 0,
}


# --------------------------------------------------------------------------------------------
# the index check
# --------------------------------------------------------------------------------------------
@triton.jit
def _first_bad(m_bad, o_idx, b_val, code, index, value, CODE: tl.constexpr):
    """Keep the first error found: while nothing is recorded (``code == 0``) and ``m_bad`` has a
    set entry, ``(CODE, its smallest o_idx, its b_val)``, else ``(code, index, value)``.
    ``m_bad``, ``o_idx`` and ``b_val`` have one shape (a tile of rows or of table entries)."""
    first = tl.min(tl.where(m_bad, o_idx, 2147483647))
    hit = first != 2147483647
    val_first = tl.sum(tl.where(m_bad & (o_idx == first), b_val, 0))
    take = hit & (code == 0)
    return tl.where(take, CODE, code), tl.where(take, first, index), tl.where(take, val_first, value)


@triton.jit
def _index_error(SEQLENS, LEFTPAD, BATCH_IDX, BLOCK_TABLE,
                 batch, stride_btb, n_cols, seqlen_new, capacity, cache_rows, rotary_need,
                 PAGE_SIZE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
                 HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, PAGED: tl.constexpr):
    """The error ``(code, index, value)`` (int32 scalars) of a call's index tensors; ``code = 0``:
    every index is valid.

    With ``len = SEQLENS[b]``, ``pad = LEFTPAD[b]`` (0 without), for rows ``b < batch`` scanned in
    blocks of ``BLOCK_B``, the first code that applies to the lowest row of the first block
    holding an error:

    1. ``len < 0``;
    2. ``len + seqlen_new > capacity``;
    3. ``pad`` outside ``[0, len]``;
    4. ``BATCH_IDX[b]`` outside ``[0, cache_rows)``;
    6. ``len > rotary_need`` (the launcher passes ``rotary_need = seqlen_ro - span``, the longest
       cache the rotary tables cover, or ``NO_ROTARY``);
    5. a ``BLOCK_TABLE`` entry the call reads or writes, columns
       ``[pad // PAGE_SIZE, ceil((len + seqlen_new) / PAGE_SIZE))``, outside
       ``[0, cache_rows)`` (the pool's pages); ``index = b * n_cols + column``.

    ``index`` is the row (code 5: the flat table entry) and ``value`` the bad value; the host
    turns them into a message (``flashtile._validate.kvcache_error_message``).
    """
    code = tl.full([], 0, tl.int32)
    index = tl.full([], 0, tl.int32)
    value = tl.full([], 0, tl.int32)
    for i_b0 in range(0, batch, BLOCK_B):
        o_b = i_b0 + tl.arange(0, BLOCK_B)  # [BLOCK_B]
        m_b = o_b < batch  # [BLOCK_B]
        b_len = tl.load(SEQLENS + o_b, mask=m_b, other=0)  # [BLOCK_B]
        code, index, value = _first_bad(m_b & (b_len < 0), o_b, b_len, code, index, value, 1)
        code, index, value = _first_bad(m_b & (b_len > capacity - seqlen_new), o_b, b_len, code,
                                        index, value, 2)
        if HAS_LEFTPAD:
            b_pad = tl.load(LEFTPAD + o_b, mask=m_b, other=0)  # [BLOCK_B]
            code, index, value = _first_bad(m_b & ((b_pad < 0) | (b_pad > b_len)), o_b, b_pad,
                                            code, index, value, 3)
        else:
            b_pad = tl.zeros([BLOCK_B], dtype=tl.int32)  # [BLOCK_B]
        if HAS_BATCH_IDX:
            b_row = tl.load(BATCH_IDX + o_b, mask=m_b, other=0)  # [BLOCK_B]
            code, index, value = _first_bad(m_b & ((b_row < 0) | (b_row >= cache_rows)), o_b,
                                            b_row, code, index, value, 4)
        code, index, value = _first_bad(m_b & (b_len > rotary_need), o_b, b_len, code, index,
                                        value, 6)
        if PAGED:
            b_first = tl.maximum(b_pad, 0) // PAGE_SIZE  # [BLOCK_B] first column used
            b_last = (tl.minimum(tl.maximum(b_len, 0) + seqlen_new, capacity) + PAGE_SIZE - 1) \
                // PAGE_SIZE  # [BLOCK_B] one past the last column used
            for i_c0 in range(0, n_cols, BLOCK_C):
                o_c = i_c0 + tl.arange(0, BLOCK_C)  # [BLOCK_C]
                m_used = (m_b[:, None] & (o_c[None, :] >= b_first[:, None])
                          & (o_c[None, :] < b_last[:, None])
                          & (o_c[None, :] < n_cols))  # [BLOCK_B, BLOCK_C]
                p_bt = BLOCK_TABLE + o_b[:, None].to(tl.int64) * stride_btb + o_c[None, :]  # [BLOCK_B, BLOCK_C]
                b_page = tl.load(p_bt, mask=m_used, other=0)  # [BLOCK_B, BLOCK_C]
                o_flat = o_b[:, None] * n_cols + o_c[None, :]  # [BLOCK_B, BLOCK_C]
                code, index, value = _first_bad(m_used & ((b_page < 0) | (b_page >= cache_rows)),
                                                o_flat, b_page, code, index, value, 5)
    return code, index, value


@triton.jit
def _record(ERR, REC, code, index, value, rec_sticky,
            HAS_ERR: tl.constexpr, HAS_REC: tl.constexpr):
    """Publish a call's verdict: ``ERR[0] = code`` (device memory) for the later kernels of the
    call, and the error record ``REC[0:3] = (RECORD_DONE + code, index, value)`` for the host.

    The status word ``REC[0]`` is stored last; the host trusts ``index`` and ``value`` only after
    a device synchronisation.  ``rec_sticky`` (a record of a captured CUDA graph, which the host
    never clears between replays): written only when ``code != 0``, so the error of a bad replay
    stays until the host collects it.
    """
    if HAS_ERR:
        tl.store(ERR, code)
    if HAS_REC:
        if (code != 0) | (rec_sticky == 0):
            tl.store(REC + 1, index)
            tl.store(REC + 2, value)
            tl.store(REC, code + RECORD_DONE)


@triton.heuristics(INDEX_FLAGS)
@triton.jit(do_not_specialize=["rec_sticky"])
def _check_kernel(
    ERR, REC, SEQLENS, LEFTPAD, BATCH_IDX, BLOCK_TABLE,
    batch, stride_btb, n_cols, seqlen_new, capacity, cache_rows, rotary_need, rec_sticky,
    PAGE_SIZE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    PAGED: tl.constexpr,
    HAS_ERR: tl.constexpr,
    HAS_REC: tl.constexpr,
):
    """One program: ``(code, index, value) = _index_error(...)`` of the call, published by
    :func:`_record` (``ERR[0] = code``; ``REC = (RECORD_DONE + code, index, value)``).  Launched
    first, before an append whose programs are too many to each decide the verdict."""
    code, index, value = _index_error(SEQLENS, LEFTPAD, BATCH_IDX, BLOCK_TABLE, batch, stride_btb,
                                      n_cols, seqlen_new, capacity, cache_rows, rotary_need,
                                      PAGE_SIZE, BLOCK_B, BLOCK_C, HAS_LEFTPAD, HAS_BATCH_IDX,
                                      PAGED)
    _record(ERR, REC, code, index, value, rec_sticky, HAS_ERR, HAS_REC)


# --------------------------------------------------------------------------------------------
# append (with rotary)
# --------------------------------------------------------------------------------------------
@triton.heuristics(APPEND_FLAGS)
@triton.jit(do_not_specialize=["rec_sticky"])
def _rotary_append_kernel(
    X, Y, XO, YO, COS, SIN, SEQLENS, LEFTPAD, BATCH_IDX, BLOCK_TABLE, ERR, REC,
    stride_xb, stride_xs, stride_xh,
    stride_yb, stride_ys, stride_yh,
    stride_xob, stride_xos, stride_xoh,
    stride_yob, stride_yos, stride_yoh,
    stride_cos, stride_sin, stride_btb,
    batch, nheads, head_dim, seqlen_ro, seqlen_new, capacity, cache_rows, n_cols, rotary_need,
    rec_sticky,
    ROTARY_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    TO_CACHE: tl.constexpr,
    CHECK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_ROTARY: tl.constexpr,
    HAS_Y: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    PAGED: tl.constexpr,
    HAS_ERR: tl.constexpr,
    HAS_REC: tl.constexpr,
):
    """Program ``(t, b, head block)``: rotate ``X[b, t]`` and store it; copy ``Y[b, t]`` alongside.

    Position of token ``t`` of row ``b``: ``pos = SEQLENS[b] + t`` (``SEQLENS[b]`` when not
    ``PER_TOKEN``).  With ``f = ROTARY_DIM / 2`` frequencies, ``c = COS[pos, i]``,
    ``s = SIN[pos, i]``::

        interleaved (pairs 2i, 2i+1):  x'[2i]   = x[2i] c - x[2i+1] s
                                       x'[2i+1] = x[2i+1] c + x[2i] s
        GPT-NeoX (halves i, i+f):      x'[i]    = x[i] c - x[i+f] s
                                       x'[i+f]  = x[i+f] c + x[i] s

    channels ``>= ROTARY_DIM`` are copied.  ``TO_CACHE``: the destination is cache position
    ``SEQLENS[b] + t`` of cache row ``BATCH_IDX[b]`` (or ``b``), through the block table when
    ``PAGED``; otherwise ``XO[b, t]`` with its own strides.

    Nothing is written outside the cache, whatever the index tensors hold: positions outside
    ``[0, capacity)``, cache rows and pages outside ``[0, cache_rows)`` are not written, and
    positions outside ``[0, seqlen_ro)`` are not rotated.  With ``TO_CACHE``, nothing at all is
    written when the call has a bad index: ``CHECK``, every program decides the call's verdict
    itself (:func:`_index_error`, the same for all) and program ``(0, 0, 0)`` publishes it
    (:func:`_record`); otherwise, with ``ERR``, the verdict :func:`_check_kernel` left there.
    """
    i_t = tl.program_id(0)
    i_b = tl.program_id(1)
    i_hb = tl.program_id(2)

    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    o_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_h = o_h < nheads  # [BLOCK_H]
    m_d = o_d < head_dim  # [BLOCK_D]
    m_hd = m_h[:, None] & m_d[None, :]  # [BLOCK_H, BLOCK_D]

    cache_len = tl.load(SEQLENS + i_b)
    p_x = X + i_b.to(tl.int64) * stride_xb + i_t * stride_xs + o_h[:, None] * stride_xh  # [BLOCK_H, 1]
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
            m_first = o_d < ROTARY_DIM // 2  # [BLOCK_D]
            o_pair = tl.where(m_first, o_d + ROTARY_DIM // 2, o_d - ROTARY_DIM // 2)  # [BLOCK_D]
            o_freq = tl.where(m_first, o_d, o_d - ROTARY_DIM // 2)  # [BLOCK_D]
            b_sign = tl.where(m_first, -1.0, 1.0)  # [BLOCK_D]
        m_cs = m_rot & (pos >= 0) & (pos < seqlen_ro)  # [BLOCK_D]
        # cos = 1, sin = 0 outside the rotary channels leaves those channels unchanged
        b_cos = tl.load(COS + pos * stride_cos + o_freq, mask=m_cs, other=1.0).to(tl.float32)  # [BLOCK_D]
        b_sin = tl.load(SIN + pos * stride_sin + o_freq, mask=m_cs, other=0.0).to(tl.float32)  # [BLOCK_D]
        b_xp = tl.load(p_x + o_pair[None, :], mask=m_h[:, None] & m_rot[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
        b_x = b_x * b_cos[None, :] + b_xp.to(tl.float32) * (b_sign * b_sin)[None, :]  # [BLOCK_H, BLOCK_D]

    if TO_CACHE:
        pos_w = cache_len + i_t
        m_pos = (pos_w >= 0) & (pos_w < capacity)
        if CHECK:
            code, index, value = _index_error(SEQLENS, LEFTPAD, BATCH_IDX, BLOCK_TABLE, batch,
                                              stride_btb, n_cols, seqlen_new, capacity,
                                              cache_rows, rotary_need, PAGE_SIZE, BLOCK_B,
                                              BLOCK_C, HAS_LEFTPAD, HAS_BATCH_IDX, PAGED)
            if (i_t == 0) & (i_b == 0) & (i_hb == 0):
                _record(ERR, REC, code, index, value, rec_sticky, HAS_ERR, HAS_REC)
            m_pos = m_pos & (code == 0)
        elif HAS_ERR:
            m_pos = m_pos & (tl.load(ERR) == 0)
        if PAGED:
            page = tl.load(BLOCK_TABLE + i_b.to(tl.int64) * stride_btb + pos_w // PAGE_SIZE,
                           mask=m_pos, other=0).to(tl.int64)
            m_pos = m_pos & (page >= 0) & (page < cache_rows)
            o_xo = page * stride_xob + (pos_w % PAGE_SIZE) * stride_xos
            o_yo = page * stride_yob + (pos_w % PAGE_SIZE) * stride_yos
        else:
            if HAS_BATCH_IDX:
                row = tl.load(BATCH_IDX + i_b).to(tl.int64)
                m_pos = m_pos & (row >= 0) & (row < cache_rows)
            else:
                row = i_b.to(tl.int64)
            o_xo = row * stride_xob + pos_w.to(tl.int64) * stride_xos
            o_yo = row * stride_yob + pos_w.to(tl.int64) * stride_yos
        m_w = m_hd & m_pos  # [BLOCK_H, BLOCK_D]
    else:
        m_w = m_hd  # [BLOCK_H, BLOCK_D]
        o_xo = i_b.to(tl.int64) * stride_xob + i_t * stride_xos
        o_yo = i_b.to(tl.int64) * stride_yob + i_t * stride_yos

    p_xo = XO + o_xo + o_h[:, None] * stride_xoh + o_d[None, :]  # [BLOCK_H, BLOCK_D]
    tl.store(p_xo, b_x.to(XO.dtype.element_ty), mask=m_w)
    if HAS_Y:
        p_y = Y + i_b.to(tl.int64) * stride_yb + i_t * stride_ys + o_h[:, None] * stride_yh + o_d[None, :]  # [BLOCK_H, BLOCK_D]
        b_y = tl.load(p_y, mask=m_hd, other=0.0)  # [BLOCK_H, BLOCK_D]
        p_yo = YO + o_yo + o_h[:, None] * stride_yoh + o_d[None, :]  # [BLOCK_H, BLOCK_D]
        tl.store(p_yo, b_y.to(YO.dtype.element_ty), mask=m_w)


# --------------------------------------------------------------------------------------------
# split-KV attention
# --------------------------------------------------------------------------------------------
@triton.heuristics(SPLIT_FLAGS)
@triton.jit(do_not_specialize=["rec_sticky"])
def _split_kv_kernel(
    Q, K, V, O, LSE, SEQLENS, LEFTPAD, BATCH_IDX, BLOCK_TABLE, ALIBI, TREE, ERR, REC,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_osplit, stride_ob, stride_os, stride_oh,
    stride_lsplit, stride_lb, stride_lh,
    stride_btb, stride_ab, stride_tb, stride_tq,
    batch, seqlen_q, seqlen_new, nheads_k, capacity, head_dim, cache_rows, n_cols, rec_sticky,
    softmax_scale, softcap, window_left, window_right, n_splits,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CHECK: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
    PAGED: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_TREE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_ERR: tl.constexpr,
    HAS_REC: tl.constexpr,
):
    """One split of FlashDecoding for one (batch row, KV head, block of query rows).

    Rows of the program pack ``(token t, head-in-group g)`` as ``r = t * GROUP + g``, so the
    ``GROUP`` query heads sharing KV head ``hk`` (heads ``hk * GROUP + g``) and all query tokens
    reuse each K/V tile loaded from HBM.

    Keys of row ``b``: cache positions ``[start, end)`` with ``start = LEFTPAD[b]`` and
    ``end = SEQLENS[b] + seqlen_new``; ``n = end - start`` keys, key ``j = pos - start``.  Query
    ``t`` (of ``sq``) sees ``j`` when, with ``shift = n - sq`` (bottom-right alignment),
    ``j >= t + shift - window_left`` (``HAS_LEFT``), ``j <= t + shift + window_right``
    (``HAS_RIGHT``) and, with a tree mask, ``j < n - sq or TREE[b, t, j - (n - sq)]``.

    Scores ``s = softcap tanh(scale q.k / softcap) - slope_h |t + shift - j|``; the program
    streams its tiles of keys with the online softmax in base 2 (``s`` pre-multiplied by
    ``log2 e``)::

        m'   = max(m, max_j s_j)
        l'   = l 2^(m - m') + sum_j 2^(s_j - m')
        acc' = acc 2^(m - m') + sum_j 2^(s_j - m') v_j

    and stores ``o = acc / l`` and ``lse = (m + log2 l) ln 2`` (natural log; ``-inf`` and
    ``o = 0`` when it saw no key).  The split owns tiles ``[lo + i per, lo + (i + 1) per)`` of
    the ``BLOCK_N``-aligned tiles covering the keys any of its rows can see.

    Bad index values: ``HAS_ERR``, every row is NaN when ``ERR[0]`` (the append's verdict) is
    set.  ``CHECK`` (no append): a row is NaN when its own length, leftpad or cache row is bad
    or a page it reads is; and with ``REC`` one extra program (the last) computes nothing but
    checks the whole call and writes the record, alongside the attention.
    """
    # a 1-D grid, (row, KV head) fastest, then split, then query block; with REC one more
    # program at the end checks the call (one program, not a row of them: at batch 1 an extra
    # row of programs would no longer fit the GPU in one wave)
    pid = tl.program_id(0)
    n_bh = batch * nheads_k
    n_work = n_bh * n_splits * tl.cdiv(seqlen_q * GROUP, BLOCK_M)
    if HAS_REC:
        if pid == n_work:
            code, index, value = _index_error(SEQLENS, LEFTPAD, BATCH_IDX, BLOCK_TABLE, batch,
                                              stride_btb, n_cols, seqlen_new, capacity,
                                              cache_rows, NO_ROTARY, PAGE_SIZE, BLOCK_B, BLOCK_C,
                                              HAS_LEFTPAD, HAS_BATCH_IDX, PAGED)
            _record(ERR, REC, code, index, value, rec_sticky, False, True)
        # the checking program attends to nothing: it stands in for the last worker, with an
        # empty key range and every store masked off
        worker = pid < n_work
        pid = tl.minimum(pid, n_work - 1)
    i_bh = pid % n_bh
    i_split = (pid // n_bh) % n_splits
    i_m = pid // (n_bh * n_splits)
    i_b = i_bh // nheads_k
    i_hk = i_bh % nheads_k
    i_b64 = i_b.to(tl.int64)
    if HAS_ERR:
        err = tl.load(ERR)  # read early, used at the end

    # Guards: whatever the index tensors hold, no key outside the cache is read (lengths and
    # leftpad are clamped to [0, capacity], cache rows and pages to the pool).
    len_in = tl.load(SEQLENS + i_b)
    cache_len = tl.maximum(len_in, 0)
    end = tl.minimum(cache_len + seqlen_new, capacity)
    if HAS_LEFTPAD:
        pad_in = tl.load(LEFTPAD + i_b)
        start = tl.minimum(tl.maximum(pad_in, 0), end)
    else:
        start = 0
    n_keys = end - start
    shift = n_keys - seqlen_q
    if CHECK:
        row_bad = (len_in < 0) | (len_in > capacity - seqlen_new)
        if HAS_LEFTPAD:
            row_bad = row_bad | (pad_in < 0) | (pad_in > len_in)
        n_bad_pages = tl.full([], 0, tl.int32)

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] packed (token, head-in-group) rows
    o_t = o_m // GROUP  # [BLOCK_M] query token
    o_h = i_hk * GROUP + o_m % GROUP  # [BLOCK_M] query head
    m_m = o_t < seqlen_q  # [BLOCK_M]
    if HAS_REC:
        m_m = m_m & worker  # [BLOCK_M]
    o_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_d = o_d < head_dim  # [BLOCK_D]

    # keys any row of this program can see (relative indices), narrowed by the window
    lo = 0
    hi = n_keys
    if HAS_LEFT:
        t_first = (i_m * BLOCK_M) // GROUP
        lo = tl.maximum(t_first + shift - window_left, 0)
    if HAS_RIGHT:
        t_last = tl.minimum((i_m * BLOCK_M + BLOCK_M - 1) // GROUP, seqlen_q - 1)
        hi = tl.minimum(t_last + shift + window_right + 1, n_keys)
    kv_lo = start + lo
    kv_hi = tl.maximum(start + hi, kv_lo)
    tile_lo = kv_lo // BLOCK_N
    tile_hi = (kv_hi + BLOCK_N - 1) // BLOCK_N
    per_split = (tile_hi - tile_lo + n_splits - 1) // n_splits
    i_lo = tile_lo + i_split * per_split
    i_hi = tl.minimum(i_lo + per_split, tile_hi)
    if HAS_REC:
        i_hi = tl.where(worker, i_hi, i_lo)

    p_q = Q + i_b64 * stride_qb + o_t[:, None] * stride_qs + o_h[:, None] * stride_qh + o_d[None, :]  # [BLOCK_M, BLOCK_D]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    if HAS_ALIBI:
        b_slope = tl.load(ALIBI + i_b64 * stride_ab + o_h, mask=m_m, other=0.0).to(tl.float32)  # [BLOCK_M]
    if PAGED:
        p_bt = BLOCK_TABLE + i_b64 * stride_btb  # pages are looked up in the loop
    else:
        if HAS_BATCH_IDX:
            row_in = tl.load(BATCH_IDX + i_b).to(tl.int64)
            cache_row = tl.minimum(tl.maximum(row_in, 0), cache_rows - 1)
            if CHECK:
                row_bad = row_bad | (row_in < 0) | (row_in >= cache_rows)
        else:
            cache_row = i_b64
        o_k_row = cache_row * stride_kb
        o_v_row = cache_row * stride_vb
    o_kh = i_hk * stride_kh
    o_vh = i_hk * stride_vh

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BLOCK_M] running max (base 2)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M] running sum
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # [BLOCK_M, BLOCK_D]

    for i_tile in range(i_lo, i_hi):
        o_n = i_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] absolute cache positions
        m_n = (o_n >= kv_lo) & (o_n < kv_hi)  # [BLOCK_N]
        if PAGED:
            if PAGE_SIZE % BLOCK_N == 0:
                # the tile lies in one page: one scalar lookup, and addresses as regular as a
                # contiguous cache's, so the pipeliner runs the K/V loads ahead as it does there.
                # The page holds at least one key the row can see: its entry is one the call uses.
                page_in = tl.load(p_bt + (i_tile * BLOCK_N) // PAGE_SIZE).to(tl.int64)
                page = tl.minimum(tl.maximum(page_in, 0), cache_rows - 1)
                if CHECK:
                    n_bad_pages += ((page_in < 0) | (page_in >= cache_rows)).to(tl.int32)
                o_in = (i_tile * BLOCK_N) % PAGE_SIZE + tl.arange(0, BLOCK_N)  # [BLOCK_N]
                o_k = page * stride_kb + o_in * stride_ks  # [BLOCK_N]
                o_v = page * stride_vb + o_in * stride_vs  # [BLOCK_N]
            else:
                b_page_in = tl.load(p_bt + o_n // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)  # [BLOCK_N]
                b_page = tl.minimum(tl.maximum(b_page_in, 0), cache_rows - 1)  # [BLOCK_N]
                if CHECK:
                    m_bad = m_n & ((b_page_in < 0) | (b_page_in >= cache_rows))  # [BLOCK_N]
                    n_bad_pages += tl.sum(m_bad.to(tl.int32), 0)
                o_k = b_page * stride_kb + (o_n % PAGE_SIZE) * stride_ks  # [BLOCK_N]
                o_v = b_page * stride_vb + (o_n % PAGE_SIZE) * stride_vs  # [BLOCK_N]
        else:
            o_k = o_k_row + o_n.to(tl.int64) * stride_ks  # [BLOCK_N]
            o_v = o_v_row + o_n.to(tl.int64) * stride_vs  # [BLOCK_N]
        m_nd = m_n[:, None] & m_d[None, :]  # [BLOCK_N, BLOCK_D]
        b_k = tl.load(K + o_k[:, None] + o_kh + o_d[None, :], mask=m_nd, other=0.0)  # [BLOCK_N, BLOCK_D]

        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * softmax_scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            b_s = softcap * tanh(b_s / softcap)  # [BLOCK_M, BLOCK_N]
        o_j = o_n - start  # [BLOCK_N] key index within the row
        if HAS_ALIBI:
            b_dist = tl.abs(o_t[:, None] + shift - o_j[None, :]).to(tl.float32)  # [BLOCK_M, BLOCK_N]
            b_s = b_s - b_slope[:, None] * b_dist  # [BLOCK_M, BLOCK_N]
        m_vis = m_m[:, None] & m_n[None, :]  # [BLOCK_M, BLOCK_N]
        if HAS_LEFT or HAS_RIGHT:
            m_vis = m_vis & visible(o_t, o_j, n_keys, shift, window_left, window_right,
                                    HAS_LEFT, HAS_RIGHT)  # [BLOCK_M, BLOCK_N]
        if HAS_TREE:
            o_c = o_j - (n_keys - seqlen_q)  # [BLOCK_N] tree column; < 0 for older cache keys
            m_c = (o_c >= 0) & m_n  # [BLOCK_N]
            p_tree = TREE + i_b64 * stride_tb + o_t[:, None] * stride_tq + o_c[None, :]  # [BLOCK_M, BLOCK_N]
            b_tree = tl.load(p_tree, mask=m_m[:, None] & m_c[None, :], other=0)  # [BLOCK_M, BLOCK_N]
            m_vis = m_vis & ((o_c[None, :] < 0) | (b_tree != 0))  # [BLOCK_M, BLOCK_N]
        b_s = tl.where(m_vis, b_s * LOG2E, float("-inf"))  # [BLOCK_M, BLOCK_N]

        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))  # [BLOCK_M]
        # a row that has seen nothing yet keeps max -inf; subtract 0 so exp2 gives 0, not nan
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # [BLOCK_M]
        b_p = tl.exp2(b_s - b_m_use[:, None])  # [BLOCK_M, BLOCK_N]
        b_alpha = tl.exp2(b_m - b_m_use)  # [BLOCK_M]
        b_l = b_l * b_alpha + tl.sum(b_p, 1)  # [BLOCK_M]
        b_v = tl.load(V + o_v[:, None] + o_vh + o_d[None, :], mask=m_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_D]
        b_m = b_m_new  # [BLOCK_M]

    m_seen = b_l > 0.0  # [BLOCK_M]
    b_l_safe = tl.where(m_seen, b_l, 1.0)  # [BLOCK_M]
    b_o = b_acc / b_l_safe[:, None]  # [BLOCK_M, BLOCK_D] zero where nothing was seen
    b_lse = tl.where(m_seen, (b_m + tl.log2(b_l_safe)) * LN2, float("-inf"))  # [BLOCK_M]
    if HAS_ERR:
        b_o = tl.where(err != 0, float("nan"), b_o)  # [BLOCK_M, BLOCK_D]
        b_lse = tl.where(err != 0, float("nan"), b_lse)  # [BLOCK_M]
    elif CHECK:
        bad = row_bad | (n_bad_pages > 0)
        b_o = tl.where(bad, float("nan"), b_o)  # [BLOCK_M, BLOCK_D]
        b_lse = tl.where(bad, float("nan"), b_lse)  # [BLOCK_M]

    p_o = (O + i_split * stride_osplit + i_b64 * stride_ob + o_t[:, None] * stride_os
           + o_h[:, None] * stride_oh + o_d[None, :])  # [BLOCK_M, BLOCK_D]
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
    p_lse = LSE + i_split * stride_lsplit + i_b64 * stride_lb + o_h * stride_lh + o_t  # [BLOCK_M]
    tl.store(p_lse, b_lse, mask=m_m)


# --------------------------------------------------------------------------------------------
# combine
# --------------------------------------------------------------------------------------------
@triton.jit
def _combine_kernel(
    O_PART, LSE_PART, O, LSE,
    stride_ops, stride_opb, stride_opm, stride_oph,
    stride_lps, stride_lpb, stride_lph,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    seqlen_q, nheads, n_splits, head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program ``(b, t, h)``: merge the ``n_splits`` partial results of one query row.

    Partials ``(o_i, lse_i)`` with ``o_i`` normalised over its own keys::

        lse = log sum_i exp(lse_i)
        o   = sum_i exp(lse_i - lse) o_i

    computed with ``M = max_i lse_i`` (``0`` when every ``lse_i = -inf``) as
    ``lse = M + log sum_i exp(lse_i - M)``.  A row whose every split saw nothing gets
    ``lse = -inf`` and ``o = 0``; an empty split contributes nothing even if its ``o_i`` were
    garbage; a NaN ``lse_i`` (a split that read a bad index) makes the row NaN.
    """
    i_row = tl.program_id(0)
    i_h = i_row % nheads
    i_bt = i_row // nheads
    i_t = i_bt % seqlen_q
    i_b = (i_bt // seqlen_q).to(tl.int64)

    o_s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    o_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_s = o_s < n_splits  # [BLOCK_S]
    m_d = o_d < head_dim  # [BLOCK_D]

    p_lp = LSE_PART + o_s * stride_lps + i_b * stride_lpb + i_h * stride_lph + i_t  # [BLOCK_S]
    b_lse_i = tl.load(p_lp, mask=m_s, other=float("-inf"))  # [BLOCK_S]
    has_nan = tl.max((b_lse_i != b_lse_i).to(tl.int32), 0) > 0
    lse_max = tl.max(b_lse_i, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    b_w = tl.exp(b_lse_i - lse_max)  # [BLOCK_S] 0 for empty splits
    w_sum = tl.sum(b_w, 0)
    seen = w_sum > 0.0
    b_w = b_w / tl.where(seen, w_sum, 1.0)  # [BLOCK_S]
    lse = tl.where(seen, lse_max + tl.log(tl.where(seen, w_sum, 1.0)), float("-inf"))

    p_op = (O_PART + o_s[:, None] * stride_ops + i_b * stride_opb + i_t * stride_opm
            + i_h * stride_oph + o_d[None, :])  # [BLOCK_S, BLOCK_D]
    b_op = tl.load(p_op, mask=m_s[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_D]
    b_o = tl.sum(tl.where(b_w[:, None] > 0.0, b_w[:, None] * b_op, 0.0), 0)  # [BLOCK_D]
    b_o = tl.where(has_nan, float("nan"), b_o)  # [BLOCK_D]
    lse = tl.where(has_nan, float("nan"), lse)

    p_o = O + i_b * stride_ob + i_t * stride_om + i_h * stride_oh + o_d  # [BLOCK_D]
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_d)
    tl.store(LSE + i_b * stride_lb + i_h * stride_lh + i_t, lse)
