"""Backward kernel: recompute probabilities tile by tile from the saved log-sum-exp.

With ``p = exp2(s - lse2)`` (``s`` the base-2 score of forward, ``lse2 = log2(e) * lse``)::

    delta = rowsum(dO * O)                  # O(N d), computed where it is used
    dV   += p^T dO
    dP    = dO V^T
    dS    = p * (dP - delta)                # gradient w.r.t. the natural-log score (= dBias)
    dS'   = dS * (1 - tanh(u)^2)            # only with softcap, u = scale * q.k / softcap
    dQ   += scale * dS' K ,   dK += scale * dS'^T Q

One kernel, two roles: a *dQ program* owns BLOCK_M query rows of one head and streams the key
tiles they see; a *dK/dV program* owns KV_BLOCK_N keys of one key/value head and streams the
query tiles of every head of its group that see them (GQA gradients summed in registers).
Neither writes what the other reads, so no program waits for another and nothing is
accumulated through memory (no atomics, no fp32 scratch, no fills or casts).

``ROLES`` (constexpr) says which programs a launch holds:

* ``ROLES_BOTH`` (the default): one grid, ``(GROUP * cdiv(Sq, BLOCK_M) + cdiv(Sk, KV_BLOCK_N),
  B * HK)``.  The programs of one ``(batch entry, key/value head)`` are consecutive, dQ ones
  first, and the GPU starts programs in that order: the dK/dV programs read the Q, dO, O, K and
  V tiles that the dQ programs of their group have just read, from L2, so each input crosses
  HBM about once (Theorem 2's compulsory bytes) instead of twice for two grids one after the
  other.  Each dK/dV program computes ``delta`` for the query tiles it streams from their O
  tile (an L2 read; a few FMAs per element beside four matrix products).
* ``ROLES_DQ`` then ``ROLES_DKDV``: two launches, each with its own block shapes; the dQ launch
  stores ``delta`` of its rows to ``DELTA`` in its prologue and the dK/dV launch reads it.
  Used for block-sparse masks (the two roles walk different block lists).

Both roles turn the saved natural-log ``lse`` into ``lse2 = log2(e) * lse`` as they load it,
``+inf`` where ``lse = -inf``: rows that saw no key then get ``p = exp2(s - inf) = 0`` and
contribute nothing (never ``inf * 0``).  Invisible keys score ``-inf`` during recomputation as
in the forward (otherwise a padded key would score 0 and ``exp2(0 - lse2)`` can overflow for a
small lse).

Dropout (``HAS_DROPOUT``) regenerates the forward's keep mask ``Z`` from the same seed and
counters (nothing N x N is stored) and follows Algorithm 4 of the paper, ``r = 1 / (1 - p)``::

    dV   += (p o Z r)^T dO ,   dP = (dO V^T) o Z r ,   dS = p * (dP - delta)

``delta = rowsum(dO * O)`` still equals ``sum_j p_j dP_j`` because ``O`` is the dropped output.
With an attention bias (``HAS_BIAS``) the scores are recomputed with it; the dQ role also
writes ``dS`` (natural-log units, before the softcap factor) to ``DBIAS`` when given: every
``(b, h, i, j)`` is visited by exactly one dQ program, so the write needs no atomics.
Block sparsity (``SPARSE``) walks the nonzero blocks of the mask (transposed lists for the dK/dV
programs) exactly as the forward.
"""
import triton
import triton.language as tl

from .common import (FEATURE_FLAGS, LOG2E, PARTIAL_ARGS, block_row, dropout_keep, dropout_row0,
                     dropout_row_base, dropout_rows, head_terms, key_walk, load_rows, load_tile,
                     query_range, rows_ptr, score_tile, sequence, stage_range, step_tiles, tanh,
                     tile_ptr, visible, walk)

