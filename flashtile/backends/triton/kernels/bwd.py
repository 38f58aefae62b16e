"""Backward kernels: recompute probabilities tile by tile from the saved log-sum-exp.

With ``p = exp2(s - lse2)`` (``s`` the base-2 score of forward, ``lse2 = log2(e) * lse``)::

    delta = rowsum(dO * O)                  # dQ kernel prologue, O(N d)
    dV   += p^T dO
    dP    = dO V^T
    dS    = p * (dP - delta)                # gradient w.r.t. the natural-log score (= dBias)
    dS'   = dS * (1 - tanh(u)^2)            # only with softcap, u = scale * q.k / softcap
    dQ   += scale * dS' K ,   dK += scale * dS'^T Q

Two kernels, no side kernels (the portable backward; on Hopper the default backward is one
Gluon kernel after ``attn_bwd_delta_kernel``): the dQ kernel (grid over query tiles) runs first and computes
``delta`` for its rows in its prologue from the O and dO tiles it loads (O is read once, dO
once, no separate preprocess pass re-reading both) and stores it; the dK/dV kernel (grid over
key tiles) then reads it.  Both turn the saved natural-log ``lse`` into ``lse2 = log2(e) * lse``
as they load it, ``+inf`` where ``lse = -inf``: rows that saw no key then get
``p = exp2(s - inf) = 0`` and contribute nothing (never ``inf * 0``).  Invisible
keys score ``-inf`` during recomputation as in the forward (otherwise a padded key
would score 0 and ``exp2(0 - lse2)`` can overflow for a small lse).

Dropout (``HAS_DROPOUT``) regenerates the forward's keep mask ``Z`` from the same seed and
counters (nothing N x N is stored) and follows Algorithm 4 of the paper, ``r = 1 / (1 - p)``::

    dV   += (p o Z r)^T dO ,   dP = (dO V^T) o Z r ,   dS = p * (dP - delta)

``delta = rowsum(dO * O)`` still equals ``sum_j p_j dP_j`` because ``O`` is the dropped output.
With an attention bias (``HAS_BIAS``) the scores are recomputed with it; the dQ kernel also
writes ``dS`` (natural-log units, before the softcap factor) to ``DBIAS`` when given: every
``(b, h, i, j)`` is visited by exactly one dQ program, so the write needs no atomics.
Block sparsity (``SPARSE``) walks the nonzero blocks of the mask (transposed lists for the dK/dV
kernel) exactly as the forward.
"""
import triton
import triton.language as tl

from .common import (FEATURE_FLAGS, LOG2E, PARTIAL_ARGS, block_row, dropout_keep, dropout_row0,
                     dropout_row_base, dropout_rows, head_terms, key_walk, load_tile, query_block,
                     query_range, rows_ptr, score_tile, sequence, stage_range, step_tiles, tanh,
                     tile_ptr, visible, walk)



@triton.jit
def _lse2(b_lse):
    """``log2(e) * lse`` for base-2 recomputation; ``+inf`` where ``lse = -inf`` (and for the
    ``+inf`` a masked load puts past the sequence end), so those rows get ``p = 0``."""
    return tl.where(b_lse == float("-inf"), float("inf"), b_lse * LOG2E)


@triton.jit
def _softcap_ds(b_ds, b_q, b_k, softcap_scale, DOT_PREC: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr):
    """Gradient w.r.t. the raw dot product q.k (without the final ``scale``) from ``dS``."""
    if HAS_SOFTCAP:
        # Recompute tanh rather than store it: one extra dot is cheaper than N^2 memory.
        b_t = tanh(tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * softcap_scale)
        b_ds = b_ds * (1.0 - b_t * b_t)
    return b_ds


