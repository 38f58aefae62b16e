"""Jit helpers shared by the forward and backward kernels: where a program works, visibility
ranges, score modifications, and the tile loads of the inner loops.

A key ``j`` is visible to query ``i`` (both local to one sequence of ``sq`` queries and ``sk``
keys) when ``j < sk`` and, with ``shift = sk - sq`` (bottom-right) or ``0`` (top-left) in a
plain call (a partial call's is in :func:`frame`),

    i + shift - window_left <= j <= i + shift + window_right

where a missing bound (``HAS_LEFT``/``HAS_RIGHT`` false) is unbounded.  Causal attention is
``window_right = 0``.  Tiles are classified into *masked* tiles (some element may be invisible;
the element-wise predicate is applied) and *full* tiles (every element visible; no predicate,
no bound checks), so the common path pays for nothing.

Optional element-wise features, each behind a constexpr flag of the kernels:

* an attention mask / additive bias ``(B|1, H|1, Sq|1, Sk|1)`` read with its broadcast strides
  (stride 0 on broadcast dims), tile by tile (:func:`apply_bias`);
* dropout: element ``(b, h, i, j)`` is kept iff ``tl.rand(seed, counter) >= p`` with the int64
  counter ``((b * H + h) * seqlen_q + i) * seqlen_k + j`` (:func:`dropout_keep`; the same rule
  as ``flashtile.rng``);
* partial calls (dense): runtime offsets and global lengths (:func:`frame`,
  :func:`dropout_row0`) make the masks, ALiBi distances and dropout counters those of the
  global positions, so blocks of one long sequence computed apart agree with the whole call;
* block sparsity: the kernels walk host-built lists of the nonzero mask blocks, those visible
  throughout first (no predicate), then those cut by a bound (``sparse_index.block_lists``),
  so zero blocks are never loaded.

Every inner loop runs as three stages over ``[a0, a1)`` masked, ``[a1, a2)`` full (no
predicate, no bound checks) and ``[a2, a3)`` masked: ``(lo, full_lo, full_hi, hi)`` of
:func:`key_range` / :func:`query_range` for a dense range of tiles, ``(0, 0, t_full, t_all)``
tile numbers of the block list for a sparse one (its full blocks come first, then those cut by
a bound; nothing is cut by the left bound alone before them).
"""
import triton
import triton.language as tl

# Constexprs so kernels may read them as globals: scores run in base 2 (``exp2``/``log2``), the
# interface speaks natural logs.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# The partial-attention offsets and totals take any value per call (context-parallel shards,
# odd cut points): not specialised on divisibility or == 1, so a new offset never compiles a
# new variant.
PARTIAL_ARGS = ["q_offset", "k_offset", "seqlen_q_total", "seqlen_k_total", "batch_offset",
                "head_offset", "nheads_total"]

# Optional features of the attention kernels, each derived from whether its argument is None
# (or, for EVEN_D, whether the head dim is a power of two): one kernel source, a constexpr flag
# per feature, and a disabled feature compiles to nothing.
FEATURE_FLAGS = {
    "IS_VARLEN": lambda a: a["CU_Q"] is not None,
    "HAS_ALIBI": lambda a: a["ALIBI"] is not None,
    "EVEN_D": lambda a: a["HEAD_DIM"] == a["BLOCK_D"],
    "HAS_BIAS": lambda a: a["BIAS"] is not None,
    "BIAS_BOOL": lambda a: a["BIAS"] is not None and not a["BIAS"].dtype.is_floating_point,
    "HAS_DROPOUT": lambda a: a["RNG"] is not None,
    "SPARSE": lambda a: a["BS_IDX"] is not None,
}


@triton.jit
def frame(sq, sk, q_offset, k_offset, seqlen_q_total, seqlen_k_total, IS_VARLEN: tl.constexpr,
          BOTTOM_RIGHT: tl.constexpr):
    """``(shift, alibi_shift)`` of a call whose local query ``i`` / key ``j`` are the global
    ``q_offset + i`` / ``k_offset + j`` of a sequence of ``seqlen_*_total`` queries / keys (a
    partial call; a plain call has offsets 0 and totals equal to its lengths): key ``j`` is on
    the diagonal of query ``i`` when ``j = i + shift``, and ALiBi's distance is
    ``|i + alibi_shift - j|`` (always bottom-right).  Varlen calls are never partial: their
    diagonal is each sequence's ``sk - sq``."""
    if IS_VARLEN:
        d = sk - sq
    else:
        d = seqlen_k_total - seqlen_q_total
    alibi_shift = d + (q_offset - k_offset) + sk * 0
    if BOTTOM_RIGHT:
        shift = alibi_shift
    else:
        shift = (q_offset - k_offset) + sk * 0
    return shift, alibi_shift


