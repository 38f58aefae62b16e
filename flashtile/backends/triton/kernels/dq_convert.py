"""dQ of the fused Hopper backward converted beside its kernel, pair by pair as each completes
(``launch_sm90.DQ_TRAIL``).

The fused backward (``attn_bwd_sm90.py``) adds every dQ tile into a float32 accumulator
``(B, Sq, H, D)``; the CTAs of a (batch, key/value head) pair add into the same rows in no fixed
order, so dQ in the input's dtype can only be written once all of the pair's work items are
done.  A copy after the kernel reads the whole accumulator back from DRAM, where most of it
went when it no longer fitted in L2 (at B 64, H 16, N 1K, d 64: 268 MB read back, as much
written out before: docs/io.md).  Here a few CTAs beside the kernel, on SMs its persistent
grid leaves free, convert each pair as soon as its items are counted done
(``attn_bwd_sm90._count_item``: one release at GPU scope an item, after its dQ reductions
were performed), while its lines are still in L2, and drop the lines afterwards without
writing them back (``discard.global.L2``)::

    for each pair p of this program (p = pid, pid + G, ...):
        wait until COUNTER[1 + p] == n_kb          (acquire: the pair's n_kb items counted)
        for each query head h of the pair, each ROWS rows m:
            DQ[b, m, h, :] = ACC[b, m, h, :]        (float32 -> q's dtype)
            drop ACC[b, m, h, :]'s lines from L2

The kernel waits only for the backward kernel's progress and the backward kernel never waits
for it, so the two finish whichever order the GPU runs them in (one after the other, they are
the copy of before); ``launch_sm90`` launches this one on a second stream that waits for the
prologue, not for the backward kernel.
"""
import triton
import triton.language as tl


@triton.jit
def _discard(p, m):
    """Drop the 128-byte L2 lines at ``p`` (where ``m``) without writing them back: their
    values are undefined afterwards."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred q; setp.ne.u32 q, $2, 0; mov.u32 $0, 0;"
        " @q discard.global.L2 [$1], 128; }",
        "=r,l,r", [p, m.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def attn_bwd_dq_convert_kernel(ACC, DQ, COUNTER, n_bh, nheads_k, group, seqlen_q, n_kb,
                               stride_ab, stride_as, stride_ah, stride_qb, stride_qs, stride_qh,
                               HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
                               DISCARD: tl.constexpr):
    """``DQ[b, :, h, :] = ACC[b, :, h, :]`` for the query heads ``h`` of each (batch ``b``,
    key/value head) pair ``p = b * nheads_k + h_k`` once ``COUNTER[1 + p]`` (int32, counted by
    the backward kernel) reaches ``n_kb``, the pair's work items; ``ACC`` float32 and ``DQ``
    (its dtype) ``(B, Sq, H, D)`` with strides ``stride_a*``, ``stride_q*`` (the last 1).  With
    ``DISCARD`` the accumulator's lines are dropped from L2 once converted (its rows are whole
    128-byte lines: ``D * 4`` bytes, 16-byte aligned rows of 64 or 128 values)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    o_r = tl.arange(0, ROWS)                                        # [ROWS]
    o_d = tl.arange(0, HEAD_DIM)                                    # [D]
    o_l = tl.arange(0, HEAD_DIM // 32) * 32                         # [D / 32] a line's first
    for i_bh in range(pid, n_bh, n_prog):
        # (acquire: every reduction counted before the count is visible to the loads below)
        n_done = tl.atomic_add(COUNTER + 1 + i_bh, 0, sem="acquire", scope="gpu")
        while n_done < n_kb:
            n_done = tl.atomic_add(COUNTER + 1 + i_bh, 0, sem="acquire", scope="gpu")
        i_b = i_bh // nheads_k
        i_hk = i_bh % nheads_k
        for i_g in range(group):
            i_h = i_hk * group + i_g
            p_a0 = ACC + i_b.to(tl.int64) * stride_ab + i_h.to(tl.int64) * stride_ah
            p_q0 = DQ + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh
            for m0 in range(0, seqlen_q, ROWS):
                o_m = m0 + o_r                                      # [ROWS] query rows
                m_m = o_m < seqlen_q
                p_a = p_a0 + o_m.to(tl.int64)[:, None] * stride_as   # [ROWS, 1]
                # (.cg: from L2, where the reductions were performed)
                b_acc = tl.load(p_a + o_d[None, :], mask=m_m[:, None], other=0.0,
                                cache_modifier=".cg")               # [ROWS, D]
                p_q = p_q0 + o_m.to(tl.int64)[:, None] * stride_qs + o_d[None, :]
                tl.store(p_q, b_acc.to(DQ.dtype.element_ty), mask=m_m[:, None])
                if DISCARD:
                    # every thread's loads have returned (their values are stored) before
                    # any line goes
                    tl.debug_barrier()
                    _discard(p_a + o_l[None, :], m_m[:, None] & (o_l >= 0)[None, :])
