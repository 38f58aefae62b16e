"""Hopper (sm_90) backward kernel in Gluon, warp-specialised like the forward
(``attn_fwd_sm90.py``): a one-warp producer loads a work item's 128 keys of K and V once and streams
(Q, dO, lse, delta) tiles of ``BLOCK_M`` query rows by TMA into a ``STAGES``-deep ring; two
consumer warpgroups own 64 keys each and take turns on the tensor cores (not the fused causal
d = 64 kernel: ``_consume_item``).

For the keys ``k``, ``v`` of a consumer and each query tile ``i`` that sees them (base-2 scores,
``qk_scale = scale * log2(e)``, ``lse2 = log2(e) * lse``, ``delta = rowsum(dO * O)`` computed
before the kernel)::

    sᵀ  = k qᵢᵀ                          # [64, BLOCK_M], wgmma, both from SMEM
    pᵀ  = exp2(qk_scale * sᵀ - lse2ᵢ)    # lse2 along the columns (the query rows)
    dpᵀ = v dOᵢᵀ                         # [64, BLOCK_M], wgmma
    dsᵀ = pᵀ * (dpᵀ - deltaᵢ)
    dv += pᵀ dOᵢ ,   dk += dsᵀ qᵢ         # wgmma, pᵀ and dsᵀ from registers

and at the end ``dk *= scale``.  With ``DQ`` the kernel also computes dQ (five matrix products
per tile instead of the seven of a separate dQ kernel): both consumers write their dsᵀ to shared
memory, and each computes ``dqᵢ[:, its half of D] = scale * dsᵢ k[:, half]`` over the CTA's 128
keys and adds it to a float32 accumulator ``(B * Sq, H * D)`` with one TMA reduction
(``cp.reduce.async.bulk``); the CTAs of a head add into the same rows in no fixed order, so dQ
is not bitwise reproducible.  Without ``DQ`` (the deterministic backward: dQ comes from the
Triton kernel) no floating-point atomics are used (the persistent kernel claims its work items
with an integer counter).  One step of a consumer::

    wait    my turn; issue sᵀ and dpᵀ (two commit groups); arrive the other's turn
    wait    group 1 -> pᵀ (masked on the tiles that cross the diagonal)
    wait    group 2 -> dsᵀ (DQ: into shared memory)
    wait    my turn; issue dv += pᵀ dO, dk += dsᵀ q (DQ: and the previous tile's dq);
            arrive the other's turn
    wait    all -> the (Q, dO) stage goes back to the producer (DQ: dq to the accumulator)

so one consumer's exponentials run while the other's matrix products occupy the tensor cores.
The dq product runs one tile late: by then the other consumer's half of that tile's ds is
written (before its previous turn), so no consumer waits for the other's softmax.  A work
item's query heads (GQA: every head of its key/value head's group) and tiles are walked in one
loop, dK and dV summed in registers.

A work item is 128 keys of one (batch, key/value head) pair, in the order of ``_item_keys``.
Without ``PERSISTENT`` each CTA takes one (the grid has one CTA per item).  With it (d = 64 and
128, ``launch_sm90.bwd_persistent``) the grid has one CTA per SM and the producer claims items
from a counter (``_claim``) and passes each to the consumers through shared memory with the K/V
barrier; the ring, ds buffers and turns run on across items.  With ``DKDV_TMA`` (2-D views of
dK and dV: lengths that are multiples of the tiles, d = 64 and 128) a consumer writes its dK
and dV into its own 64 rows of the item's V buffer and stores each by one TMA copy, then frees
the buffer for the next item's K and V (tuning log, step 72: 5-7% less time at N = 1K-2K,
d = 128); without it, it frees the buffer first and stores from registers while the next load
runs.  A CTA's own launch, K/V load, first turns and stores cost about three query tiles' time
(docs/dev/tuning-log.md, step 52), a fifth of a causal item at 1K-2K keys.

At ``D`` = 256 one consumer cannot hold dK and dV of 64 keys (256 float32 registers a thread):
a work item is 64 keys that both consumers share, each taking half of a tile's rows for
``sᵀ``, ``dpᵀ`` and half of D for dK, dV and dq (``_consume_item_wide``).

Scope (``launch_sm90.bwd_eligible`` checks it): dense ``(B, S, H, D)`` inputs in a layout the
TMA reads (the forward's, each with its own tile coordinates ``*_rb``, ``*_rh``, ``*_ch``),
``D`` = 64, 128 or 256, fp16/bf16, any lengths, no optional feature but a window with
``sk >= sq`` (``MASKED``, the forward's rule: query ``i`` sees key ``j`` iff
``-wl <= j - (i + sk - sq) <= wr``; causal masking is the window (no edge, 0)).  A CTA walks
only the query tiles that see one of its keys, possibly none.  ``WINDOW`` marks a window other
than the causal one: only then are both edges checked and empty CTAs guarded, so the causal
code is what it was before windows (a 2-3% slower causal backward otherwise).

Lengths that are not multiples of the tiles (``RAGGED``): Q, dO, K, V and the dQ accumulator
have 3-D descriptors (the forward's ``_tma_load``; K and V one 128-key tile), so a tile past the
end of a sequence reads zeros and its dQ reduction writes nothing there; lse and delta come
padded to whole tiles (+inf, 0: ``launch_sm90._pad_rows``), so those rows have p = 0.  Keys past
``sk`` (zeros) score 0, and ``p`` is capped at 1 (``s <= lse``): with zero k and v their
products add nothing, and their dK, dV are not stored.

A head dim narrower than the kernel's ``D`` (``launch_sm90.padded_backward``: 80, 96, 192, ...
at 128 or 256) reads Q, dO, K and V through the forward's views with a dimension for the heads
(tiles ``[rows, 1, D]``, ragged ``[1, rows, 1, D]``, the head's index as the coordinate), so
the TMA reads zeros past each head's last column: zero columns add nothing to ``q·k`` or
``dO·v``, and their dQ, dK, dV columns are zero, in buffers ``D`` wide (the accumulator, dK,
dV) that the launcher crops.

A head dim of 128 and a smaller tile's width (144, 160, 192: ``attn_bwd_split_sm90_kernel``,
``launch_sm90.BWD_SPLIT``, the dK/dV kernel only) reads each tensor through two descriptors
(the first 128 columns, then the rest) into buffers of their own and runs the d = 256 items
(``_consume_item_wide``) with ``sᵀ`` and ``dpᵀ`` two products each and consumer 0 computing
dK and dV of the first tile's columns, consumer 1 of the second's: no column past the head.
A head dim of 64 and a smaller tile's width (80, 96: ``launch_sm90.BWD128_SPLIT``, the fused
kernel) reads them the same way and runs the d = 128 items (``_consume_item``) with ``sᵀ``
and ``dpᵀ`` two products each, dK and dV two accumulators each, and dq of the first tile's
columns added by consumer 0, of the second's by consumer 1.
"""
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from .attn_fwd_sm90 import (_heads_view, _key_masked, _key_range, _key_visible, _sequence,
                            _split_sum, _width,
                            _tile_rows, _tma_load)

LOG2E = gl.constexpr(1.4426950408889634)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``global[coord tile] += src`` for a shared-memory tile: one asynchronous TMA reduction
    (``cp.reduce.async.bulk.tensor``), committed like a TMA store (``tma.store_wait``)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


@gluon.jit
def _blocks(n, size, RAGGED: gl.constexpr):
    """Blocks of ``size`` over ``n``: the last one partial with ``RAGGED`` (the aligned code is
    left as it was: the rounding up alone cost the d = 128 kernel 4-20 more spill bytes)."""
    if RAGGED:
        return gl.cdiv(n, size)
    else:
        return n // size


@gluon.jit
def _query_tiles(n0, n_keys, sq, shift, wl, wr, masked, window, Ranges, i_b,
                 BLOCK_M: gl.constexpr, RAGGED: gl.constexpr):
    """First query tile that sees one of the keys ``[n0, n0 + n_keys)`` and the number of tiles
    from it on that do (0 where no row's window reaches them, or where a key mask hides all of
    them: ``Ranges`` int32, ``kernels/key_mask.py``)."""
    lo = 0
    n_m = _blocks(sq, BLOCK_M, RAGGED)
    if masked:
        if window:
            # row m sees key n iff -wl <= n - (m + shift) <= wr
            lo = gl.maximum(n0 - shift - wr, 0) // BLOCK_M
            hi = gl.minimum(n0 + n_keys - 1 - shift + wl + 1, sq)
            n_m = gl.maximum(gl.cdiv(hi, BLOCK_M) - lo, 0)
        else:
            # causal: row m sees key n iff n <= m + shift (every key some row, as sk >= sq)
            lo = gl.maximum(n0 - shift, 0) // BLOCK_M
            n_m = _blocks(sq, BLOCK_M, RAGGED) - lo
    if Ranges.dtype.element_ty == gl.int32:
        # batch entry i_b's visible keys are within [Ranges[i_b, 0], Ranges[i_b, 1])
        dead = (n0 >= gl.load(Ranges + i_b * 3 + 1)) | (n0 + n_keys <= gl.load(Ranges + i_b * 3))
        n_m = gl.where(dead, 0, n_m)
    return lo, n_m