@triton.jit
def sequence(CU_Q, CU_K, i_b, seqlen_q, seqlen_k, q_offset, k_offset, seqlen_q_total,
             seqlen_k_total, IS_VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr):
    """``(q_start, sq, k_start, sk, shift, alibi_shift)`` of batch entry ``i_b``: where its rows
    start in a packed varlen tensor (0 when dense), its lengths, the diagonal's shift and
    ALiBi's (:func:`frame`)."""
    if IS_VARLEN:
        q_start = tl.load(CU_Q + i_b)
        sq = tl.load(CU_Q + i_b + 1) - q_start
        k_start = tl.load(CU_K + i_b)
        sk = tl.load(CU_K + i_b + 1) - k_start
    else:
        q_start = seqlen_q * 0
        sq = seqlen_q
        k_start = seqlen_k * 0
        sk = seqlen_k
    shift, alibi_shift = frame(sq, sk, q_offset, k_offset, seqlen_q_total, seqlen_k_total,
                               IS_VARLEN=IS_VARLEN, BOTTOM_RIGHT=BOTTOM_RIGHT)
    return q_start, sq, k_start, sk, shift, alibi_shift


@triton.jit
def query_block(CU_Q, CU_K, seqlen_q, seqlen_k, H, GROUP, q_offset, k_offset, seqlen_q_total,
                seqlen_k_total, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
                BOTTOM_RIGHT: tl.constexpr):
    """Where a program of a query-tile grid ``(cdiv(seqlen_q, BLOCK_M), B * H)`` works:
    ``(i_b, i_h, i_hk, q_start, sq, k_start, sk, shift, alibi_shift, m_first, m_last)``, its
    batch entry, query head and key/value head, the entry's :func:`sequence`, and its rows
    ``[m_first, m_last]``.  The caller returns at once when ``m_first >= sq`` (a tile past the
    end of a shorter varlen sequence).

    The heaviest causal tiles (the last query rows) are scheduled first, so the tail of the
    grid is made of cheap programs.
    """
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    i_hk = i_h // GROUP
    q_start, sq, k_start, sk, shift, alibi_shift = sequence(
        CU_Q, CU_K, i_b, seqlen_q, seqlen_k, q_offset, k_offset, seqlen_q_total, seqlen_k_total,
        IS_VARLEN=IS_VARLEN, BOTTOM_RIGHT=BOTTOM_RIGHT)
    m_first = i_m * BLOCK_M
    m_last = tl.minimum(m_first + BLOCK_M, sq) - 1
    return i_b, i_h, i_hk, q_start, sq, k_start, sk, shift, alibi_shift, m_first, m_last


@triton.jit
def rows_ptr(X, i_b, start, i_h, stride_b, stride_row, stride_h):
    """Row 0 of head ``i_h`` of batch entry ``i_b`` (a varlen sequence starts at row ``start``
    of the packed tensor, whose batch stride is 0); the batch and row offsets in int64."""
    return X + i_b.to(tl.int64) * stride_b + start.to(tl.int64) * stride_row + i_h * stride_h


@triton.jit
def tile_ptr(X, i_b, start, i_h, stride_b, stride_row, stride_h, o_rows, o_d):
    """Pointers to the rows ``o_rows`` (local to the sequence) of head ``i_h`` of batch entry
    ``i_b``, ``# [BLOCK, BLOCK_D]`` (:func:`rows_ptr`)."""
    return (rows_ptr(X, i_b, start, i_h, stride_b, stride_row, stride_h)
            + o_rows[:, None] * stride_row + o_d[None, :])


@triton.jit
def load_tile(X, i_b, start, i_h, stride_b, stride_row, stride_h, o_rows, o_d, mask):
    """The tile of :func:`tile_ptr` loaded, 0 where ``mask`` is off, ``# [BLOCK, BLOCK_D]``."""
    return tl.load(tile_ptr(X, i_b, start, i_h, stride_b, stride_row, stride_h, o_rows, o_d),
                   mask=mask, other=0.0)


