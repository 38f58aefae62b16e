"""Hopper (sm_90) dQ kernel in Gluon: the dQ pass of the two-kernel backward at ``D`` = 256 (the
default backward there, ``launch_sm90.fused_pays``, and the deterministic one),
warp-specialised like the forward (``attn_fwd_sm90.py``).  A one-warp producer loads a work
item's ``2 * 64`` query rows of Q and dO (with their lse and delta) once and streams K and V
tiles of ``BLOCK_N`` keys by TMA into a ``STAGES``-deep ring; two consumer warpgroups own 64
rows each.  For every key tile ``j`` a row block sees (base-2 scores, ``qk_scale = scale *
log2(e)``, ``delta = rowsum(dO * O)`` computed before the kernel)::

    s  = q k_jᵀ                       # [64, BLOCK_N], wgmma, both from SMEM
    p  = exp2(qk_scale * s - lse2)    # lse2 = log2(e) * lse, per row
    dp = dO v_jᵀ                      # [64, BLOCK_N], wgmma
    ds = p * (dp - delta)
    dq += ds k_j                      # wgmma, ds from registers

and at the end ``dq *= scale``, written through the consumer's Q tile by one TMA store.  dQ is
held in registers over the whole key loop and written once: no accumulator in memory, no
atomics (the fused kernel's dq reductions are what we estimate bounds it at d = 256:
docs/dev/tuning-log.md, steps 60 and 62).

Scope (``launch_sm90.dq_eligible``): the backward kernel's (dense inputs in a layout the TMA
reads, fp16/bf16, any lengths, a window with ``sk >= sq``), ``D`` = 256.  The kernel is written
for any ``D`` whose tiles fit; at ``D`` = 128 (64-key tiles) it ran 0.93-1.05x the Triton dQ
kernel, which therefore stays the dQ pass there (step 62).  Lengths that
are not multiples of the tiles (``RAGGED``): 3-D descriptors, so tiles past a sequence read
zeros and the dq store writes nothing there; lse and delta come padded to whole 64-row tiles
(+inf, 0).  Keys past ``sk`` are zeros: their ``p`` is capped at 1 and their ``ds k`` adds 0.

A head dim that is the sum of two tile widths (``launch_sm90.split_width``: 144, 160, 192 =
128 + 16, 32, 64; ``attn_bwd_dq_split_sm90_kernel``) reads q, dO, k and v and stores dQ through
two descriptors each, the head's first 128 columns and the rest, in buffers of their own under
the same barriers: ``s`` and ``dp`` are two products each into one accumulator, ``dq`` is two
accumulators (``[64, 128]`` and ``[64, D2]``), stored by two TMA copies; no column is computed
past the head (the kernel of width 256 computes a third more at d = 192).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from .attn_bwd_sm90 import LOG2E
from .attn_fwd_sm90 import _split_sum, _tile_range, _tile_rows, _tma_load, _tma_store


@gluon.jit
def _dq_item(w, n_m, n_bh, nheads, group):
    """``(i_m, i_b, i_h, i_hk)`` of work item ``w``: row blocks from the last (with causal
    masking the heaviest) to the first, each over every (batch, head) pair (``n_bh``)."""
    i_bh = w % n_bh
    i_m = n_m - 1 - w // n_bh
    i_b = i_bh // nheads
    i_h = i_bh % nheads
    return i_m, i_b, i_h, i_h // group


@gluon.jit
def _dq_producer(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, q_smem, do_smem, k_smem,
                 v_smem, lse_smem, delta_smem, bar_q, bar_kv, bar_kvfree, sq, sk, sq_pad, nheads,
                 group, n_m, n_bh, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, kv_rb, kv_rh, kv_ch, wl,
                 wr, masked, desc_q2, desc_do2, desc_k2, desc_v2, q2_smem, do2_smem, k2_smem,
                 v2_smem):
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HALF: gl.constexpr = q_smem.shape[1]          # rows of one consumer
    HEAD_DIM: gl.constexpr = q_smem.shape[2]      # (of the first tile, split or not)
    SPLIT: gl.constexpr = q2_smem.shape[2] != HEAD_DIM
    # a split head dim's two tiles of each tensor arrive on one barrier
    Q_BYTES: gl.constexpr = _split_sum(desc_q.block_type.nbytes + desc_do.block_type.nbytes,
                                       desc_q2.block_type.nbytes + desc_do2.block_type.nbytes,
                                       SPLIT)
    KV_BYTES: gl.constexpr = _split_sum(desc_k.block_type.nbytes + desc_v.block_type.nbytes,
                                        desc_k2.block_type.nbytes + desc_v2.block_type.nbytes,
                                        SPLIT)
    i_m, i_b, i_h, i_hk = _dq_item(gl.program_id(0), n_m, n_bh, nheads, group)
    m0 = i_m * 2 * HALF
    # the item's Q, dO, lse and delta, both consumers' rows
    mbarrier.expect(bar_q, 2 * (Q_BYTES + desc_lse.block_type.nbytes
                                + desc_delta.block_type.nbytes))
    for c in gl.static_range(2):
        _tma_load(desc_q, i_b * q_rb + i_h * q_rh, m0 + c * HALF, i_h * q_ch, bar_q,
                  q_smem.index(c))
        _tma_load(desc_do, i_b * do_rb + i_h * do_rh, m0 + c * HALF, i_h * do_ch, bar_q,
                  do_smem.index(c))
        if SPLIT:  # the columns from HEAD_DIM on
            _tma_load(desc_q2, i_b * q_rb + i_h * q_rh, m0 + c * HALF, i_h * q_ch + HEAD_DIM,
                      bar_q, q2_smem.index(c))
            _tma_load(desc_do2, i_b * do_rb + i_h * do_rh, m0 + c * HALF,
                      i_h * do_ch + HEAD_DIM, bar_q, do2_smem.index(c))
        # lse and delta are (B, H, sq_pad) float32, seen flat
        p_l = (i_b * nheads + i_h) * sq_pad + m0 + c * HALF
        tma.async_copy_global_to_shared(desc_lse, [p_l], bar_q, lse_smem.index(c))
        tma.async_copy_global_to_shared(desc_delta, [p_l], bar_q, delta_smem.index(c))
    lo, hi = _tile_range(i_m * 2 * HALF, sk, sk - sq, wl, wr, masked, 2 * HALF, BLOCK_N)
    base_k = i_b * kv_rb + i_hk * kv_rh
    for j in range(hi - lo):
        i_s = j % STAGES
        # stage i_s is free once both consumers' products of tile j - STAGES completed
        mbarrier.wait(bar_kvfree.index(i_s), ((j // STAGES) & 1) ^ 1, pred=j >= STAGES)
        bar = bar_kv.index(i_s)
        mbarrier.expect(bar, KV_BYTES)
        _tma_load(desc_k, base_k, (lo + j) * BLOCK_N, i_hk * kv_ch, bar, k_smem.index(i_s))
        _tma_load(desc_v, base_k, (lo + j) * BLOCK_N, i_hk * kv_ch, bar, v_smem.index(i_s))
        if SPLIT:
            _tma_load(desc_k2, base_k, (lo + j) * BLOCK_N, i_hk * kv_ch + HEAD_DIM, bar,
                      k2_smem.index(i_s))
            _tma_load(desc_v2, base_k, (lo + j) * BLOCK_N, i_hk * kv_ch + HEAD_DIM, bar,
                      v2_smem.index(i_s))


@gluon.jit
def _dq_probs(b_s, o_m, o_n, m0, n0, shift, wl, wr, masked, window, b_lse2, qk_scale,
              RAGGED: gl.constexpr):
    """``p = exp2(qk_scale * s - lse2)`` of a consumer's ``[64, BLOCK_N]`` tile (rows ``o_m``
    from ``m0``, keys ``n0 + o_n``), the pairs the window hides (``masked``) at 0."""
    HALF: gl.constexpr = b_s.shape[0]
    BLOCK_N: gl.constexpr = b_s.shape[1]
    if masked:
        # only tiles crossing an edge of the window (the diagonal when causal) hide pairs
        if window:
            if ((m0 + shift + wr < n0 + BLOCK_N - 1)
                    | (n0 < m0 + HALF - 1 + shift - wl)):
                m_d = (n0 + o_n)[None, :] - (o_m + shift)[:, None]         # [64, BLOCK_N]
                b_s = gl.where((m_d <= wr) & (m_d >= -wl), b_s, float("-inf"))
        elif m0 + shift < n0 + BLOCK_N - 1:
            b_s = gl.where((n0 + o_n)[None, :] <= (o_m + shift)[:, None], b_s, float("-inf"))
    if RAGGED:
        # p <= 1 (s <= lse): the keys from sk on (zeros: the TMA read past the sequence) add
        # ds * 0 to dq, and with p capped ds stays finite
        return gl.exp2(gl.minimum(b_s * qk_scale - b_lse2[:, None], 0.0))
    else:
        return gl.exp2(b_s * qk_scale - b_lse2[:, None])


@gluon.jit
def _dq_consumer(i_wg, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, bar_q, bar_kv,
                 bar_kvfree, desc_dq, sq, sk, nheads, group, n_m, n_bh, dq_rb, dq_rh, dq_ch, scale,
                 qk_scale, wl, wr, masked, window, RAGGED: gl.constexpr, q2_smem, do2_smem,
                 k2_smem, v2_smem, desc_dq2):
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HALF: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    D2: gl.constexpr = q2_smem.shape[2]           # (HEAD_DIM: not split)
    SPLIT: gl.constexpr = D2 != HEAD_DIM
    S_GROUPS: gl.constexpr = _split_sum(1, 1, SPLIT)  # commit groups of a tile's dp
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    g_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
    g2_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D2, 16])
    a2_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g2_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    i_m, i_b, i_h, i_hk = _dq_item(gl.program_id(0), n_m, n_bh, nheads, group)
    m0 = i_m * 2 * HALF + i_wg * HALF                          # this consumer's first row
    shift = sk - sq
    lo, hi = _tile_range(i_m * 2 * HALF, sk, shift, wl, wr, masked, 2 * HALF, BLOCK_N)
    q_tile = q_smem.index(i_wg)                                 # [64, D]
    do_tile = do_smem.index(i_wg)                               # [64, D]
    o_m = m0 + gl.arange(0, HALF, layout=row_s)                 # [64] rows
    o_n = gl.arange(0, BLOCK_N, layout=col_s)                   # [BLOCK_N] keys of a tile
    mbarrier.wait(bar_q, 0)
    b_lse = lse_smem.index(i_wg).load(row_s)                    # [64]
    # a row that sees no key (lse -inf) gets p = 0
    b_lse2 = gl.where(b_lse == float("-inf"), float("inf"), b_lse * LOG2E)
    b_delta = delta_smem.index(i_wg).load(row_s)                # [64]
    b_dq = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=g_layout)      # [64, D]
    b_z = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)        # [64, BLOCK_N]
    if SPLIT:
        q2_tile = q2_smem.index(i_wg)                           # [64, D2]
        do2_tile = do2_smem.index(i_wg)                         # [64, D2]
        b_dq2 = gl.zeros([HALF, D2], gl.float32, layout=g2_layout)      # [64, D2]
    for j in range(hi - lo):
        i_s = j % STAGES
        k_tile = k_smem.index(i_s)                              # [BLOCK_N, D]
        mbarrier.wait(bar_kv.index(i_s), (j // STAGES) & 1)
        b_s = warpgroup_mma(q_tile, k_tile.permute((1, 0)), b_z, use_acc=False, is_async=True)
        if SPLIT:  # s and dp sum over both tiles' columns
            b_s = warpgroup_mma(q2_tile, k2_smem.index(i_s).permute((1, 0)), b_s,
                                is_async=True)
        b_dp = warpgroup_mma(do_tile, v_smem.index(i_s).permute((1, 0)), b_z, use_acc=False,
                             is_async=True)
        if SPLIT:
            b_dp = warpgroup_mma(do2_tile, v2_smem.index(i_s).permute((1, 0)), b_dp,
                                 is_async=True)
        # the softmax of s runs while dp's product is in flight
        b_s = warpgroup_mma_wait(num_outstanding=S_GROUPS, deps=(b_s,))
        b_p = _dq_probs(b_s, o_m, o_n, m0, (lo + j) * BLOCK_N, shift, wl, wr, masked, window,
                        b_lse2, qk_scale, RAGGED)                # [64, BLOCK_N]
        b_dp = warpgroup_mma_wait(num_outstanding=0, deps=(b_dp,))
        b_ds = b_p * (b_dp - b_delta[:, None])                  # [64, BLOCK_N]
        b_dsa = gl.convert_layout(b_ds.to(dtype), a_layout)
        b_dq = warpgroup_mma(b_dsa, k_tile, b_dq, is_async=True)
        # the stage is released once the product that reads K has completed; the other
        # consumer's products fill the tensor cores meanwhile
        if SPLIT:
            b_dsa2 = gl.convert_layout(b_ds.to(dtype), a2_layout)
            b_dq2 = warpgroup_mma(b_dsa2, k2_smem.index(i_s), b_dq2, is_async=True)
            b_dq, b_dsa, b_dq2, b_dsa2 = warpgroup_mma_wait(
                num_outstanding=0, deps=(b_dq, b_dsa, b_dq2, b_dsa2))
        else:
            b_dq, b_dsa = warpgroup_mma_wait(num_outstanding=0, deps=(b_dq, b_dsa))
        mbarrier.arrive(bar_kvfree.index(i_s))
    # dq through this consumer's Q tile (its last read, s of the last tile, has completed)
    q_tile.store((b_dq * scale).to(dtype))
    if SPLIT:
        q2_tile.store((b_dq2 * scale).to(dtype))
    fence_async_shared()
    _tma_store(desc_dq, i_b * dq_rb + i_h * dq_rh, m0, i_h * dq_ch, q_tile)
    if SPLIT:
        _tma_store(desc_dq2, i_b * dq_rb + i_h * dq_rh, m0, i_h * dq_ch + HEAD_DIM, q2_tile)
    tma.store_wait(0)


# A partition is a function of its own: one wrapper per consumer warpgroup.
@gluon.jit
def _dq_consumer0(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, bar_q, bar_kv,
                  bar_kvfree, desc_dq, sq, sk, nheads, group, n_m, n_bh, dq_rb, dq_rh, dq_ch, scale,
                  qk_scale, wl, wr, masked, window, RAGGED: gl.constexpr, q2_smem, do2_smem,
                  k2_smem, v2_smem, desc_dq2):
    _dq_consumer(0, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, bar_q, bar_kv,
                 bar_kvfree, desc_dq, sq, sk, nheads, group, n_m, n_bh, dq_rb, dq_rh, dq_ch, scale,
                 qk_scale, wl, wr, masked, window, RAGGED, q2_smem, do2_smem, k2_smem, v2_smem,
                 desc_dq2)


@gluon.jit
def _dq_consumer1(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, bar_q, bar_kv,
                  bar_kvfree, desc_dq, sq, sk, nheads, group, n_m, n_bh, dq_rb, dq_rh, dq_ch, scale,
                  qk_scale, wl, wr, masked, window, RAGGED: gl.constexpr, q2_smem, do2_smem,
                  k2_smem, v2_smem, desc_dq2):
    _dq_consumer(1, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, bar_q, bar_kv,
                 bar_kvfree, desc_dq, sq, sk, nheads, group, n_m, n_bh, dq_rb, dq_rh, dq_ch, scale,
                 qk_scale, wl, wr, masked, window, RAGGED, q2_smem, do2_smem, k2_smem, v2_smem,
                 desc_dq2)


@gluon.jit
def attn_bwd_dq_sm90_kernel(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, desc_dq, sq,
                            sk, sq_pad, nheads, group, n_m, n_bh, q_rb, q_rh, q_ch, do_rb, do_rh,
                            do_ch, kv_rb, kv_rh, kv_ch, dq_rb, dq_rh, dq_ch, scale, qk_scale,
                            wl, wr, MASKED: gl.constexpr, WINDOW: gl.constexpr,
                            RAGGED: gl.constexpr, STAGES: gl.constexpr,
                            num_warps: gl.constexpr):
    """One CTA a work item: ``2 * 64`` query rows of one (batch, head) pair (``n_m`` row blocks
    a pair, ``_dq_item``); ``desc_dq`` is dQ in q's dtype and layout, tiles of ``[64, D]``."""
    _attn_bwd_dq(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, desc_dq, desc_q,
                 desc_do, desc_k, desc_v, desc_dq, sq, sk, sq_pad, nheads, group, n_m, n_bh, q_rb,
                 q_rh, q_ch, do_rb, do_rh, do_ch, kv_rb, kv_rh, kv_ch, dq_rb, dq_rh, dq_ch, scale,
                 qk_scale, wl, wr, MASKED, WINDOW, RAGGED, STAGES)


