"""Forward kernel: one program owns BLOCK_M query rows of one head and streams key/value tiles.

For each visible key tile ``j`` (scores in base 2, ``log2(e)`` folded into the scale)::

    s_j   = log2(e) * score(q, k_j)                      # [BLOCK_M, BLOCK_N]
    m_new = max(m, rowmax(s_j))
    p_j   = exp2(s_j - m_new)
    l     = l * exp2(m - m_new) + rowsum(p_j)
    acc   = acc * exp2(m - m_new) + p_j @ v_j
    m     = m_new

and once at the end ``out = acc / l`` and ``lse = ln(2) * (m + log2(l))`` (natural log, ``-inf``
for a row that saw no key, whose output is 0).  ``score`` is ``scale * q.k``, optionally
soft-capped (``c * tanh(.../c)``) and ALiBi-biased (``- slope * |i + sk - sq - j|`` in a plain
call, ``common.frame`` for a partial one); invisible keys score ``-inf`` *before* the row max
so they contribute exactly 0.

Optional features (constexpr flags, derived from which optional pointers are None):

* ``HAS_BIAS``: a bool mask (``BIAS_BOOL``; False scores ``-inf``) or an additive float bias,
  streamed tile by tile with its broadcast strides, applied to every tile (not only the masked
  ones), so rows may become empty anywhere and the ``-inf`` row-max guard runs on every tile.
* ``HAS_DROPOUT``: ``p_j`` is zeroed where the Philox keep mask is False *after* it entered
  ``l`` (dropout acts on the normalised probabilities; lse is unaffected), and the output is
  scaled by ``1 / (1 - p)``.
* ``SPARSE``: the key tiles come from the list of nonzero mask blocks of this query block
  (``BS_IDX[b, h, row] = [n_full, n_part, full blocks..., partial blocks...]``): one flat
  unmasked loop over the tiles of the blocks that are visible throughout, one masked loop over
  those cut by the causal/window bounds or the sequence ends, so zero blocks are never loaded.
* ``PAGED`` (varlen only): ``K``/``V`` are page pools ``(num_blocks, PAGE_SIZE, Hk, D)`` and key
  ``j`` of sequence ``b`` lives in page ``BLOCK_TABLE[b, j // PAGE_SIZE]`` at slot
  ``j % PAGE_SIZE``; every key row address of a tile is looked up in the table (see
  ``_kv_rows``).  Positions stay local to the sequence, so masks, ALiBi and the dropout
  counter are those of the same call on contiguous keys.
"""
import triton
import triton.language as tl

from .common import (FEATURE_FLAGS, LN2, PARTIAL_ARGS, block_row, dropout_keep, dropout_rows,
                     head_terms, key_walk, load_rows, load_tile, query_block, rows_ptr,
                     score_tile, stage_range, tile_ptr, tile_start, visible)


# The forward kernel's flags: the shared ones plus paged keys/values, which only the forward
# reads in place (the backward runs on keys/values gathered from the pages).
FWD_FEATURE_FLAGS = {
    **FEATURE_FLAGS,
    "PAGED": lambda a: a["BLOCK_TABLE"] is not None,
}


