"""The FlashAttention algorithms of the papers, block by block, for one head in float64 NumPy.

Shapes: ``q`` is ``(Sq, D)``, ``k`` and ``v`` are ``(Sk, D)``.  ``S = tau * Q K^T`` with
``tau = softmax_scale`` (default ``1/sqrt(D)``); with ``causal=True`` key ``j`` is hidden
from query ``i`` when ``j > i + Sk - Sq`` (bottom-right alignment, as in
``flashtile.backends.spec``; for ``Sq == Sk`` this is the usual ``j > i``).

The arrays named ``O``, ``l``, ``m`` (and ``dQ``, ``dK``, ``dV``) play the role of HBM: a block
is read from them, updated "on chip" in local variables, and written back.  Everything the
algorithms keep per row is ``O(Sq)``; the only ``Br x Bc`` arrays are the current block's.

Online softmax.  Split the keys of one row into blocks and let ``m`` be a running maximum and
``l`` the running sum of ``exp(s - m)``.  Seeing a new block with scores ``s_b``::

    m_new = max(m, rowmax(s_b))
    l_new = exp(m - m_new) * l + rowsum(exp(s_b - m_new))

keeps ``l * exp(m) = sum exp(s)`` over the keys seen so far, without overflow, so that at the
end ``lse = m + log(l)`` and ``P = exp(S - lse)``.

A row that has seen only masked keys has ``m = -inf``; the convention ``exp(-inf - (-inf)) = 0``
(implemented by :func:`_exp_sub`) keeps its ``l`` and output at 0 instead of NaN, and the
final output of a row with ``l = 0`` is 0 and its lse is ``-inf``.

Every algorithm takes an optional ``trace`` callable, called as ``trace(event, **fields)`` at
each block step with copies of the block's values (``flashtile.reference.trace`` records them
for the interactive explainer); it does not change what is computed.  ``block_mask`` (a
boolean ``(ceil(Sq/Br), ceil(Sk/Bc))`` array, True = compute) skips whole blocks as in the
paper's block-sparse Algorithm 5.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = [
    "flash_attention_forward_v1",
    "flash_attention_forward_v1_dropout",
    "flash_attention_forward_v2",
    "flash_attention_backward",
    "split_kv_decode",
    "merge_states",
    "causal_block_mask",
]


def _exp_sub(x, m):
    """``exp(x - m)`` broadcasting ``m`` over the last axis of ``x``, with ``exp(-inf - -inf) = 0``.

    ``m = -inf`` only happens for rows that have seen no visible key; their ``x`` are all
    ``-inf`` too, so offsetting by 0 instead gives ``exp(-inf) = 0`` as wanted.
    """
    m = np.asarray(m, dtype=np.float64)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    if np.ndim(x) > np.ndim(m):
        m_safe = m_safe[..., None]
    return np.exp(x - m_safe)


def _scale(softmax_scale, d):
    return 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)


def causal_block_mask(r0, r1, c0, c1, sq, sk):
    """Boolean ``(r1 - r0, c1 - c0)``: visible pairs of a block under bottom-right causality."""
    i = np.arange(r0, r1)[:, None]
    j = np.arange(c0, c1)[None, :]
    return j <= i + (sk - sq)


def _block_hidden(r0, r1, c0, c1, sq, sk):
    """True when the whole block is above the causal diagonal, so it can be skipped."""
    # the most permissive query of the block is its last one, the strictest key is its first
    return c0 > (r1 - 1) + (sk - sq)


def _masked_scores(q_blk, k_blk, tau, causal, r0, c0, sq, sk):
    s = tau * (q_blk @ k_blk.T)  # [Br, Bc]
    if causal:
        keep = causal_block_mask(r0, r0 + s.shape[0], c0, c0 + s.shape[1], sq, sk)
        s = np.where(keep, s, -np.inf)
    return s


def _block_off(block_mask, r0, c0, block_r, block_c):
    """True when the block-sparsity mask switches off the block starting at ``(r0, c0)``."""
    return block_mask is not None and not block_mask[r0 // block_r, c0 // block_c]


def flash_attention_forward_v1(q, k, v, *, block_r=16, block_c=16, causal=False,
                               softmax_scale=None, block_mask=None, trace=None):
    """Algorithm 1 (FlashAttention): outer loop over K/V blocks, inner loop over Q blocks.

    For each key block ``j`` and query block ``i``::

        S_ij  = tau Q_i K_j^T                               [Br, Bc]
        m~    = rowmax(S_ij),  P~ = exp(S_ij - m~),  l~ = rowsum(P~)
        m_new = max(m_i, m~)
        l_new = exp(m_i - m_new) l_i + exp(m~ - m_new) l~
        O_i  <- diag(l_new)^-1 (diag(l_i) exp(m_i - m_new) O_i + exp(m~ - m_new) P~ V_j)
        l_i  <- l_new,  m_i <- m_new

    ``O_i`` stays normalised after every step, which is why it is rescaled by ``l_i / l_new``.
    Returns ``(O, l, m)``; ``lse = m + log(l)``.
    """
    return flash_attention_forward_v1_dropout(q, k, v, None, 0.0, block_r=block_r,
                                              block_c=block_c, causal=causal,
                                              softmax_scale=softmax_scale,
                                              block_mask=block_mask, trace=trace)


def flash_attention_forward_v1_dropout(q, k, v, keep, dropout_p, *, block_r=16, block_c=16,
                                       causal=False, softmax_scale=None, block_mask=None,
                                       trace=None):
    """Algorithm 2: Algorithm 1 with MASK and dropout.

    ``keep`` is a boolean ``(Sq, Sk)`` keep mask standing in for the Philox stream (``None``:
    no dropout).  Dropout acts on the unnormalised block only in the ``P~ V_j`` product::

        P~_dropped = P~ o Z_ij,   Z = keep / (1 - p)
        O_i <- diag(l_new)^-1 (diag(l_i) exp(m_i - m_new) O_i + exp(m~ - m_new) P~_dropped V_j)

    while ``l`` and ``m`` are the statistics of the undropped softmax, so the result is
    ``(P o Z) V`` with ``P`` the true softmax.  Returns ``(O, l, m)``.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    sq, d = q.shape
    sk = k.shape[0]
    tau = _scale(softmax_scale, d)
    # "HBM"
    O = np.zeros((sq, v.shape[1]))
    l = np.zeros(sq)
    m = np.full(sq, -np.inf)
    for c0 in range(0, sk, block_c):
        c1 = min(c0 + block_c, sk)
        b_k, b_v = k[c0:c1], v[c0:c1]  # [Bc, D]
        if trace is not None:
            trace("load_kv", c0=c0, c1=c1)
        for r0 in range(0, sq, block_r):
            r1 = min(r0 + block_r, sq)
            if causal and _block_hidden(r0, r1, c0, c1, sq, sk):
                if trace is not None:
                    trace("skip", r0=r0, r1=r1, c0=c0, c1=c1, reason="causal")
                continue  # all -inf: m~ = -inf and the update would change nothing
            if _block_off(block_mask, r0, c0, block_r, block_c):
                if trace is not None:
                    trace("skip", r0=r0, r1=r1, c0=c0, c1=c1, reason="sparse")
                continue
            b_o, b_l, b_m = O[r0:r1], l[r0:r1], m[r0:r1]  # [Br, D], [Br], [Br]
            b_s = _masked_scores(q[r0:r1], b_k, tau, causal, r0, c0, sq, sk)  # [Br, Bc]
            b_mt = b_s.max(axis=1)  # [Br]
            b_pt = _exp_sub(b_s, b_mt)  # [Br, Bc]
            b_lt = b_pt.sum(axis=1)
            b_mnew = np.maximum(b_m, b_mt)
            alpha = _exp_sub(b_m, b_mnew)  # weight of what was already accumulated
            beta = _exp_sub(b_mt, b_mnew)  # weight of this block
            b_lnew = alpha * b_l + beta * b_lt
            if keep is not None:
                b_pt = b_pt * keep[r0:r1, c0:c1] / (1.0 - dropout_p)
            num = (b_l * alpha)[:, None] * b_o + beta[:, None] * (b_pt @ b_v)  # [Br, D]
            b_onew = np.divide(num, b_lnew[:, None], out=np.zeros_like(num),
                               where=b_lnew[:, None] > 0)
            if trace is not None:
                trace("tile", r0=r0, r1=r1, c0=c0, c1=c1, s=b_s.copy(), m_old=b_m.copy(),
                      m_new=b_mnew.copy(), l_old=b_l.copy(), l_new=b_lnew.copy(),
                      alpha=alpha.copy(), o=b_onew.copy())
            O[r0:r1] = b_onew
            l[r0:r1] = b_lnew
            m[r0:r1] = b_mnew
    return O, l, m