@gluon.jit
def _sparse_rows(Lists, i_b, i_h, i_n, stride_xb, stride_xh, stride_xr, tpr, ipc):
    """A block-sparse item's query tiles: the list of the nonzero mask rows of its key block's
    column (``sparse_index.block_lists`` transposed: ``[n_full, n_part, rows...]`` per column,
    ``ipc`` work items a column, ``tpr`` query tiles a mask row; query head ``i_h``) and how
    many tiles the item walks for each query head of its group."""
    p_col = (Lists + i_b.to(gl.int64) * stride_xb + i_h.to(gl.int64) * stride_xh
             + (i_n // ipc) * stride_xr)
    return p_col + 2, (gl.load(p_col) + gl.load(p_col + 1)) * tpr


@gluon.jit
def _row_tile(u, lo, p_rows, tpr, SPARSE: gl.constexpr):
    """The query tile walked ``u``-th for one head: ``lo + u``, or with ``SPARSE`` the
    ``u % tpr``-th tile of the ``u // tpr``-th mask row in the column's list."""
    if SPARSE:
        return gl.load(p_rows + u // tpr) * tpr + u % tpr
    return lo + u


@gluon.jit
def _masked_scores(b_st, o_k, o_r, m0, k0, shift, wl, wr, masked, window, kpart, b_kvis,
                   KEYMASK: gl.constexpr):
    """``sᵀ`` (``[n keys, m rows]``: keys ``o_k`` from ``k0``, rows ``m0 + o_r``) with the pairs
    that the window (``masked``) or the key mask (``KEYMASK``, where ``kpart``: ``b_kvis`` the
    visible keys) hides set to -inf."""
    N_KEYS: gl.constexpr = b_st.shape[0]
    N_ROWS: gl.constexpr = b_st.shape[1]
    if masked:
        # only tiles crossing an edge of this consumer's window (its diagonal when
        # causal) have invisible (row, key) pairs; a row that sees none of its keys gets
        # p = 0 (``window``: edges other than the causal diagonal, two comparisons a pair)
        if window:
            if ((m0 + shift + wr < k0 + N_KEYS - 1)
                    | (k0 < m0 + N_ROWS - 1 + shift - wl)):
                m_d = o_k[:, None] - (m0 + o_r + shift)[None, :]         # [n, m]
                b_st = gl.where((m_d <= wr) & (m_d >= -wl), b_st, float("-inf"))
        elif m0 + shift < k0 + N_KEYS - 1:
            m_vis = o_k[:, None] <= (m0 + o_r + shift)[None, :]          # [n, m]
            b_st = gl.where(m_vis, b_st, float("-inf"))
    if KEYMASK:
        if kpart:
            b_st = gl.where(b_kvis[:, None], b_st, float("-inf"))
    return b_st


@gluon.jit
def _probs(b_st, b_lse, qk_scale, RAGGED: gl.constexpr):
    """``pᵀ = exp2(qk_scale * sᵀ - log2(e) * lse)`` (``[n keys, m rows]``, ``b_lse`` ``[m]``; a
    row that sees no key has lse -inf and p = 0)."""
    b_lse2 = gl.where(b_lse == float("-inf"), float("inf"), b_lse * LOG2E)
    if RAGGED:
        # p <= 1 (s <= lse): the keys from sk on (zeros: the TMA read past the sequence)
        # are seen by rows whose window reaches them (without masking, every row); with
        # p capped they add nothing (their k and v are zeros, their dK, dV not stored).
        # Rows from sq on have zero q and dO, lse +inf and delta 0 (padding): p = 0
        return gl.exp2(gl.minimum(b_st * qk_scale - b_lse2[None, :], 0.0))
    else:
        return gl.exp2(b_st * qk_scale - b_lse2[None, :])


@gluon.jit
def _store_dkdv(b_dk, b_dv, DK, DV, i_b, i_hk, k0, col, stride_kb, stride_kn, stride_kh, sk,
                scale, RAGGED: gl.constexpr, COLS: gl.constexpr = 0):
    """``dK = scale * b_dk`` and ``dV = b_dv`` (``[n keys, c]`` float32 in a wgmma layout) at
    keys ``k0:`` and columns ``col:`` of head ``i_hk`` of batch entry ``i_b``; with ``RAGGED``
    none from key ``sk`` on, and with ``COLS`` (> 0) none from column ``COLS`` on (dK and dV of
    a padded head dim, narrower than the kernel's tiles)."""
    layout: gl.constexpr = b_dk.type.layout
    o_kg = k0 + gl.arange(0, b_dk.shape[0], layout=gl.SliceLayout(1, layout))
    o_d = col + gl.arange(0, b_dk.shape[1], layout=gl.SliceLayout(0, layout))
    p_g = (i_b.to(gl.int64) * stride_kb + i_hk.to(gl.int64) * stride_kh
           + o_kg.to(gl.int64)[:, None] * stride_kn + o_d[None, :])     # [n, c]
    dtype: gl.constexpr = DK.dtype.element_ty
    if RAGGED or COLS > 0:
        if RAGGED:  # keys from sk on are no keys
            m_k = (o_kg < sk)[:, None]
            if COLS > 0:
                m_k = m_k & (o_d < COLS)[None, :]                       # [n, c]
        else:
            m_k = (o_d < COLS)[None, :]
        gl.store(DK + p_g, (b_dk * scale).to(dtype), mask=m_k)
        gl.store(DV + p_g, b_dv.to(dtype), mask=m_k)
    else:
        gl.store(DK + p_g, (b_dk * scale).to(dtype))
        gl.store(DV + p_g, b_dv.to(dtype))


@gluon.jit
def _store_dkdv_tma(b_dk, b_dv, tile, desc_dk, desc_dv, row, col, scale):
    """``dV = b_dv``, then ``dK = scale * b_dk`` (``[64 keys, D]`` float32 in a wgmma layout),
    each through ``tile`` (this consumer's 64 rows of the item's V buffer, which no other
    warpgroup reads) and one TMA store at ``[row, col]`` of the 2-D views of dK and dV: 64
    scattered 4-byte stores a thread become two shared-memory writes (tuning log, step 72)."""
    dtype: gl.constexpr = tile.dtype
    tile.store(b_dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_dv, [row, col], tile)
    tma.store_wait(pendings=0)  # the store has read the tile
    tile.store((b_dk * scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_dk, [row, col], tile)
    tma.store_wait(pendings=0)


@gluon.jit
def _key_part(o_k, k0, Ranges, KeyMask, i_b, stride_mb):
    """Under a key mask (``Ranges`` int32, ``kernels/key_mask.py``) whether a consumer's keys
    ``o_k`` (``[n]`` from ``k0``) include hidden ones, masked on every tile then, and which
    are visible: ``(kpart, [n] visible)``; without one ``(False, all)``."""
    kpart = False
    b_kvis = o_k >= 0                                                    # [n]
    if Ranges.dtype.element_ty == gl.int32:
        k_range = _key_range(Ranges, KeyMask, i_b, stride_mb)
        kpart = _key_masked(k0, o_k.shape[0], k_range)
        b_kvis = _key_visible(o_k, k_range)
    return kpart, b_kvis


@gluon.jit
def _item_keys(w, n_kb, n_bh, bh_group):
    """``(i_n, i_bh)``: the key block and the (batch, key/value head) of work item ``w``.  Items
    come in groups of ``bh_group`` (batch, head) pairs, each group key block by key block across
    its pairs: with causal masking a block's work falls with its index, so the heaviest blocks
    of a group are claimed first and its light ones fill the tail (``launch_sm90.bwd_group``
    picks the group; with 1 the key blocks of one pair come in order, one pair after another)."""
    per = n_kb * bh_group
    g0 = (w // per) * bh_group
    size = gl.minimum(bh_group, n_bh - g0)
    r = w % per
    return r // size, g0 + r % size


@gluon.jit
def _claim(Counter):
    """The next work item of this CTA: lane 0 of the (one-warp) producer adds 1 to the launch's
    item counter and every lane gets the old value (``[1]``, one per lane: the same)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    p_c = Counter + gl.zeros([1], gl.int32, layout=lay)
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 l, o; mov.u32 l, %laneid; setp.eq.u32 p, l, 0;"
        " mov.u32 o, 0; @p atom.global.add.u32 o, [$1], 1;"
        " shfl.sync.idx.b32 $0, o, 0, 0x1f, 0xffffffff; }",
        "=r,l", [p_c], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dq_add(b_dq, desc_dq, dq_tile, base, row, col, scale, RAGGED: gl.constexpr):
    """``dq_accumulator[row:, col:] += scale * b_dq`` (a ``[BLOCK_M, D / 2]`` float32 tile of
    batch entry ``base``'s rows: ``_tma_load``'s coordinates) through this consumer's
    shared-memory tile ``dq_tile``."""
    tma.store_wait(0)  # the previous reduction has read the tile
    dq_tile.store(b_dq * scale)
    fence_async_shared()
    if RAGGED:  # rows past the sequence are not written
        _tma_reduce_add(desc_dq, [base, row, col],
                        dq_tile.reshape([1, dq_tile.shape[0], dq_tile.shape[1]]))
    else:
        _tma_reduce_add(desc_dq, [base + row, col], dq_tile)


@gluon.jit
def _dq_last(t_last, bar_ds, bar_dsfree, ds_smem, k_half, b_dq0, desc_dq, dq_tile, base, row, col,
             scale, RAGGED: gl.constexpr):
    """dq of an item's last tile (``t_last``, counted over the CTA's items), added one step late
    like the others; its ds buffer goes back to the writers of tile ``t_last + 2``."""
    i_d = t_last % 2
    mbarrier.wait(bar_ds.index(i_d), (t_last // 2) & 1)
    b_dq = warpgroup_mma(ds_smem.index(i_d).permute((1, 0)), k_half, b_dq0, use_acc=False,
                         is_async=True)
    b_dq = warpgroup_mma_wait(num_outstanding=0, deps=(b_dq,))
    mbarrier.arrive(bar_dsfree.index(i_d))
    _dq_add(b_dq, desc_dq, dq_tile, base, row, col, scale, RAGGED)
    tma.store_wait(0)


@gluon.jit
def _produce_item(w, c, t, b_w, desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, q_smem,
                  do_smem, k_smem, v_smem, lse_smem, delta_smem, item_smem, bar_kv, bar_kvfree,
                  bar_qd, bar_free, sq, sk, sq_pad, nheads_k, n_bh, bh_group, group, q_rb, q_rh,
                  q_ch,
                  do_rb, do_rh, do_ch, kv_rb, kv_rh, kv_ch, wl, wr, masked, window, Ranges,
                  Lists, stride_xb, stride_xh, stride_xr, tpr, ipc, CuQ, CuK,
                  PERSISTENT: gl.constexpr, RAGGED: gl.constexpr, desc_q2, desc_do2, desc_k2,
                  desc_v2, q2_smem, do2_smem, k2_smem, v2_smem):
    """Load work item ``w`` (the CTA's ``c``-th): its K and V, then its (Q, dO, lse, delta)
    tiles into the ring from position ``t`` on; the ring position after them.  A split head
    dim (``attn_bwd_split_sm90_kernel``) loads each tile's columns from ``HEAD_DIM`` on through
    the second descriptors into the second buffers, on the same barriers."""
    SPARSE: gl.constexpr = Lists.dtype.element_ty == gl.int32
    # packed sequences' cumulative lengths are int32 (without them the lse pointer stands in)
    VARLEN: gl.constexpr = CuQ.dtype.element_ty == gl.int32
    STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    KEYS: gl.constexpr = k_smem.shape[0]   # keys of a work item
    KV_ROWS: gl.constexpr = _tile_rows(desc_k.block_type.shape)
    # K/V tiles: one per consumer (d <= 128), or one of all the item's keys (d = 256, and with
    # RAGGED or a padded head dim's heads view: a 3-D TMA cannot write into a slice of the
    # buffer)
    KV_LOADS: gl.constexpr = KEYS // KV_ROWS
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    SPLIT: gl.constexpr = q2_smem.shape[2] != HEAD_DIM
    gl.static_assert(not SPLIT or KV_LOADS == 1, "a split head dim: one K/V tile an item")
    nbytes: gl.constexpr = (_split_sum(desc_q.block_type.nbytes + desc_do.block_type.nbytes,
                                       desc_q2.block_type.nbytes + desc_do2.block_type.nbytes,
                                       SPLIT)
                            + desc_lse.block_type.nbytes + desc_delta.block_type.nbytes)
    i_n, i_bh = _item_keys(w, _blocks(sk, KEYS, RAGGED or VARLEN), n_bh, bh_group)
    i_b = i_bh // nheads_k
    i_hk = i_bh % nheads_k
    n0 = i_n * KEYS
    # the item's sequence: its first query and key rows and lengths (packed), else (0, sq,
    # 0, sk)
    q0, sq_i, k0s, sk_i = _sequence(CuQ, CuK, i_b, n_bh // nheads_k, sq, sk, VARLEN)
    if PERSISTENT:
        # the consumers read the previous item's K and V to its last dq: then the slots are
        # free; the item goes to the consumers with the arrival on bar_kv below
        mbarrier.wait(bar_kvfree, (c & 1) ^ 1, pred=c > 0)
        item_smem.store(b_w)
    mbarrier.expect(bar_kv, _split_sum(KV_LOADS * (desc_k.block_type.nbytes
                                                   + desc_v.block_type.nbytes),
                                       desc_k2.block_type.nbytes + desc_v2.block_type.nbytes,
                                       SPLIT))
    # the item's K and V (d <= 128: rows [0, 64) are consumer 0's keys, [64, 128) consumer
    # 1's; the sequences' coordinates in the descriptors: launch_sm90._plan, _tma_load)
    base_k = i_b * kv_rb + i_hk * kv_rh
    if VARLEN:  # (packed rows: the 2-D views of one batch entry)
        base_k = k0s + i_hk * kv_rh
    if KV_LOADS == 1:
        _tma_load(desc_k, base_k, n0, i_hk * kv_ch, bar_kv, k_smem)
        _tma_load(desc_v, base_k, n0, i_hk * kv_ch, bar_kv, v_smem)
        if SPLIT:
            _tma_load(desc_k2, base_k, n0, i_hk * kv_ch + HEAD_DIM, bar_kv, k2_smem)
            _tma_load(desc_v2, base_k, n0, i_hk * kv_ch + HEAD_DIM, bar_kv, v2_smem)
    else:
        for i in gl.static_range(KV_LOADS):
            _tma_load(desc_k, base_k, n0 + i * KV_ROWS, i_hk * kv_ch, bar_kv,
                      k_smem.slice(i * KV_ROWS, KV_ROWS))
            _tma_load(desc_v, base_k, n0 + i * KV_ROWS, i_hk * kv_ch, bar_kv,
                      v_smem.slice(i * KV_ROWS, KV_ROWS))
    lo, n_m = _query_tiles(n0, KEYS, sq_i, sk_i - sq_i, wl, wr, masked, window, Ranges, i_b,
                           BLOCK_M, RAGGED or VARLEN)
    if VARLEN:  # the key blocks past a sequence's end (the longest sequence's) walk no tile
        n_m = gl.where(n0 < sk_i, n_m, 0)
    p_rows = Lists
    if SPARSE:  # the query tiles of the column's mask rows (one list for the group's heads)
        p_rows, n_m = _sparse_rows(Lists, i_b, i_hk * group, i_n, stride_xb, stride_xh,
                                   stride_xr, tpr, ipc)
    for j in range(group * n_m):
        i_h = i_hk * group + j // n_m
        m0 = _row_tile(j % n_m, lo, p_rows, tpr, SPARSE) * BLOCK_M
        i_s = t % STAGES
        # stage i_s is free once both consumers' products of tile t - STAGES completed
        mbarrier.wait(bar_free.index(i_s), ((t // STAGES) & 1) ^ 1, pred=t >= STAGES)
        bar = bar_qd.index(i_s)
        mbarrier.expect(bar, nbytes)
        base_q = i_b * q_rb + i_h * q_rh
        base_do = i_b * do_rb + i_h * do_rh
        # lse and delta are (B, H, sq_pad) float32, seen flat (sq_pad = Sq, or with RAGGED
        # padded to whole tiles: launch_sm90._bwd; packed: (H, sq_pad), packed_prologue)
        p_l = (i_b * nheads_k * group + i_h) * sq_pad + m0
        if VARLEN:  # a tile's rows past the sequence are the next one's: masked (consumers)
            base_q = q0 + i_h * q_rh
            base_do = q0 + i_h * do_rh
            # lse and delta: each sequence's rows from a whole tile on (a TMA's start must be
            # 16-byte aligned; launch_sm90.packed_prologue lays them out)
            p_l = i_h * sq_pad + ((q0 + i_b * BLOCK_M) // BLOCK_M) * BLOCK_M + m0
        _tma_load(desc_q, base_q, m0, i_h * q_ch, bar, q_smem.index(i_s))
        _tma_load(desc_do, base_do, m0, i_h * do_ch, bar, do_smem.index(i_s))
        if SPLIT:
            _tma_load(desc_q2, base_q, m0, i_h * q_ch + HEAD_DIM, bar, q2_smem.index(i_s))
            _tma_load(desc_do2, base_do, m0, i_h * do_ch + HEAD_DIM, bar, do2_smem.index(i_s))
        tma.async_copy_global_to_shared(desc_lse, [p_l], bar, lse_smem.index(i_s))
        tma.async_copy_global_to_shared(desc_delta, [p_l], bar, delta_smem.index(i_s))
        t += 1
    return t


@gluon.jit
def _bwd_producer(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, q_smem, do_smem,
                  k_smem, v_smem, lse_smem, delta_smem, item_smem, bar_kv, bar_kvfree, bar_qd,
                  bar_free, Counter, sq, sk, sq_pad, nheads_k, n_bh, bh_group, group, q_rb, q_rh,
                  q_ch,
                  do_rb, do_rh, do_ch, kv_rb, kv_rh, kv_ch, wl, wr, masked, window, Ranges,
                  Lists, stride_xb, stride_xh, stride_xr, tpr, ipc, CuQ, CuK,
                  PERSISTENT: gl.constexpr, RAGGED: gl.constexpr, desc_q2, desc_do2, desc_k2,
                  desc_v2, q2_smem, do2_smem, k2_smem, v2_smem):
    n_items = _blocks(sk, k_smem.shape[0], RAGGED or CuQ.dtype.element_ty == gl.int32) * n_bh
    if PERSISTENT:
        c = 0  # items of this CTA so far (K/V phase)
        t = 0  # (Q, dO) tiles loaded so far, over the items (ring position and phase)
        b_w = _claim(Counter)                                       # [1]
        w = gl.max(b_w, axis=0)
        while w < n_items:
            t = _produce_item(w, c, t, b_w, desc_q, desc_do, desc_k, desc_v, desc_lse,
                              desc_delta, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                              item_smem, bar_kv, bar_kvfree, bar_qd, bar_free, sq, sk, sq_pad,
                              nheads_k, n_bh, bh_group, group, q_rb, q_rh, q_ch, do_rb, do_rh,
                              do_ch, kv_rb, kv_rh, kv_ch, wl, wr, masked, window, Ranges,
                              Lists, stride_xb, stride_xh, stride_xr, tpr, ipc, CuQ, CuK,
                              PERSISTENT, RAGGED, desc_q2, desc_do2, desc_k2, desc_v2, q2_smem,
                              do2_smem, k2_smem, v2_smem)
            c += 1
            # claimed while the consumers still work on this item's last tiles
            b_w = _claim(Counter)
            w = gl.max(b_w, axis=0)
        # no item left: the consumers read an index past the last one and stop
        mbarrier.wait(bar_kvfree, (c & 1) ^ 1, pred=c > 0)
        item_smem.store(b_w)
        mbarrier.arrive(bar_kv)
    else:
        b_w = gl.full([1], 0, gl.int32, layout=gl.BlockedLayout([1], [32], [1], [0]))
        _produce_item(gl.program_id(0), 0, gl.to_tensor(0), b_w, desc_q, desc_do, desc_k,
                      desc_v, desc_lse, desc_delta, q_smem, do_smem, k_smem, v_smem, lse_smem,
                      delta_smem, item_smem, bar_kv, bar_kvfree, bar_qd, bar_free, sq, sk, sq_pad,
                      nheads_k, n_bh, bh_group, group, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch,
                      kv_rb, kv_rh, kv_ch, wl, wr, masked, window, Ranges, Lists, stride_xb,
                      stride_xh, stride_xr, tpr, ipc, CuQ, CuK, PERSISTENT, RAGGED, desc_q2,
                      desc_do2, desc_k2, desc_v2, q2_smem, do2_smem, k2_smem, v2_smem)


@gluon.jit
def _consumer_kv(k_smem, v_smem, k2_smem, v2_smem, z, i_wg: gl.constexpr):
    """Consumer ``i_wg``'s views of the item's K and V buffers at index ``z`` (``[1, 128 keys,
    D]``): its 64 keys of K and V (``[64, D]``; of a split head dim's second buffers ``[64,
    D2]``, else the same again) and the K columns of its dq: half of D (``[128 keys, D / 2]``),
    or of a split head dim its own tile's (consumer 0 ``[128 keys, D]``, 1 ``[128 keys,
    D2]``)."""
    HALF_N: gl.constexpr = k_smem.shape[1] // 2
    D: gl.constexpr = k_smem.shape[2]
    k_tile = k_smem.index(z).slice(i_wg * HALF_N, HALF_N)
    v_tile = v_smem.index(z).slice(i_wg * HALF_N, HALF_N)
    k2_tile = k2_smem.index(z).slice(i_wg * HALF_N, HALF_N)
    v2_tile = v2_smem.index(z).slice(i_wg * HALF_N, HALF_N)
    if k2_smem.shape[2] != D:
        if i_wg == 0:
            k_half = k_smem.index(z)
        else:
            k_half = k2_smem.index(z)
    else:
        k_half = k_smem.index(z).slice(i_wg * (D // 2), D // 2, dim=1)
    return k_tile, v_tile, k2_tile, v2_tile, k_half


@gluon.jit
def _consume_item(i_wg, w, t, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem,
                  dq_smem, bar_kvfree, bar_qd, bar_free, bar_turn, bar_ds, bar_dsfree, desc_dq, DK,
                  DV, stride_kb, stride_kn, stride_kh, sq, sk, nheads_k, n_bh, bh_group,
                  group, scale, qk_scale, wl, wr, masked, window, Ranges, KeyMask, stride_mb,
                  desc_dk, desc_dv, dk_rb, dk_rh, dk_ch, Lists, stride_xb, stride_xh, stride_xr,
                  tpr, ipc, CuQ, CuK, DQ: gl.constexpr,
                  PERSISTENT: gl.constexpr, RAGGED: gl.constexpr, DKDV_TMA: gl.constexpr,
                  DK_COLS: gl.constexpr, q2_smem, do2_smem, k2_smem, v2_smem, dq2_smem,
                  desc_dq2):
    """Work item ``w`` of one consumer warpgroup, its tiles from ring position ``t`` on (K and V
    already loaded): dK and dV of its 64 keys, and with ``DQ`` its adds into dQ; the ring
    position after them.

    A split head dim (``attn_bwd_split_sm90_kernel`` at 80 = 64 + 16 and 96 = 64 + 32: Q, dO,
    K and V from ``HEAD_DIM`` on in the second buffers, ``D2`` wide): ``sᵀ`` and ``dpᵀ`` two
    products each, dK and dV two accumulators (``HEAD_DIM`` and ``D2`` columns) and two
    products each, and dq of the first tile's columns from consumer 0, of the second's from
    consumer 1 (through ``dq2_smem`` and ``desc_dq2``): no column past the head."""
    STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    D2: gl.constexpr = q2_smem.shape[2]               # (HEAD_DIM: not split)
    SPLIT: gl.constexpr = D2 != HEAD_DIM
    S_GROUPS: gl.constexpr = _split_sum(1, 1, SPLIT)  # commit groups of a tile's sᵀ
    BLOCK_NW: gl.constexpr = k_smem.shape[1] // 2
    HALF_D: gl.constexpr = HEAD_DIM // 2
    # this consumer's columns of dq: half of D, or of a split head dim one tile's
    DQ_W: gl.constexpr = _consumer_cols(HEAD_DIM, D2, i_wg)
    # the dQ accumulator's columns a head: D, or a split head dim's padded width (128 = 2 x 64)
    ACC_D: gl.constexpr = 2 * HEAD_DIM if SPLIT else HEAD_DIM
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    g_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    g2_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D2, 16])
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_W, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
    a2_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g2_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    # packed sequences (the producer's)
    VARLEN: gl.constexpr = CuQ.dtype.element_ty == gl.int32
    shift = sk - sq
    n_kb = _blocks(sk, 2 * BLOCK_NW, RAGGED or VARLEN)
    k_tile, v_tile, k2_tile, v2_tile, k_half = _consumer_kv(k_smem, v_smem, k2_smem, v2_smem,
                                                            0, i_wg)
    # the consumers take turns on the tensor cores (each turn: wait for mine, issue, hand the
    # other its turn), except for the fused causal d = 64 kernel, which is 1-3% faster with the
    # two consumers issuing freely (docs/dev/tuning-log.md, step 67; slower by 2-4% without
    # masking and at causal d = 128)
    TURNS: gl.constexpr = not (HEAD_DIM == 64 and masked and not window and DQ)
    bar_mine = bar_turn.index(i_wg)
    bar_other = bar_turn.index(1 - i_wg)
    o_r = gl.arange(0, BLOCK_M, layout=col_s)                  # [BLOCK_M] rows of a tile
    desc_dqc = desc_dq
    if SPLIT:  # consumer 0: the first tile's columns; 1: the second's, in buffers of its own
        dq_col = i_wg * HEAD_DIM
        if i_wg == 1:
            dq_tile = dq2_smem.index(0)                                  # [BLOCK_M, D2]
            desc_dqc = desc_dq2
        else:
            dq_tile = dq_smem.index(0)                                   # [BLOCK_M, D]
    else:
        dq_tile = dq_smem.index(i_wg)                                    # [BLOCK_M, D / 2]
        dq_col = i_wg * HALF_D

    i_n, i_bh = _item_keys(w, n_kb, n_bh, bh_group)
    i_b = i_bh // nheads_k
    i_hk = i_bh % nheads_k
    n0 = i_n * 2 * BLOCK_NW
    k0 = n0 + i_wg * BLOCK_NW                                   # this consumer's first key
    # the rows of batch entry i_b in the dQ accumulator (_dq_add): i_b * sq, or with RAGGED
    # (3-D) i_b; sq_rows is sq or 1
    sq_rows = sq
    if RAGGED:
        sq_rows = 1
    dq_base = i_b * sq_rows
    # the item's sequence (_produce_item's): packed, its rows from q0 (the dQ accumulator's
    # too) and its own shift; else (0, sq, 0, sk)
    q0, sq_i, k0s, sk_i = _sequence(CuQ, CuK, i_b, n_bh // nheads_k, sq, sk, VARLEN)
    if VARLEN:
        shift = sk_i - sq_i
        dq_base = q0
    o_k = k0 + gl.arange(0, BLOCK_NW, layout=row_s)            # [64] keys
    b_dk = gl.zeros([BLOCK_NW, HEAD_DIM], gl.float32, layout=g_layout)   # [64, D]
    b_dv = gl.zeros([BLOCK_NW, HEAD_DIM], gl.float32, layout=g_layout)   # [64, D]
    b_dk2 = gl.zeros([BLOCK_NW, D2], gl.float32, layout=g2_layout)       # [64, D2] (split)
    b_dv2 = gl.zeros([BLOCK_NW, D2], gl.float32, layout=g2_layout)       # [64, D2]
    # per item, so that they are dead in the item's stores below
    b_st = gl.zeros([BLOCK_NW, BLOCK_M], gl.float32, layout=s_layout)    # [64, BLOCK_M]
    b_dpt = gl.zeros([BLOCK_NW, BLOCK_M], gl.float32, layout=s_layout)   # [64, BLOCK_M]
    b_dq0 = gl.zeros([BLOCK_M, DQ_W], gl.float32, layout=q_layout)       # [BLOCK_M, D / 2]
    m_prev = 0  # the previous tile's first row and head (its dq is added one step late)
    h_prev = 0
    lo, n_m = _query_tiles(n0, 2 * BLOCK_NW, sq_i, shift, wl, wr, masked, window, Ranges, i_b,
                           BLOCK_M, RAGGED or VARLEN)
    if VARLEN:  # (_produce_item's)
        n_m = gl.where(n0 < sk_i, n_m, 0)
    SPARSE: gl.constexpr = Lists.dtype.element_ty == gl.int32
    p_rows = Lists
    if SPARSE:  # (_produce_item's walk)
        p_rows, n_m = _sparse_rows(Lists, i_b, i_hk * group, i_n, stride_xb, stride_xh,
                                   stride_xr, tpr, ipc)
    n_t = group * n_m
    KEYMASK: gl.constexpr = Ranges.dtype.element_ty == gl.int32
    kpart, b_kvis = _key_part(o_k, k0, Ranges, KeyMask, i_b, stride_mb)
    for j in range(n_t):
        i_h = i_hk * group + j // n_m
        m0 = _row_tile(j % n_m, lo, p_rows, tpr, SPARSE) * BLOCK_M
        i_s = t % STAGES
        mbarrier.wait(bar_qd.index(i_s), (t // STAGES) & 1)
        q_tile = q_smem.index(i_s)
        do_tile = do_smem.index(i_s)
        q2_tile = q2_smem.index(i_s)                                    # [BLOCK_M, D2] (split)
        do2_tile = do2_smem.index(i_s)
        if PERSISTENT and (HEAD_DIM == 128 or SPLIT or BLOCK_M == 128):
            # the K/V tiles' matrix descriptors from an index the compiler cannot fold (t >= 0:
            # 0): recomputed per tile, not hoisted over the item loop, where ptxas spilled them
            # (284-376 bytes at d = 128; 380-460 at d = 64 with 128-row tiles, 20-96 so) and
            # reloaded them in this loop; d = 64 with 64-row tiles has the registers
            k_tile, v_tile, k2_tile, v2_tile, k_half = _consumer_kv(k_smem, v_smem, k2_smem,
                                                                    v2_smem, t >> 31, i_wg)
        # turn 1: sᵀ = k qᵀ and dpᵀ = v dOᵀ (a split head dim: each over both tiles' columns)
        if TURNS:
            mbarrier.wait(bar_mine, 0)
        b_st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), b_st, use_acc=False,
                             is_async=True)
        if SPLIT:
            b_st = warpgroup_mma(k2_tile, q2_tile.permute((1, 0)), b_st, is_async=True)
        b_dpt = warpgroup_mma(v_tile, do_tile.permute((1, 0)), b_dpt, use_acc=False,
                              is_async=True)
        if SPLIT:
            b_dpt = warpgroup_mma(v2_tile, do2_tile.permute((1, 0)), b_dpt, is_async=True)
        if TURNS:
            mbarrier.arrive(bar_other)
        b_st = warpgroup_mma_wait(num_outstanding=S_GROUPS, deps=(b_st,))
        b_st = _masked_scores(b_st, o_k, o_r, m0, k0, shift, wl, wr, masked, window, kpart,
                              b_kvis, KEYMASK)
        if VARLEN:
            # a tile's rows and keys past the sequence's ends are the next sequence's (read
            # by the TMA): p = 0 for them, so they add nothing to dK, dV or dQ
            if (m0 + BLOCK_M > sq_i) | (k0 + BLOCK_NW > sk_i):
                m_in = (o_k < sk_i)[:, None] & ((m0 + o_r) < sq_i)[None, :]   # [64, BLOCK_M]
                b_st = gl.where(m_in, b_st, float("-inf"))
        # lse and delta from shared memory (staged with Q and dO): read where they are
        # used, they do not hold registers across the products
        b_pt = _probs(b_st, lse_smem.index(i_s).load(col_s), qk_scale, RAGGED)  # [64, BLOCK_M]
        b_dpt = warpgroup_mma_wait(num_outstanding=0, deps=(b_dpt,))
        b_delta = delta_smem.index(i_s).load(col_s)                     # [BLOCK_M]
        b_dst = b_pt * (b_dpt - b_delta[None, :])                       # [64, BLOCK_M]
        b_pa = gl.convert_layout(b_pt.to(dtype), a_layout)
        b_dsa = gl.convert_layout(b_dst.to(dtype), a_layout)
        if SPLIT:  # (the operands of the second tile's products: the same registers)
            b_pa2 = gl.convert_layout(b_pt.to(dtype), a2_layout)
            b_dsa2 = gl.convert_layout(b_dst.to(dtype), a2_layout)
        i_d = t % 2
        if DQ:
            # this consumer's dsᵀ into the tile's ds buffer [128 keys, BLOCK_M], once both
            # consumers' dq products of tile t - 2 (which read it) completed
            mbarrier.wait(bar_dsfree.index(i_d), ((t // 2) & 1) ^ 1, pred=t >= 2)
            ds_smem.index(i_d).slice(i_wg * BLOCK_NW, BLOCK_NW).store(b_dst.to(dtype))
            fence_async_shared()
            mbarrier.arrive(bar_ds.index(i_d))
        # turn 2: dv += pᵀ dO, dk += dsᵀ q (and dq of tile t - 1)
        if TURNS:
            mbarrier.wait(bar_mine, 1)
        b_dv = warpgroup_mma(b_pa, do_tile, b_dv, is_async=True)
        b_dk = warpgroup_mma(b_dsa, q_tile, b_dk, is_async=True)
        if SPLIT:
            b_dv2 = warpgroup_mma(b_pa2, do2_tile, b_dv2, is_async=True)
            b_dk2 = warpgroup_mma(b_dsa2, q2_tile, b_dk2, is_async=True)
        if DQ:
            # dq[:, my half] = ds k[:, my half] of tile t - 1.  On an item's first tile the
            # product reads a buffer of the previous item (or none) and is discarded.
            mbarrier.wait(bar_ds.index(1 - i_d), ((t - 1) // 2) & 1, pred=j > 0)
            b_dq = warpgroup_mma(ds_smem.index(1 - i_d).permute((1, 0)), k_half, b_dq0,
                                 use_acc=False, is_async=True)
            if TURNS:
                mbarrier.arrive(bar_other)
            if SPLIT:
                b_dv, b_dk, b_dv2, b_dk2, b_dq, b_pa, b_dsa, b_pa2, b_dsa2 = warpgroup_mma_wait(
                    num_outstanding=0,
                    deps=(b_dv, b_dk, b_dv2, b_dk2, b_dq, b_pa, b_dsa, b_pa2, b_dsa2))
            else:
                b_dv, b_dk, b_dq, b_pa, b_dsa = warpgroup_mma_wait(
                    num_outstanding=0, deps=(b_dv, b_dk, b_dq, b_pa, b_dsa))
            mbarrier.arrive(bar_free.index(i_s))
            mbarrier.arrive(bar_dsfree.index(1 - i_d), pred=j > 0)
            if j > 0:
                _dq_add(b_dq, desc_dqc, dq_tile, dq_base, m_prev,
                        h_prev * ACC_D + dq_col, scale, RAGGED)
            m_prev = m0
            h_prev = i_h
        else:
            if TURNS:
                mbarrier.arrive(bar_other)
            if SPLIT:
                b_dv, b_dk, b_dv2, b_dk2, b_pa, b_dsa, b_pa2, b_dsa2 = warpgroup_mma_wait(
                    num_outstanding=0, deps=(b_dv, b_dk, b_dv2, b_dk2, b_pa, b_dsa, b_pa2,
                                             b_dsa2))
            else:
                b_dv, b_dk, b_pa, b_dsa = warpgroup_mma_wait(num_outstanding=0,
                                                             deps=(b_dv, b_dk, b_pa, b_dsa))
            mbarrier.arrive(bar_free.index(i_s))
        t += 1
    if DQ:
        # the last tile's dq (its ds buffer is complete once both consumers arrived on
        # it); with a window, keys that no row's window reaches have no tile (without, the
        # check is the constant True)
        has_tile = True
        if window or KEYMASK or SPARSE or VARLEN:  # (a key mask, a block mask's empty
            has_tile = n_t > 0  # column or a key block past a packed sequence's end: no tile)
        if has_tile:
            _dq_last(t - 1, bar_ds, bar_dsfree, ds_smem, k_half, b_dq0, desc_dqc, dq_tile,
                     dq_base, m_prev, h_prev * ACC_D + dq_col, scale, RAGGED)
    if DKDV_TMA:
        # through this consumer's rows of the V buffer (its products above have completed),
        # before the producer may load the next item's into it (taken afresh: at d = 128 the
        # loop's v_tile is per tile, not carried out of it)
        _store_dkdv_tma(b_dk, b_dv, v_smem.index(0).slice(i_wg * BLOCK_NW, BLOCK_NW), desc_dk,
                        desc_dv, i_b * dk_rb + i_hk * dk_rh + k0, i_hk * dk_ch, scale)
        if PERSISTENT:
            mbarrier.arrive(bar_kvfree)
    else:
        if PERSISTENT:
            # this consumer reads the item's K and V no more: the producer may load the
            # next's while the stores below run
            mbarrier.arrive(bar_kvfree)
        if SPLIT:  # each tile's columns (the second's end at the head's last column)
            _store_dkdv(b_dk, b_dv, DK, DV, i_b, i_hk, k0, 0, stride_kb, stride_kn, stride_kh,
                        sk, scale, RAGGED)
            _store_dkdv(b_dk2, b_dv2, DK, DV, i_b, i_hk, k0, HEAD_DIM, stride_kb, stride_kn,
                        stride_kh, sk, scale, RAGGED)
        elif VARLEN:  # rows of the packed keys; those past the sequence's end are the next's
            # (and columns from DK_COLS on: a padded head dim's narrower dK, dV)
            _store_dkdv(b_dk, b_dv, DK, DV, i_b * 0, i_hk, k0s + k0, 0, stride_kb, stride_kn,
                        stride_kh, k0s + sk_i, scale, True,
                        DK_COLS if DK_COLS < HEAD_DIM else 0)
        else:
            _store_dkdv(b_dk, b_dv, DK, DV, i_b, i_hk, k0, 0, stride_kb, stride_kn, stride_kh,
                        sk, scale, RAGGED, DK_COLS if DK_COLS < HEAD_DIM else 0)
    return t


@gluon.jit
def _split_cols(x):
    """``x`` ``[m, n]`` as its two column halves (each ``[m, n / 2]``, registers unmoved)."""
    m: gl.constexpr = x.shape[0]
    n: gl.constexpr = x.shape[1]
    return gl.split(x.reshape([m, 2, n // 2]).permute((0, 2, 1)))


@gluon.constexpr_function
def _consumer_cols(d1, d2, i_wg):
    """The columns of dK and dV consumer ``i_wg`` computes in ``_consume_item_wide``: half of
    ``d1``, or of a head dim split into tiles ``d1`` and ``d2`` wide the ``i_wg``-th tile's."""
    if d2 == d1:
        return d1 // 2
    return d1 if i_wg == 0 else d2


@gluon.constexpr_function
def _split_pick(a, b, split):
    """``b`` for a split head dim, else ``a``."""
    return b if split else a


@gluon.jit
def _dq_add_wide(b_dq, desc_dq, dq_tile, base, row, col, RAGGED: gl.constexpr):
    """``dq_accumulator[row:, col:] += b_dq`` (``[BLOCK_M, D / 2]`` float32) at d = 256 through
    the consumer's ``[BLOCK_M, D / 8]`` shared-memory tile, a quarter at a time (a whole half's
    tile does not fit beside the ring), each by one TMA reduction."""
    C: gl.constexpr = dq_tile.shape[1]
    b_lo, b_hi = _split_cols(b_dq)
    b_0, b_1 = _split_cols(b_lo)
    b_2, b_3 = _split_cols(b_hi)
    _dq_add(b_0, desc_dq, dq_tile, base, row, col, 1.0, RAGGED)
    _dq_add(b_1, desc_dq, dq_tile, base, row, col + C, 1.0, RAGGED)
    _dq_add(b_2, desc_dq, dq_tile, base, row, col + 2 * C, 1.0, RAGGED)
    _dq_add(b_3, desc_dq, dq_tile, base, row, col + 3 * C, 1.0, RAGGED)


@gluon.jit
def _wide_probs(b_st, lse_tile, o_k, o_r, m0, r0: gl.constexpr, k0, shift, wl, wr, masked,
                window, kpart, b_kvis, qk_scale, KEYMASK: gl.constexpr, RAGGED: gl.constexpr):
    """``pᵀ`` of a consumer's half of a tile at d = 256 (``_consume_item_wide``): its
    ``sᵀ`` ``[64 keys, BLOCK_M / 2]`` masked, rows ``m0 + r0`` on; ``lse_tile`` the tile's
    ``[BLOCK_M]`` lse in shared memory."""
    HALF_M: gl.constexpr = b_st.shape[1]
    b_st = _masked_scores(b_st, o_k, o_r, m0 + r0, k0, shift, wl, wr, masked, window, kpart,
                          b_kvis, KEYMASK)
    return _probs(b_st, lse_tile.slice(r0, HALF_M).load(o_r.type.layout), qk_scale, RAGGED)


@gluon.jit
def _wide_exchange(b_pt, b_dpt, delta_tile, p_smem, ds_smem, r0: gl.constexpr, bar_pds,
                   bar_pdsfree, t):
    """``dsᵀ = pᵀ (dpᵀ - delta)`` of a consumer's half of tile ``t`` at d = 256; its rows of
    ``p`` and ``ds`` into the shared buffers once both consumers' products of tile ``t - 1``
    (which read them) have completed, and back when the other consumer's rows are written."""
    HALF_M: gl.constexpr = b_pt.shape[1]
    dtype: gl.constexpr = p_smem.dtype
    b_delta = delta_tile.slice(r0, HALF_M).load(gl.SliceLayout(0, b_pt.type.layout))
    b_dst = b_pt * (b_dpt - b_delta[None, :])                           # [64, BLOCK_M / 2]
    mbarrier.wait(bar_pdsfree, (t & 1) ^ 1, pred=t > 0)
    p_smem.slice(r0, HALF_M).permute((1, 0)).store(b_pt.to(dtype))
    ds_smem.slice(r0, HALF_M).permute((1, 0)).store(b_dst.to(dtype))
    fence_async_shared()
    mbarrier.arrive(bar_pds)
    mbarrier.wait(bar_pds, t & 1)


@gluon.jit
def _wide_step(t, b_pt, b_dpt, b_dv, b_dk, q_smem, do_smem, k_smem, delta_smem, p_smem, ds_smem,
               dq_tile, bar_free, bar_pds, bar_pdsfree, desc_dq, base, row, col, scale,
               r0: gl.constexpr, c0: gl.constexpr, DQ: gl.constexpr, RAGGED: gl.constexpr):
    """Tile ``t`` of a consumer at d = 256 once its ``pᵀ``, ``dpᵀ`` are computed: the p/ds
    exchange (``_wide_exchange``), dv and dk of its half of D (and dq, which goes to the
    accumulator at ``row``, ``col`` of sequence ``base`` before the next tile's sᵀ and dpᵀ
    are issued: their accumulators and dq's would not fit beside dK and dV in 240 registers);
    the (Q, dO) stage and the p/ds buffers go back.  ``(dv, dk)``."""
    STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HALF_D: gl.constexpr = b_dv.shape[1]
    g_layout: gl.constexpr = b_dv.type.layout
    i_s = t % STAGES
    _wide_exchange(b_pt, b_dpt, delta_smem.index(i_s), p_smem, ds_smem, r0, bar_pds,
                   bar_pdsfree, t)
    q_tile = q_smem.index(i_s)
    do_tile = do_smem.index(i_s)
    b_dv = warpgroup_mma(p_smem.permute((1, 0)), do_tile.slice(c0, HALF_D, dim=1), b_dv,
                         is_async=True)
    b_dk = warpgroup_mma(ds_smem.permute((1, 0)), q_tile.slice(c0, HALF_D, dim=1), b_dk,
                         is_async=True)
    if DQ:
        # (a fresh [BLOCK_M, D / 2] accumulator: carried through the loop it would hold 64
        # registers a thread across the softmax)
        b_dq = warpgroup_mma(ds_smem, k_smem.slice(c0, HALF_D, dim=1),
                             gl.zeros([BLOCK_M, HALF_D], gl.float32, layout=g_layout),
                             use_acc=False, is_async=True)
        b_dv, b_dk, b_dq = warpgroup_mma_wait(num_outstanding=0, deps=(b_dv, b_dk, b_dq))
    else:
        b_dv, b_dk = warpgroup_mma_wait(num_outstanding=0, deps=(b_dv, b_dk))
    mbarrier.arrive(bar_free.index(i_s))
    mbarrier.arrive(bar_pdsfree)
    if DQ:
        _dq_add_wide(b_dq * scale, desc_dq, dq_tile, base, row, col, RAGGED)
    return b_dv, b_dk


@gluon.jit
def _consume_item_wide(i_wg, w, t, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem,
                       pds_smem, dq_smem, bar_qd, bar_free, bar_pds, bar_pdsfree, desc_dq, DK, DV,
                       stride_kb, stride_kn, stride_kh, sq, sk, nheads_k, n_bh, bh_group, group,
                       scale, qk_scale, wl, wr, masked, window, Ranges, KeyMask, stride_mb,
                       DQ: gl.constexpr, RAGGED: gl.constexpr, DK_COLS: gl.constexpr, q2_smem,
                       do2_smem, k2_smem, v2_smem):
    """Work item ``w`` at d = 256, where one consumer cannot hold dK and dV of 64 keys (256
    float32 registers a thread): both consumers take the item's 64 keys, each computes
    ``sᵀ``, ``dpᵀ``, ``pᵀ`` and ``dsᵀ`` for its half of a tile's ``BLOCK_M`` query rows and
    writes ``p`` and ``ds`` to shared memory, and after both halves are written each computes
    dV, dK (and dq) for its half of D::

        sᵀ_c = k q_cᵀ,  dpᵀ_c = v dO_cᵀ           # [64 keys, BLOCK_M / 2] (rows of half c)
        dv[:, D_c] += pᵀ dO[:, D_c],  dk[:, D_c] += dsᵀ q[:, D_c]
        dq[:, D_c]  = ds k[:, D_c]               # to the accumulator: _dq_add_wide

    dq leaves (a quarter tile at a time, through the consumer's float32 tile) before the next
    tile's ``sᵀ`` and ``dpᵀ`` are issued: issued first, their accumulators beside dK, dV and
    dq made the consumers spill, 1.2x slower (docs/dev/tuning-log.md, step 60).  ``p`` and
    ``ds`` share one buffer pair: a tile's halves are written once both consumers' products of
    the previous tile have completed (``bar_pdsfree``), read once both are written
    (``bar_pds``).  Without ``DQ`` (the dK/dV kernel of the default backward at d = 256) the
    same steps without dq.

    A split head dim (``attn_bwd_split_sm90_kernel``: 192 = 128 + 64, 160, 144; without
    ``DQ``): ``sᵀ`` and ``dpᵀ`` are two products each (the first ``HEAD_DIM`` columns, then
    the second buffers' ``D2``), and consumer 0 computes dK, dV of the first tile's columns,
    consumer 1 of the second's (``_consumer_cols``)."""
    STAGES: gl.constexpr = q_smem.shape[0]
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    D2: gl.constexpr = q2_smem.shape[2]           # (HEAD_DIM: not split)
    SPLIT: gl.constexpr = D2 != HEAD_DIM
    gl.static_assert(not (SPLIT and DQ), "a split head dim: the dK/dV kernel only")
    S_GROUPS: gl.constexpr = _split_sum(1, 1, SPLIT)  # commit groups of a tile's sᵀ
    KEYS: gl.constexpr = k_smem.shape[0]
    HALF_M: gl.constexpr = BLOCK_M // 2
    # this consumer's columns of dK and dV: half of D, or of a split head dim one tile's
    HALF_D: gl.constexpr = _consumer_cols(HEAD_DIM, D2, i_wg)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_M, 16])
    g_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_D, 16])
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    shift = sk - sq
    i_n, i_bh = _item_keys(w, _blocks(sk, KEYS, RAGGED), n_bh, bh_group)
    i_b = i_bh // nheads_k
    i_hk = i_bh % nheads_k
    k0 = i_n * KEYS
    r0: gl.constexpr = i_wg * HALF_M                          # this consumer's rows of a tile
    c0: gl.constexpr = i_wg * HALF_D                          # and columns of D
    col0: gl.constexpr = _split_pick(c0, i_wg * HEAD_DIM, SPLIT)  # (in the head)
    s0: gl.constexpr = _split_pick(c0, 0, SPLIT)              # (in its buffers)
    # the buffers of this consumer's columns of Q and dO
    if SPLIT and i_wg == 1:
        qc_smem = q2_smem
        doc_smem = do2_smem
    else:
        qc_smem = q_smem
        doc_smem = do_smem
    dq_tile = dq_smem.index(i_wg)                             # [BLOCK_M, D / 8]
    # the rows of batch entry i_b in the dQ accumulator (_dq_add)
    sq_rows = sq
    if RAGGED:
        sq_rows = 1
    p_smem = pds_smem.index(0)                                # [BLOCK_M, 64 keys] p
    ds_smem = pds_smem.index(1)                               # [BLOCK_M, 64 keys] ds
    o_k = k0 + gl.arange(0, KEYS, layout=row_s)               # [64] keys
    o_r = gl.arange(0, HALF_M, layout=col_s)                  # [BLOCK_M / 2] rows
    b_dk = gl.zeros([KEYS, HALF_D], gl.float32, layout=g_layout)         # [64, D / 2]
    b_dv = gl.zeros([KEYS, HALF_D], gl.float32, layout=g_layout)         # [64, D / 2]
    b_st = gl.zeros([KEYS, HALF_M], gl.float32, layout=s_layout)         # [64, BLOCK_M / 2]
    b_dpt = gl.zeros([KEYS, HALF_M], gl.float32, layout=s_layout)        # [64, BLOCK_M / 2]
    lo, n_m = _query_tiles(k0, KEYS, sq, shift, wl, wr, masked, window, Ranges, i_b, BLOCK_M,
                           RAGGED)
    n_t = group * n_m
    KEYMASK: gl.constexpr = Ranges.dtype.element_ty == gl.int32
    kpart, b_kvis = _key_part(o_k, k0, Ranges, KeyMask, i_b, stride_mb)
    b_pt = gl.zeros([KEYS, HALF_M], gl.float32, layout=s_layout)         # [64, BLOCK_M / 2]
    # (an asynchronous product's result must be waited for in the block that issued it: the
    # loop runs over all tiles but the last, each step issuing the next tile's sᵀ, dpᵀ)
    if n_t > 0:  # the first tile's sᵀ, dpᵀ and pᵀ
        i_s = t % STAGES
        mbarrier.wait(bar_qd.index(i_s), (t // STAGES) & 1)
        b_st = warpgroup_mma(k_smem, q_smem.index(i_s).slice(r0, HALF_M).permute((1, 0)), b_st,
                             use_acc=False, is_async=True)
        if SPLIT:  # sᵀ and dpᵀ sum over both tiles' columns
            b_st = warpgroup_mma(k2_smem, q2_smem.index(i_s).slice(r0, HALF_M).permute((1, 0)),
                                 b_st, is_async=True)
        b_dpt = warpgroup_mma(v_smem, do_smem.index(i_s).slice(r0, HALF_M).permute((1, 0)),
                              b_dpt, use_acc=False, is_async=True)
        if SPLIT:
            b_dpt = warpgroup_mma(v2_smem, do2_smem.index(i_s).slice(r0, HALF_M).permute((1, 0)),
                                  b_dpt, is_async=True)
        b_st = warpgroup_mma_wait(num_outstanding=S_GROUPS, deps=(b_st,))
        b_pt = _wide_probs(b_st, lse_smem.index(i_s), o_k, o_r, lo * BLOCK_M, r0, k0, shift, wl,
                           wr, masked, window, kpart, b_kvis, qk_scale, KEYMASK, RAGGED)
        b_dpt = warpgroup_mma_wait(num_outstanding=0, deps=(b_dpt,))
    for j in range(n_t - 1):
        i_h = i_hk * group + j // n_m
        m0 = (lo + j % n_m) * BLOCK_M
        b_dv, b_dk = _wide_step(t, b_pt, b_dpt, b_dv, b_dk, qc_smem, doc_smem, k_smem,
                                delta_smem, p_smem, ds_smem, dq_tile, bar_free, bar_pds,
                                bar_pdsfree, desc_dq, i_b * sq_rows, m0, i_h * HEAD_DIM + c0,
                                scale, r0, s0, DQ, RAGGED)
        i_s1 = (t + 1) % STAGES
        mbarrier.wait(bar_qd.index(i_s1), ((t + 1) // STAGES) & 1)
        b_st = warpgroup_mma(k_smem, q_smem.index(i_s1).slice(r0, HALF_M).permute((1, 0)), b_st,
                             use_acc=False, is_async=True)
        if SPLIT:
            b_st = warpgroup_mma(k2_smem, q2_smem.index(i_s1).slice(r0, HALF_M).permute((1, 0)),
                                 b_st, is_async=True)
        b_dpt = warpgroup_mma(v_smem, do_smem.index(i_s1).slice(r0, HALF_M).permute((1, 0)),
                              b_dpt, use_acc=False, is_async=True)
        if SPLIT:
            b_dpt = warpgroup_mma(v2_smem,
                                  do2_smem.index(i_s1).slice(r0, HALF_M).permute((1, 0)),
                                  b_dpt, is_async=True)
        b_st = warpgroup_mma_wait(num_outstanding=S_GROUPS, deps=(b_st,))
        b_pt = _wide_probs(b_st, lse_smem.index(i_s1), o_k, o_r, (lo + (j + 1) % n_m) * BLOCK_M,
                           r0, k0, shift, wl, wr, masked, window, kpart, b_kvis, qk_scale,
                           KEYMASK, RAGGED)
        b_dpt = warpgroup_mma_wait(num_outstanding=0, deps=(b_dpt,))
        t += 1
    if n_t > 0:  # the last tile
        i_h = i_hk * group + (n_t - 1) // n_m
        m0 = (lo + (n_t - 1) % n_m) * BLOCK_M
        b_dv, b_dk = _wide_step(t, b_pt, b_dpt, b_dv, b_dk, qc_smem, doc_smem, k_smem,
                                delta_smem, p_smem, ds_smem, dq_tile, bar_free, bar_pds,
                                bar_pdsfree, desc_dq, i_b * sq_rows, m0, i_h * HEAD_DIM + c0,
                                scale, r0, s0, DQ, RAGGED)
        if DQ:
            tma.store_wait(0)
        t += 1
    # (a padded head dim's narrower dK, dV: the columns from DK_COLS on masked; a split one's
    # tiles end at the head's last column)
    _store_dkdv(b_dk, b_dv, DK, DV, i_b, i_hk, k0, col0, stride_kb, stride_kn, stride_kh, sk,
                scale, RAGGED, DK_COLS if DK_COLS < _width(HEAD_DIM, D2) else 0)
    return t


@gluon.jit
def _bwd_consumer(i_wg, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                  item_smem, bar_kv, bar_kvfree, bar_qd, bar_free, bar_turn, bar_ds, bar_dsfree,
                  desc_dq, DK, DV, stride_kb, stride_kn, stride_kh, sq, sk, nheads_k, n_bh,
                  bh_group, group, scale, qk_scale, wl, wr, masked, window, Ranges, KeyMask,
                  stride_mb, desc_dk, desc_dv, dk_rb, dk_rh, dk_ch, Lists, stride_xb, stride_xh,
                  stride_xr, tpr, ipc, CuQ, CuK, DQ: gl.constexpr,
                  PERSISTENT: gl.constexpr, RAGGED: gl.constexpr, DKDV_TMA: gl.constexpr,
                  DK_COLS: gl.constexpr, q2_smem, do2_smem, k2_smem, v2_smem, dq2_smem, desc_dq2):
    if PERSISTENT:
        n_items = _blocks(sk, k_smem.shape[1], RAGGED or CuQ.dtype.element_ty == gl.int32) * n_bh
        w_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        c = 0  # items of this CTA so far (K/V phase)
        t = 0  # tiles so far, over the items: ring stage, ds buffer and their phases
        mbarrier.wait(bar_kv, 0)
        w = gl.max(item_smem.load(w_layout), axis=0)
        while w < n_items:
            t = _consume_item(i_wg, w, t, q_smem, do_smem, k_smem, v_smem, lse_smem,
                              delta_smem, ds_smem, dq_smem, bar_kvfree, bar_qd, bar_free,
                              bar_turn, bar_ds, bar_dsfree, desc_dq, DK, DV, stride_kb,
                              stride_kn, stride_kh, sq, sk, nheads_k, n_bh, bh_group,
                              group, scale, qk_scale, wl, wr, masked, window, Ranges, KeyMask,
                              stride_mb, desc_dk, desc_dv, dk_rb, dk_rh, dk_ch, Lists, stride_xb,
                              stride_xh, stride_xr, tpr, ipc, CuQ, CuK, DQ, PERSISTENT, RAGGED,
                              DKDV_TMA, DK_COLS, q2_smem, do2_smem, k2_smem, v2_smem, dq2_smem,
                              desc_dq2)
            c += 1
            mbarrier.wait(bar_kv, c & 1)
            w = gl.max(item_smem.load(w_layout), axis=0)
    elif q_smem.shape[2] == 256 or (q_smem.shape[2] == 128
                                    and q2_smem.shape[2] != q_smem.shape[2]):  # (or split)
        mbarrier.wait(bar_kv, 0)
        _consume_item_wide(i_wg, gl.program_id(0), gl.to_tensor(0), q_smem, do_smem,
                           k_smem.index(0), v_smem.index(0), lse_smem, delta_smem, ds_smem,
                           dq_smem, bar_qd, bar_free, bar_ds.index(0), bar_dsfree.index(0),
                           desc_dq, DK, DV, stride_kb, stride_kn, stride_kh, sq, sk, nheads_k,
                           n_bh, bh_group, group, scale, qk_scale, wl, wr, masked, window,
                           Ranges, KeyMask, stride_mb, DQ, RAGGED, DK_COLS, q2_smem, do2_smem,
                           k2_smem.index(0), v2_smem.index(0))
    else:
        mbarrier.wait(bar_kv, 0)
        _consume_item(i_wg, gl.program_id(0), gl.to_tensor(0), q_smem, do_smem, k_smem,
                      v_smem, lse_smem, delta_smem, ds_smem, dq_smem, bar_kvfree, bar_qd,
                      bar_free, bar_turn, bar_ds, bar_dsfree, desc_dq, DK, DV, stride_kb,
                      stride_kn, stride_kh, sq, sk, nheads_k, n_bh, bh_group, group, scale,
                      qk_scale, wl, wr, masked, window, Ranges, KeyMask, stride_mb, desc_dk,
                      desc_dv, dk_rb, dk_rh, dk_ch, Lists, stride_xb, stride_xh, stride_xr, tpr,
                      ipc, CuQ, CuK, DQ, PERSISTENT, RAGGED, DKDV_TMA, DK_COLS, q2_smem, do2_smem,
                      k2_smem, v2_smem, dq2_smem, desc_dq2)


# A partition is a function of its own: one wrapper per consumer warpgroup.
@gluon.jit
def _bwd_consumer0(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                   item_smem, bar_kv, bar_kvfree, bar_qd, bar_free, bar_turn, bar_ds, bar_dsfree,
                   desc_dq, DK, DV, stride_kb, stride_kn, stride_kh, sq, sk, nheads_k,
                   n_bh, bh_group, group, scale, qk_scale, wl, wr, masked, window, Ranges, KeyMask,
                   stride_mb, desc_dk, desc_dv, dk_rb, dk_rh, dk_ch, Lists, stride_xb, stride_xh,
                   stride_xr, tpr, ipc, CuQ, CuK, DQ: gl.constexpr,
                   PERSISTENT: gl.constexpr, RAGGED: gl.constexpr, DKDV_TMA: gl.constexpr,
                   DK_COLS: gl.constexpr, q2_smem, do2_smem, k2_smem, v2_smem, dq2_smem,
                   desc_dq2):
    _bwd_consumer(0, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                  item_smem, bar_kv, bar_kvfree, bar_qd, bar_free, bar_turn, bar_ds, bar_dsfree,
                  desc_dq, DK, DV, stride_kb, stride_kn, stride_kh, sq, sk, nheads_k, n_bh,
                  bh_group, group, scale, qk_scale, wl, wr, masked, window, Ranges, KeyMask,
                  stride_mb, desc_dk, desc_dv, dk_rb, dk_rh, dk_ch, Lists, stride_xb, stride_xh,
                  stride_xr, tpr, ipc, CuQ, CuK, DQ, PERSISTENT, RAGGED, DKDV_TMA, DK_COLS,
                  q2_smem, do2_smem, k2_smem, v2_smem, dq2_smem, desc_dq2)


@gluon.jit
def _bwd_consumer1(q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                   item_smem, bar_kv, bar_kvfree, bar_qd, bar_free, bar_turn, bar_ds, bar_dsfree,
                   desc_dq, DK, DV, stride_kb, stride_kn, stride_kh, sq, sk, nheads_k,
                   n_bh, bh_group, group, scale, qk_scale, wl, wr, masked, window, Ranges, KeyMask,
                   stride_mb, desc_dk, desc_dv, dk_rb, dk_rh, dk_ch, Lists, stride_xb, stride_xh,
                   stride_xr, tpr, ipc, CuQ, CuK, DQ: gl.constexpr,
                   PERSISTENT: gl.constexpr, RAGGED: gl.constexpr, DKDV_TMA: gl.constexpr,
                   DK_COLS: gl.constexpr, q2_smem, do2_smem, k2_smem, v2_smem, dq2_smem,
                   desc_dq2):
    _bwd_consumer(1, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                  item_smem, bar_kv, bar_kvfree, bar_qd, bar_free, bar_turn, bar_ds, bar_dsfree,
                  desc_dq, DK, DV, stride_kb, stride_kn, stride_kh, sq, sk, nheads_k, n_bh,
                  bh_group, group, scale, qk_scale, wl, wr, masked, window, Ranges, KeyMask,
                  stride_mb, desc_dk, desc_dv, dk_rb, dk_rh, dk_ch, Lists, stride_xb, stride_xh,
                  stride_xr, tpr, ipc, CuQ, CuK, DQ, PERSISTENT, RAGGED, DKDV_TMA, DK_COLS,
                  q2_smem, do2_smem, k2_smem, v2_smem, dq2_smem, desc_dq2)


@gluon.jit
def attn_bwd_sm90_kernel(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, desc_dq, desc_dk,
                         desc_dv, DK, DV, Counter, stride_kb, stride_kn, stride_kh, sq, sk,
                         sq_pad, nheads_k, n_bh, bh_group, group, q_rb, q_rh, q_ch, do_rb, do_rh,
                         do_ch, kv_rb, kv_rh, kv_ch, dk_rb, dk_rh, dk_ch, scale, qk_scale, wl, wr,
                         Ranges, KeyMask, stride_mb, Lists, stride_xb, stride_xh, stride_xr, tpr,
                         ipc, CuQ, CuK, MASKED: gl.constexpr, WINDOW: gl.constexpr,
                         DQ: gl.constexpr, PERSISTENT: gl.constexpr, RAGGED: gl.constexpr,
                         DKDV_TMA: gl.constexpr, DK_COLS: gl.constexpr, STAGES: gl.constexpr,
                         num_warps: gl.constexpr):
    """Persistent grid (at most one CTA per SM): a work item is 128 keys of one key/value head
    (``Sk / 128 * n_bh`` items, ``n_bh = B * Hk``, in the order of ``_item_keys``), and a CTA's
    producer claims the next from ``Counter`` (an int32 zero before the launch) as the last one
    is drained, so items go to CTAs in order as they free, as the GPU issues CTAs, without a
    CTA's launch, K/V load and first turns between two items.  ``desc_dq`` is the float32 dQ
    accumulator ``(B * Sq, H * D)`` in tiles of ``[BLOCK_M, D / 2]``, at d = 256 ``[BLOCK_M,
    D / 8]`` (read only with ``DQ``; at d = 256 a work item is 64 keys: ``_consume_item_wide``);
    ``desc_lse`` and ``desc_delta`` are ``(B * H * sq_pad,)`` in tiles of ``BLOCK_M``: ``sq_pad``
    is ``Sq``, or with ``RAGGED`` ``Sq`` padded to whole tiles (lse with +inf, delta with 0), so
    that the rows of a last tile past ``Sq`` read p = 0 and delta = 0, not the next head's.
    ``Lists`` (int32, ``sparse_index.block_lists`` transposed: per mask column ``[n_full,
    n_part, rows...]``, columns ``stride_xr`` apart, batch and head entries ``stride_xb``,
    ``stride_xh``; one list for the query heads of a key/value head): a block mask whose
    columns are ``ipc`` work items wide and whose rows are ``tpr`` query tiles high, each item
    walking only its column's rows (``_sparse_rows``; d <= 128); without one the lse pointer
    (the element type tells).  ``CuQ``, ``CuK`` (int32 ``(B + 1,)``): packed sequences
    (``VARLEN``; the persistent d <= 128 kernel): q, k, v, dO and the dQ accumulator are
    ``(total, H, D)`` seen as one batch entry by 2-D descriptors, ``sq`` and ``sk`` the longest
    sequences (they size the key blocks), lse and delta ``(H, sq_pad)`` with each sequence's
    rows from a whole tile on (``launch_sm90.packed_prologue``); an item's sequence
    comes from the cumulative lengths (``_sequence``), its key blocks past the sequence's end
    walk no tile, a tile's rows and keys past the ends (the next sequence's, read by the TMA)
    are masked, and dK, dV are stored from registers with the keys past the end masked (and
    the columns from ``DK_COLS`` on: a padded head dim's dK and dV, narrower than the kernel's
    ``D``, stored by the kernel itself, not by TMA; elsewhere ``DK_COLS`` is ``D``); without
    them the lse pointer."""
    _attn_bwd(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, desc_dq, desc_dk, desc_dv,
              desc_q, desc_do, desc_k, desc_v, desc_dq, DK, DV, Counter, stride_kb, stride_kn,
              stride_kh, sq, sk, sq_pad, nheads_k, n_bh, bh_group, group, q_rb, q_rh, q_ch,
              do_rb, do_rh, do_ch, kv_rb, kv_rh, kv_ch, dk_rb, dk_rh, dk_ch, scale, qk_scale, wl,
              wr, Ranges,
              KeyMask, stride_mb, Lists, stride_xb, stride_xh, stride_xr, tpr, ipc, CuQ, CuK,
              MASKED, WINDOW, DQ, PERSISTENT, RAGGED, DKDV_TMA, DK_COLS, STAGES)


@gluon.jit
def attn_bwd_split_sm90_kernel(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, desc_dq,
                               desc_dk, desc_dv, desc_q2, desc_do2, desc_k2, desc_v2, desc_dq2,
                               DK, DV,
                               Counter, stride_kb, stride_kn, stride_kh, sq, sk, sq_pad, nheads_k,
                               n_bh, bh_group, group, q_rb, q_rh, q_ch, do_rb, do_rh, do_ch,
                               kv_rb, kv_rh, kv_ch, dk_rb, dk_rh, dk_ch, scale, qk_scale, wl, wr,
                               Ranges, KeyMask, stride_mb, Lists, stride_xb, stride_xh, stride_xr,
                               tpr, ipc, CuQ, CuK, MASKED: gl.constexpr, WINDOW: gl.constexpr,
                               DQ: gl.constexpr, PERSISTENT: gl.constexpr, RAGGED: gl.constexpr,
                               DKDV_TMA: gl.constexpr, DK_COLS: gl.constexpr,
                               STAGES: gl.constexpr, num_warps: gl.constexpr):
    """The kernel at a head dim that is two tiles' widths, ``desc_q``, ``desc_do``, ``desc_k``
    and ``desc_v`` tiling each head's first ``D`` columns, ``desc_q2`` ... ``desc_v2`` the rest
    (``D2``), in buffers of their own; no column computed past the head.

    * 128 and a smaller tile (192 = 128 + 64, 160, 144): the dK/dV kernel (no ``DQ``, one CTA
      an item, dense inputs, no mask but a window) with the work items and consumers of
      d = 256 (``_consume_item_wide``: 64 keys that both consumers share), consumer 0
      computing dK and dV of the first 128 columns, consumer 1 of the rest.
    * 64 and a smaller tile (96 = 64 + 32, 80 = 64 + 16): the fused kernel of d = 128 (``DQ``,
      persistent or not; a key mask; not packed sequences or block masks; dK and dV stored by
      the kernel), each consumer owning 64 keys (``_consume_item``), consumer 0
      adding dq of the first tile's columns, consumer 1 of the second's (``desc_dq2``, tiles
      ``[BLOCK_M, D2]``) into the accumulator of width 128."""
    _attn_bwd(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, desc_dq, desc_dk, desc_dv,
              desc_q2, desc_do2, desc_k2, desc_v2, desc_dq2, DK, DV, Counter, stride_kb, stride_kn,
              stride_kh, sq, sk, sq_pad, nheads_k, n_bh, bh_group, group, q_rb, q_rh, q_ch,
              do_rb, do_rh, do_ch, kv_rb, kv_rh, kv_ch, dk_rb, dk_rh, dk_ch, scale, qk_scale, wl,
              wr, Ranges,
              KeyMask, stride_mb, Lists, stride_xb, stride_xh, stride_xr, tpr, ipc, CuQ, CuK,
              MASKED, WINDOW, DQ, PERSISTENT, RAGGED, DKDV_TMA, DK_COLS, STAGES)


@gluon.jit
def _attn_bwd(desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, desc_dq, desc_dk, desc_dv,
              desc_q2, desc_do2, desc_k2, desc_v2, desc_dq2, DK, DV, Counter, stride_kb, stride_kn,
              stride_kh, sq, sk, sq_pad, nheads_k, n_bh, bh_group, group, q_rb, q_rh, q_ch, do_rb,
              do_rh, do_ch, kv_rb, kv_rh, kv_ch, dk_rb, dk_rh, dk_ch, scale, qk_scale, wl, wr,
              Ranges, KeyMask, stride_mb, Lists, stride_xb, stride_xh, stride_xr, tpr, ipc, CuQ,
              CuK, MASKED: gl.constexpr, WINDOW: gl.constexpr, DQ: gl.constexpr,
              PERSISTENT: gl.constexpr, RAGGED: gl.constexpr, DKDV_TMA: gl.constexpr,
              DK_COLS: gl.constexpr, STAGES: gl.constexpr):
    """The kernels' body: the second descriptors are the first ones again but for a split
    head dim (``attn_bwd_split_sm90_kernel``)."""
    # (a padded head dim's views have a tile [rows, 1, D] or [1, rows, 1, D]: _tma_load)
    BLOCK_M: gl.constexpr = _tile_rows(desc_q.block_type.shape)
    HEAD_DIM: gl.constexpr = desc_q.block_type.shape[-1]
    D2: gl.constexpr = desc_q2.block_type.shape[-1]  # (HEAD_DIM: not split)
    SPLIT: gl.constexpr = D2 != HEAD_DIM
    # a split head dim of 64 and a smaller tile (80, 96): the kernel of d = 128's consumers
    NARROW: gl.constexpr = SPLIT and HEAD_DIM == 64
    gl.static_assert(not (SPLIT and not NARROW and (DQ or PERSISTENT)),
                     "a split head dim of 128 and more: the dK/dV kernel, one CTA an item")
    gl.static_assert(not (NARROW and not DQ), "a split head dim of 64 and less: fused")
    gl.static_assert(not (SPLIT and (DKDV_TMA or Lists.dtype.element_ty == gl.int32
                                     or CuQ.dtype.element_ty == gl.int32)),
                     "a split head dim: dense inputs, dK and dV stored by the kernel")
    # d = 256 (and a split head dim of 128 and more): both consumers share an item's 64 keys
    # (_consume_item_wide); else each owns 64 of its 128
    WIDE: gl.constexpr = HEAD_DIM == 256 or (SPLIT and not NARROW)
    gl.static_assert(not (WIDE and PERSISTENT), "the d = 256 consumers walk one item a CTA")
    gl.static_assert(not (WIDE and Lists.dtype.element_ty == gl.int32),
                     "block masks: d <= 128 only")
    gl.static_assert(not ((WIDE or DKDV_TMA or RAGGED or not PERSISTENT)
                          and CuQ.dtype.element_ty == gl.int32),
                     "packed sequences: the persistent d <= 128 kernel, 2-D views, own stores")
    # keys of an item (a RAGGED K/V descriptor's tile holds them all, and a padded head dim's
    # view of heads side by side (the TMA cannot write a reshaped slice of the buffer); at
    # d <= 128 one consumer's otherwise)
    ONE_TILE: gl.constexpr = RAGGED or WIDE or SPLIT or _heads_view(desc_k.block_type.shape)
    KEYS: gl.constexpr = _tile_rows(desc_k.block_type.shape) * (1 if ONE_TILE else 2)
    KV_TILE: gl.constexpr = KEYS if WIDE else KEYS // 2
    dtype: gl.constexpr = desc_q.dtype
    # the tiles' shared-memory layouts (a RAGGED descriptor's is the 3-D one of the same tile)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KV_TILE, HEAD_DIM], dtype)
    # (a split head dim of 64 and more: consumer 0's tile, D wide; consumer 1's D2, dq2_smem)
    DQ_COLS: gl.constexpr = HEAD_DIM // 8 if WIDE else (HEAD_DIM if NARROW else HEAD_DIM // 2)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_COLS],
                                                                   gl.float32)

    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_layout)
    # K and V as [1, keys, D]: the consumers take their tiles with an index (_consume_item)
    k_all = gl.allocate_shared_memory(dtype, [1, KEYS, HEAD_DIM], kv_layout)
    v_all = gl.allocate_shared_memory(dtype, [1, KEYS, HEAD_DIM], kv_layout)
    k_smem = k_all.index(0)
    v_smem = v_all.index(0)
    if SPLIT:  # the columns from HEAD_DIM on
        q2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D2], dtype)
        kv2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KV_TILE, D2], dtype)
        q2_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D2], q2_layout)
        do2_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D2], q2_layout)
        k2_all = gl.allocate_shared_memory(dtype, [1, KEYS, D2], kv2_layout)
        v2_all = gl.allocate_shared_memory(dtype, [1, KEYS, D2], kv2_layout)
    else:
        q2_smem = q_smem
        do2_smem = do_smem
        k2_all = k_all
        v2_all = v_all
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], desc_lse.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], desc_delta.layout)
    # d <= 128 with DQ: two ds buffers [keys, rows] (tile t is written while tile t - 1's is
    # read) and one float32 dq tile per consumer; without DQ they are one row each.  d = 256:
    # p and ds of a tile [rows, keys] (its dq goes to the accumulator from registers)
    DS_ROWS: gl.constexpr = BLOCK_M if WIDE else (KEYS if DQ else 8)
    DS_COLS: gl.constexpr = KEYS if WIDE else BLOCK_M
    DQ_ROWS: gl.constexpr = BLOCK_M if DQ else 8
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                   rank=2)
    ds_smem = gl.allocate_shared_memory(dtype, [2, DS_ROWS, DS_COLS], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [1 if NARROW else 2, DQ_ROWS, DQ_COLS],
                                        dq_layout)
    if NARROW:
        dq2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D2],
                                                                        gl.float32)
        dq2_smem = gl.allocate_shared_memory(gl.float32, [1, BLOCK_M, D2], dq2_layout)
    else:
        dq2_smem = dq_smem
    # the current item's index, from the producer to the consumers
    item_smem = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bar_kv = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bar_kvfree = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bar_qd = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    bar_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    bar_turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    bar_ds = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    bar_dsfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar_kv, count=1)
    mbarrier.init(bar_kvfree, count=2)
    for i in gl.static_range(2):
        mbarrier.init(bar_turn.index(i), count=1)
        mbarrier.init(bar_ds.index(i), count=2)
        mbarrier.init(bar_dsfree.index(i), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(bar_qd.index(i), count=1)
        mbarrier.init(bar_free.index(i), count=2)
    # consumer 0 takes the first tensor-core turn
    mbarrier.arrive(bar_turn.index(0))

    # registers a thread: at d = 256 a consumer holds its halves of dK, dV and dq (192); at
    # d = 128 dK and dV (128) beside sᵀ, dpᵀ and dq: with 232 the causal consumer spilled 28
    # bytes (0 with 240), 8% of the causal 2K backward's time.  Two consumer
    # warpgroups at 240 and the producer warp at 24: 62,208 of the SM's 65,536 registers.
    CONSUMER_REGS: gl.constexpr = 240
    # literal argument tuples: a tuple bound to a name would turn DQ into a run-time value
    gl.warp_specialize([
        (_bwd_consumer0, (q_smem, do_smem, k_all, v_all, lse_smem, delta_smem, ds_smem,
                          dq_smem, item_smem, bar_kv, bar_kvfree, bar_qd, bar_free, bar_turn,
                          bar_ds, bar_dsfree, desc_dq, DK, DV, stride_kb, stride_kn, stride_kh,
                          sq, sk, nheads_k, n_bh, bh_group, group, scale, qk_scale, wl, wr,
                          MASKED, WINDOW, Ranges, KeyMask, stride_mb, desc_dk, desc_dv, dk_rb,
                          dk_rh, dk_ch, Lists, stride_xb, stride_xh, stride_xr, tpr, ipc, CuQ,
                          CuK, DQ, PERSISTENT, RAGGED, DKDV_TMA, DK_COLS, q2_smem, do2_smem,
                          k2_all, v2_all, dq2_smem, desc_dq2)),
        (_bwd_consumer1, (q_smem, do_smem, k_all, v_all, lse_smem, delta_smem, ds_smem,
                          dq_smem, item_smem, bar_kv, bar_kvfree, bar_qd, bar_free, bar_turn,
                          bar_ds, bar_dsfree, desc_dq, DK, DV, stride_kb, stride_kn, stride_kh,
                          sq, sk, nheads_k, n_bh, bh_group, group, scale, qk_scale, wl, wr,
                          MASKED, WINDOW, Ranges, KeyMask, stride_mb, desc_dk, desc_dv, dk_rb,
                          dk_rh, dk_ch, Lists, stride_xb, stride_xh, stride_xr, tpr, ipc, CuQ,
                          CuK, DQ, PERSISTENT, RAGGED, DKDV_TMA, DK_COLS, q2_smem, do2_smem,
                          k2_all, v2_all, dq2_smem, desc_dq2)),
        (_bwd_producer, (desc_q, desc_do, desc_k, desc_v, desc_lse, desc_delta, q_smem, do_smem,
                         k_smem, v_smem, lse_smem, delta_smem, item_smem, bar_kv, bar_kvfree,
                         bar_qd, bar_free, Counter, sq, sk, sq_pad, nheads_k, n_bh, bh_group, group,
                         q_rb, q_rh, q_ch, do_rb, do_rh, do_ch, kv_rb, kv_rh, kv_ch, wl, wr,
                         MASKED, WINDOW, Ranges, Lists, stride_xb, stride_xh, stride_xr, tpr, ipc,
                         CuQ, CuK, PERSISTENT, RAGGED, desc_q2, desc_do2, desc_k2, desc_v2,
                         q2_smem, do2_smem, k2_all.index(0), v2_all.index(0))),
    ], [4, 1], [CONSUMER_REGS, 24])