@triton.jit
def _kv_rows(p_bt, n0, o_n, sk, stride_kpage, stride_kn, stride_vpage, stride_vn,
             MASKED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Offsets of the key rows ``o_n`` (local positions) in the K and V page pools, two int64
    ``[BLOCK_N]`` vectors.

    The page is looked up per key rather than per tile: a tile of BLOCK_N keys spans
    ``BLOCK_N / PAGE_SIZE`` pages when pages are smaller than the tile, and this keeps the tile
    sizes tuned for contiguous keys (restricting BLOCK_N to the page size would force 16-key
    tiles for 16-slot pages).  It costs one small int32 gather per tile next to a
    ``BLOCK_N x HEAD_DIM`` load, and each key row stays contiguous.

    When the tile size divides the page size the tile lies in one page: one scalar lookup of
    its page (the tile starts ``n0 < sk``, so that table entry is valid) and consecutive rows:
    the pipeliner can run a scalar lookup ahead of the tile loads, not a vector gather
    (docs/dev/tuning-log.md has the measurement).
    """
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(p_bt + n0 // PAGE_SIZE).to(tl.int64)
        o_slot = o_n % PAGE_SIZE  # [BLOCK_N] consecutive
        return page * stride_kpage + o_slot * stride_kn, page * stride_vpage + o_slot * stride_vn
    if MASKED:
        # keys past the sequence end may lie past the row's valid table entries: not read
        b_page = tl.load(p_bt + o_n // PAGE_SIZE, mask=o_n < sk, other=0)  # [BLOCK_N]
    else:
        b_page = tl.load(p_bt + o_n // PAGE_SIZE)  # [BLOCK_N]
    b_page = b_page.to(tl.int64)  # page * stride_page may pass 2^31 in a large pool
    o_slot = o_n % PAGE_SIZE  # [BLOCK_N]
    return b_page * stride_kpage + o_slot * stride_kn, b_page * stride_vpage + o_slot * stride_vn


@triton.jit
def _fwd_inner(b_acc, b_l, b_m, b_q, p_k_base, p_v_base, stride_kn, stride_vn,
               o_m, o_d, n_start, n_end, sq, sk, shift, alibi_shift, window_left, window_right,
               qk_scale, softcap_scale, slope, p_bias, stride_bm, stride_bn,
               seed, row_base, dropout_p, p_bt, stride_kpage, stride_vpage,
               p_list, tiles_per_block, bs_n,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, SPARSE: tl.constexpr,
               I_STEP: tl.constexpr):
    """Online-softmax update over key tiles; MASKED applies visibility.

    Dense: the tiles starting at ``n_start, n_start + BLOCK_N, ... < n_end``.  SPARSE: tiles
    number ``n_start .. n_end - 1`` of the block list ``p_list`` (``tiles_per_block`` tiles
    of BLOCK_N keys per mask block of ``bs_n`` keys), one flat loop so that the software
    pipeliner overlaps the loads of consecutive tiles across mask blocks too.
    """
    m_d = o_d < HEAD_DIM
    for it in range(n_start, n_end, I_STEP):
        n0 = tile_start(it, p_list, tiles_per_block, bs_n, BLOCK=BLOCK_N, SPARSE=SPARSE)
        o_n = n0 + tl.arange(0, BLOCK_N)
        if PAGED:
            o_krow, o_vrow = _kv_rows(p_bt, n0, o_n, sk, stride_kpage, stride_kn, stride_vpage,
                                      stride_vn, MASKED=MASKED, PAGE_SIZE=PAGE_SIZE,
                                      BLOCK_N=BLOCK_N)  # [BLOCK_N] each
            p_k = p_k_base + o_krow[:, None] + o_d[None, :]  # [BLOCK_N, BLOCK_D]
            p_v = p_v_base + o_vrow[:, None] + o_d[None, :]  # [BLOCK_N, BLOCK_D]
        else:
            p_k = p_k_base + o_n[:, None] * stride_kn + o_d[None, :]  # [BLOCK_N, BLOCK_D]
            p_v = p_v_base + o_n[:, None] * stride_vn + o_d[None, :]  # [BLOCK_N, BLOCK_D]
        b_k = load_rows(p_k, o_n, sk, m_d, MASKED=MASKED, EVEN_D=EVEN_D)  # [BLOCK_N, BLOCK_D]
        b_s = score_tile(b_q, b_k, o_m, o_n, sq, sk, alibi_shift, qk_scale, softcap_scale, slope,
                         p_bias, stride_bm, stride_bn, DOT_PREC=DOT_PREC,
                         HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI, HAS_BIAS=HAS_BIAS,
                         BIAS_BOOL=BIAS_BOOL)  # [BLOCK_M, BLOCK_N]
        if MASKED:
            m_vis = visible(o_m, o_n, sk, shift, window_left, window_right,
                            HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT)  # [BLOCK_M, BLOCK_N]
            b_s = tl.where(m_vis, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))  # [BLOCK_M]
        if MASKED or HAS_BIAS:
            # A row that has seen no visible key yet has max -inf; subtracting it would give
            # exp2(-inf + inf) = NaN.  Clamping it to 0 makes its p and alpha exactly 0.
            b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        else:
            b_m_use = b_m_new
        b_p = tl.math.exp2(b_s - b_m_use[:, None])  # [BLOCK_M, BLOCK_N]
        b_alpha = tl.math.exp2(b_m - b_m_use)  # [BLOCK_M]
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        if HAS_DROPOUT:
            # after l: dropout acts on the normalised probabilities, not on the normaliser
            b_p = tl.where(dropout_keep(seed, row_base, o_n, dropout_p), b_p, 0.0)
        b_v = load_rows(p_v, o_n, sk, m_d, MASKED=MASKED, EVEN_D=EVEN_D)  # [BLOCK_N, BLOCK_D]
        b_acc = b_acc * b_alpha[:, None]
        b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc, input_precision=DOT_PREC)
        b_m = b_m_new
    return b_acc, b_l, b_m


@triton.heuristics(FWD_FEATURE_FLAGS)
@triton.jit(do_not_specialize=PARTIAL_ARGS)
def attn_fwd_kernel(
    Q, K, V, O, LSE, ALIBI, CU_Q, CU_K, BIAS, RNG, BS_IDX, BLOCK_TABLE,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh, stride_ab,
    stride_biasb, stride_biash, stride_biasm, stride_biasn,
    stride_bsb, stride_bsh, stride_bsr, bs_m, bs_n, stride_btb,
    seqlen_q, seqlen_k, H, GROUP,
    qk_scale, softcap_scale, window_left, window_right, dropout_p, dropout_scale,
    q_offset, k_offset, seqlen_q_total, seqlen_k_total, batch_offset, head_offset, nheads_total,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_ALIBI: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SPARSE: tl.constexpr, PAGED: tl.constexpr,
):
    i_b, i_h, i_hk, q_start, sq, k_start, sk, shift, alibi_shift, m_first, m_last = query_block(
        CU_Q, CU_K, seqlen_q, seqlen_k, H, GROUP, q_offset, k_offset, seqlen_q_total,
        seqlen_k_total, BLOCK_M=BLOCK_M, IS_VARLEN=IS_VARLEN, BOTTOM_RIGHT=BOTTOM_RIGHT)
    if m_first >= sq:
        return

    o_m = m_first + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_q = (o_m[:, None] < sq) & (o_d[None, :] < HEAD_DIM)  # [BLOCK_M, BLOCK_D]
    b_q = load_tile(Q, i_b, q_start, i_h, stride_qb, stride_qm, stride_qh,
                    o_m, o_d, m_q)  # [BLOCK_M, BLOCK_D]
    if PAGED:
        # K/V are page pools (stride_kb / stride_vb are the page strides): rows are found
        # through this sequence's block-table row, not from k_start.
        p_k_base = K + i_hk * stride_kh
        p_v_base = V + i_hk * stride_vh
        p_bt = BLOCK_TABLE + i_b.to(tl.int64) * stride_btb
    else:
        p_k_base = rows_ptr(K, i_b, k_start, i_hk, stride_kb, stride_kn, stride_kh)
        p_v_base = rows_ptr(V, i_b, k_start, i_hk, stride_vb, stride_vn, stride_vh)
        p_bt = BLOCK_TABLE

    slope, bias_offset = head_terms(ALIBI, i_b, i_h, stride_ab, stride_biasb, stride_biash,
                                    HAS_ALIBI=HAS_ALIBI, HAS_BIAS=HAS_BIAS)
    p_bias = BIAS + bias_offset if HAS_BIAS else BIAS
    seed, row_base = dropout_rows(RNG, i_b, i_h, o_m, batch_offset, nheads_total, head_offset,
                                  seqlen_q_total, q_offset, seqlen_k_total, k_offset,
                                  HAS_DROPOUT=HAS_DROPOUT)

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Stage 1: tiles cut by the left window edge.  Stage 2: interior tiles, no predicate.
    # Stage 3: tiles cut by the right edge (the causal diagonal) or the end of the sequence.
    # SPARSE: only the nonzero mask blocks of this query block, those visible throughout
    # first (no predicate), then those cut by a bound.
    p_list = BS_IDX
    if SPARSE:
        p_list = block_row(BS_IDX, i_b, i_h, m_first // bs_m, stride_bsb, stride_bsh, stride_bsr)
    a0, a1, a2, a3, tpb = key_walk(m_first, m_last, sk, shift, window_left, window_right, p_list,
                                   bs_n, BLOCK_N=BLOCK_N, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT,
                                   SPARSE=SPARSE)
    I_STEP: tl.constexpr = 1 if SPARSE else BLOCK_N
    # masked [a0, a1), full [a1, a2), masked [a2, a3)
    for stage in tl.static_range(3):
        start, end = stage_range(stage, a0, a1, a2, a3)
        b_acc, b_l, b_m = _fwd_inner(
            b_acc=b_acc, b_l=b_l, b_m=b_m, b_q=b_q, p_k_base=p_k_base, p_v_base=p_v_base,
            stride_kn=stride_kn, stride_vn=stride_vn, o_m=o_m, o_d=o_d, n_start=start, n_end=end,
            sq=sq, sk=sk, shift=shift, alibi_shift=alibi_shift, window_left=window_left,
            window_right=window_right, qk_scale=qk_scale, softcap_scale=softcap_scale,
            slope=slope, p_bias=p_bias, stride_bm=stride_biasm, stride_bn=stride_biasn,
            seed=seed, row_base=row_base, dropout_p=dropout_p, p_bt=p_bt, stride_kpage=stride_kb,
            stride_vpage=stride_vb, p_list=p_list, tiles_per_block=tpb, bs_n=bs_n,
            HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, MASKED=stage != 1, EVEN_D=EVEN_D,
            DOT_PREC=DOT_PREC, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI, HAS_LEFT=HAS_LEFT,
            HAS_RIGHT=HAS_RIGHT, HAS_BIAS=HAS_BIAS, BIAS_BOOL=BIAS_BOOL,
            HAS_DROPOUT=HAS_DROPOUT, PAGED=PAGED, PAGE_SIZE=PAGE_SIZE, SPARSE=SPARSE,
            I_STEP=I_STEP)

    # Rows that saw no key keep l == 0: they output 0 and report lse = -inf.
    m_empty = b_l == 0.0
    b_l_safe = tl.where(m_empty, 1.0, b_l)
    if HAS_DROPOUT:
        b_out = b_acc * (dropout_scale / b_l_safe)[:, None]  # [BLOCK_M, BLOCK_D]
    else:
        b_out = b_acc / b_l_safe[:, None]  # [BLOCK_M, BLOCK_D]
    b_lse = tl.where(m_empty, float("-inf"), (b_m + tl.math.log2(b_l_safe)) * LN2)
    p_o = tile_ptr(O, i_b, q_start, i_h, stride_ob, stride_om, stride_oh,
                   o_m, o_d)  # [BLOCK_M, BLOCK_D]
    tl.store(p_o, b_out.to(O.dtype.element_ty), mask=m_q)
    p_lse = LSE + i_b * stride_lb + i_h * stride_lh + q_start + o_m
    tl.store(p_lse, b_lse, mask=o_m < sq)