# What one launch of ``attn_bwd_kernel`` holds (its ``ROLES``): ints for the launcher, the
# same values as constexprs for the kernel (a jitted function reads only constexpr globals).
ROLES_DQ, ROLES_DKDV, ROLES_BOTH = 1, 2, 3
_DQ, _DKDV, _BOTH = tl.constexpr(ROLES_DQ), tl.constexpr(ROLES_DKDV), tl.constexpr(ROLES_BOTH)


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
                SPARSE: tl.constexpr, I_STEP: tl.constexpr, DELTA_CG: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles: those starting at
    ``m_start, m_start + BLOCK_M, ... < m_end``, or with SPARSE tiles number
    ``m_start .. m_end - 1`` of the block list ``p_list`` (one flat loop, see ``_fwd_inner``).
    DELTA_CG: ``delta`` was written by other programs of this grid: read through L2 only
    (``.cg``), never from a line this SM's L1 may hold from before."""
    m_d = o_d < HEAD_DIM
    for it in range(m_start, m_end, I_STEP):
        # o_m [BLOCK_M]; b_q, b_do [BLOCK_M, BLOCK_D]
        o_m, b_q, b_do = step_tiles(it, p_q_base, p_do_base, stride_qm, stride_dm, o_d, m_d, sq,
                                    p_list, tiles_per_block, bs_m, BLOCK=BLOCK_M, MASKED=MASKED,
                                    EVEN_D=EVEN_D, SPARSE=SPARSE)
        if MASKED:
            # +inf lse2 for rows past the end makes their p exactly 0.
            b_lse2 = _lse2(tl.load(p_lse + o_m, mask=o_m < sq, other=float("inf")))  # [BLOCK_M]
        else:
            b_lse2 = _lse2(tl.load(p_lse + o_m))  # [BLOCK_M]
        if DELTA_CG:
            b_delta = tl.load(p_delta + o_m, mask=o_m < sq, other=0.0,
                              cache_modifier=".cg")  # [BLOCK_M]
        elif MASKED:
            b_delta = tl.load(p_delta + o_m, mask=o_m < sq, other=0.0)  # [BLOCK_M]
        else:
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



@triton.jit
def _dkdv_role(
    i_n, i_b, i_hk, Q, K, V, DO, DK, DV, LSE, DELTA, ALIBI, CU_Q, CU_K, BIAS, RNG, BS_IDX,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh, stride_lb, stride_lh, stride_ab,
    stride_biasb, stride_biash, stride_biasm, stride_biasn,
    stride_bsb, stride_bsh, stride_bsr, bs_m, bs_n,
    seqlen_q, seqlen_k, GROUP, scale, qk_scale, softcap_scale, window_left, window_right,
    dropout_p, dropout_scale, q_offset, k_offset, seqlen_q_total, seqlen_k_total,
    batch_offset, head_offset, nheads_total,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_ALIBI: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SPARSE: tl.constexpr, DELTA_CG: tl.constexpr,
):
    """dK/dV program: keys ``[i_n * BLOCK_N, (i_n + 1) * BLOCK_N)`` of key/value head ``i_hk`` of
    batch entry ``i_b``, over every query head of the group and every query tile of BLOCK_M
    rows that sees them.  With SPARSE, ``BS_IDX`` holds the transposed lists (nonzero query
    blocks per key block)."""
    q_start, sq, k_start, sk, shift, alibi_shift = sequence(
        CU_Q, CU_K, i_b, seqlen_q, seqlen_k, q_offset, k_offset, seqlen_q_total, seqlen_k_total,
        IS_VARLEN=IS_VARLEN, BOTTOM_RIGHT=BOTTOM_RIGHT)
    n_first = i_n * BLOCK_N
    if n_first < sk:  # else a tile past the end of a shorter varlen sequence
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
            slope, bias_offset = head_terms(ALIBI, i_b, i_h, stride_ab, stride_biasb,
                                            stride_biash, HAS_ALIBI=HAS_ALIBI, HAS_BIAS=HAS_BIAS)
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
                    b_dk=b_dk, b_dv=b_dv, b_k=b_k, b_v=b_v, p_q_base=p_q_base,
                    p_do_base=p_do_base, p_lse=p_lse, p_delta=p_delta,
                    stride_qm=stride_qm, stride_dm=stride_dom, o_n=o_n,
                    o_d=o_d, m_start=start, m_end=end, sq=sq, sk=sk, shift=shift,
                    alibi_shift=alibi_shift, window_left=window_left, window_right=window_right,
                    qk_scale=qk_scale, softcap_scale=softcap_scale, slope=slope, p_bias=p_bias,
                    stride_bm=stride_biasm, stride_bn=stride_biasn, seed=seed, row0=row0,
                    seqlen_k_total=seqlen_k_total, k_offset=k_offset, dropout_p=dropout_p,
                    dropout_scale=dropout_scale, p_list=p_list, tiles_per_block=tpb, bs_m=bs_m,
                    HEAD_DIM=HEAD_DIM, BLOCK_M=BLOCK_M, MASKED=stage != 1, EVEN_D=EVEN_D,
                    DOT_PREC=DOT_PREC, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI,
                    HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, HAS_BIAS=HAS_BIAS,
                    BIAS_BOOL=BIAS_BOOL, HAS_DROPOUT=HAS_DROPOUT, SPARSE=SPARSE, I_STEP=I_STEP,
                    DELTA_CG=DELTA_CG)
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



