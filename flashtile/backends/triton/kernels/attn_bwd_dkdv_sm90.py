"""Hopper (sm_90) dK/dV kernel in Gluon, warp-specialised like the forward
(``attn_fwd_sm90.py``): a one-warp producer loads the CTA's K and V once and streams (Q, dO)
tiles of ``BLOCK_M`` query rows by TMA into a ``STAGES``-deep ring; two consumer warpgroups own
64 keys each and take turns on the tensor cores.

For the keys ``k``, ``v`` of a consumer and each query tile ``i`` that sees them (base-2 scores,
``qk_scale = scale * log2(e)``, ``lse2 = log2(e) * lse``, ``delta = rowsum(dO * O)`` from the dQ
kernel)::

    sᵀ  = k qᵢᵀ                          # [64, BLOCK_M], wgmma, both from SMEM
    pᵀ  = exp2(qk_scale * sᵀ - lse2ᵢ)    # lse2 along the columns (the query rows)
    dpᵀ = v dOᵢᵀ                         # [64, BLOCK_M], wgmma
    dsᵀ = pᵀ * (dpᵀ - deltaᵢ)
    dv += pᵀ dOᵢ ,   dk += dsᵀ qᵢ         # wgmma, pᵀ and dsᵀ from registers

and at the end ``dk *= scale``.  One step of a consumer::

    wait    my turn; issue sᵀ and dpᵀ (two commit groups); arrive the other's turn
    wait    group 1 -> pᵀ (masked on the tiles that cross the diagonal)
    wait    group 2 -> dsᵀ
    wait    my turn; issue dv += pᵀ dO, dk += dsᵀ q; arrive the other's turn
    wait    both -> the (Q, dO) stage goes back to the producer

so one consumer's exponentials run while the other's matrix products occupy the tensor cores.
The CTA's query heads (GQA: every head of its key/value head's group) and tiles are walked in
one loop, gradients summed in registers (deterministic, no atomics).

Scope (``launch_sm90.bwd_eligible`` checks it; other calls take the Triton dK/dV kernel): dense
contiguous ``(B, S, H, D)`` inputs, ``D`` = 128 (64 with causal masking: without it the Triton
kernel is as fast), fp16/bf16, ``Sq`` a multiple of ``BLOCK_M``, ``Sk`` of 128, no optional
feature but causal masking with ``sk >= sq``.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _query_tiles(n0, sq, shift, causal, BLOCK_M: gl.constexpr):
    """First query tile that sees key ``n0`` and the number of tiles from it to the end."""
    lo = 0
    if causal:
        # row m sees key n iff n <= m + shift
        lo = gl.maximum(n0 - shift, 0) // BLOCK_M
    return lo, sq // BLOCK_M - lo


@gluon.jit
def _bwd_producer(desc_q, desc_do, desc_k, desc_v, q_smem, do_smem, k_smem, v_smem, bar_kv,
                  bar_qd, bar_free, sq, sk, nheads_k, group, causal):
    STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    BLOCK_NW: gl.constexpr = k_smem.shape[1]   # keys of one consumer
    i_n = gl.program_id(0)
    i_bh = gl.program_id(1)
    i_b = i_bh // nheads_k
    i_hk = i_bh % nheads_k
    n0 = i_n * 2 * BLOCK_NW
    # the CTA's K and V, each consumer's half in its own buffer
    mbarrier.expect(bar_kv, 2 * desc_k.block_type.nbytes + 2 * desc_v.block_type.nbytes)
    for i in gl.static_range(2):
        tma.async_copy_global_to_shared(desc_k, [i_b * sk + n0 + i * BLOCK_NW, i_hk * HEAD_DIM],
                                        bar_kv, k_smem.index(i))
        tma.async_copy_global_to_shared(desc_v, [i_b * sk + n0 + i * BLOCK_NW, i_hk * HEAD_DIM],
                                        bar_kv, v_smem.index(i))
    lo, n_m = _query_tiles(n0, sq, sk - sq, causal, BLOCK_M)
    for t in range(group * n_m):
        i_h = i_hk * group + t // n_m
        row = i_b * sq + (lo + t % n_m) * BLOCK_M
        i_s = t % STAGES
        # stage i_s is free once both consumers' products of tile t - STAGES completed
        mbarrier.wait(bar_free.index(i_s), ((t // STAGES) & 1) ^ 1, pred=t >= STAGES)
        mbarrier.expect(bar_qd.index(i_s), desc_q.block_type.nbytes + desc_do.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_q, [row, i_h * HEAD_DIM], bar_qd.index(i_s),
                                        q_smem.index(i_s))
        tma.async_copy_global_to_shared(desc_do, [row, i_h * HEAD_DIM], bar_qd.index(i_s),
                                        do_smem.index(i_s))


@gluon.jit
def _bwd_consumer(i_wg, q_smem, do_smem, k_smem, v_smem, bar_kv, bar_qd, bar_free, bar_turn,
                  DK, DV, LSE, DELTA, stride_kb, stride_kn, stride_kh, stride_lb, stride_lh,
                  sq, sk, nheads_k, group, scale, qk_scale, causal):
    STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    BLOCK_NW: gl.constexpr = k_smem.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    g_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    i_n = gl.program_id(0)
    i_bh = gl.program_id(1)
    i_b = i_bh // nheads_k
    i_hk = i_bh % nheads_k
    shift = sk - sq
    n0 = i_n * 2 * BLOCK_NW
    k0 = n0 + i_wg * BLOCK_NW                                   # this consumer's first key
    k_tile = k_smem.index(i_wg)
    v_tile = v_smem.index(i_wg)
    bar_mine = bar_turn.index(i_wg)
    bar_other = bar_turn.index(1 - i_wg)
    o_k = k0 + gl.arange(0, BLOCK_NW, layout=row_s)            # [64] keys
    o_r = gl.arange(0, BLOCK_M, layout=col_s)                  # [BLOCK_M] rows of a tile
    b_dk = gl.zeros([BLOCK_NW, HEAD_DIM], gl.float32, layout=g_layout)   # [64, D]
    b_dv = gl.zeros([BLOCK_NW, HEAD_DIM], gl.float32, layout=g_layout)   # [64, D]
    b_st = gl.zeros([BLOCK_NW, BLOCK_M], gl.float32, layout=s_layout)    # [64, BLOCK_M]
    b_dpt = gl.zeros([BLOCK_NW, BLOCK_M], gl.float32, layout=s_layout)   # [64, BLOCK_M]

    lo, n_m = _query_tiles(n0, sq, shift, causal, BLOCK_M)
    mbarrier.wait(bar_kv, 0)
    for t in range(group * n_m):
        i_h = i_hk * group + t // n_m
        m0 = (lo + t % n_m) * BLOCK_M
        i_s = t % STAGES
        # lse2 and delta of the tile's rows, loaded before the wait so that L2 latency overlaps
        p_l = i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh + m0 + o_r
        b_lse = gl.load(LSE + p_l)                                      # [BLOCK_M]
        b_lse2 = gl.where(b_lse == float("-inf"), float("inf"), b_lse * LOG2E)
        b_delta = gl.load(DELTA + p_l)                                  # [BLOCK_M]
        mbarrier.wait(bar_qd.index(i_s), (t // STAGES) & 1)
        q_tile = q_smem.index(i_s)
        do_tile = do_smem.index(i_s)
        # turn 1: sᵀ = k qᵀ and dpᵀ = v dOᵀ
        mbarrier.wait(bar_mine, (2 * t) & 1)
        b_st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), b_st, use_acc=False, is_async=True)
        b_dpt = warpgroup_mma(v_tile, do_tile.permute((1, 0)), b_dpt, use_acc=False,
                              is_async=True)
        mbarrier.arrive(bar_other)
        b_st = warpgroup_mma_wait(num_outstanding=1, deps=(b_st,))
        if causal:
            # only tiles crossing this consumer's diagonal have invisible (row, key) pairs
            if m0 + shift < k0 + BLOCK_NW - 1:
                m_vis = o_k[:, None] <= (m0 + o_r + shift)[None, :]    # [64, BLOCK_M]
                b_st = gl.where(m_vis, b_st, float("-inf"))
        b_pt = gl.exp2(b_st * qk_scale - b_lse2[None, :])               # [64, BLOCK_M]
        b_dpt = warpgroup_mma_wait(num_outstanding=0, deps=(b_dpt,))
        b_dst = b_pt * (b_dpt - b_delta[None, :])                       # [64, BLOCK_M]
        b_pa = gl.convert_layout(b_pt.to(dtype), a_layout)
        b_dsa = gl.convert_layout(b_dst.to(dtype), a_layout)
        # turn 2: dv += pᵀ dO, dk += dsᵀ q
        mbarrier.wait(bar_mine, (2 * t + 1) & 1)
        b_dv = warpgroup_mma(b_pa, do_tile, b_dv, is_async=True)
        b_dk = warpgroup_mma(b_dsa, q_tile, b_dk, is_async=True)
        mbarrier.arrive(bar_other)
        b_dv, b_dk, b_pa, b_dsa = warpgroup_mma_wait(num_outstanding=0,
                                                     deps=(b_dv, b_dk, b_pa, b_dsa))
        mbarrier.arrive(bar_free.index(i_s))

    o_kg = k0 + gl.arange(0, BLOCK_NW, layout=gl.SliceLayout(1, g_layout))
    o_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, g_layout))
    p_g = (i_b.to(gl.int64) * stride_kb + i_hk.to(gl.int64) * stride_kh
           + o_kg.to(gl.int64)[:, None] * stride_kn + o_d[None, :])     # [64, D]
    gl.store(DK + p_g, (b_dk * scale).to(dtype))
    gl.store(DV + p_g, b_dv.to(dtype))


@gluon.jit
def _bwd_consumer0(q_smem, do_smem, k_smem, v_smem, bar_kv, bar_qd, bar_free, bar_turn, DK, DV,
                   LSE, DELTA, stride_kb, stride_kn, stride_kh, stride_lb, stride_lh, sq, sk,
                   nheads_k, group, scale, qk_scale, causal):
    _bwd_consumer(0, q_smem, do_smem, k_smem, v_smem, bar_kv, bar_qd, bar_free, bar_turn, DK,
                  DV, LSE, DELTA, stride_kb, stride_kn, stride_kh, stride_lb, stride_lh, sq, sk,
                  nheads_k, group, scale, qk_scale, causal)


@gluon.jit
def _bwd_consumer1(q_smem, do_smem, k_smem, v_smem, bar_kv, bar_qd, bar_free, bar_turn, DK, DV,
                   LSE, DELTA, stride_kb, stride_kn, stride_kh, stride_lb, stride_lh, sq, sk,
                   nheads_k, group, scale, qk_scale, causal):
    _bwd_consumer(1, q_smem, do_smem, k_smem, v_smem, bar_kv, bar_qd, bar_free, bar_turn, DK,
                  DV, LSE, DELTA, stride_kb, stride_kn, stride_kh, stride_lb, stride_lh, sq, sk,
                  nheads_k, group, scale, qk_scale, causal)


@gluon.jit
def attn_bwd_dkdv_sm90_kernel(desc_q, desc_do, desc_k, desc_v, DK, DV, LSE, DELTA,
                              stride_kb, stride_kn, stride_kh, stride_lb, stride_lh,
                              sq, sk, nheads_k, group, scale, qk_scale,
                              CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                              num_warps: gl.constexpr):
    """Grid ``(Sk / 128, B * Hk)``: 128 keys of one key/value head per CTA."""
    BLOCK_M: gl.constexpr = desc_q.block_type.shape[0]
    HEAD_DIM: gl.constexpr = desc_q.block_type.shape[1]
    BLOCK_NW: gl.constexpr = desc_k.block_type.shape[0]
    dtype: gl.constexpr = desc_q.dtype

    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], desc_do.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_NW, HEAD_DIM], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_NW, HEAD_DIM], desc_v.layout)
    bar_kv = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bar_qd = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    bar_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    bar_turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar_kv, count=1)
    for i in gl.static_range(2):
        mbarrier.init(bar_turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bar_qd.index(i), count=1)
        mbarrier.init(bar_free.index(i), count=2)
    # consumer 0 takes the first tensor-core turn
    mbarrier.arrive(bar_turn.index(0))

    consumer_args = (q_smem, do_smem, k_smem, v_smem, bar_kv, bar_qd, bar_free, bar_turn, DK, DV,
                     LSE, DELTA, stride_kb, stride_kn, stride_kh, stride_lb, stride_lh, sq, sk,
                     nheads_k, group, scale, qk_scale, CAUSAL)
    gl.warp_specialize([
        (_bwd_consumer0, consumer_args),
        (_bwd_consumer1, consumer_args),
        (_bwd_producer, (desc_q, desc_do, desc_k, desc_v, q_smem, do_smem, k_smem, v_smem,
                         bar_kv, bar_qd, bar_free, sq, sk, nheads_k, group, CAUSAL)),
    ], [4, 1], [232, 24])
