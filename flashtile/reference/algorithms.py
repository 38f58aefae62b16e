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
(implemented by :func:`exp_sub`) keeps its ``l`` and output at 0 instead of NaN, and the
final output of a row with ``l = 0`` is 0 and its lse is ``-inf``.

Every algorithm takes an optional ``trace`` callable, called as ``trace(event, **fields)`` at
each block step with copies of the block's values (``flashtile.explain`` records them for the
interactive explainer); it does not change what is computed.  ``block_mask`` (a
boolean ``(ceil(Sq/Br), ceil(Sk/Bc))`` array, True = compute) skips whole blocks as in the
paper's block-sparse Algorithm 5.

Bytes moved (the second part of this module): the paper's IO analysis (Theorem 2) written out
per kernel, for the paper's algorithms and for flashtile's kernels.  All counts are exact
integers in bytes for one call over ``batch x heads`` heads of ``n`` queries and ``n_k`` keys of
head dim ``d`` (``e`` bytes an element, 4 for the float32 statistics).  Four levels:

``compulsory``  what any exact attention must move: the forward reads Q, K, V and writes O and
                the log-sum-exp (LSE); the backward reads Q, K, V, O, dO, LSE and writes dQ,
                dK, dV::

                    fwd = e (2 n d H + 2 n_k d Hk) + 4 n H          (per batch element)
                    bwd = e (3 n d H + 2 n_k d Hk) + 4 n H + e (n d H + 2 n_k d Hk)

``tile``        what the kernels' tile loads and stores move between global memory and the
                SMs (through L2): Theorem 2's count, every tile load counted.  flashtile's
                forward walks query tiles outside (``B_r = block_m`` rows) and key tiles
                inside (``B_c = block_n``), so K and V are read once per query tile::

                    fwd:  Q n d e + (K + V) T_r n_k d e + O n d e + LSE 4 n,  T_r = ceil(n / B_r)

                The paper's Algorithm 1 has the loops the other way round and re-reads Q and O
                (``T_c = ceil(n_k / B_c)`` passes, :func:`paper_forward`): the same
                ``Theta(N^2 d^2 / M)`` once ``B ~ M / d``, with the re-read operand swapped.
                The backward runs as flashtile runs it (:func:`flashtile_backward`): a dQ
                kernel over query tiles that also computes ``delta = rowsum(dO * O)`` in its
                prologue, then a dK/dV kernel over key tiles that re-reads Q, dO, LSE and delta
                per visited tile (``fused_delta=False`` counts a three-kernel backward with a
                separate preprocess instead).

``dram``        the HBM bytes once a cache holds the re-read tiles: every tensor a kernel
                touches is read once.  On an H100 the 50 MB L2 holds one head's K and V
                (``2 n d e``, 256 KB at n=1024, d=64, bf16) for all the programs of the heads
                in flight, so DRAM traffic hardly depends on the tile sizes while the
                tile (L2 <-> SM) traffic does.  :func:`dram_bytes` falls back to the tile count
                when the re-read operands of the heads in flight do not fit in ``cache_bytes``.

``standard``    Algorithm 0 (forward) and its backward: S and P (and dP, dS) materialised in
                HBM, ``Theta(N d + N^2)`` (:func:`standard_forward`, :func:`standard_backward`).