@triton.jit
def _dkdv_inner(b_dk, b_dv, b_k, b_v, p_q_base, p_do_base, p_lse, p_delta,
                stride_qm, stride_dm, o_n, o_d, m_start, m_end, sq, sk, shift, alibi_shift,
                window_left, window_right, qk_scale, softcap_scale, slope,
                p_bias, stride_bm, stride_bn, seed, row0, seqlen_k_total, k_offset, dropout_p,
                dropout_scale, p_list, tiles_per_block, bs_m,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                SPARSE: tl.constexpr, I_STEP: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles: those starting at
    ``m_start, m_start + BLOCK_M, ... < m_end``, or with SPARSE tiles number
    ``m_start .. m_end - 1`` of the block list ``p_list`` (one flat loop, see ``_fwd_inner``)."""
    m_d = o_d < HEAD_DIM
    for it in range(m_start, m_end, I_STEP):
        # o_m [BLOCK_M]; b_q, b_do [BLOCK_M, BLOCK_D]
        o_m, b_q, b_do = step_tiles(it, p_q_base, p_do_base, stride_qm, stride_dm, o_d, m_d, sq,
                                    p_list, tiles_per_block, bs_m, BLOCK=BLOCK_M, MASKED=MASKED,
                                    EVEN_D=EVEN_D, SPARSE=SPARSE)
        if MASKED:
            # +inf lse2 for rows past the end makes their p exactly 0.
            b_lse2 = _lse2(tl.load(p_lse + o_m, mask=o_m < sq, other=float("inf")))  # [BLOCK_M]
            b_delta = tl.load(p_delta + o_m, mask=o_m < sq, other=0.0)  # [BLOCK_M]
        else:
            b_lse2 = _lse2(tl.load(p_lse + o_m))  # [BLOCK_M]
            b_delta = tl.load(p_delta + o_m)  # [BLOCK_M]
        b_s = score_tile(b_q, b_k, o_m, o_n, sq, sk, alibi_shift, qk_scale, softcap_scale, slope,
                         p_bias, stride_bm, stride_bn, DOT_PREC=DOT_PREC,
                         HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI, HAS_BIAS=HAS_BIAS,
                         BIAS_BOOL=BIAS_BOOL)  # [BLOCK_M, BLOCK_N]
        if MASKED:
            m_vis = visible(o_m, o_n, sk, shift, window_left, window_right,
                            HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT)  # [BLOCK_M, BLOCK_N]
            b_s = tl.where(m_vis, b_s, float("-inf"))
        b_p = tl.math.exp2(b_s - b_lse2[:, None])  # [BLOCK_M, BLOCK_N]
        if HAS_DROPOUT:
            m_keep = dropout_keep(seed, dropout_row_base(row0, seqlen_k_total, k_offset, o_m),
                                  o_n, dropout_p)  # [BLOCK_M, BLOCK_N]
            b_pd = tl.where(m_keep, b_p * dropout_scale, 0.0)
        else:
            b_pd = b_p
        b_dv = tl.dot(tl.trans(b_pd.to(b_do.dtype)), b_do, b_dv, input_precision=DOT_PREC)
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
        if HAS_DROPOUT:
            b_dp = tl.where(m_keep, b_dp * dropout_scale, 0.0)
        b_ds = b_p * (b_dp - b_delta[:, None])  # [BLOCK_M, BLOCK_N]
        b_ds = _softcap_ds(b_ds, b_q, b_k, softcap_scale, DOT_PREC=DOT_PREC,
                           HAS_SOFTCAP=HAS_SOFTCAP)
        b_dk = tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q, b_dk, input_precision=DOT_PREC)
    return b_dk, b_dv


@triton.heuristics(FEATURE_FLAGS)
@triton.jit(do_not_specialize=PARTIAL_ARGS)
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, ALIBI, CU_Q, CU_K, BIAS, RNG, BS_IDX,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lb, stride_lh, stride_ab,
    stride_biasb, stride_biash, stride_biasm, stride_biasn,
    stride_bsb, stride_bsh, stride_bsr, bs_m, bs_n,
    seqlen_q, seqlen_k, HK, GROUP,
    scale, qk_scale, softcap_scale, window_left, window_right, dropout_p, dropout_scale,
    q_offset, k_offset, seqlen_q_total, seqlen_k_total, batch_offset, head_offset, nheads_total,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_ALIBI: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SPARSE: tl.constexpr,
):
    """One program owns BLOCK_N keys of one key/value head and loops over every query head of
    its group and every query tile that sees them, so GQA gradients are summed in registers.
    With SPARSE, ``BS_IDX`` holds the transposed lists (nonzero query blocks per key block)."""
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // HK
    i_hk = i_bh % HK
    q_start, sq, k_start, sk, shift, alibi_shift = sequence(
        CU_Q, CU_K, i_b, seqlen_q, seqlen_k, q_offset, k_offset, seqlen_q_total, seqlen_k_total,
        IS_VARLEN=IS_VARLEN, BOTTOM_RIGHT=BOTTOM_RIGHT)
    n_first = i_n * BLOCK_N
    if n_first >= sk:
        return
    o_n = n_first + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_kd = (o_n[:, None] < sk) & (o_d[None, :] < HEAD_DIM)  # [BLOCK_N, BLOCK_D]
    b_k = load_tile(K, i_b, k_start, i_hk, stride_kb, stride_kn, stride_kh,
                    o_n, o_d, m_kd)  # [BLOCK_N, BLOCK_D]
    b_v = load_tile(V, i_b, k_start, i_hk, stride_vb, stride_vn, stride_vh,
                    o_n, o_d, m_kd)  # [BLOCK_N, BLOCK_D]
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(RNG)

    lo, full_lo, full_hi, hi = query_range(n_first, n_first + BLOCK_N - 1, sq, sk, shift,
                                           window_left, window_right, BLOCK_M=BLOCK_M,
                                           HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT)
    for i_g in range(GROUP):
        i_h = i_hk * GROUP + i_g
        slope, bias_offset = head_terms(ALIBI, i_b, i_h, stride_ab, stride_biasb, stride_biash,
                                        HAS_ALIBI=HAS_ALIBI, HAS_BIAS=HAS_BIAS)
        p_bias = BIAS + bias_offset if HAS_BIAS else BIAS
        row0 = dropout_row0(i_b, batch_offset, nheads_total, i_h, head_offset,
                            seqlen_q_total, q_offset)
        p_q_base = rows_ptr(Q, i_b, q_start, i_h, stride_qb, stride_qm, stride_qh)
        p_do_base = rows_ptr(DO, i_b, q_start, i_h, stride_dob, stride_dom, stride_doh)
        p_lse = LSE + i_b * stride_lb + i_h * stride_lh + q_start
        p_delta = DELTA + i_b * stride_lb + i_h * stride_lh + q_start
        # the forward's three stages, over query tiles (SPARSE: the transposed block lists)
        p_list = BS_IDX
        if SPARSE:
            p_list = block_row(BS_IDX, i_b, i_h, n_first // bs_n, stride_bsb, stride_bsh,
                               stride_bsr)
        a0, a1, a2, a3, tpb = walk(lo, full_lo, full_hi, hi, p_list, bs_m, BLOCK=BLOCK_M,
                                   SPARSE=SPARSE)
        I_STEP: tl.constexpr = 1 if SPARSE else BLOCK_M
        # masked [a0, a1), full [a1, a2), masked [a2, a3)
        for stage in tl.static_range(3):
            start, end = stage_range(stage, a0, a1, a2, a3)
            b_dk, b_dv = _dkdv_inner(
                b_dk=b_dk, b_dv=b_dv, b_k=b_k, b_v=b_v, p_q_base=p_q_base, p_do_base=p_do_base,
                p_lse=p_lse, p_delta=p_delta, stride_qm=stride_qm, stride_dm=stride_dom, o_n=o_n,
                o_d=o_d, m_start=start, m_end=end, sq=sq, sk=sk, shift=shift,
                alibi_shift=alibi_shift, window_left=window_left, window_right=window_right,
                qk_scale=qk_scale, softcap_scale=softcap_scale, slope=slope, p_bias=p_bias,
                stride_bm=stride_biasm, stride_bn=stride_biasn, seed=seed, row0=row0,
                seqlen_k_total=seqlen_k_total, k_offset=k_offset, dropout_p=dropout_p,
                dropout_scale=dropout_scale, p_list=p_list, tiles_per_block=tpb, bs_m=bs_m,
                HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, MASKED=stage != 1, EVEN_D=EVEN_D,
                DOT_PREC=DOT_PREC, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI, HAS_LEFT=HAS_LEFT,
                HAS_RIGHT=HAS_RIGHT, HAS_BIAS=HAS_BIAS, BIAS_BOOL=BIAS_BOOL,
                HAS_DROPOUT=HAS_DROPOUT, SPARSE=SPARSE, I_STEP=I_STEP)
    p_dk = tile_ptr(DK, i_b, k_start, i_hk, stride_dkb, stride_dkn, stride_dkh,
                    o_n, o_d)  # [BLOCK_N, BLOCK_D]
    p_dv = tile_ptr(DV, i_b, k_start, i_hk, stride_dvb, stride_dvn, stride_dvh,
                    o_n, o_d)  # [BLOCK_N, BLOCK_D]
    tl.store(p_dk, (b_dk * scale).to(DK.dtype.element_ty), mask=m_kd)
    tl.store(p_dv, b_dv.to(DV.dtype.element_ty), mask=m_kd)


@triton.jit
def _dq_inner(b_dq, b_q, b_do, b_lse2, b_delta, p_k_base, p_v_base, stride_kn, stride_vn,
              o_m, o_d, n_start, n_end, sq, sk, shift, alibi_shift, window_left, window_right,
              qk_scale, softcap_scale, slope, p_bias, stride_bm, stride_bn, seed, row_base,
              dropout_p, dropout_scale, p_dbias, stride_dbm, stride_dbn,
              p_list, tiles_per_block, bs_n,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              STORE_DBIAS: tl.constexpr, SPARSE: tl.constexpr, I_STEP: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles: those starting at
    ``n_start, n_start + BLOCK_N, ... < n_end``, or with SPARSE tiles number
    ``n_start .. n_end - 1`` of the block list ``p_list`` (one flat loop, see ``_fwd_inner``)."""
    m_d = o_d < HEAD_DIM
    for it in range(n_start, n_end, I_STEP):
        # o_n [BLOCK_N]; b_k, b_v [BLOCK_N, BLOCK_D]
        o_n, b_k, b_v = step_tiles(it, p_k_base, p_v_base, stride_kn, stride_vn, o_d, m_d, sk,
                                   p_list, tiles_per_block, bs_n, BLOCK=BLOCK_N, MASKED=MASKED,
                                   EVEN_D=EVEN_D, SPARSE=SPARSE)
        b_s = score_tile(b_q, b_k, o_m, o_n, sq, sk, alibi_shift, qk_scale, softcap_scale, slope,
                         p_bias, stride_bm, stride_bn, DOT_PREC=DOT_PREC,
                         HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI, HAS_BIAS=HAS_BIAS,
                         BIAS_BOOL=BIAS_BOOL)  # [BLOCK_M, BLOCK_N]
        if MASKED:
            m_vis = visible(o_m, o_n, sk, shift, window_left, window_right,
                            HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT)  # [BLOCK_M, BLOCK_N]
            b_s = tl.where(m_vis, b_s, float("-inf"))
        b_p = tl.math.exp2(b_s - b_lse2[:, None])  # [BLOCK_M, BLOCK_N]
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
        if HAS_DROPOUT:
            m_keep = dropout_keep(seed, row_base, o_n, dropout_p)  # [BLOCK_M, BLOCK_N]
            b_dp = tl.where(m_keep, b_dp * dropout_scale, 0.0)
        b_ds = b_p * (b_dp - b_delta[:, None])  # [BLOCK_M, BLOCK_N]
        if STORE_DBIAS:
            p_db = p_dbias + o_m[:, None] * stride_dbm + o_n[None, :] * stride_dbn
            m_db = (o_m[:, None] < sq) & (o_n[None, :] < sk)  # [BLOCK_M, BLOCK_N]
            tl.store(p_db, b_ds.to(p_dbias.dtype.element_ty), mask=m_db)
        b_ds = _softcap_ds(b_ds, b_q, b_k, softcap_scale, DOT_PREC=DOT_PREC,
                           HAS_SOFTCAP=HAS_SOFTCAP)
        b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq, input_precision=DOT_PREC)
    return b_dq


