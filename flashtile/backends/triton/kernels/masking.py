"""Visibility ranges and score modifications shared by the forward and backward kernels.

A key ``j`` is visible to query ``i`` (both local to one sequence of ``sq`` queries and ``sk``
keys) when ``j < sk`` and, with ``shift = sk - sq`` (bottom-right) or ``0`` (top-left),

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
  throughout first (no predicate), then those cut by a bound (``launch_common.block_lists``),
  so zero blocks are never loaded.
"""
import triton
import triton.language as tl

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
def sequence(CU_Q, CU_K, i_b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr,
             BOTTOM_RIGHT: tl.constexpr):
    """``(q_start, sq, k_start, sk, shift)`` of batch entry ``i_b``: where its rows start in a
    packed varlen tensor (0 when dense), its lengths, and the diagonal's shift."""
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
    if BOTTOM_RIGHT:
        shift = sk - sq
    else:
        shift = sk * 0
    return q_start, sq, k_start, sk, shift


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


# A constexpr so kernels may read it as a global.
LOG2E = tl.constexpr(1.4426950408889634)


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
    tiles_per_block``-th block of the list ``p_list`` (blocks of ``bs`` rows)."""
    if SPARSE:
        start = tl.load(p_list + it // tiles_per_block) * bs + (it % tiles_per_block) * BLOCK
    else:
        start = it
    return tl.multiple_of(start, BLOCK)


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
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


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