Masks: ``causal`` counts exactly the (query tile, key tile) pairs the kernels visit (bottom-
right aligned, as flashtile); ``density`` scales the visited pairs of a block-sparse call.
"""
from __future__ import annotations

import dataclasses
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
    "Problem",
    "KernelIO",
    "compulsory",
    "flashtile_forward",
    "flashtile_backward",
    "flashtile_kernels",
    "total",
    "dram_bytes",
    "sram_tiles",
    "paper_forward",
    "standard_forward",
    "standard_backward",
    "standard",
    "figure2_problem",
    "key_rows_per_query_tile",
    "query_rows_per_key_tile",
    "cdiv",
    "gb",
]


def exp_sub(x, m):
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


def _causal_rows(sq, sk, block_r, c0, c1, causal, trace):
    """The query blocks ``(r0, r1)`` that see some key of ``[c0, c1)``.  A block wholly above
    the causal diagonal is traced as skipped: all its scores are -inf, so ``m~ = -inf`` and its
    update (forward) or gradient (backward) would change nothing."""
    for r0 in range(0, sq, block_r):
        r1 = min(r0 + block_r, sq)
        if causal and _block_hidden(r0, r1, c0, c1, sq, sk):
            if trace is not None:
                trace("skip", r0=r0, r1=r1, c0=c0, c1=c1, reason="causal")
            continue
        yield r0, r1


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
        for r0, r1 in _causal_rows(sq, sk, block_r, c0, c1, causal, trace):
            if _block_off(block_mask, r0, c0, block_r, block_c):
                if trace is not None:
                    trace("skip", r0=r0, r1=r1, c0=c0, c1=c1, reason="sparse")
                continue
            b_o, b_l, b_m = O[r0:r1], l[r0:r1], m[r0:r1]  # [Br, D], [Br], [Br]
            b_s = _masked_scores(q[r0:r1], b_k, tau, causal, r0, c0, sq, sk)  # [Br, Bc]
            b_mt = b_s.max(axis=1)  # [Br]
            b_pt = exp_sub(b_s, b_mt)  # [Br, Bc]
            b_lt = b_pt.sum(axis=1)
            b_mnew = np.maximum(b_m, b_mt)
            alpha = exp_sub(b_m, b_mnew)  # weight of what was already accumulated
            beta = exp_sub(b_mt, b_mnew)  # weight of this block
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
            b_p = exp_sub(b_s, b_mnew)  # [BM, BN]
            alpha = exp_sub(b_m, b_mnew)  # [BM]
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
        for r0, r1 in _causal_rows(sq, sk, block_r, c0, c1, causal, trace):
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
    w = exp_sub(lses.T, m).T  # [n, Sq]
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


# ----------------------------------------------------------------------------------------------
# Bytes moved (Theorem 2)


STAT_BYTES = 4  # LSE, delta: float32 per row


@dataclasses.dataclass(frozen=True)
class Problem:
    """One attention call: ``batch x heads`` heads of ``n`` queries, ``n_k`` keys, head dim
    ``d``, ``dtype_bytes`` per element; ``heads_k`` key/value heads (GQA)."""
    n: int
    d: int
    heads: int = 1
    batch: int = 1
    dtype_bytes: int = 2
    n_k: int | None = None
    heads_k: int | None = None
    causal: bool = False
    density: float = 1.0

    @property
    def nk(self) -> int:
        return self.n if self.n_k is None else self.n_k

    @property
    def hk(self) -> int:
        return self.heads if self.heads_k is None else self.heads_k

    def q_bytes(self) -> int:
        """One ``(batch, n, heads, d)`` tensor (Q, O, dO, dQ)."""
        return self.batch * self.n * self.heads * self.d * self.dtype_bytes

    def kv_bytes(self) -> int:
        """One ``(batch, n_k, heads_k, d)`` tensor (K, V, dK, dV)."""
        return self.batch * self.nk * self.hk * self.d * self.dtype_bytes

    def stat_bytes(self) -> int:
        """One float32 ``(batch, heads, n)`` row statistic (LSE, delta)."""
        return self.batch * self.heads * self.n * STAT_BYTES


@dataclasses.dataclass(frozen=True)
class KernelIO:
    """Bytes of one kernel: ``tile_*`` every tile load/store (L2 <-> SM), ``dram_*`` each
    tensor touched once (HBM with a cache that holds the re-read tiles)."""
    kernel: str
    tile_read: int
    tile_write: int
    dram_read: int
    dram_write: int
    reread_per_head: int = 0  # bytes one head's programs re-read from the cache
    programs_per_head: int = 1

    @property
    def tile(self) -> int:
        return self.tile_read + self.tile_write

    @property
    def dram(self) -> int:
        return self.dram_read + self.dram_write


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def key_rows_per_query_tile(p: Problem, block_m: int, block_n: int) -> list[int]:
    """For each query tile, the key rows it loads (whole visited key tiles, the last one
    partial): what the forward and dQ kernels read of K and V per query tile."""
    shift = p.nk - p.n
    out = []
    for i in range(cdiv(p.n, block_m)):
        if p.causal:
            last_q = min((i + 1) * block_m, p.n) - 1
            last_key = min(last_q + shift, p.nk - 1)  # visible keys are j <= i + shift
            tiles = 0 if last_key < 0 else cdiv(last_key + 1, block_n)
        else:
            tiles = cdiv(p.nk, block_n)
        out.append(min(p.nk, tiles * block_n))  # tiles 0 .. tiles-1, the last one may be partial
    return out


def query_rows_per_key_tile(p: Problem, block_m: int, block_n: int) -> list[int]:
    """For each key tile, the query rows the dK/dV kernel loads (whole visited query tiles)."""
    shift = p.nk - p.n
    out = []
    for j in range(cdiv(p.nk, block_n)):
        if p.causal:
            first_q = max(0, j * block_n - shift)  # first query that sees key j * block_n
            first_tile = first_q // block_m
            rows = 0 if first_q >= p.n else p.n - first_tile * block_m
        else:
            rows = p.n
        out.append(rows)
    return out


def _per_head(p: Problem) -> int:
    return p.batch * p.heads


def compulsory(p: Problem, pass_: str = "fwd_bwd") -> int:
    """Bytes any exact attention must move for ``pass_`` (``fwd``, ``bwd`` or ``fwd_bwd``)."""
    fwd = p.q_bytes() + 2 * p.kv_bytes() + p.q_bytes() + p.stat_bytes()
    bwd = (2 * p.q_bytes() + 2 * p.kv_bytes() + p.q_bytes() + p.stat_bytes()  # Q dO K V O LSE
           + p.q_bytes() + 2 * p.kv_bytes())  # dQ dK dV
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[pass_]


def _scaled(x: int, density: float) -> int:
    return x if density >= 1.0 else int(round(x * density))


def flashtile_forward(p: Problem, block_m: int, block_n: int) -> list[KernelIO]:
    """The forward kernel (grid: query tiles x heads)."""
    e, d = p.dtype_bytes, p.d
    kv_rows = _scaled(sum(key_rows_per_query_tile(p, block_m, block_n)), p.density)
    tile_read = p.q_bytes() + 2 * _per_head(p) * kv_rows * d * e
    write = p.q_bytes() + p.stat_bytes()
    dram_read = p.q_bytes() + 2 * p.kv_bytes()
    return [KernelIO("fwd", tile_read, write, min(dram_read, tile_read), write,
                     2 * p.nk * d * e, cdiv(p.n, block_m))]


def flashtile_backward(p: Problem, dkdv: tuple[int, int], dq: tuple[int, int],
                       fused_delta: bool = True, pre_block_m: int = 64,
                       l2_reuse: bool = False) -> list[KernelIO]:
    """The backward's kernels in launch order.  ``dkdv`` / ``dq``: ``(block_m, block_n)`` of
    the two kernels.  ``fused_delta``: the dQ kernel runs first and computes
    ``delta = rowsum(dO * O)`` itself (reads O, writes delta), the dK/dV kernel reads LSE and
    delta; otherwise a preprocess kernel writes delta and ``lse2 = log2(e) lse`` first.
    ``l2_reuse``: the batch is processed in chunks that fit in L2, each chunk's dK/dV kernel
    right after its dQ kernel, so the dK/dV kernel reads nothing from HBM (everything it reads,
    the dQ kernel of its chunk has just read or written)."""
    e, d, s = p.dtype_bytes, p.d, p.stat_bytes()
    kernels = []
    # dQ: Q, dO (and O) tiles once, K and V per visited key tile, one LSE/delta row each.
    kv_rows = _scaled(sum(key_rows_per_query_tile(p, *dq)), p.density)
    dq_read = 2 * p.q_bytes() + 2 * s + 2 * _per_head(p) * kv_rows * d * e
    dq_dram = 2 * p.q_bytes() + 2 * s + 2 * p.kv_bytes()
    dq_write = p.q_bytes()
    if fused_delta:
        dq_read += p.q_bytes() - s  # reads O, and LSE only (it writes delta)
        dq_dram += p.q_bytes() - s
        dq_write += s
    else:
        pre_read, pre_write = 2 * p.q_bytes() + s, 2 * s
        kernels.append(KernelIO("pre", pre_read, pre_write, pre_read, pre_write))
    dq_kernel = KernelIO("dq", dq_read, dq_write, min(dq_dram, dq_read), dq_write,
                         2 * p.nk * d * e, cdiv(p.n, dq[0]))
    # dK/dV: K, V tiles once; per visited query tile Q, dO tiles and two row statistics,
    # for each query head of the key/value head's group.
    q_rows = _scaled(sum(query_rows_per_key_tile(p, *dkdv)), p.density)
    dkdv_read = 2 * p.kv_bytes() + 2 * _per_head(p) * q_rows * (d * e + STAT_BYTES)
    dkdv_dram = 2 * p.kv_bytes() + 2 * p.q_bytes() + 2 * s
    dkdv_write = 2 * p.kv_bytes()
    if l2_reuse and fused_delta:
        dkdv_dram = 0
    dkdv_kernel = KernelIO("dkdv", dkdv_read, dkdv_write, min(dkdv_dram, dkdv_read), dkdv_write,
                           2 * p.n * (d * e + STAT_BYTES) * (p.heads // p.hk),
                           cdiv(p.nk, dkdv[1]))
    kernels += [dq_kernel, dkdv_kernel] if fused_delta else [dkdv_kernel, dq_kernel]
    return kernels


ACC_BYTES = 4  # the float32 dQ accumulator of the one-kernel backward


def flashtile_backward_fused(p: Problem, block_m: int = 64, block_n: int = 128) -> list[KernelIO]:
    """The Hopper one-kernel backward (``attn_bwd_sm90.py`` with ``DQ``), in launch order:
    ``delta`` (reads O and dO, writes delta and zeroes the float32 dQ accumulator), ``bwd``
    (the dK/dV kernel's reads, plus one ``[block_m, d]`` float32 reduction into the accumulator
    per visited (key tile, query tile); in DRAM the accumulator is read once and written back
    once when it does not stay in the cache) and ``dq`` (the accumulator converted into dQ)."""
    e, d, s = p.dtype_bytes, p.d, p.stat_bytes()
    acc = p.q_bytes() // e * ACC_BYTES
    delta = KernelIO("delta", 2 * p.q_bytes(), s + acc, 2 * p.q_bytes(), s + acc)
    q_rows = _scaled(sum(query_rows_per_key_tile(p, block_m, block_n)), p.density)
    read = 2 * p.kv_bytes() + 2 * _per_head(p) * q_rows * (d * e + STAT_BYTES)
    reduce = _per_head(p) * q_rows * d * ACC_BYTES  # each tile's dq, read-modify-write in L2
    dram = 2 * p.kv_bytes() + 2 * p.q_bytes() + 2 * s + acc
    bwd = KernelIO("bwd", read, 2 * p.kv_bytes() + reduce, min(dram, read),
                   2 * p.kv_bytes() + acc,
                   2 * p.n * (d * e + STAT_BYTES) * (p.heads // p.hk), cdiv(p.nk, block_n))
    copy = KernelIO("dq", acc, p.q_bytes(), acc, p.q_bytes())
    return [delta, bwd, copy]


def flashtile_kernels(p: Problem, fwd: tuple[int, int], dkdv: tuple[int, int],
                      dq: tuple[int, int], fused_delta: bool = True) -> dict[str, list[KernelIO]]:
    """``{"fwd": [...], "bwd": [...]}`` for the given ``(block_m, block_n)`` of each kernel."""
    return {"fwd": flashtile_forward(p, *fwd),
            "bwd": flashtile_backward(p, dkdv, dq, fused_delta)}


def total(kernels: list[KernelIO], level: str = "dram") -> int:
    return sum(getattr(k, level) for k in kernels)


def dram_bytes(p: Problem, kernels: list[KernelIO], cache_bytes: int = 50 * 2**20,
               programs_in_flight: int = 2 * 132) -> int:
    """HBM bytes of ``kernels`` with a cache of ``cache_bytes``: a kernel moves its ``dram``
    count when the re-read operands (K and V of a head in the forward and dQ kernels; Q, dO
    and two row statistics in the dK/dV kernel) of the heads in flight fit in the cache
    (``programs_in_flight`` programs, consecutive programs working on the same head), else its
    ``tile`` count."""
    out = 0
    for k in kernels:
        heads = min(cdiv(programs_in_flight, k.programs_per_head), p.batch * p.hk) + 1
        out += k.dram if k.reread_per_head * heads <= cache_bytes else k.tile
    return out


def sram_tiles(sram_bytes: int, d: int, dtype_bytes: int = 2) -> tuple[int, int]:
    """The paper's block sizes for an on-chip memory of ``M`` elements:
    ``B_c = ceil(M / 4d)``, ``B_r = min(ceil(M / 4d), d)``."""
    m = sram_bytes // dtype_bytes
    bc = cdiv(m, 4 * d)
    return min(bc, d), bc


def paper_forward(p: Problem, block_r: int, block_c: int) -> int:
    """Tile bytes of the paper's Algorithm 1 (outer loop over K/V blocks): K and V read once;
    for each of the ``T_c`` key blocks every query block reads Q_i, O_i, l_i, m_i and writes
    O_i, l_i, m_i (``l``, ``m`` in float32).  ``Theta(N d T_c) = Theta(N^2 d^2 / M)``."""
    tc = cdiv(p.nk, block_c)
    rows = _per_head(p) * p.n
    per_pass = rows * (3 * p.d * p.dtype_bytes + 4 * STAT_BYTES)  # Q, O in, O out; l, m in/out
    return 2 * p.kv_bytes() + _scaled(tc * per_pass, p.density)


def standard_forward(p: Problem, score_bytes: int | None = None) -> int:
    """Algorithm 0: ``S = Q K^T`` (read Q, K, write S), ``P = softmax(S)`` (read S, write P),
    ``O = P V`` (read P, V, write O): ``4 n d e + 4 n^2 s`` per head (``s`` bytes a score)."""
    s = p.dtype_bytes if score_bytes is None else score_bytes
    nn = _per_head(p) * p.n * p.nk * s
    return (p.q_bytes() + p.kv_bytes() + nn) + 2 * nn + (nn + p.kv_bytes() + p.q_bytes())


def standard_backward(p: Problem, score_bytes: int | None = None) -> int:
    """The standard backward (the paper's Algorithm 3) with P saved:
    ``dV = P^T dO`` (read P, dO; write dV), ``dP = dO V^T`` (read dO, V; write dP),
    ``D = rowsum(dO * O)`` (read dO, O; write D), ``dS = P o (dP - D)`` (read P, dP, D; write
    dS), ``dQ = dS K`` (read dS, K; write dQ), ``dK = dS^T Q`` (read dS, Q; write dK):
    ``7 n^2 s`` score bytes, ten ``n d`` tensors, two row statistics."""
    s = p.dtype_bytes if score_bytes is None else score_bytes
    nn = _per_head(p) * p.n * p.nk * s
    qb, kb, st = p.q_bytes(), p.kv_bytes(), p.stat_bytes()
    dv = nn + qb + kb
    dp = qb + kb + nn
    dd = 2 * qb + st
    ds = 2 * nn + st + nn
    dq = nn + kb + qb
    dk = nn + qb + kb
    return dv + dp + dd + ds + dq + dk


def standard(p: Problem, pass_: str = "fwd_bwd", score_bytes: int | None = None) -> int:
    fwd, bwd = standard_forward(p, score_bytes), standard_backward(p, score_bytes)
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[pass_]


def figure2_problem() -> Problem:
    """The paper's Figure 2 shape: GPT-2 medium, N=1024, d=64, 16 heads, batch 64, 2-byte."""
    return Problem(n=1024, d=64, heads=16, batch=64, dtype_bytes=2)


def gb(x: int | float) -> float:
    return x / 1e9