@triton.heuristics({
    **FEATURE_FLAGS,
    "STORE_DBIAS": lambda a: a["DBIAS"] is not None,
})
@triton.jit(do_not_specialize=PARTIAL_ARGS)
def attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, O, LSE, DELTA, ALIBI, CU_Q, CU_K, BIAS, RNG, BS_IDX, DBIAS,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh, stride_ab,
    stride_biasb, stride_biash, stride_biasm, stride_biasn,
    stride_dbb, stride_dbh, stride_dbm, stride_dbn,
    stride_bsb, stride_bsh, stride_bsr, bs_m, bs_n,
    seqlen_q, seqlen_k, H, GROUP,
    scale, qk_scale, softcap_scale, window_left, window_right, dropout_p, dropout_scale,
    q_offset, k_offset, seqlen_q_total, seqlen_k_total, batch_offset, head_offset, nheads_total,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_ALIBI: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SPARSE: tl.constexpr, STORE_DBIAS: tl.constexpr,
):
    """One program owns BLOCK_M query rows of one head and streams the key tiles they see.
    Its prologue computes ``delta = rowsum(dO * O)`` of its rows and stores it to ``DELTA``
    for the dK/dV kernel that runs next (every row of every sequence belongs to exactly one
    program, which stores it before any other work, whatever the mask)."""
    i_b, i_h, i_hk, q_start, sq, k_start, sk, shift, alibi_shift, m_first, m_last = query_block(
        CU_Q, CU_K, seqlen_q, seqlen_k, H, GROUP, q_offset, k_offset, seqlen_q_total,
        seqlen_k_total, BLOCK_M=BLOCK_M, IS_VARLEN=IS_VARLEN, BOTTOM_RIGHT=BOTTOM_RIGHT)
    if m_first >= sq:
        return
    o_m = m_first + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_qd = (o_m[:, None] < sq) & (o_d[None, :] < HEAD_DIM)  # [BLOCK_M, BLOCK_D]
    b_q = load_tile(Q, i_b, q_start, i_h, stride_qb, stride_qm, stride_qh,
                    o_m, o_d, m_qd)  # [BLOCK_M, BLOCK_D]
    b_do = load_tile(DO, i_b, q_start, i_h, stride_dob, stride_dom, stride_doh,
                     o_m, o_d, m_qd)  # [BLOCK_M, BLOCK_D]
    b_o = load_tile(O, i_b, q_start, i_h, stride_ob, stride_om, stride_oh,
                    o_m, o_d, m_qd)  # [BLOCK_M, BLOCK_D], only for delta
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)  # [BLOCK_M]
    o_l = i_b * stride_lb + i_h * stride_lh + q_start + o_m
    tl.store(DELTA + o_l, b_delta, mask=o_m < sq)
    b_lse2 = _lse2(tl.load(LSE + o_l, mask=o_m < sq, other=float("inf")))  # [BLOCK_M]
    slope, bias_offset = head_terms(ALIBI, i_b, i_h, stride_ab, stride_biasb, stride_biash,
                                    HAS_ALIBI=HAS_ALIBI, HAS_BIAS=HAS_BIAS)
    p_bias = BIAS + bias_offset if HAS_BIAS else BIAS
    p_dbias = DBIAS
    if STORE_DBIAS:
        p_dbias = DBIAS + i_b.to(tl.int64) * stride_dbb + i_h.to(tl.int64) * stride_dbh
    seed, row_base = dropout_rows(RNG, i_b, i_h, o_m, batch_offset, nheads_total, head_offset,
                                  seqlen_q_total, q_offset, seqlen_k_total, k_offset,
                                  HAS_DROPOUT=HAS_DROPOUT)
    p_k_base = rows_ptr(K, i_b, k_start, i_hk, stride_kb, stride_kn, stride_kh)
    p_v_base = rows_ptr(V, i_b, k_start, i_hk, stride_vb, stride_vn, stride_vh)
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # the forward's three stages, over key tiles
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
        b_dq = _dq_inner(
            b_dq=b_dq, b_q=b_q, b_do=b_do, b_lse2=b_lse2, b_delta=b_delta, p_k_base=p_k_base,
            p_v_base=p_v_base, stride_kn=stride_kn, stride_vn=stride_vn, o_m=o_m, o_d=o_d,
            n_start=start, n_end=end, sq=sq, sk=sk, shift=shift, alibi_shift=alibi_shift,
            window_left=window_left, window_right=window_right, qk_scale=qk_scale,
            softcap_scale=softcap_scale, slope=slope, p_bias=p_bias, stride_bm=stride_biasm,
            stride_bn=stride_biasn, seed=seed, row_base=row_base, dropout_p=dropout_p,
            dropout_scale=dropout_scale, p_dbias=p_dbias, stride_dbm=stride_dbm,
            stride_dbn=stride_dbn, p_list=p_list, tiles_per_block=tpb, bs_n=bs_n,
            HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, MASKED=stage != 1, EVEN_D=EVEN_D, DOT_PREC=DOT_PREC,
            HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT,
            HAS_BIAS=HAS_BIAS, BIAS_BOOL=BIAS_BOOL, HAS_DROPOUT=HAS_DROPOUT,
            STORE_DBIAS=STORE_DBIAS, SPARSE=SPARSE, I_STEP=I_STEP)
    p_dq = tile_ptr(DQ, i_b, q_start, i_h, stride_dqb, stride_dqm, stride_dqh,
                    o_m, o_d)  # [BLOCK_M, BLOCK_D]
    tl.store(p_dq, (b_dq * scale).to(DQ.dtype.element_ty), mask=m_qd)