@triton.jit
def head_terms(ALIBI, i_b, i_h, stride_ab, stride_biasb, stride_biash,
               HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``(slope, bias_offset)`` of head ``i_h`` of batch entry ``i_b``: its ALiBi slope
    (:func:`alibi_slope`) and the int64 offset of its ``[Sq, Sk]`` attention-bias plane (0
    without a bias; the caller adds it to ``BIAS``, which may be None)."""
    slope = alibi_slope(ALIBI, i_b, i_h, stride_ab, HAS_ALIBI=HAS_ALIBI)
    bias_offset = 0
    if HAS_BIAS:
        bias_offset = i_b.to(tl.int64) * stride_biasb + i_h.to(tl.int64) * stride_biash
    return slope, bias_offset


@triton.jit
def dropout_rows(RNG, i_b, i_h, o_m, batch_offset, nheads_total, head_offset, seqlen_q_total,
                 q_offset, seqlen_k_total, k_offset, HAS_DROPOUT: tl.constexpr):
    """``(seed, row_base)`` of the query rows ``o_m`` of head ``i_h`` of batch entry ``i_b``:
    the Philox seed and the int64 counters of their local key 0 (:func:`dropout_row_base`),
    ``# [BLOCK_M]``; ``(0, o_m)`` without dropout."""
    seed = 0
    row_base = o_m
    if HAS_DROPOUT:
        seed = tl.load(RNG)
        row_base = dropout_row_base(
            dropout_row0(i_b, batch_offset, nheads_total, i_h, head_offset, seqlen_q_total,
                         q_offset), seqlen_k_total, k_offset, o_m)
    return seed, row_base


@triton.jit
def alibi_slope(ALIBI, i_b, i_h, stride_ab, HAS_ALIBI: tl.constexpr):
    """ALiBi slope of head ``i_h`` of batch entry ``i_b`` in base-2 units (0 without ALiBi)."""
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + i_b * stride_ab + i_h).to(tl.float32) * LOG2E
    return slope


@triton.jit
def block_row(BS_IDX, i_b, i_h, i_row, stride_bsb, stride_bsh, stride_bsr):
    """Row ``i_row`` of the block lists of head ``i_h`` of batch entry ``i_b``:
    ``[n_full, n_part, full blocks..., partial blocks...]`` (``sparse_index.block_lists``)."""
    return BS_IDX + i_b * stride_bsb + i_h * stride_bsh + i_row * stride_bsr


