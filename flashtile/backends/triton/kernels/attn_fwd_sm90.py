"""Hopper (sm_90) forward kernel in Gluon, warp-specialised: a one-warp producer (with three
consumers the default partition's warpgroup) streams K/V tiles by TMA into a ``STAGES``-deep
shared-memory ring; ``CONSUMERS`` warpgroups (two; three at d = 64 without masking, or causal
from 3K queries, at 160 registers a thread; one at d = 64 with masking over few keys,
where two or three CTAs share an SM and their turns interleave without a barrier: the launcher
caps the registers a thread, ``launch_sm90.consumers`` and ``ONE_CONSUMER_CTAS``) own 64 query
rows each and take turns on the tensor cores in order (ping-pong: while one issues its Q·Kᵀ and
P·V, the others compute their softmax); within a warpgroup the next tile's Q·Kᵀ is issued
before this tile's P·V, so the softmax of one tile overlaps the tensor cores working on the
other.

For each visible key tile ``j`` of a consumer (base-2 scores, ``qk_scale = scale * log2(e)``)::

    s_j   = q k_jᵀ                                   # [64, BLOCK_N], wgmma, both from SMEM
    m_new = max(m, rowmax(s_j))                      # raw units; the scale is folded into exp2
    alpha = exp2(qk_scale * (m - m_new))
    p_j   = exp2(qk_scale * s_j - qk_scale * m_new)  # one FMA per element
    l     = l * alpha + rowsum(p_j)
    acc   = acc * alpha + p_j v_j                    # wgmma, p_j from registers, v_j from SMEM

and at the end ``out = acc / l``, ``lse = ln(2) * (qk_scale * m + log2(l))``.  A consumer
writes ``out`` into a shared-memory tile and leaves the global store to one TMA instruction:
stored from registers, the scattered store instructions of each thread held up the consumer,
and with it the other consumer's next turn (docs/dev/tuning-log.md, steps 39-40).  At d <= 128
each consumer has a tile of its own and waits only before reusing it, an item later; at
d = 256 two tiles do not fit beside Q and the rings, so the consumers share one, consumer 0
first in every item, each handing it over (mbarrier ``bar_o``) once its store has read it.

One step of a consumer, with ``p_j`` ready in registers::

    wait    my turn                     (mbarrier, armed by the other consumer)
    issue   s_{j+1} = q k_{j+1}ᵀ        (async, commit group 1)
    issue   acc    += p_j v_j           (async, commit group 2)
    arrive  the other consumer's turn
    wait    group 1 -> softmax of tile j+1 while p_j v_j is still on the tensor cores
    wait    group 2 -> release V_j's stage to the producer; acc *= alpha_{j+1}

At d = 256 (``DEFER``) ``acc *= alpha_{j+1}`` moves to the start of the next step, before the
turn: the same instructions in another order, measured 4-8% faster non-causal at 8K-16K; at
d = 128 the same move is 4-6% slower (docs/dev/tuning-log.md, step 127).  There the second
consumer runs at 240 registers, which lets part of the softmax start before the P·V wait
(step 128).

K and V have separate rings: K_{j+1}'s stage is released as soon as both consumers' Q·K_{j+1}ᵀ
completed (group 1), V_j's after P_j·V_j (group 2), and the producer loads K one tile ahead of V.
With one ring for both, the stage of tile j came back only after both consumers' P_j·V_j, which
left the producer no time to fetch K_{j+2} before it was needed (docs/dev/tuning-log.md, step 36).

All consumers walk the same key tiles (those some row of the ``CONSUMERS * 64``-row block sees:
for causal masking up to the block's last row, so the extra tile of the first consumer is
masked), so their turns pair up one for one.  With three consumers a sequence's last block may
end before a consumer's rows (three run only at lengths that are multiples of 128, never of
192): that consumer takes its turns on rows of the next head or past the tensor's end (TMA
reads zeros there) and stores nothing.  With masking (causal) the blocks are laid from the
sequence's end instead (``_block_row``): the block with fewer rows is the first, whose rows see
the fewest keys, and its consumers before row 0 take their turns on rows of the previous head
(or zeros before the tensor) and store nothing.

With masking (``PLAIN``: a window, causal included; tiles walked in order, i.e. not RAGGED,
VARLEN or SPARSE; no key mask) and at least ``PLAIN_KEYS`` keys, a consumer walks the tiles that
no row of its 64 cuts (all but the diagonal's, causal) in a loop compiled without the mask's
code, then the others in a second loop with it: that first loop is about 30% fewer instructions
(d = 128: 472 against 690), 2-8% faster causal from 2K keys at d = 64-256. Below ``PLAIN_KEYS``
the second loop takes every tile: there, where each item's few tiles cross both loops, the
kernel was 4-5% slower with two (docs/dev/tuning-log.md, step 133).

The grid is persistent: one CTA per SM walks the (row block, batch, head) work items
``w = k * G + (pid or G - 1 - pid)`` for rounds ``k`` (``_work_item`` gives their order).  The
producer fetches the next item's Q and first K while the consumers finish the current one;
every barrier phase runs on across items (``it`` counts K/V tiles, ``ts`` tensor-core turns,
``c`` items).

Scope (``launch_sm90.eligible`` checks it; every other call takes the portable Triton kernel):
dense ``(B, S, H, D)`` inputs in a layout the TMA reads (contiguous, slices of a fused QKV
projection, or the ``(B, H, S, D)`` SDPA layout transposed: ``launch_sm90._plan``; the producer
takes each tensor's tile coordinates from its ``*_rb``, ``*_rh``, ``*_ch``), ``D`` in
{64, 128, 256} (``BLOCK_N`` = 64 keys at 256) - or, without a block mask, a multiple of 8
between them run at the next of those widths: the descriptors end at the head's last column,
so the TMA reads zeros past it (zero columns add nothing to q.k and give zero output columns,
which the output's TMA store does not write; ``_tma_load``), or, where the head dim is two
tile widths (``launch_sm90.split_width``: 80, 96, 144, 160, 192) and ``launch_sm90.FWD_SPLIT``
asks for it, by ``attn_fwd_split_sm90_kernel``: every tile in two parts, no column computed
past the head - fp16/bf16, any lengths, no optional feature but
a window with ``sk >= sq`` (``MASKED``): query ``i`` sees key ``j`` iff
``-wl <= j - (i + sk - sq) <= wr`` (causal masking is ``wl`` = no edge, ``wr = 0``; the launcher
passes an edge no key reaches for a side without one).  A block walks only the key tiles its
rows see, and only the tiles that cross a warpgroup's edges apply the mask.  Beside a window, a
key mask (``KEYMASK``) or a block mask (``SPARSE``, lengths multiples of the tiles): an item then
walks the key tiles of its row's nonzero blocks in the order of the row's list (whether a tile
needs the window's mask depends on its index only, so the order does not matter).

Lengths that are not multiples of the tiles (``RAGGED``, from the descriptors' rank): the
descriptors are 3-D, one sequence (a batch entry, or a batch entry and head) by ``S`` rows by
its columns, so a tile that reaches past ``S`` reads zeros there, not the next sequence's rows,
and the output's TMA store leaves those rows unwritten (the lse store is masked).  Zero keys
still score 0: a work item whose last key tile holds the end walks that tile first
(``_tile_order``), and only that first tile's softmax masks the keys from ``sk`` on, so the loop
over whole tiles keeps its code.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

LN2 = gl.constexpr(0.6931471805599453)
# keys from which a masked forward walks its whole tiles in a loop of their own (``PLAIN``)
PLAIN_KEYS = gl.constexpr(2048)


@gluon.constexpr_function
def _ragged_view(shape):
    """Whether a descriptor's tile ``shape`` is one sequence's (``[1, rows, D]`` or
    ``[1, rows, 1, D]``: ``RAGGED``, ``_tma_load``)."""
    return shape[0] == 1


@gluon.constexpr_function
def _tile_rows(shape):
    """The rows of a descriptor's tile ``shape`` (``_tma_load``'s four kinds)."""
    return shape[1] if _ragged_view(shape) else shape[0]


@gluon.constexpr_function
def _heads_view(shape):
    """Whether a descriptor's tile ``shape`` is one head's of heads side by side
    (``[rows, 1, D]`` or ``[1, rows, 1, D]``: a padded head dim, ``_tma_load``)."""
    return len(shape) == 4 or (len(shape) == 3 and shape[1] == 1)


@gluon.constexpr_function
def _width(d1, d2):
    """The head dim of tiles ``d1`` wide and, split into two (``attn_fwd_split_sm90_kernel``),
    ``d2``; ``d2 == d1``: not split (the second descriptors and buffers are the first ones)."""
    return d1 + d2 if d2 != d1 else d1


@gluon.constexpr_function
def _split_sum(a, b, split):
    """``a + b`` for a split head dim (its two tiles' bytes; its two P·V groups), else ``a``."""
    return a + b if split else a


@gluon.jit
def _tma_load(desc, base, row, col, bar, smem):
    """Load the tile at ``row`` of a sequence into ``smem`` (``[rows, D]``).  A 2-D descriptor
    is the view of ``launch_sm90._plan`` and ``base`` the sequence's first row in it; a 3-D one
    with tiles ``[1, rows, D]`` (``RAGGED``: lengths that are not multiples of the tiles) is
    ``(sequences, S, columns)`` and ``base`` the sequence's index, so rows past ``S`` read as
    zeros instead of the next sequence's.  A head dim narrower than the kernel's ``D`` (its
    tiles then reach past the head's last column, where the TMA reads zeros) with heads side
    by side in a row: the view is ``(rows, H, head dim)`` with tiles ``[rows, 1, D]``, or with
    ``RAGGED`` ``(sequences, S, H, head dim)`` with tiles ``[1, rows, 1, D]``, and ``col`` is
    the head's index.  The rank and tile are the descriptor's type: constants in every
    partition (a flag passed to a partition arrives as a run-time value)."""
    RANK: gl.constexpr = len(desc.block_type.shape)
    R: gl.constexpr = smem.shape[0]
    C: gl.constexpr = smem.shape[1]
    if RANK == 4:
        tma.async_copy_global_to_shared(desc, [base, row, col, 0], bar,
                                        smem.reshape([1, R, 1, C]))
    elif RANK == 3:
        if _heads_view(desc.block_type.shape):
            tma.async_copy_global_to_shared(desc, [base + row, col, 0], bar,
                                            smem.reshape([R, 1, C]))
        else:
            tma.async_copy_global_to_shared(desc, [base, row, col], bar,
                                            smem.reshape([1, R, C]))
    else:
        tma.async_copy_global_to_shared(desc, [base + row, col], bar, smem)


@gluon.jit
def _tma_store(desc, base, row, col, smem):
    """Store ``smem`` at ``row`` of a sequence (``_tma_load``'s coordinates and views); the
    TMA writes nothing past ``S`` (``RAGGED``) or past a head's last column."""
    RANK: gl.constexpr = len(desc.block_type.shape)
    R: gl.constexpr = smem.shape[0]
    C: gl.constexpr = smem.shape[1]
    if RANK == 4:
        tma.async_copy_shared_to_global(desc, [base, row, col, 0], smem.reshape([1, R, 1, C]))
    elif RANK == 3:
        if _heads_view(desc.block_type.shape):
            tma.async_copy_shared_to_global(desc, [base + row, col, 0], smem.reshape([R, 1, C]))
        else:
            tma.async_copy_shared_to_global(desc, [base, row, col], smem.reshape([1, R, C]))
    else:
        tma.async_copy_shared_to_global(desc, [base + row, col], smem)


@gluon.jit
def _online_softmax(b_s, m_i, l_i, n0, o_m, o_n, qk_scale, shift, wl, wr, sk,
                    MASKED: gl.constexpr, masked, RAGGED: gl.constexpr, km, k_range,
                    KEYMASK: gl.constexpr, U32: gl.constexpr):
    """One online-softmax update for the score tile ``b_s`` (raw ``q.k``) of keys from ``n0``;
    ``masked``: the tile crosses a row's window ``[o_m + shift - wl, o_m + shift + wr]``.  With
    ``RAGGED`` the keys from ``sk`` on (zeros: the TMA read past the sequence) are masked if
    the tile holds them (a work item's first tile: ``_tile_order``).  With ``KEYMASK``, ``km``:
    the tile is not inside the batch entry's visible key range ``k_range`` (``_key_range``),
    whose keys it then masks.  ``U32``: the window test as one subtraction and one unsigned
    comparison (``0 <= d <= wl + wr`` is ``unsigned(d) <= wl + wr``; ``wl + wr`` and ``d``
    stay far inside int32: ``launch_sm90._window``): with the select, 3 instructions a score
    instead of 5.  A thread's key columns ``o_n`` are its lane's few low bits plus constants
    (multiples of 8), so ``d`` is written as such a constant minus a value per row and low
    bits: the constants become immediates instead of a register per column held across the
    loop (the causal d = 64 kernel's 16 bytes of spills go)."""
    if MASKED:
        if masked:
            if U32:
                # key n0 + o_n is visible to query o_m iff
                # 0 <= o_n - (o_m + shift - wl - n0) <= wl + wr (o_n = (o_n & -8) + (o_n & 7))
                m_d = (o_n & -8)[None, :] - ((o_m + (shift - wl - n0))[:, None]
                                             - (o_n & 7)[None, :])  # [BLOCK_M, BLOCK_N]
                m_v = m_d.to(gl.uint32, bitcast=True) <= (wl + wr).to(gl.uint32, bitcast=True)
                b_s = gl.where(m_v, b_s, float("-inf"))
            else:
                # key n0 + o_n is visible to query o_m iff -wl <= n0 + o_n - (o_m + shift) <= wr
                m_d = (n0 + o_n)[None, :] - (o_m + shift)[:, None]  # [BLOCK_M, BLOCK_N]
                b_s = gl.where((m_d <= wr) & (m_d >= -wl), b_s, float("-inf"))
    if KEYMASK:
        if km:
            b_s = gl.where(_key_visible(n0 + o_n, k_range)[None, :], b_s, float("-inf"))
    if RAGGED:
        if n0 + o_n.shape[0] > sk:
            b_s = gl.where(((n0 + o_n) < sk)[None, :], b_s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(b_s, axis=1))                     # [BLOCK_M]
    m_ref = m_new
    if MASKED or KEYMASK:
        if masked | km:
            # a row that has seen no visible key yet (a window's first tiles, keys masked)
            # keeps m = -inf, and exp2(-inf - -inf) would be NaN: measured from 0, its p and
            # alpha are 0
            m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    b_alpha = gl.exp2((m_i - m_ref) * qk_scale)                     # [BLOCK_M]
    b_p = gl.exp2(b_s * qk_scale - (m_ref * qk_scale)[:, None])     # [BLOCK_M, BLOCK_N]
    l_i = l_i * b_alpha + gl.sum(b_p, axis=1)
    return b_p, m_new, l_i, b_alpha


@gluon.jit
def _key_range(Ranges, KeyMask, i_b, stride_mb):
    """Batch entry ``i_b``'s keys under a key mask (``kernels/key_mask.py``): ``(lo, hi, full,
    mask row)``.  A key outside ``[lo, hi)`` is invisible, one inside it visible when ``full``
    (the visible keys are a range) or when its mask element is set."""
    p_r = Ranges + i_b * 3
    return (gl.load(p_r), gl.load(p_r + 1), gl.load(p_r + 2),
            KeyMask + i_b.to(gl.int64) * stride_mb)


@gluon.jit
def _key_tiles(lo, hi, k_range, BLOCK_N: gl.constexpr):
    """The key tiles ``[lo, hi)`` narrowed to those holding a key of the visible range
    (``_key_range``); where none is left, tile ``lo`` alone, all of its keys masked (a row
    that sees no key: output 0, lse -inf)."""
    lo_k = gl.maximum(lo, k_range[0] // BLOCK_N)
    hi_k = gl.minimum(hi, gl.cdiv(k_range[1], BLOCK_N))
    empty = hi_k <= lo_k
    return gl.where(empty, lo, lo_k), gl.where(empty, lo + 1, hi_k)


@gluon.jit
def _key_masked(n0, n: gl.constexpr, k_range):
    """Whether the keys ``[n0, n0 + n)`` need the key mask (``_key_range``): they cross an edge
    of the visible range, or the range has holes."""
    return (n0 < k_range[0]) | (n0 + n > k_range[1]) | (k_range[2] == 0)


@gluon.jit
def _key_visible(o_k, k_range):
    """Which keys ``o_k`` (``[n]``) are visible under the key mask (``_key_range``; the mask
    row's keys are contiguous)."""
    k_lo, k_hi, k_full, p_km = k_range
    b_vis = (o_k >= k_lo) & (o_k < k_hi)                              # [n]
    if k_full == 0:  # holes in the range: the mask's own elements (inside the range only)
        b_vis = b_vis & (gl.load(p_km + o_k, mask=b_vis, other=0) != 0)
    return b_vis


@gluon.jit
def _work_item(k, pid, n_ctas, n_m, n_bh, nheads, lpt, causal):
    """Work item of round ``k`` for CTA ``pid``: ``(w, i_m, i_b, i_h)``, ``w`` out of range when
    the last round has no item for this CTA.  The rounds snake over the CTAs (even rounds from
    CTA 0 up, odd ones down).  By default the row blocks of one head are neighbours (the CTAs
    at work at one time share their K/V through L2), for causal masking last row block (the
    longest) first.  ``lpt`` sorts every causal item longest first instead (row blocks from
    the last, every head of one before the next): the launcher asks for it where the default
    order would leave one CTA far more work than the mean (``launch_sm90.causal_order``)."""
    w = k * n_ctas + pid + (k % 2) * (n_ctas - 1 - 2 * pid)
    if lpt:
        i_m = n_m - 1 - w // n_bh
        i_bh = w % n_bh
    else:
        i_m = w % n_m
        i_bh = w // n_m
        if causal:
            i_m = n_m - 1 - i_m
    return w, i_m, i_bh // nheads, i_bh % nheads


@gluon.jit
def _tile_order(lo, hi, sk, BLOCK_N: gl.constexpr):
    """``rot`` of a work item's key tiles ``[lo, hi)`` when the keys are not a multiple of the
    tiles (``RAGGED``): the ``u``-th tile walked is ``lo + (u + rot) % (hi - lo)``
    (``_walk``).  Where the item's last tile holds the end of the keys (``rot = hi - lo - 1``)
    it is walked first, so that only the first tile's softmax masks the keys past the end (the
    order of the tiles does not change the result) and the loop runs on whole tiles (masking
    the last tile in the loop spilled 68-476 bytes at d = 128 / 256, compiled for sm_90a)."""
    return gl.where(hi * BLOCK_N > sk, hi - lo - 1, 0)


@gluon.jit
def _walk(u, lo, hi, rot, RAGGED: gl.constexpr):
    """The key tile walked ``u``-th among ``[lo, hi)`` (``_tile_order``)."""
    if RAGGED:
        u = (u + rot) % (hi - lo)
    return lo + u


@gluon.jit
def _sparse_row(Lists, i_b, i_h, i_m, stride_xb, stride_xh, stride_xr, tpb, ipr):
    """A block-sparse item's key tiles (``Lists``: ``sparse_index.block_lists``, one row per
    mask row of ``ipr`` work items, ``[n_full, n_part, columns...]``; ``tpb`` key tiles a mask
    block): ``(p_cols, n_tiles, empty)``, the row's column list, how many tiles the item walks
    and whether it has no block (it then walks one tile, every key masked: output 0, lse
    -inf)."""
    p_row = (Lists + i_b.to(gl.int64) * stride_xb + i_h.to(gl.int64) * stride_xh
             + (i_m // ipr) * stride_xr)
    n_blocks = gl.load(p_row) + gl.load(p_row + 1)
    return p_row + 2, gl.maximum(n_blocks * tpb, 1), n_blocks == 0


@gluon.jit
def _tile_at(u, lo, hi, rot, p_cols, tpb, RAGGED: gl.constexpr, SPARSE: gl.constexpr):
    """The key tile walked ``u``-th: ``_walk``'s, or with ``SPARSE`` the ``u % tpb``-th tile of
    the ``u // tpb``-th block in the row's list (``_sparse_row``)."""
    if SPARSE:
        return gl.load(p_cols + u // tpb) * tpb + u % tpb
    return _walk(u, lo, hi, rot, RAGGED)


@gluon.jit
def _sequence(CuQ, CuK, i_b, batch, sq, sk, VARLEN: gl.constexpr):
    """Batch entry ``i_b``'s ``(first query row, queries, first key row, keys)``: with
    ``VARLEN`` from the cumulative lengths ``CuQ``, ``CuK`` (int32 ``(B + 1,)``; rows of the
    packed ``(total, H, D)`` tensors), else ``(0, sq, 0, sk)``.  (An index past the batch, a
    round's item beyond the last, reads the last entry's.)"""
    if VARLEN:
        i = gl.minimum(i_b, batch - 1)
        q0 = gl.load(CuQ + i)
        k0 = gl.load(CuK + i)
        return q0, gl.load(CuQ + i + 1) - q0, k0, gl.load(CuK + i + 1) - k0
    return 0, sq, 0, sk


@gluon.jit
def _packed_item(w, Items, n_m, nheads, n_work):
    """Packed sequences: work item ``w``'s ``(i_m, i_b, i_h)`` from ``Items`` (int32 ``(B *
    n_m,)``, each (sequence, row block) pair as ``i_b * n_m + i_m``, sorted by the key tiles
    the pair walks, most first, the pairs past a sequence's end last: launch_sm90.packed_order);
    the heads of one pair are neighbours.  The snake then deals the longest items first, as
    a longest-processing-time schedule does: dealt in the longest sequence's row-block order
    instead, one CTA got 1.29x the mean work non-causal and 1.33x causal at the variants
    sweep's 17 sequences, sorted 1.01x and 1.08x (counted by the launcher's model).  (An item
    past the last, in a CTA's last round, reads the last pair.)"""
    e = gl.load(Items + gl.minimum(w, n_work - 1) // nheads)
    return e % n_m, e // n_m, w % nheads


@gluon.jit
def _block_row(i_m, sq, BLOCK_M: gl.constexpr, end):
    """The first query row of row block ``i_m`` (``BLOCK_M`` rows): ``i_m * BLOCK_M``, or with
    ``end`` (three consumers with masking) the blocks laid from the sequence's end, so that
    the block of fewer rows is the first, whose rows see the fewest keys, and not the last,
    whose see the most while the consumers past its rows walk the same tiles for nothing
    (causal d = 64 at 4K: the last block is a third full); rows before 0 are no work."""
    m0 = i_m * BLOCK_M
    if end:
        m0 = m0 - (gl.cdiv(sq, BLOCK_M) * BLOCK_M - sq)
    return m0


@gluon.jit
def _tile_range(m0, sk, shift, wl, wr, masked, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key tiles ``[lo, hi)`` that some row of the row block from row ``m0`` sees."""
    lo = 0
    hi = sk
    if masked:
        lo = gl.maximum(m0 + shift - wl, 0) // BLOCK_N
        hi = gl.minimum(sk, m0 + BLOCK_M + shift + wr)
    return lo, gl.cdiv(hi, BLOCK_N)


@gluon.jit
def _whole(mq0, BLOCK_MQ: gl.constexpr, sq_i, VARLEN: gl.constexpr):
    """Whether a consumer's output tile from row ``mq0`` lies inside its sequence (always
    without ``VARLEN``: the TMA store writes nothing past a sequence's end)."""
    if VARLEN:
        return mq0 + BLOCK_MQ <= sq_i
    return True


@gluon.jit
def _store_rows(Out, b_out, row0, n_rows, stride_om, col0, n_cols, VARLEN: gl.constexpr,
                PADDED: gl.constexpr):
    """Store the first ``n_rows`` rows of ``b_out`` (``[rows, D]``, a consumer's output tile)
    at rows ``row0 + i`` and columns ``col0 + d`` of ``Out`` (rows ``stride_om`` elements
    apart), with ``PADDED`` (a head dim narrower than the tile) only its first ``n_cols``
    columns; only with ``VARLEN`` (no code without)."""
    if not VARLEN:
        return
    # (from the products' layout: a conversion would need shared memory that d = 256 lacks)
    layout: gl.constexpr = b_out.type.layout
    o_r = gl.arange(0, b_out.shape[0], layout=gl.SliceLayout(1, layout))     # [rows]
    o_d = gl.arange(0, b_out.shape[1], layout=gl.SliceLayout(0, layout))     # [D]
    p_o = (Out + (row0 + o_r).to(gl.int64)[:, None] * stride_om
           + (col0 + o_d)[None, :])                                          # [rows, D]
    m_o = (o_r < n_rows)[:, None]                                           # [rows, 1]
    if PADDED:
        m_o = m_o & (o_d < n_cols)[None, :]                                  # [rows, D]
    gl.store(p_o, b_out, mask=m_o)


@gluon.jit
def _ws_producer(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, bar_q, bar_qfree, bar_k, bar_v,
                 bar_kfree, bar_vfree, sq, sk, nheads, group, q_rb, q_rh, q_ch, kv_rb, kv_rh,
                 kv_ch, n_m, n_work, lpt, wl, wr, masked, Ranges, KeyMask, stride_mb, Lists,
                 stride_xb, stride_xh, stride_xr, tpb, ipr, CuQ, CuK, Items, batch, desc_q2,
                 desc_k2, desc_v2, q2_smem, k2_smem, v2_smem):
    NC: gl.constexpr = q_smem.shape[0]   # consumer warpgroups
    BLOCK_MQ: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    # a split head dim: each tile's columns from HEAD_DIM on come through the second
    # descriptors into the second buffers, under the same barrier
    SPLIT: gl.constexpr = q2_smem.shape[2] != HEAD_DIM
    Q_BYTES: gl.constexpr = _split_sum(desc_q.block_type.nbytes, desc_q2.block_type.nbytes,
                                       SPLIT)
    KV_BYTES: gl.constexpr = _split_sum(desc_k.block_type.nbytes, desc_k2.block_type.nbytes,
                                        SPLIT)
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    RAGGED: gl.constexpr = _ragged_view(desc_k.block_type.shape)
    # a key mask's ranges are int32 (without one the lse pointer stands in)
    KEYMASK: gl.constexpr = Ranges.dtype.element_ty == gl.int32
    # block-sparse lists are int32 (without them the lse pointer stands in)
    SPARSE: gl.constexpr = Lists.dtype.element_ty == gl.int32
    # packed sequences' cumulative lengths are int32 (without them the lse pointer stands in)
    VARLEN: gl.constexpr = CuQ.dtype.element_ty == gl.int32
    # the keys past a sequence's end are masked in the item's first tile (_tile_order)
    TAIL: gl.constexpr = RAGGED or VARLEN
    pid = gl.program_id(0)
    n_ctas = gl.num_programs(0)
    it = 0  # K/V tiles loaded so far (ring position and phase)
    c = 0   # work items loaded so far (Q phase)
    for k in range(gl.cdiv(n_work, n_ctas)):
        w, i_m, i_b, i_h = _work_item(k, pid, n_ctas, n_m, n_work // n_m, nheads, lpt,
                                      masked)
        if VARLEN:  # (sequence, row block) pairs longest first
            i_m, i_b, i_h = _packed_item(w, Items, n_m, nheads, n_work)
        q0, sq_i, k0, sk_i = _sequence(CuQ, CuK, i_b, batch, sq, sk, VARLEN)
        live_item = w < n_work
        if VARLEN:  # the row blocks past a sequence's end are no work
            live_item = live_item & (i_m * NC * BLOCK_MQ < sq_i)
        if live_item:
            # (three consumers with masking: blocks laid from the end, _block_row)
            end = False
            if NC == 3:
                end = masked
            m0 = _block_row(i_m, sq_i, NC * BLOCK_MQ, end)
            lo, hi = _tile_range(m0, sk_i, sk_i - sq_i, wl, wr, masked, NC * BLOCK_MQ, BLOCK_N)
            if VARLEN:  # a sequence whose rows see no key still walks one tile (all masked)
                hi = gl.maximum(hi, lo + 1)
            if KEYMASK:  # only the tiles of the batch entry's visible keys
                lo, hi = _key_tiles(lo, hi, _key_range(Ranges, KeyMask, i_b, stride_mb),
                                    BLOCK_N)
            n_tiles = hi - lo
            p_cols = Lists
            if SPARSE:  # the tiles of the row's blocks, in the list's order
                p_cols, n_tiles, _ = _sparse_row(Lists, i_b, i_h, i_m, stride_xb, stride_xh,
                                                 stride_xr, tpb, ipr)
            # the sequences' coordinates in the descriptors (launch_sm90._plan; _tma_load),
            # from the first key tile a row of the block sees
            base_k = i_b * kv_rb + (i_h // group) * kv_rh
            base_q = i_b * q_rb + i_h * q_rh
            if VARLEN:  # (packed rows: the views of one batch entry)
                base_k = k0
                base_q = q0
            col_k = (i_h // group) * kv_ch
            rot = 0
            if TAIL:
                rot = _tile_order(lo, hi, sk_i, BLOCK_N)
            # K_0 first, then Q: both are needed by the item's first Q·Kᵀ
            i_k = it % STAGES
            mbarrier.wait(bar_kfree.index(i_k), ((it // STAGES) & 1) ^ 1, pred=it >= STAGES)
            mbarrier.expect(bar_k.index(i_k), KV_BYTES)
            row = _tile_at(0, lo, hi, rot, p_cols, tpb, TAIL, SPARSE) * BLOCK_N
            _tma_load(desc_k, base_k, row, col_k, bar_k.index(i_k), k_smem.index(i_k))
            if SPLIT:
                _tma_load(desc_k2, base_k, row, col_k + HEAD_DIM, bar_k.index(i_k),
                          k2_smem.index(i_k))
            for i in gl.static_range(NC):
                # consumer i's Q buffer is free once its last Q·Kᵀ of the previous item completed
                mbarrier.wait(bar_qfree.index(i), (c & 1) ^ 1, pred=c > 0)
                mbarrier.expect(bar_q.index(i), Q_BYTES)
                _tma_load(desc_q, base_q, m0 + i * BLOCK_MQ, i_h * q_ch,
                          bar_q.index(i), q_smem.index(i))
                if SPLIT:
                    _tma_load(desc_q2, base_q, m0 + i * BLOCK_MQ,
                              i_h * q_ch + HEAD_DIM, bar_q.index(i), q2_smem.index(i))
            # K runs one tile ahead of V: a consumer's step issues Q·K_{t+1}ᵀ with P_t·V_t
            for t in range(n_tiles):
                if t + 1 < n_tiles:
                    u = it + t + 1
                    i_k = u % STAGES
                    # K stage i_k is free once both consumers' Q·K_{u-STAGES}ᵀ completed
                    mbarrier.wait(bar_kfree.index(i_k), ((u // STAGES) & 1) ^ 1,
                                  pred=u >= STAGES)
                    mbarrier.expect(bar_k.index(i_k), KV_BYTES)
                    row = _tile_at(t + 1, lo, hi, rot, p_cols, tpb, TAIL, SPARSE) * BLOCK_N
                    _tma_load(desc_k, base_k, row, col_k, bar_k.index(i_k), k_smem.index(i_k))
                    if SPLIT:
                        _tma_load(desc_k2, base_k, row, col_k + HEAD_DIM, bar_k.index(i_k),
                                  k2_smem.index(i_k))
                u = it + t
                i_v = u % STAGES
                # V stage i_v is free once both consumers' P_{u-STAGES}·V_{u-STAGES} completed
                mbarrier.wait(bar_vfree.index(i_v), ((u // STAGES) & 1) ^ 1, pred=u >= STAGES)
                mbarrier.expect(bar_v.index(i_v), KV_BYTES)
                row = _tile_at(t, lo, hi, rot, p_cols, tpb, TAIL, SPARSE) * BLOCK_N
                _tma_load(desc_v, base_k, row, col_k, bar_v.index(i_v), v_smem.index(i_v))
                if SPLIT:
                    _tma_load(desc_v2, base_k, row, col_k + HEAD_DIM, bar_v.index(i_v),
                              v2_smem.index(i_v))
            it += n_tiles
            c += 1


@gluon.jit
def _ws_consumer(i_wg, q_smem, k_smem, v_smem, o_smem, bar_q, bar_qfree, bar_k, bar_v,
                 bar_kfree, bar_vfree, bar_turn, bar_o, desc_o, Lse, stride_lb, stride_lh, sq, sk,
                 nheads, n_m, n_work, lpt, qk_scale, wl, wr, Ranges, KeyMask, stride_mb,
                 Lists, stride_xb, stride_xh, stride_xr, tpb, ipr, CuQ, CuK, Items, batch, Out,
                 stride_om, q2_smem, k2_smem, v2_smem, o2_smem, desc_o2, TURNS: gl.constexpr,
                 U32: gl.constexpr, MASKED: gl.constexpr):
    # the values of a tuple bound to a name reach a partition as run-time values: the tile
    # shapes come from the buffers, RAGGED (_tma_load) from the output's descriptor, and the
    # constexprs TURNS, U32 and MASKED beside the tuple (_ws_consumer0)
    BLOCK_MQ: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    STAGES: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # a split head dim (attn_fwd_split_sm90_kernel): columns from HEAD_DIM on in the second
    # buffers, Q·Kᵀ two products into one S, P·V two into two accumulators
    D2: gl.constexpr = q2_smem.shape[2]
    SPLIT: gl.constexpr = D2 != HEAD_DIM
    WIDTH: gl.constexpr = _width(HEAD_DIM, D2)  # the head dim
    PV_GROUPS: gl.constexpr = _split_sum(1, 1, SPLIT)  # commit groups of a tile's P·V
    o2_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D2, 16])
    p2_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o2_layout, k_width=2)
    row_o2: gl.constexpr = gl.SliceLayout(1, o2_layout)
    O_TILES: gl.constexpr = o_smem.shape[0]  # one per consumer, or one shared (d = 256)
    NC: gl.constexpr = q_smem.shape[0]       # consumer warpgroups, taking turns in order
    RAGGED: gl.constexpr = _ragged_view(desc_o.block_type.shape)
    # the output's column coordinate of head i_h: its first column, or with heads side by side
    # in a view of one head's columns (a padded head dim, _tma_load) its index
    PADDED: gl.constexpr = _heads_view(desc_o.block_type.shape)
    O_CH: gl.constexpr = 1 if PADDED else WIDTH
    KEYMASK: gl.constexpr = Ranges.dtype.element_ty == gl.int32  # (the producer's)
    SPARSE: gl.constexpr = Lists.dtype.element_ty == gl.int32
    VARLEN: gl.constexpr = CuQ.dtype.element_ty == gl.int32  # (the producer's)
    TAIL: gl.constexpr = RAGGED or VARLEN
    # the rescale of the accumulator at the start of the next step (module docstring)
    DEFER: gl.constexpr = HEAD_DIM == 256
    # a masked kernel walks an item's tiles that no row's window cuts in a loop of their own,
    # compiled without the mask's code, then the tiles that cross the window's edge (the
    # tiles in walking order: not RAGGED, VARLEN or SPARSE; with a key mask the two loops
    # spilled 172-760 bytes: one loop; module docstring)
    PLAIN: gl.constexpr = MASKED and not TAIL and not SPARSE and not KEYMASK
    # three consumers (160 registers a thread): the second loop masks every tile it walks. A
    # branch there on whether the tile needs the mask carried the score tile through both of
    # its arms, and ptxas spilled in both loops (612 bytes; 30-35 local loads and stores a
    # step) where without the branch it spills nothing in them (docs/dev/tuning-log.md, step 137)
    MASK_ALL: gl.constexpr = PLAIN and NC == 3

    pid = gl.program_id(0)
    n_ctas = gl.num_programs(0)
    shift = sk - sq
    q_tile = q_smem.index(i_wg)
    q2_tile = q2_smem.index(i_wg)
    bar_mine = bar_turn.index(i_wg)
    bar_other = bar_turn.index((i_wg + 1) % NC)
    o_r = gl.arange(0, BLOCK_MQ, layout=row_s)
    o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    it = 0  # K/V tiles consumed so far
    ts = 0  # tensor-core turns taken so far
    c = 0   # work items done so far
    for k in range(gl.cdiv(n_work, n_ctas)):
        w, i_m, i_b, i_h = _work_item(k, pid, n_ctas, n_m, n_work // n_m, nheads, lpt,
                                      MASKED)
        if VARLEN:  # (the producer's order)
            i_m, i_b, i_h = _packed_item(w, Items, n_m, nheads, n_work)
        # the item's sequence (_sequence; the producer skips the same items)
        q0, sq_i, k0, sk_i = _sequence(CuQ, CuK, i_b, batch, sq, sk, VARLEN)
        shift_i = shift
        live_item = w < n_work
        if VARLEN:
            shift_i = sk_i - sq_i
            live_item = live_item & (i_m * NC * BLOCK_MQ < sq_i)
        if live_item:
            m0 = _block_row(i_m, sq_i, NC * BLOCK_MQ, MASKED and NC == 3)
            lo, hi = _tile_range(m0, sk_i, shift_i, wl, wr, MASKED, NC * BLOCK_MQ, BLOCK_N)
            if VARLEN:
                hi = gl.maximum(hi, lo + 1)
            k_range = (0, 0, 0, Ranges)
            if KEYMASK:
                k_range = _key_range(Ranges, KeyMask, i_b, stride_mb)
                lo, hi = _key_tiles(lo, hi, k_range, BLOCK_N)
            n_tiles = hi - lo
            rot = 0
            if TAIL:
                rot = _tile_order(lo, hi, sk_i, BLOCK_N)
            p_cols = Lists
            empty = False
            # the window's edges for this item: an item with no block masks every key
            wl_i = wl
            wr_i = wr
            if SPARSE:
                p_cols, n_tiles, empty = _sparse_row(Lists, i_b, i_h, i_m, stride_xb, stride_xh,
                                                     stride_xr, tpb, ipr)
                wl_i = gl.where(empty, 1 << 29, wl)
                wr_i = gl.where(empty, -(1 << 29), wr)
            mq0 = m0 + i_wg * BLOCK_MQ
            # tiles from n_full on cross the upper edge of this warpgroup's window (its
            # diagonal when causal), tiles starting below lo_key its lower edge: both masked
            n_full = hi
            if SPARSE:  # (the tiles of the list are not below hi)
                n_full = 1 << 30
            lo_key = 0
            if MASKED:
                n_full = (mq0 + shift_i + wr + 1) // BLOCK_N
                lo_key = mq0 + BLOCK_MQ - 1 + shift_i - wl
            o_m = mq0 + o_r
            m_i = gl.full([BLOCK_MQ], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([BLOCK_MQ], gl.float32, layout=row_s)
            b_acc = gl.zeros([BLOCK_MQ, HEAD_DIM], gl.float32, layout=o_layout)  # [64, D]
            if SPLIT:
                b_acc2 = gl.zeros([BLOCK_MQ, D2], gl.float32, layout=o2_layout)  # [64, D2]
            b_s = gl.zeros([BLOCK_MQ, BLOCK_N], gl.float32, layout=s_layout)     # [64, BLOCK_N]

            mbarrier.wait(bar_q.index(i_wg), c & 1)
            i_s = it % STAGES
            mbarrier.wait(bar_k.index(i_s), (it // STAGES) & 1)
            # a turn of its own: Q·K_0ᵀ
            if TURNS:
                mbarrier.wait(bar_mine, ts & 1)
            b_s = warpgroup_mma(q_tile, k_smem.index(i_s).permute((1, 0)), b_s, use_acc=False,
                                is_async=True)
            if SPLIT:
                b_s = warpgroup_mma(q2_tile, k2_smem.index(i_s).permute((1, 0)), b_s,
                                    is_async=True)
            if TURNS:
                mbarrier.arrive(bar_other)
            b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s,))
            mbarrier.arrive(bar_kfree.index(i_s))
            mbarrier.arrive(bar_qfree.index(i_wg), pred=n_tiles == 1)
            # (with RAGGED the first tile walked may be the item's last: _tile_order)
            t = _tile_at(0, lo, hi, rot, p_cols, tpb, TAIL, SPARSE)
            km = False
            if KEYMASK:
                km = _key_masked(t * BLOCK_N, BLOCK_N, k_range)
            masked0 = (t >= n_full) | (t * BLOCK_N < lo_key)
            if SPARSE:
                masked0 = masked0 | empty
            if VARLEN:  # a sequence with no key: its rows keep m = -inf (_online_softmax's guard)
                masked0 = masked0 | (sk_i == 0)
            b_p, m_i, l_i, b_alpha = _online_softmax(b_s, m_i, l_i, t * BLOCK_N, o_m, o_n,
                                                     qk_scale, shift_i, wl_i, wr_i, sk_i, True,
                                                     masked0, TAIL, km, k_range, KEYMASK, U32)
            # PLAIN: the steps j < n_plain walk tiles no row of this warpgroup's window cuts
            # (tile lo + j + 1 below n_full, none of them below lo_key), the rest the others
            # (causal: the diagonal's); below PLAIN_KEYS keys every step takes the second loop
            n_plain = 0
            if PLAIN:
                n_plain = gl.where((lo_key <= (lo + 1) * BLOCK_N) & (sk_i >= PLAIN_KEYS),
                                   gl.minimum(gl.maximum(n_full - lo - 1, 0), n_tiles - 1), 0)
            for i_pass in gl.static_range(2 if PLAIN else 1):
                j_lo = 0
                j_hi = n_tiles - 1
                if PLAIN:
                    if i_pass == 0:
                        j_hi = n_plain
                    else:
                        j_lo = n_plain
                for j in range(j_lo, j_hi):
                    i_st = (it + j) % STAGES
                    i_nx = (it + j + 1) % STAGES
                    mbarrier.wait(bar_k.index(i_nx), ((it + j + 1) // STAGES) & 1)
                    mbarrier.wait(bar_v.index(i_st), ((it + j) // STAGES) & 1)
                    b_pv = gl.convert_layout(b_p.to(dtype), p_layout)            # [64, BLOCK_N]
                    if SPLIT:
                        b_pv2 = gl.convert_layout(b_p.to(dtype), p2_layout)      # [64, BLOCK_N]
                    if DEFER:  # acc *= alpha_j (on the first step: zeros)
                        b_acc = b_acc * gl.convert_layout(b_alpha, row_o)[:, None]
                    # a turn for Q·K_{j+1}ᵀ and P_j·V_j
                    if TURNS:
                        mbarrier.wait(bar_mine, (ts + j + 1) & 1)
                    b_s = warpgroup_mma(q_tile, k_smem.index(i_nx).permute((1, 0)), b_s,
                                        use_acc=False, is_async=True)
                    if SPLIT:
                        b_s = warpgroup_mma(q2_tile, k2_smem.index(i_nx).permute((1, 0)), b_s,
                                            is_async=True)
                    b_acc = warpgroup_mma(b_pv, v_smem.index(i_st), b_acc, is_async=True)
                    if SPLIT:
                        b_acc2 = warpgroup_mma(b_pv2, v2_smem.index(i_st), b_acc2, is_async=True)
                    if TURNS:
                        mbarrier.arrive(bar_other)
                    b_s = warpgroup_mma_wait(num_outstanding=PV_GROUPS, deps=(b_s,))
                    # Q·K_{j+1}ᵀ done (groups complete in order): its K stage goes back
                    mbarrier.arrive(bar_kfree.index(i_nx))
                    # the item's last Q·Kᵀ: Q's buffer goes back (a predicate, not a branch,
                    # keeps the softmax below in this basic block, where ptxas overlaps it with
                    # P·V)
                    mbarrier.arrive(bar_qfree.index(i_wg), pred=j == n_tiles - 2)
                    t = _tile_at(j + 1, lo, hi, rot, p_cols, tpb, TAIL, SPARSE)
                    if KEYMASK:
                        km = _key_masked(t * BLOCK_N, BLOCK_N, k_range)
                    # (a whole tile: the keys past the end are in the first one walked; the
                    # first of PLAIN's loops compiles without the window's mask)
                    if PLAIN and i_pass == 0:
                        m_j = False
                    elif MASK_ALL:
                        m_j = True
                    else:
                        m_j = (t >= n_full) | (t * BLOCK_N < lo_key)
                    b_p, m_i, l_i, b_alpha = _online_softmax(
                        b_s, m_i, l_i, t * BLOCK_N, o_m, o_n, qk_scale, shift_i, wl_i, wr_i,
                        sk_i, True, m_j, False, km, k_range, KEYMASK, U32)
                    if SPLIT:
                        b_acc, b_pv, b_acc2, b_pv2 = warpgroup_mma_wait(
                            num_outstanding=0, deps=(b_acc, b_pv, b_acc2, b_pv2))
                        b_acc2 = b_acc2 * gl.convert_layout(b_alpha, row_o2)[:, None]
                    else:
                        b_acc, b_pv = warpgroup_mma_wait(num_outstanding=0, deps=(b_acc, b_pv))
                    mbarrier.arrive(bar_vfree.index(i_st))
                    if not DEFER:
                        b_acc = b_acc * gl.convert_layout(b_alpha, row_o)[:, None]
            i_st = (it + n_tiles - 1) % STAGES
            mbarrier.wait(bar_v.index(i_st), ((it + n_tiles - 1) // STAGES) & 1)
            b_pv = gl.convert_layout(b_p.to(dtype), p_layout)
            if SPLIT:
                b_pv2 = gl.convert_layout(b_p.to(dtype), p2_layout)
            if DEFER:
                b_acc = b_acc * gl.convert_layout(b_alpha, row_o)[:, None]
            if TURNS:
                mbarrier.wait(bar_mine, (ts + n_tiles) & 1)
            b_acc = warpgroup_mma(b_pv, v_smem.index(i_st), b_acc, is_async=True)
            if SPLIT:
                b_acc2 = warpgroup_mma(b_pv2, v2_smem.index(i_st), b_acc2, is_async=True)
            if TURNS:
                mbarrier.arrive(bar_other)
            if SPLIT:
                b_acc, b_pv, b_acc2, b_pv2 = warpgroup_mma_wait(
                    num_outstanding=0, deps=(b_acc, b_pv, b_acc2, b_pv2))
            else:
                b_acc, b_pv = warpgroup_mma_wait(num_outstanding=0, deps=(b_acc, b_pv))
            mbarrier.arrive(bar_vfree.index(i_st))
            it += n_tiles
            ts += n_tiles + 1
            c += 1

            b_l = l_i
            if KEYMASK or SPARSE or VARLEN:  # a row that sees no key outputs 0 (lse -inf)
                b_l = gl.where(l_i == 0.0, 1.0, l_i)
            b_out = b_acc / gl.convert_layout(b_l, row_o)[:, None]            # [64, HEAD_DIM]
            if SPLIT:
                b_out2 = b_acc2 / gl.convert_layout(b_l, row_o2)[:, None]     # [64, D2]
            # through shared memory and one TMA store that the consumer does not wait for (the
            # other consumer's next turn waits on this one's next Q·Kᵀ)
            # three consumers: the last block of a sequence may end before this one's rows,
            # which then ran the turns on rows of no use and store nothing
            live = True
            if NC > 2:
                live = (mq0 >= 0) & (mq0 < sq)
            # (_tma_store's coordinates of the output, a contiguous (B, Sq, H, D))
            o_base = i_b * sq
            if RAGGED:
                o_base = i_b
            # a packed sequence's last tile ends inside the next sequence's rows, which a TMA
            # store would overwrite: stored from registers, its rows masked
            if VARLEN:
                o_base = q0
            # the output's columns a head: the tile's, or with a padded head dim the head's own
            # (packed outputs are contiguous (total, H, head dim): stride_om = H * head dim)
            o_cols = WIDTH
            if VARLEN and PADDED:
                o_cols = stride_om // nheads
            if O_TILES == NC:  # a tile of its own
                if live:
                    if _whole(mq0, BLOCK_MQ, sq_i, VARLEN):
                        o_tile = o_smem.index(i_wg)
                        tma.store_wait(pendings=0)  # the previous item's store has read it
                        o_tile.store(b_out.to(dtype))
                        if SPLIT:
                            o2_tile = o2_smem.index(i_wg)
                            o2_tile.store(b_out2.to(dtype))
                        fence_async_shared()
                        _tma_store(desc_o, o_base, mq0, i_h * O_CH, o_tile)
                        if SPLIT:
                            _tma_store(desc_o2, o_base, mq0, i_h * O_CH + HEAD_DIM, o2_tile)
                    else:
                        _store_rows(Out, b_out.to(dtype), q0 + mq0, sq_i - mq0, stride_om,
                                    i_h * o_cols, o_cols, VARLEN, PADDED)
                        if SPLIT:
                            _store_rows(Out, b_out2.to(dtype), q0 + mq0, sq_i - mq0,
                                        stride_om, i_h * o_cols + HEAD_DIM, o_cols, VARLEN,
                                        PADDED)
            else:
                # one tile for both consumers, consumer 0 first in every item: wait for the
                # other's store to have read it, and hand it over once this one's has
                # (a split head dim's tiles are 128 wide at most: never here)
                gl.static_assert(not SPLIT)
                o_tile = o_smem.index(0)
                mbarrier.wait(bar_o.index(i_wg), ((c - 1) & 1) ^ (1 - i_wg), pred=c > 1 - i_wg)
                if _whole(mq0, BLOCK_MQ, sq_i, VARLEN):
                    o_tile.store(b_out.to(dtype))
                    fence_async_shared()
                    _tma_store(desc_o, o_base, mq0, i_h * O_CH, o_tile)
                    tma.store_wait(pendings=0)
                else:
                    _store_rows(Out, b_out.to(dtype), q0 + mq0, sq_i - mq0, stride_om,
                                i_h * o_cols, o_cols, VARLEN, PADDED)
                mbarrier.arrive(bar_o.index(1 - i_wg))
            b_lse = (m_i * qk_scale + gl.log2(l_i)) * LN2
            if live:
                # (packed: lse is (H, total), row q0 + o_m of head i_h)
                p_lse = (Lse + i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh
                         + q0 + o_m)
                if TAIL:
                    gl.store(p_lse, b_lse, mask=o_m < sq_i)
                else:
                    gl.store(p_lse, b_lse)
    tma.store_wait(pendings=0)  # shared memory outlives the last store's reads


@gluon.jit
def _ws_consumer0(args, TURNS: gl.constexpr, U32: gl.constexpr, MASKED: gl.constexpr):
    """Consumer warpgroup 0: ``args`` the consumers' run-time arguments (one tuple for all),
    ``TURNS`` whether they take turns on the tensor cores, ``U32`` whether the window test
    is the unsigned one (``_online_softmax``) and ``MASKED`` the kernel's (``PLAIN``):
    constexprs apart from the tuple."""
    _ws_consumer(0, *args, TURNS=TURNS, U32=U32, MASKED=MASKED)


@gluon.jit
def _ws_consumer1(args, TURNS: gl.constexpr, U32: gl.constexpr, MASKED: gl.constexpr):
    """Consumer warpgroup 1 (``_ws_consumer0``)."""
    _ws_consumer(1, *args, TURNS=TURNS, U32=U32, MASKED=MASKED)


@gluon.jit
def _ws_consumer2(args, TURNS: gl.constexpr, U32: gl.constexpr, MASKED: gl.constexpr):
    """Consumer warpgroup 2 (``_ws_consumer0``)."""
    _ws_consumer(2, *args, TURNS=TURNS, U32=U32, MASKED=MASKED)


@gluon.jit
def attn_fwd_sm90_kernel(desc_q, desc_k, desc_v, desc_o, Lse, stride_lb, stride_lh,
                         batch, sq, sk, nheads, group, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch,
                         qk_scale, lpt, wl, wr, Ranges, KeyMask, stride_mb, Lists, stride_xb,
                         stride_xh, stride_xr, tpb, ipr, CuQ, CuK, Items, Out, stride_om,
                         MASKED: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr,
                         num_warps: gl.constexpr):
    """``Ranges`` (int32 ``(B, 3)``) and ``KeyMask`` (uint8 ``(B, Sk)``, rows ``stride_mb`` apart,
    contiguous keys): a key mask (``kernels/key_mask.py``), or without one the lse pointer in
    both places (the kernel tells them apart by ``Ranges``' element type).  ``Lists`` (int32,
    ``sparse_index.block_lists``: ``[n_full, n_part, columns...]`` per mask row, rows
    ``stride_xr`` apart, batch and head entries ``stride_xb``, ``stride_xh``): a block mask whose
    blocks are ``ipr`` work items high and ``tpb`` key tiles wide, each item walking only its
    row's blocks; without one the lse pointer (the element type tells).  ``CuQ``, ``CuK``
    (int32 ``(B + 1,)``): packed sequences (``VARLEN``): q, k, v and the output are ``(total,
    H, D)`` seen as one batch entry by 2-D descriptors, ``sq`` and ``sk`` the longest
    sequences, lse ``(H, total)``; a sequence's last row tile is stored from registers into
    ``Out`` (rows ``stride_om`` apart) with its rows masked; ``Items`` the order of the work
    items (``_packed_item``); without them the lse pointer."""
    _attn_fwd(desc_q, desc_k, desc_v, desc_o, desc_q, desc_k, desc_v, desc_o, Lse, stride_lb,
              stride_lh, batch, sq, sk, nheads, group, q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch,
              qk_scale, lpt, wl, wr, Ranges, KeyMask, stride_mb, Lists, stride_xb, stride_xh,
              stride_xr, tpb, ipr, CuQ, CuK, Items, Out, stride_om, MASKED, CONSUMERS, STAGES)


@gluon.jit
def attn_fwd_split_sm90_kernel(desc_q, desc_k, desc_v, desc_o, desc_q2, desc_k2, desc_v2,
                               desc_o2, Lse, stride_lb, stride_lh, batch, sq, sk, nheads, group,
                               q_rb, q_rh, q_ch, kv_rb, kv_rh, kv_ch, qk_scale, lpt, wl, wr,
                               Ranges, KeyMask, stride_mb, Lists, stride_xb, stride_xh,
                               stride_xr, tpb, ipr, CuQ, CuK, Items, Out, stride_om,
                               MASKED: gl.constexpr, CONSUMERS: gl.constexpr,
                               STAGES: gl.constexpr, num_warps: gl.constexpr):
    """``attn_fwd_sm90_kernel`` at a head dim that is the sum of two tile widths (192 = 128 +
    64, 160 = 128 + 32, 96 = 64 + 32, 80 = 64 + 16): ``desc_q``, ``desc_k``, ``desc_v`` and
    ``desc_o`` tile the head's first ``D1`` columns, ``desc_q2`` ... ``desc_o2`` the rest,
    ``D2`` (tiles are powers of two wide: a 192-wide one is refused), in buffers of their
    own: every tile's two loads arrive on one barrier, Q·Kᵀ is two products into one S and
    P·V two into two accumulators; no column computed past the head (a tile width padded to
    the next power of two computes a third more at d = 192 and 96)."""
    _attn_fwd(desc_q, desc_k, desc_v, desc_o, desc_q2, desc_k2, desc_v2, desc_o2, Lse,
              stride_lb, stride_lh, batch, sq, sk, nheads, group, q_rb, q_rh, q_ch, kv_rb, kv_rh,
              kv_ch, qk_scale, lpt, wl, wr, Ranges, KeyMask, stride_mb, Lists, stride_xb,
              stride_xh, stride_xr, tpb, ipr, CuQ, CuK, Items, Out, stride_om, MASKED,
              CONSUMERS, STAGES)


@gluon.jit
def _attn_fwd(desc_q, desc_k, desc_v, desc_o, desc_q2, desc_k2, desc_v2, desc_o2, Lse,
              stride_lb, stride_lh, batch, sq, sk, nheads, group, q_rb, q_rh, q_ch, kv_rb, kv_rh,
              kv_ch, qk_scale, lpt, wl, wr, Ranges, KeyMask, stride_mb, Lists, stride_xb,
              stride_xh, stride_xr, tpb, ipr, CuQ, CuK, Items, Out, stride_om,
              MASKED: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr):
    """The kernels' body: the second descriptors are the first ones again but for a split
    head dim (``attn_fwd_split_sm90_kernel``)."""
    BLOCK_MQ: gl.constexpr = _tile_rows(desc_q.block_type.shape)   # rows of one consumer (64)
    # the tiles' width: the head dim, or the next of 64 / 128 / 256 above a narrower one
    HEAD_DIM: gl.constexpr = desc_q.block_type.shape[-1]
    D2: gl.constexpr = desc_q2.block_type.shape[-1]  # (HEAD_DIM: not split)
    SPLIT: gl.constexpr = D2 != HEAD_DIM
    WIDTH: gl.constexpr = _width(HEAD_DIM, D2)
    BLOCK_N: gl.constexpr = _tile_rows(desc_k.block_type.shape)
    dtype: gl.constexpr = desc_q.dtype
    # the tiles' shared-memory layouts (a 3-D descriptor's is the 3-D one of the same tile)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_MQ, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)

    # a work item is CONSUMERS * 64 rows; with three consumers the last one of a sequence may
    # hold fewer (its consumers past the end store nothing)
    n_m = gl.cdiv(sq, CONSUMERS * BLOCK_MQ)
    n_work = n_m * batch * nheads

    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_MQ, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    # the consumers' output tiles, stored by TMA; at d = 256 two would not fit beside the rings
    O_TILES: gl.constexpr = CONSUMERS if HEAD_DIM <= 128 else 1  # (one consumer: its own)
    o_smem = gl.allocate_shared_memory(dtype, [O_TILES, BLOCK_MQ, HEAD_DIM], q_layout)
    if SPLIT:  # the columns from HEAD_DIM on
        q2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_MQ, D2], dtype)
        kv2_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D2], dtype)
        q2_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_MQ, D2], q2_layout)
        k2_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D2], kv2_layout)
        v2_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D2], kv2_layout)
        o2_smem = gl.allocate_shared_memory(dtype, [O_TILES, BLOCK_MQ, D2], q2_layout)
    else:
        q2_smem = q_smem
        k2_smem = k_smem
        v2_smem = v_smem
        o2_smem = o_smem
    bar_q = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    bar_qfree = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    bar_k = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    bar_v = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    bar_kfree = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    bar_vfree = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    bar_turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    bar_o = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(bar_q.index(i), count=1)
        mbarrier.init(bar_qfree.index(i), count=1)
        mbarrier.init(bar_turn.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(bar_o.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bar_k.index(i), count=1)
        mbarrier.init(bar_v.index(i), count=1)
        mbarrier.init(bar_kfree.index(i), count=CONSUMERS)
        mbarrier.init(bar_vfree.index(i), count=CONSUMERS)
    # consumer 0 takes the first tensor-core turn.  The consumers take turns on the tensor
    # cores except at d = 64 with masking and at d = 128 without, which are 1-3% faster with
    # each consumer issuing freely (docs/dev/tuning-log.md, step 68); calls with a key mask
    # keep them (at d = 128 ptxas spills 144 bytes without), and so do three consumers (causal
    # d = 64 at 3K-16K 0-8% faster with them, step 137)
    KEYMASK: gl.constexpr = Ranges.dtype.element_ty == gl.int32
    TURNS: gl.constexpr = KEYMASK or CONSUMERS == 3 or not ((WIDTH == 64 and MASKED)
                                          or (WIDTH == 128 and not MASKED))
    # the window test in 3 instructions a score, not 5, where masking is on (step 70: causal
    # N = 1K 8% faster at d = 128, 5% at d = 64); with a key mask or at d = 256, ptxas spills
    # more with it
    U32: gl.constexpr = MASKED and not KEYMASK and WIDTH <= 128
    mbarrier.arrive(bar_turn.index(0))

    consumer_args = (q_smem, k_smem, v_smem, o_smem, bar_q, bar_qfree, bar_k, bar_v, bar_kfree,
                     bar_vfree, bar_turn, bar_o, desc_o, Lse, stride_lb, stride_lh, sq, sk, nheads,
                     n_m, n_work, lpt, qk_scale, wl, wr, Ranges, KeyMask, stride_mb, Lists,
                     stride_xb, stride_xh, stride_xr, tpb, ipr, CuQ, CuK, Items, batch, Out,
                     stride_om, q2_smem, k2_smem, v2_smem, o2_smem, desc_o2)
    producer_args = (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, bar_q, bar_qfree, bar_k,
                     bar_v, bar_kfree, bar_vfree, sq, sk, nheads, group, q_rb, q_rh, q_ch, kv_rb,
                     kv_rh, kv_ch, n_m, n_work, lpt, wl, wr, MASKED, Ranges, KeyMask, stride_mb,
                     Lists, stride_xb, stride_xh, stride_xr, tpb, ipr, CuQ, CuK, Items, batch,
                     desc_q2, desc_k2, desc_v2, q2_smem, k2_smem, v2_smem)
    if CONSUMERS == 3:
        # FlashAttention-3's split at d = 64: three consumers at 160 registers a thread, all
        # three workers, the producer the default partition (its warpgroup keeps the 32 left).
        # As the default partition at 168 a consumer spilled 145 local loads and stores a step
        # where the workers at 160 spilled none to 35 (causal, compiled for sm_90a): the slowest
        # consumer sets the pace of the K/V ring (docs/dev/tuning-log.md, step 137)
        gl.warp_specialize([(_ws_producer, producer_args),
                            (_ws_consumer0, (consumer_args, TURNS, U32, MASKED)),
                            (_ws_consumer1, (consumer_args, TURNS, U32, MASKED)),
                            (_ws_consumer2, (consumer_args, TURNS, U32, MASKED))],
                           [4, 4, 4], [160, 160, 160])
    elif CONSUMERS == 1:
        # two or three CTAs an SM (launch_sm90.ONE_CONSUMER_CTAS: 128 or 80 registers a thread
        # at launch): the producer's warpgroup drops to 24, the consumer takes the rest (232 or
        # 136), and the other CTAs' turns fill the tensor cores through this one's first tile
        # and epilogue
        gl.warp_specialize([(_ws_consumer0, (consumer_args, TURNS, U32, MASKED)),
                            (_ws_producer, producer_args)],
                           [1], [24])
    else:
        # 240 registers for the second consumer at d = 256 (232 elsewhere): with the deferred
        # rescale ptxas then starts 14 of a tile's 34 exponentials before the P.V wait instead
        # of none (spilling 32 bytes), 0-7% faster (docs/dev/tuning-log.md, step 128); and at
        # d = 128 with masking, where the two loops of PLAIN spilled in both at 232 (step 133)
        gl.warp_specialize([(_ws_consumer0, (consumer_args, TURNS, U32, MASKED)),
                            (_ws_consumer1, (consumer_args, TURNS, U32, MASKED)),
                            (_ws_producer, producer_args)], [4, 1],
                           [240 if HEAD_DIM == 256 or (HEAD_DIM == 128 and MASKED and not KEYMASK)
                            else 232, 24])
