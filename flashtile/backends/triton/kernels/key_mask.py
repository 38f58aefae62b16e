"""Key masks of the Hopper kernels: a bool mask ``(B, Sk)`` over the keys (a padding mask, the
``(B, 1, 1, Sk)`` attention mask transformers builds for a padded batch) summarised per batch
entry, so that the kernels skip the key tiles no row may see and mask only the tiles at the
edges of the visible range.

For batch entry ``b`` with visible keys ``V_b = {j : mask[b, j]}``::

    lo_b   = min(V_b)            (Sk when V_b is empty)
    hi_b   = max(V_b) + 1        (0 when V_b is empty)
    full_b = |V_b| == hi_b - lo_b   (every key of [lo_b, hi_b) visible: the mask is a range)

A key outside ``[lo_b, hi_b)`` is never visible; inside it, it is visible when ``full_b`` or
when its mask element is set (the kernels then read the mask on every tile they walk).
"""
import triton
import triton.language as tl


@triton.jit
def key_mask_ranges_kernel(MASK, RANGES, stride_mb, stride_mn, seqlen_k, BLOCK: tl.constexpr):
    """``RANGES[b] = (lo_b, hi_b, full_b)`` (int32) for the mask row ``b`` (one program a batch
    entry; ``MASK`` uint8, 0 = invisible, read with strides ``stride_mb``, ``stride_mn``)."""
    i_b = tl.program_id(0)
    o_n = tl.arange(0, BLOCK)                                           # [BLOCK]
    p_m = MASK + i_b.to(tl.int64) * stride_mb
    b_lo = tl.full([BLOCK], seqlen_k, tl.int32)                         # [BLOCK]
    b_hi = tl.zeros([BLOCK], tl.int32)
    b_count = tl.zeros([BLOCK], tl.int32)
    for n0 in range(0, seqlen_k, BLOCK):
        o_k = n0 + o_n
        b_vis = tl.load(p_m + o_k.to(tl.int64) * stride_mn, mask=o_k < seqlen_k, other=0) != 0
        b_lo = tl.minimum(b_lo, tl.where(b_vis, o_k, seqlen_k))
        b_hi = tl.maximum(b_hi, tl.where(b_vis, o_k + 1, 0))
        b_count += b_vis.to(tl.int32)
    lo = tl.min(b_lo, axis=0)
    hi = tl.max(b_hi, axis=0)
    count = tl.sum(b_count, axis=0)
    p_r = RANGES + i_b * 3
    tl.store(p_r, lo)
    tl.store(p_r + 1, hi)
    # an empty row (count 0, lo = Sk > hi = 0) is "full": nothing in [lo, hi) to read
    tl.store(p_r + 2, (count == tl.maximum(hi - lo, 0)).to(tl.int32))