@gluon.jit
def attn_bwd_dq_split_sm90_kernel(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, desc_dq,
                                  desc_q2, desc_do2, desc_k2, desc_v2, desc_dq2, sq, sk, sq_pad,
                                  nheads, group, n_m, n_bh, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch,
                                  kv_rb, kv_rh, kv_ch, dq_rb, dq_rh, dq_ch, scale, qk_scale, wl,
                                  wr, MASKED: gl.constexpr, WINDOW: gl.constexpr,
                                  RAGGED: gl.constexpr, STAGES: gl.constexpr,
                                  num_warps: gl.constexpr):
    """``attn_bwd_dq_sm90_kernel`` at a head dim that is two tile widths (192 = 128 + 64, 160,
    144): ``desc_q`` ... ``desc_dq`` tile each head's first 128 columns, ``desc_q2`` ...
    ``desc_dq2`` the rest (``D2`` wide), read into and stored from buffers of their own (TMA
    tiles are powers of two wide)."""
    _attn_bwd_dq(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, desc_dq, desc_q2,
                 desc_do2, desc_k2, desc_v2, desc_dq2, sq, sk, sq_pad, nheads, group, n_m, n_bh,
                 q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, kv_rb, kv_rh, kv_ch, dq_rb, dq_rh, dq_ch,
                 scale, qk_scale, wl, wr, MASKED, WINDOW, RAGGED, STAGES)