@triton.jit
def attn_bwd_delta_kernel(O, DO, DELTA, DQ_ACC, stride_db, stride_ds, stride_dh, n_rows,
                          seqlen_q, nheads, LSE, LSE_P, SRC, COUNTER, total,
                          HEAD_DIM: tl.constexpr, O_COLS: tl.constexpr, ROWS: tl.constexpr,
                          ZERO: tl.constexpr, PACKED: tl.constexpr, COUNT: tl.constexpr,
                          PAD: tl.constexpr):
    """Prologue of the Hopper backward kernels, which compute no ``delta`` themselves:
    ``delta = rowsum(dO * O)`` into ``DELTA`` (float32 ``(B, H, Sq)``) and with ``ZERO`` (the
    fused kernel, ``attn_bwd_sm90.py`` with ``DQ``) the float32 dQ accumulator zeroed, for
    ``ROWS`` of the ``B * Sq * H`` rows of the contiguous ``(B, Sq, H, D)`` tensors ``O`` and
    ``DQ_ACC`` a program (``DO``: the same shape with strides ``stride_d*`` and contiguous
    rows).  With ``COUNT`` program 0 zeroes the persistent kernel's work counter ``COUNTER``
    (int32 ``(1,)``): one device op less than a separate fill.

    ``PACKED`` (packed sequences, ``B = 1``, ``Sq = total``): the rows are those of the padded
    layout ``(H, seqlen_q)`` of ``launch_sm90.packed_prologue`` instead, position ``i`` of head
    ``h`` holding packed row ``SRC[i]`` (int32, -1 in the gaps): ``DELTA[h, i]`` its delta and
    ``LSE_P[h, i] = LSE[h, SRC[i]]`` (``LSE`` float32 ``(H, total)``), the gaps 0 and +inf (p = 0
    and delta = 0 there), with ``COUNT`` the counter zeroed too.  One launch where the layout
    would otherwise take five small device ops.

    ``PAD`` (``Sq`` not a multiple of the backward kernel's row tile): ``seqlen_q`` is the
    padded length and ``total`` the true one; the rows are those of ``(B, seqlen_q, H)``,
    ``DELTA`` and ``LSE_P`` float32 ``(B, H, seqlen_q)`` with ``LSE_P[b, h, s] = LSE[b, h, s]``
    (``LSE`` ``(B, H, total)``) and the rows from ``total`` on +inf and 0, as the TMA tiles
    of the backward kernel read them: two pads less a call.

    ``O_COLS`` below ``HEAD_DIM`` (a head dim the Hopper kernels run at the next width,
    ``launch_sm90.padded_width``): ``O`` and ``DO`` are ``O_COLS`` wide (``O``'s rows that
    pitch apart), the columns from ``O_COLS`` on read as zeros (they add nothing to delta), and
    ``DQ_ACC`` is ``HEAD_DIM`` wide, every column zeroed."""
    i_r = tl.program_id(0)
    o_r = i_r * ROWS + tl.arange(0, ROWS)                          # [ROWS] rows (b, s, h)
    o_d = tl.arange(0, HEAD_DIM)                                   # [D]
    m_r = o_r < n_rows
    i_h = o_r % nheads
    i_bs = o_r // nheads
    m_live = m_r
    i_row = o_r                                                    # [ROWS] row of O, DQ_ACC
    if PACKED:
        i_src = tl.load(SRC + i_bs, mask=m_r, other=-1)            # [ROWS] packed row or -1
        m_live = m_r & (i_src >= 0)
        i_bs = tl.maximum(i_src, 0)
        i_row = i_bs * nheads + i_h
    if PAD:  # position s of batch entry b: a row of O where s < total, else a gap
        i_b = i_bs // seqlen_q
        i_s = i_bs % seqlen_q
        m_live = m_r & (i_s < total)
        i_row = (i_b * total + i_s) * nheads + i_h
    if COUNT:
        if i_r == 0:
            tl.store(COUNTER, 0)
    p = i_row.to(tl.int64)[:, None] * HEAD_DIM + o_d[None, :]      # [ROWS, D] of DQ_ACC
    p_o = i_row.to(tl.int64)[:, None] * O_COLS + o_d[None, :]      # [ROWS, D] of O
    p_do = ((i_bs // seqlen_q).to(tl.int64) * stride_db
            + (i_bs % seqlen_q).to(tl.int64) * stride_ds
            + i_h.to(tl.int64) * stride_dh)[:, None] + o_d[None, :]     # [ROWS, D]
    if PACKED:  # (one sequence of all the packed rows)
        p_do = (i_bs.to(tl.int64) * stride_ds + i_h.to(tl.int64) * stride_dh)[:, None] \
            + o_d[None, :]
    m_ld = m_live[:, None]                                         # [ROWS, 1]
    if O_COLS < HEAD_DIM:  # (a narrower head: its columns only)
        m_ld = m_ld & (o_d < O_COLS)[None, :]                      # [ROWS, D]
    b_o = tl.load(O + p_o, mask=m_ld, other=0.0).to(tl.float32)
    b_do = tl.load(DO + p_do, mask=m_ld, other=0.0).to(tl.float32)
    if ZERO:
        tl.store(DQ_ACC + p, tl.zeros([ROWS, HEAD_DIM], tl.float32), mask=m_live[:, None])
    b_delta = tl.sum(b_o * b_do, axis=1)                           # [ROWS]
    # row (b * Sq + s) * H + h  ->  delta[b, h, s]
    p_delta = ((i_bs // seqlen_q) * nheads + i_h).to(tl.int64) * seqlen_q + i_bs % seqlen_q
    if PACKED:  # position i of head h, gaps included
        p_delta = i_h.to(tl.int64) * seqlen_q + o_r // nheads
        b_lse = tl.load(LSE + i_h.to(tl.int64) * total + i_bs, mask=m_live, other=float("inf"))
        tl.store(LSE_P + p_delta, b_lse, mask=m_r)
    if PAD:  # (p_delta is already the padded layout's, seqlen_q being the padded length)
        b_lse = tl.load(LSE + (i_b * nheads + i_h).to(tl.int64) * total + i_s, mask=m_live,
                        other=float("inf"))
        tl.store(LSE_P + p_delta, b_lse, mask=m_r)
    tl.store(DELTA + p_delta, b_delta, mask=m_r)