@triton.jit
def load_rows(p, o_rows, n, m_d, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """The ``[BLOCK, BLOCK_D]`` tile at ``p`` of the rows ``o_rows``: in a masked stage rows
    ``>= n`` and the head-dim padding (``~m_d``) read 0; in a full stage every row exists, so
    only a padded head dim (not EVEN_D) needs a mask."""
    if MASKED:
        b_x = tl.load(p, mask=(o_rows[:, None] < n) & m_d[None, :], other=0.0)
    elif EVEN_D:
        b_x = tl.load(p)
    else:
        b_x = tl.load(p, mask=m_d[None, :], other=0.0)
    return b_x


@triton.jit
def step_tiles(it, p_a_base, p_b_base, stride_a, stride_b, o_d, m_d, n, p_list, tiles_per_block,
               bs, BLOCK: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
               SPARSE: tl.constexpr):
    """Step ``it`` of an inner loop that streams two tensors' tiles: the rows ``o_rows`` of the
    step (:func:`tile_start`), ``# [BLOCK]``, and their tiles of both tensors (rows from
    ``p_a_base`` / ``p_b_base``, row strides ``stride_a`` / ``stride_b``; :func:`load_rows`
    against ``n`` rows), ``# [BLOCK, BLOCK_D]`` each."""
    r0 = tile_start(it, p_list, tiles_per_block, bs, BLOCK=BLOCK, SPARSE=SPARSE)
    o_rows = r0 + tl.arange(0, BLOCK)
    p_a = p_a_base + o_rows[:, None] * stride_a + o_d[None, :]  # [BLOCK, BLOCK_D]
    p_b = p_b_base + o_rows[:, None] * stride_b + o_d[None, :]  # [BLOCK, BLOCK_D]
    b_a = load_rows(p_a, o_rows, n, m_d, MASKED=MASKED, EVEN_D=EVEN_D)  # [BLOCK, BLOCK_D]
    b_b = load_rows(p_b, o_rows, n, m_d, MASKED=MASKED, EVEN_D=EVEN_D)  # [BLOCK, BLOCK_D]
    return o_rows, b_a, b_b


@triton.jit
def key_range(m_first, m_last, sk, shift, window_left, window_right,
              BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Key tiles for the query rows ``[m_first, m_last]``.

    Returns ``lo <= full_lo <= full_hi <= hi`` (multiples of BLOCK_N except ``hi``): tiles in
    ``[lo, full_lo)`` and ``[full_hi, hi)`` need the mask, tiles in ``[full_lo, full_hi)`` do not.
    Tiles outside ``[lo, hi)`` hold no visible key for any of the rows and are skipped.
    """
    lo = 0
    hi = sk
    if HAS_LEFT:
        lo = tl.maximum(m_first + shift - window_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(m_last + shift + window_right + 1, sk)
    hi = tl.maximum(hi, lo)
    # A tile is free of the left bound once its first key is visible to the *last* row.
    full_lo = lo
    if HAS_LEFT:
        full_lo = tl.maximum(m_last + shift - window_left, 0)
        full_lo = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    # ... and free of the right bound (and of the sequence end) once its last key is visible
    # to the *first* row.
    full_hi = sk
    if HAS_RIGHT:
        full_hi = tl.minimum(m_first + shift + window_right + 1, sk)
    full_hi = (full_hi // BLOCK_N) * BLOCK_N
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_range(n_first, n_last, sq, sk, shift, window_left, window_right,
                BLOCK_M: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query tiles that see any of the keys ``[n_first, n_last]``; same contract as key_range.

    Row ``i`` sees key ``j`` iff ``j - shift - window_right <= i <= j - shift + window_left``.
    A tile is *full* only if every row is in the sequence, every key of the block is
    (``n_last < sk``) and both bounds hold for the whole block.
    """
    lo = 0
    hi = sq
    if HAS_RIGHT:
        lo = tl.maximum(n_first - shift - window_right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(n_last - shift + window_left + 1, sq)
    hi = tl.maximum(hi, lo)
    full_lo = lo
    if HAS_RIGHT:
        full_lo = tl.maximum(n_last - shift - window_right, 0)
        full_lo = tl.cdiv(full_lo, BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = sq
    if HAS_LEFT:
        full_hi = tl.minimum(n_first - shift + window_left + 1, sq)
    full_hi = (full_hi // BLOCK_M) * BLOCK_M
    # Keys past the end of the sequence exist only in the last key block: no tile is full there.
    full_hi = tl.where(n_last < sk, full_hi, full_lo)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def tile_start(it, p_list, tiles_per_block, bs, BLOCK: tl.constexpr, SPARSE: tl.constexpr):
    """First row of loop step ``it`` of the inner loops: ``it`` itself for a dense range of
    BLOCK-aligned starts, or with SPARSE tile ``it % tiles_per_block`` of the ``it //
    tiles_per_block``-th block of the list ``p_list`` (:func:`block_row`; blocks of ``bs``
    rows)."""
    if SPARSE:
        start = (tl.load(p_list + 2 + it // tiles_per_block) * bs
                 + (it % tiles_per_block) * BLOCK)
    else:
        start = it
    return tl.multiple_of(start, BLOCK)


@triton.jit
def walk(lo, full_lo, full_hi, hi, p_list, bs, BLOCK: tl.constexpr, SPARSE: tl.constexpr):
    """How the three stages of an inner loop walk its tiles of BLOCK rows:
    ``(a0, a1, a2, a3, tiles_per_block)``, stages masked ``[a0, a1)``, full ``[a1, a2)`` and
    masked ``[a2, a3)`` (:func:`stage_range`).

    Dense: the range ``(lo, full_lo, full_hi, hi)`` of :func:`key_range` / :func:`query_range`,
    counted in rows, a tile per step of BLOCK.  SPARSE: tile numbers of the block list
    ``p_list`` (:func:`block_row`; blocks of ``bs`` rows), a tile per step: its full blocks
    (no predicate) first, then those cut by a bound; none is cut by the left bound alone before
    them, so the first masked stage is empty."""
    if SPARSE:
        tpb = bs // BLOCK
        a0 = 0
        a1 = 0
        a2 = tl.load(p_list) * tpb
        a3 = a2 + tl.load(p_list + 1) * tpb
    else:
        tpb = 1
        a0 = lo
        a1 = full_lo
        a2 = full_hi
        a3 = hi
    return a0, a1, a2, a3, tpb


@triton.jit
def key_walk(m_first, m_last, sk, shift, window_left, window_right, p_list, bs_n,
             BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
             SPARSE: tl.constexpr):
    """The three stages over key tiles of the query rows ``[m_first, m_last]``
    (:func:`key_range`, then :func:`walk`; ``p_list`` their block-list row when SPARSE):
    ``(a0, a1, a2, a3, tiles_per_block)``."""
    lo, full_lo, full_hi, hi = key_range(m_first, m_last, sk, shift, window_left, window_right,
                                         BLOCK_N=BLOCK_N, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT)
    return walk(lo, full_lo, full_hi, hi, p_list, bs_n, BLOCK=BLOCK_N, SPARSE=SPARSE)


@triton.jit
def stage_range(STAGE: tl.constexpr, a0, a1, a2, a3):
    """``[start, end)`` of stage ``STAGE`` of an inner loop: 0 masked ``[a0, a1)``, 1 full
    ``[a1, a2)``, 2 masked ``[a2, a3)``."""
    if STAGE == 0:
        start = a0
        end = a1
    elif STAGE == 1:
        start = a1
        end = a2
    else:
        start = a2
        end = a3
    return start, end


@triton.jit
def visible(o_m, o_n, sk, shift, window_left, window_right,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Element-wise visibility predicate, ``# [BLOCK_M, BLOCK_N]``."""
    m_vis = o_n[None, :] < sk
    if HAS_RIGHT:
        m_vis = m_vis & (o_n[None, :] <= o_m[:, None] + (shift + window_right))
    if HAS_LEFT:
        m_vis = m_vis & (o_n[None, :] >= o_m[:, None] + (shift - window_left))
    return m_vis


@triton.jit
def tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): exp2 overflows to inf for large x and gives exactly 1,
    # underflows to 0 for very negative x and gives exactly -1, so no clamping is needed.
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def apply_bias(b_s, p_bias, stride_bm, stride_bn, o_m, o_n, sq, sk, BIAS_BOOL: tl.constexpr):
    """Base-2 scores plus the additive bias (natural-log units), or ``-inf`` where a bool mask
    is False.  Elements outside the sequence read a neutral value (they are masked elsewhere)."""
    m_in = (o_m[:, None] < sq) & (o_n[None, :] < sk)
    p_b = p_bias + o_m[:, None] * stride_bm + o_n[None, :] * stride_bn
    if BIAS_BOOL:
        b_b = tl.load(p_b, mask=m_in, other=1)  # [BLOCK_M, BLOCK_N]
        b_s = tl.where(b_b != 0, b_s, float("-inf"))
    else:
        b_b = tl.load(p_b, mask=m_in, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_N]
        b_s = b_s + b_b * LOG2E
    return b_s


@triton.jit
def score_tile(b_q, b_k, o_m, o_n, sq, sk, alibi_shift, qk_scale, softcap_scale, slope,
               p_bias, stride_bm, stride_bn,
               DOT_PREC: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr):
    """Base-2 scores of one tile before the visibility mask, ``# [BLOCK_M, BLOCK_N]``.

    Without softcap ``qk_scale = scale * log2(e)``; with it ``qk_scale = softcap * log2(e)``
    and ``softcap_scale = scale / softcap``.  ``slope`` is already multiplied by log2(e);
    ALiBi's distance is ``|i + alibi_shift - j|`` (:func:`frame`).
    """
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
    if HAS_SOFTCAP:
        b_s = tanh(b_s * softcap_scale)
    b_s = b_s * qk_scale
    if HAS_ALIBI:
        b_dist = (o_m[:, None] + alibi_shift) - o_n[None, :]  # [BLOCK_M, BLOCK_N]
        b_s = b_s - slope * tl.abs(b_dist).to(tl.float32)
    if HAS_BIAS:
        b_s = apply_bias(b_s, p_bias, stride_bm, stride_bn, o_m, o_n, sq, sk,
                         BIAS_BOOL=BIAS_BOOL)
    return b_s


@triton.jit
def dropout_keep(seed, row_base, o_n, dropout_p):
    """Keep mask ``# [BLOCK_M, BLOCK_N]``; ``row_base`` is the int64 counter of key 0 per row."""
    b_u = tl.rand(seed, row_base[:, None] + o_n[None, :].to(tl.int64))
    return b_u >= dropout_p


@triton.jit
def dropout_row_base(row0, seqlen_k_total, k_offset, o_m):
    """int64 counter of local key 0 for the rows ``o_m``, ``# [BLOCK]``:
    ``(row0 + i) * seqlen_k_total + k_offset`` with the int64
    ``row0 = ((batch_offset + b) * H + h) * seqlen_q_total + q_offset`` (:func:`dropout_row0`)."""
    return (row0 + o_m.to(tl.int64)) * seqlen_k_total + k_offset


@triton.jit
def dropout_row0(i_b, batch_offset, nheads_total, i_h, head_offset, seqlen_q_total, q_offset):
    """int64 dropout counter row of local query 0 of batch entry ``i_b``, head ``i_h``."""
    return (((i_b + batch_offset) * nheads_total + head_offset + i_h).to(tl.int64)
            * seqlen_q_total + q_offset)