@gluon.jit
def _attn_bwd_dq(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, desc_dq, desc_q2,
                 desc_do2, desc_k2, desc_v2, desc_dq2, sq, sk, sq_pad, nheads, group, n_m, n_bh,
                 q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, kv_rb, kv_rh, kv_ch, dq_rb, dq_rh, dq_ch,
                 scale, qk_scale, wl, wr, MASKED: gl.constexpr, WINDOW: gl.constexpr,
                 RAGGED: gl.constexpr, STAGES: gl.constexpr):
    """The kernels' body: the second descriptors are the first ones again but for a split
    head dim (``attn_bwd_dq_split_sm90_kernel``)."""
    # (a padded head dim's views have a tile [rows, 1, D] or [1, rows, 1, D]: _tma_load)
    HALF: gl.constexpr = _tile_rows(desc_q.block_type.shape)
    HEAD_DIM: gl.constexpr = desc_q.block_type.shape[-1]
    D2: gl.constexpr = desc_q2.block_type.shape[-1]  # (HEAD_DIM: not split)
    BLOCK_N: gl.constexpr = _tile_rows(desc_k.block_type.shape)
    dtype: gl.constexpr = desc_q.dtype
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    if D2 != HEAD_DIM:  # the columns from HEAD_DIM on
        q2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, D2], dtype)
        kv2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D2], dtype)
        q2_smem = gl.allocate_shared_memory(dtype, [2, HALF, D2], q2_layout)
        do2_smem = gl.allocate_shared_memory(dtype, [2, HALF, D2], q2_layout)
        k2_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D2], kv2_layout)
        v2_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D2], kv2_layout)
    else:
        q2_smem = q_smem
        do2_smem = do_smem
        k2_smem = k_smem
        v2_smem = v_smem
    lse_smem = gl.allocate_shared_memory(gl.float32, [2, HALF], desc_lse.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [2, HALF], desc_delta.layout)
    bar_q = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bar_kv = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    bar_kvfree = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar_q, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bar_kv.index(i), count=1)
        mbarrier.init(bar_kvfree.index(i), count=2)
    consumer_args = (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, bar_q, bar_kv,
                     bar_kvfree, desc_dq, sq, sk, nheads, group, n_m, n_bh, dq_rb, dq_rh, dq_ch,
                     scale, qk_scale, wl, wr, MASKED, WINDOW, RAGGED, q2_smem, do2_smem, k2_smem,
                     v2_smem, desc_dq2)
    producer_args = (desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, q_smem, do_smem,
                     k_smem, v_smem, lse_smem, delta_smem, bar_q, bar_kv, bar_kvfree, sq, sk,
                     sq_pad, nheads, group, n_m, n_bh, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch,
                     kv_rb, kv_rh, kv_ch, wl, wr, MASKED, desc_q2, desc_do2, desc_k2, desc_v2,
                     q2_smem, do2_smem, k2_smem, v2_smem)
    gl.warp_specialize([(_dq_consumer0, consumer_args), (_dq_consumer1, consumer_args),
                        (_dq_producer, producer_args)], [4, 1], [240, 24])