@triton.jit
def _signal(p_ready):
    """Add 1 to the counter at ``p_ready`` once every thread's earlier stores are done (the
    barrier), releasing them at GPU scope to whoever acquires the new count."""
    tl.debug_barrier()
    tl.atomic_add(p_ready, 1, sem="release", scope="gpu")


@triton.jit
def _wait(p_ready, count):
    """Spin until the counter at ``p_ready`` reaches ``count`` (acquire), then line the
    program's threads up behind it."""
    while tl.atomic_add(p_ready, 0, sem="acquire", scope="gpu") < count:
        pass
    tl.debug_barrier()


@triton.jit
def _dq_role(
    i_p, i_b, i_hk, Q, K, V, DO, O, DQ, LSE, DELTA, p_ready, ALIBI, CU_Q, CU_K, BIAS, RNG, BS_IDX,
    DBIAS,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh, stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh, stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh, stride_ab,
    stride_biasb, stride_biash, stride_biasm, stride_biasn,
    stride_dbb, stride_dbh, stride_dbm, stride_dbn,
    stride_bsb, stride_bsh, stride_bsr, bs_m, bs_n,
    seqlen_q, seqlen_k, GROUP, scale, qk_scale, softcap_scale, window_left, window_right,
    dropout_p, dropout_scale, q_offset, k_offset, seqlen_q_total, seqlen_k_total,
    batch_offset, head_offset, nheads_total,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_ALIBI: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SPARSE: tl.constexpr, STORE_DBIAS: tl.constexpr, SIGNAL: tl.constexpr,
):
    """dQ program ``i_p`` of its group (key/value head ``i_hk`` of batch entry ``i_b``): query
    head ``i_hk * GROUP + i_p // n_tiles``, the ``i_p % n_tiles``-th query tile counted from the
    last (the heaviest causal tiles first, so a grid's tail is made of cheap programs).  Computes
    ``delta = rowsum(dO * O)`` of its rows first and stores it for the dK/dV programs (every row
    of every sequence belongs to exactly one dQ program, which stores it before any other work,
    whatever the mask); SIGNAL: then adds 1 to its group's counter at ``p_ready`` (also when
    its tile is past the end of a shorter varlen sequence), which dK/dV programs of the same
    grid wait on."""
    n_tiles = tl.cdiv(seqlen_q, BLOCK_M)
    i_h = i_hk * GROUP + i_p // n_tiles
    i_m = n_tiles - 1 - i_p % n_tiles
    q_start, sq, k_start, sk, shift, alibi_shift = sequence(
        CU_Q, CU_K, i_b, seqlen_q, seqlen_k, q_offset, k_offset, seqlen_q_total, seqlen_k_total,
        IS_VARLEN=IS_VARLEN, BOTTOM_RIGHT=BOTTOM_RIGHT)
    m_first = i_m * BLOCK_M
    if m_first < sq:  # else a tile past the end of a shorter varlen sequence
        m_last = tl.minimum(m_first + BLOCK_M, sq) - 1
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
        if SIGNAL:
            _signal(p_ready)
        b_lse2 = _lse2(tl.load(LSE + o_l, mask=o_m < sq, other=float("inf")))  # [BLOCK_M]
        slope, bias_offset = head_terms(ALIBI, i_b, i_h, stride_ab, stride_biasb, stride_biash,
                                        HAS_ALIBI=HAS_ALIBI, HAS_BIAS=HAS_BIAS)
        p_bias = BIAS + bias_offset if HAS_BIAS else BIAS
        p_dbias = DBIAS
        if STORE_DBIAS:
            p_dbias = DBIAS + i_b.to(tl.int64) * stride_dbb + i_h.to(tl.int64) * stride_dbh
        seed, row_base = dropout_rows(RNG, i_b, i_h, o_m, batch_offset, nheads_total,
                                      head_offset, seqlen_q_total, q_offset, seqlen_k_total,
                                      k_offset, HAS_DROPOUT=HAS_DROPOUT)
        p_k_base = rows_ptr(K, i_b, k_start, i_hk, stride_kb, stride_kn, stride_kh)
        p_v_base = rows_ptr(V, i_b, k_start, i_hk, stride_vb, stride_vn, stride_vh)
        b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # the forward's three stages, over key tiles
        p_list = BS_IDX
        if SPARSE:
            p_list = block_row(BS_IDX, i_b, i_h, m_first // bs_m, stride_bsb, stride_bsh,
                               stride_bsr)
        a0, a1, a2, a3, tpb = key_walk(m_first, m_last, sk, shift, window_left, window_right,
                                       p_list, bs_n, BLOCK_N=BLOCK_N, HAS_LEFT=HAS_LEFT,
                                       HAS_RIGHT=HAS_RIGHT, SPARSE=SPARSE)
        I_STEP: tl.constexpr = 1 if SPARSE else BLOCK_N
        # masked [a0, a1), full [a1, a2), masked [a2, a3)
        for stage in tl.static_range(3):
            start, end = stage_range(stage, a0, a1, a2, a3)
            b_dq = _dq_inner(
                b_dq=b_dq, b_q=b_q, b_do=b_do, b_lse2=b_lse2, b_delta=b_delta,
                p_k_base=p_k_base, p_v_base=p_v_base, stride_kn=stride_kn, stride_vn=stride_vn,
                o_m=o_m, o_d=o_d, n_start=start, n_end=end, sq=sq, sk=sk, shift=shift,
                alibi_shift=alibi_shift, window_left=window_left, window_right=window_right,
                qk_scale=qk_scale, softcap_scale=softcap_scale, slope=slope, p_bias=p_bias,
                stride_bm=stride_biasm, stride_bn=stride_biasn, seed=seed, row_base=row_base,
                dropout_p=dropout_p, dropout_scale=dropout_scale, p_dbias=p_dbias,
                stride_dbm=stride_dbm, stride_dbn=stride_dbn, p_list=p_list,
                tiles_per_block=tpb, bs_n=bs_n, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N,
                MASKED=stage != 1, EVEN_D=EVEN_D, DOT_PREC=DOT_PREC, HAS_SOFTCAP=HAS_SOFTCAP,
                HAS_ALIBI=HAS_ALIBI, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, HAS_BIAS=HAS_BIAS,
                BIAS_BOOL=BIAS_BOOL, HAS_DROPOUT=HAS_DROPOUT, STORE_DBIAS=STORE_DBIAS,
                SPARSE=SPARSE, I_STEP=I_STEP)
        p_dq = tile_ptr(DQ, i_b, q_start, i_h, stride_dqb, stride_dqm, stride_dqh,
                        o_m, o_d)  # [BLOCK_M, BLOCK_D]
        tl.store(p_dq, (b_dq * scale).to(DQ.dtype.element_ty), mask=m_qd)
    elif SIGNAL:
        _signal(p_ready)