def flash_attention_forward_v2(q, k, v, *, block_m=16, block_n=16, causal=False,
                               softmax_scale=None, block_mask=None, trace=None):
    """FlashAttention-2 forward: outer loop over Q blocks, inner over K/V blocks.

    The accumulator is left unnormalised and rescaled only by the change of the maximum::

        m_new = max(m, rowmax(S_ij))
        P     = exp(S_ij - m_new)
        l     = exp(m - m_new) l + rowsum(P)
        acc   = exp(m - m_new) acc + P V_j
        ...after the last block:  O_i = acc / l,   lse_i = m + log(l)

    Each query block is finished before the next is started, so only ``lse`` (one number
    per row) has to be saved for the backward pass.  Key blocks entirely above the causal
    diagonal are never visited.  Returns ``(O, lse)``.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    sq, d = q.shape
    sk = k.shape[0]
    tau = _scale(softmax_scale, d)
    O = np.zeros((sq, v.shape[1]))
    lse = np.full(sq, -np.inf)
    for r0 in range(0, sq, block_m):
        r1 = min(r0 + block_m, sq)
        b_q = q[r0:r1]  # [BM, D]
        b_m = np.full(r1 - r0, -np.inf)  # [BM]
        b_l = np.zeros(r1 - r0)  # [BM]
        b_acc = np.zeros((r1 - r0, v.shape[1]))  # [BM, D]
        # the last visible key of the block's last query bounds the loop
        c_end = sk if not causal else min(sk, max(0, (r1 - 1) + (sk - sq) + 1))
        if trace is not None:
            trace("load_q", r0=r0, r1=r1)
        for c0 in range(0, c_end, block_n):
            c1 = min(c0 + block_n, sk)
            if _block_off(block_mask, r0, c0, block_m, block_n):
                if trace is not None:
                    trace("skip", r0=r0, r1=r1, c0=c0, c1=c1, reason="sparse")
                continue
            b_s = _masked_scores(b_q, k[c0:c1], tau, causal, r0, c0, sq, sk)  # [BM, BN]
            b_mnew = np.maximum(b_m, b_s.max(axis=1))
            b_p = _exp_sub(b_s, b_mnew)  # [BM, BN]
            alpha = _exp_sub(b_m, b_mnew)  # [BM]
            b_lnew = alpha * b_l + b_p.sum(axis=1)
            b_acc = alpha[:, None] * b_acc + b_p @ v[c0:c1]
            if trace is not None:
                trace("tile", r0=r0, r1=r1, c0=c0, c1=c1, s=b_s.copy(), m_old=b_m.copy(),
                      m_new=b_mnew.copy(), l_old=b_l.copy(), l_new=b_lnew.copy(),
                      alpha=alpha.copy(), acc=b_acc.copy())
            b_l = b_lnew
            b_m = b_mnew
        if trace is not None:  # the loop bound leaves out the blocks above the diagonal
            for c0 in range(-(-c_end // block_n) * block_n, sk, block_n):
                trace("skip", r0=r0, r1=r1, c0=c0, c1=min(c0 + block_n, sk), reason="causal")
        O[r0:r1] = np.divide(b_acc, b_l[:, None], out=np.zeros_like(b_acc),
                             where=b_l[:, None] > 0)
        with np.errstate(divide="ignore"):
            lse[r0:r1] = np.where(b_l > 0, b_m + np.log(b_l), -np.inf)
        if trace is not None:
            trace("store_o", r0=r0, r1=r1, o=O[r0:r1].copy(), lse=lse[r0:r1].copy(),
                  m=b_m.copy(), l=b_l.copy())
    return O, lse


def flash_attention_backward(do, q, k, v, out, *, lse=None, m=None, l=None, block_r=16,
                             block_c=16, causal=False, softmax_scale=None, keep=None,
                             dropout_p=0.0, trace=None):
    """Algorithm 4: blockwise backward pass, recomputing ``P`` from the saved statistics.

    Give either ``lse`` or the pair ``(m, l)`` of Algorithms 1/2 (``lse = m + log l``).
    Outer loop over K/V blocks ``j`` (``dK_j``, ``dV_j`` stay on chip), inner over Q blocks::

        P_ij   = exp(S_ij - lse_i)            (= diag(l_i)^-1 exp(S_ij - m_i))
        dV_j  += (P_ij o Z_ij)^T dO_i
        dP_ij  = (dO_i V_j^T) o Z_ij
        D_i    = rowsum(dO_i o O_i)           (= rowsum(P o dP): O = (P o Z) V)
        dS_ij  = P_ij o (dP_ij - D_i)
        dQ_i  += tau dS_ij K_j                (read-modify-write of "HBM")
        dK_j  += tau dS_ij^T Q_i

    ``keep`` is the same boolean keep mask the forward used (``Z = keep / (1 - p)``).
    Returns ``(dQ, dK, dV)``.
    """
    do, q, k, v, out = (np.asarray(x, dtype=np.float64) for x in (do, q, k, v, out))
    sq, d = q.shape
    sk = k.shape[0]
    tau = _scale(softmax_scale, d)
    if lse is None:
        if m is None or l is None:
            raise ValueError("give lse or both m and l")
        with np.errstate(divide="ignore"):
            lse = np.where(np.asarray(l) > 0, np.asarray(m) + np.log(np.asarray(l)), -np.inf)
    lse = np.asarray(lse, dtype=np.float64)
    # rows that saw no key: exp(S - inf) = 0 makes their P, and so every gradient they feed, 0
    lse_safe = np.where(np.isneginf(lse), np.inf, lse)
    delta = (do * out).sum(axis=1)  # [Sq]
    dQ = np.zeros_like(q)
    dK = np.zeros_like(k)
    dV = np.zeros_like(v)
    for c0 in range(0, sk, block_c):
        c1 = min(c0 + block_c, sk)
        b_k, b_v = k[c0:c1], v[c0:c1]  # [Bc, D]
        b_dk = np.zeros_like(b_k)  # [Bc, D]
        b_dv = np.zeros_like(b_v)  # [Bc, D]
        if trace is not None:
            trace("load_kv", c0=c0, c1=c1)
        for r0 in range(0, sq, block_r):
            r1 = min(r0 + block_r, sq)
            if causal and _block_hidden(r0, r1, c0, c1, sq, sk):
                if trace is not None:
                    trace("skip", r0=r0, r1=r1, c0=c0, c1=c1, reason="causal")
                continue
            b_q, b_do = q[r0:r1], do[r0:r1]  # [Br, D]
            b_s = _masked_scores(b_q, b_k, tau, causal, r0, c0, sq, sk)  # [Br, Bc]
            b_p = np.exp(b_s - lse_safe[r0:r1, None])  # [Br, Bc]
            b_z = None
            if keep is not None:
                b_z = keep[r0:r1, c0:c1] / (1.0 - dropout_p)  # [Br, Bc]
            b_pd = b_p if b_z is None else b_p * b_z
            b_dv += b_pd.T @ b_do
            b_dp = b_do @ b_v.T  # [Br, Bc]
            if b_z is not None:
                b_dp = b_dp * b_z
            b_ds = b_p * (b_dp - delta[r0:r1, None])  # [Br, Bc]
            dQ[r0:r1] += tau * (b_ds @ b_k)
            b_dk += tau * (b_ds.T @ b_q)
            if trace is not None:
                trace("tile", r0=r0, r1=r1, c0=c0, c1=c1, s=b_s.copy(), p=b_p.copy(),
                      dp=b_dp.copy(), ds=b_ds.copy(), dq=dQ[r0:r1].copy(), dk=b_dk.copy(),
                      dv=b_dv.copy())
        dK[c0:c1] = b_dk
        dV[c0:c1] = b_dv
        if trace is not None:
            trace("store_kv", c0=c0, c1=c1, dk=b_dk.copy(), dv=b_dv.copy())
    return dQ, dK, dV


def merge_states(outs, lses):
    """Merge results over disjoint key sets (the LSE merge of split-KV decoding).

    ``outs`` is ``(n, Sq, D)``, each normalised over its own keys, ``lses`` is ``(n, Sq)``::

        lse = log sum_s exp(lse_s),    O = sum_s exp(lse_s - lse) O_s

    A split that saw no key (``lse_s = -inf``) gets weight 0.  Returns ``(O, lse, weights)``
    with ``weights`` ``(n, Sq)``.
    """
    outs = np.asarray(outs, dtype=np.float64)
    lses = np.asarray(lses, dtype=np.float64)
    m = lses.max(axis=0)  # [Sq]
    w = _exp_sub(lses.T, m).T  # [n, Sq]
    total = w.sum(axis=0)
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, np.where(np.isneginf(m), 0.0, m) + np.log(total), -np.inf)
    weights = np.divide(w, total, out=np.zeros_like(w), where=total > 0)
    return (weights[..., None] * outs).sum(axis=0), lse, weights


def split_kv_decode(q, k, v, *, num_splits=2, block_n=16, softmax_scale=None, trace=None):
    """Split-KV decoding: each split of the keys runs the FlashAttention-2 forward, then
    :func:`merge_states` combines the partial outputs by their log-sum-exp.

    ``q`` is ``(Sq, D)`` (a few new tokens, each seeing every cached key), ``k`` and ``v`` are
    ``(Sk, D)``.  The keys are cut into ``num_splits`` contiguous ranges of whole blocks (a GPU
    runs them in parallel).  Returns ``(O, lse)``; with ``trace``, each split's events carry
    ``split=s`` and the merge is reported as ``trace("merge", lses=..., weights=..., o=...,
    lse=...)``.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    sk = k.shape[0]
    tau = _scale(softmax_scale, q.shape[1])
    n_blocks = max(1, -(-sk // block_n))
    num_splits = max(1, min(int(num_splits), n_blocks))
    per = -(-n_blocks // num_splits)  # blocks per split
    bounds = [(s * per * block_n, min(sk, (s + 1) * per * block_n)) for s in range(num_splits)]
    bounds = [(a, b) for a, b in bounds if a < b] or [(0, 0)]
    outs, lses = [], []
    for s, (a, b) in enumerate(bounds):
        sub = None
        if trace is not None:
            def sub(event, _s=s, _a=a, **f):  # report key positions in the whole cache
                if "c0" in f:
                    f["c0"] += _a
                    f["c1"] += _a
                trace(event, split=_s, **f)
            trace("split", split=s, c0=a, c1=b)
        o_s, lse_s = flash_attention_forward_v2(q, k[a:b], v[a:b], block_m=max(1, q.shape[0]),
                                                block_n=block_n, softmax_scale=tau, trace=sub)
        outs.append(o_s)
        lses.append(lse_s)
    out, lse, weights = merge_states(outs, lses)
    if trace is not None:
        trace("merge", lses=np.array(lses), weights=weights, o=out.copy(), lse=lse.copy())
    return out, lse