@triton.heuristics({
    **FEATURE_FLAGS,
    "STORE_DBIAS": lambda a: a["DBIAS"] is not None,
})
@triton.jit(do_not_specialize=PARTIAL_ARGS)
def attn_bwd_kernel(
    Q, K, V, DO, O, DQ, DK, DV, LSE, DELTA, CNT, ALIBI, CU_Q, CU_K, BIAS, RNG, BS_IDX, DBIAS,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_ob, stride_om, stride_oh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lb, stride_lh, stride_ab,
    stride_biasb, stride_biash, stride_biasm, stride_biasn,
    stride_dbb, stride_dbh, stride_dbm, stride_dbn,
    stride_bsb, stride_bsh, stride_bsr, bs_m, bs_n,
    seqlen_q, seqlen_k, HK, GROUP,
    scale, qk_scale, softcap_scale, window_left, window_right, dropout_p, dropout_scale,
    q_offset, k_offset, seqlen_q_total, seqlen_k_total, batch_offset, head_offset, nheads_total,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_BLOCK_M: tl.constexpr, KV_BLOCK_N: tl.constexpr, ROLES: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_ALIBI: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SPARSE: tl.constexpr, STORE_DBIAS: tl.constexpr,
):
    """Grid ``(programs per group, B * HK)``; a group is one key/value head of one batch entry.
    dQ programs are ``BLOCK_M`` query rows x ``BLOCK_N`` key tiles, dK/dV programs
    ``KV_BLOCK_N`` keys x ``KV_BLOCK_M`` query tiles; ``ROLES`` as in the module docstring.

    ROLES_BOTH: ``CNT`` holds ``1 + B * HK`` zeroed int32 counters, the ticket counter and one
    counter per group.  A program's work is its ticket (the order in which programs start), not
    its place in the grid, so the dQ programs of a group have started before any dK/dV program
    of the group waits for them: the wait always ends, whatever order the GPU starts programs
    in."""
    if ROLES == _BOTH:
        per_group = tl.num_programs(0)
        ticket = tl.atomic_add(CNT, 1, sem="relaxed", scope="gpu")
        i_p = ticket % per_group
        i_bh = ticket // per_group
    else:
        i_p = tl.program_id(0)
        i_bh = tl.program_id(1)
    i_b = i_bh // HK
    i_hk = i_bh % HK
    p_ready = CNT
    if ROLES == _BOTH:
        p_ready = CNT + 1 + i_bh  # the group's counter
    n_dq = 0
    if ROLES != _DKDV:
        n_dq = GROUP * tl.cdiv(seqlen_q, BLOCK_M)
    if ROLES != _DKDV and i_p < n_dq:
        _dq_role(
            i_p=i_p, i_b=i_b, i_hk=i_hk, Q=Q, K=K, V=V, DO=DO, O=O, DQ=DQ, LSE=LSE, DELTA=DELTA,
            p_ready=p_ready,
            ALIBI=ALIBI, CU_Q=CU_Q, CU_K=CU_K, BIAS=BIAS, RNG=RNG, BS_IDX=BS_IDX, DBIAS=DBIAS,
            stride_qb=stride_qb, stride_qm=stride_qm, stride_qh=stride_qh,
            stride_kb=stride_kb, stride_kn=stride_kn, stride_kh=stride_kh,
            stride_vb=stride_vb, stride_vn=stride_vn, stride_vh=stride_vh,
            stride_dob=stride_dob, stride_dom=stride_dom, stride_doh=stride_doh,
            stride_dqb=stride_dqb, stride_dqm=stride_dqm, stride_dqh=stride_dqh,
            stride_ob=stride_ob, stride_om=stride_om, stride_oh=stride_oh,
            stride_lb=stride_lb, stride_lh=stride_lh, stride_ab=stride_ab,
            stride_biasb=stride_biasb, stride_biash=stride_biash, stride_biasm=stride_biasm,
            stride_biasn=stride_biasn, stride_dbb=stride_dbb, stride_dbh=stride_dbh,
            stride_dbm=stride_dbm, stride_dbn=stride_dbn, stride_bsb=stride_bsb,
            stride_bsh=stride_bsh, stride_bsr=stride_bsr, bs_m=bs_m, bs_n=bs_n,
            seqlen_q=seqlen_q, seqlen_k=seqlen_k, GROUP=GROUP, scale=scale, qk_scale=qk_scale,
            softcap_scale=softcap_scale, window_left=window_left, window_right=window_right,
            dropout_p=dropout_p, dropout_scale=dropout_scale, q_offset=q_offset,
            k_offset=k_offset, seqlen_q_total=seqlen_q_total, seqlen_k_total=seqlen_k_total,
            batch_offset=batch_offset, head_offset=head_offset, nheads_total=nheads_total,
            HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BOTTOM_RIGHT=BOTTOM_RIGHT, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT,
            HAS_SOFTCAP=HAS_SOFTCAP, DOT_PREC=DOT_PREC, IS_VARLEN=IS_VARLEN, HAS_ALIBI=HAS_ALIBI,
            EVEN_D=EVEN_D, HAS_BIAS=HAS_BIAS, BIAS_BOOL=BIAS_BOOL, HAS_DROPOUT=HAS_DROPOUT,
            SPARSE=SPARSE, STORE_DBIAS=STORE_DBIAS, SIGNAL=ROLES == _BOTH)
    elif ROLES != _DQ:
        if ROLES == _BOTH:
            _wait(p_ready, n_dq)  # the delta of every row of the group is stored
        _dkdv_role(
            i_n=i_p - n_dq, i_b=i_b, i_hk=i_hk, Q=Q, K=K, V=V, DO=DO, DK=DK, DV=DV,
            LSE=LSE, DELTA=DELTA, ALIBI=ALIBI, CU_Q=CU_Q, CU_K=CU_K, BIAS=BIAS, RNG=RNG,
            BS_IDX=BS_IDX, stride_qb=stride_qb, stride_qm=stride_qm, stride_qh=stride_qh,
            stride_kb=stride_kb, stride_kn=stride_kn, stride_kh=stride_kh,
            stride_vb=stride_vb, stride_vn=stride_vn, stride_vh=stride_vh,
            stride_dob=stride_dob, stride_dom=stride_dom, stride_doh=stride_doh,
            stride_dkb=stride_dkb, stride_dkn=stride_dkn, stride_dkh=stride_dkh,
            stride_dvb=stride_dvb, stride_dvn=stride_dvn, stride_dvh=stride_dvh,
            stride_lb=stride_lb, stride_lh=stride_lh, stride_ab=stride_ab,
            stride_biasb=stride_biasb, stride_biash=stride_biash, stride_biasm=stride_biasm,
            stride_biasn=stride_biasn, stride_bsb=stride_bsb, stride_bsh=stride_bsh,
            stride_bsr=stride_bsr, bs_m=bs_m, bs_n=bs_n, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            GROUP=GROUP, scale=scale, qk_scale=qk_scale, softcap_scale=softcap_scale,
            window_left=window_left, window_right=window_right, dropout_p=dropout_p,
            dropout_scale=dropout_scale, q_offset=q_offset, k_offset=k_offset,
            seqlen_q_total=seqlen_q_total, seqlen_k_total=seqlen_k_total,
            batch_offset=batch_offset, head_offset=head_offset, nheads_total=nheads_total,
            HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=KV_BLOCK_M, BLOCK_N=KV_BLOCK_N,
            BOTTOM_RIGHT=BOTTOM_RIGHT, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT,
            HAS_SOFTCAP=HAS_SOFTCAP, DOT_PREC=DOT_PREC, IS_VARLEN=IS_VARLEN, HAS_ALIBI=HAS_ALIBI,
            EVEN_D=EVEN_D, HAS_BIAS=HAS_BIAS, BIAS_BOOL=BIAS_BOOL, HAS_DROPOUT=HAS_DROPOUT,
            SPARSE=SPARSE, DELTA_CG=ROLES == _BOTH)
