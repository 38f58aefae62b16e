"""Materialised attention in float64 NumPy: the oracle every backend is checked against.

For one batch entry ``b`` and query head ``h`` (reading key/value head ``h // (H // Hk)``)::

    S_ij   = tau * q_i . k_j                       (tau = softmax_scale, default 1/sqrt(D))
    S_ij   = c * tanh(S_ij / c)                    if softcap c > 0
    S_ij  -= slope[b, h] * |i + Sk - Sq - j|       if ALiBi slopes are given
    S_ij  += bias[b, h, i, j]                      if an additive bias is given
    S_ij   = -inf                                  if key j is not visible to query i
    lse_i  = log sum_j exp(S_ij)                   (-inf when row i sees no key)
    P_ij   = exp(S_ij - lse_i)                     (0 for the whole row when lse_i = -inf)
    O_i    = sum_j P_ij Z_ij / (1 - p) v_j         (Z = keep mask, Z = 1 without dropout)

Visibility (the window rule of ``flashtile.backends.spec``): with ``shift = Sk - Sq`` when
``bottom_right`` else 0, key ``j`` is visible to query ``i`` iff
``j >= i + shift - window_left`` (unless ``window_left < 0``) and
``j <= i + shift + window_right`` (unless ``window_right < 0``).

The backward pass is the chain rule written out, with ``dO`` the incoming gradient::

    dV   = (P o Z / (1 - p))^T dO
    dP   = (dO V^T) o Z / (1 - p)
    dS_ij = P_ij (dP_ij - sum_l P_il dP_il)         (softmax Jacobian; = dBias)
    dS_raw = dS o (1 - tanh^2(tau q.k / c))        (softcap; dS_raw = dS without it)
    dQ   = tau dS_raw K,        dK = tau dS_raw^T Q

ALiBi and the mask are constants, so they only enter through ``P``.  Grouped-query heads sum
their ``dK``/``dV`` into the shared key/value head.

Inputs may be NumPy arrays or torch tensors (any float dtype, any device); everything is
converted to float64 NumPy and the results are float64 NumPy arrays.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["attention", "attention_backward", "visibility_mask"]


def _f64(x):
    if x is None:
        return None
    if hasattr(x, "detach"):  # a torch tensor; bf16 has no NumPy twin, so widen in torch first
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _int_array(x):
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64)


def visibility_mask(sq: int, sk: int, window_left: int = -1, window_right: int = -1,
                    bottom_right: bool = True, shift: int | None = None) -> np.ndarray:
    """Boolean ``(sq, sk)``: True where key ``j`` is visible to query ``i``; ``shift`` overrides
    the diagonal's (partial calls: ``AttnSpec.shift``)."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    if shift is None:
        shift = sk - sq if bottom_right else 0
    visible = np.ones((sq, sk), dtype=bool)
    if window_left >= 0:
        visible &= j >= i + shift - window_left
    if window_right >= 0:
        visible &= j <= i + shift + window_right
    return visible


def _sum_to_shape(x: np.ndarray, shape) -> np.ndarray:
    """Undo NumPy broadcasting: sum ``x`` down to ``shape`` (the gradient of a broadcast)."""
    shape = tuple(shape)
    lead = x.ndim - len(shape)
    if lead:
        x = x.sum(axis=tuple(range(lead)))
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x.reshape(shape)


class _Forward:
    """Every intermediate of the dense forward, kept for the analytic backward."""

    def __init__(self, q, k, v, scale, window_left, window_right, bottom_right, softcap,
                 slopes, bias, keep, dropout_p, frame=None):
        H = q.shape[2]
        Sq, Sk, Hk = q.shape[1], k.shape[1], k.shape[2]
        if H % Hk:
            raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hk})")
        group = H // Hk
        self.group = group
        self.scale = scale
        self.softcap = softcap
        # (B, H, S, D) with key/value heads repeated so that head h reads h // group
        self.qh = q.transpose(0, 2, 1, 3)
        self.kh = np.repeat(k, group, axis=2).transpose(0, 2, 1, 3)
        self.vh = np.repeat(v, group, axis=2).transpose(0, 2, 1, 3)

        s = scale * (self.qh @ self.kh.swapaxes(-1, -2))  # [B, H, Sq, Sk]
        self.tanh = None
        if softcap > 0:
            self.tanh = np.tanh(s / softcap)
            s = softcap * self.tanh
        shift, alibi_shift = frame if frame is not None else (None, Sk - Sq)
        if slopes is not None:
            i = np.arange(Sq)[:, None]
            j = np.arange(Sk)[None, :]
            dist = np.abs(i + alibi_shift - j).astype(np.float64)
            s = s - slopes[:, :, None, None] * dist
        if bias is not None:
            s = s + bias
        visible = visibility_mask(Sq, Sk, window_left, window_right, bottom_right,
                                  shift)[None, None]
        # an additive bias of -inf hides a key just like the window does
        visible = visible & (s > -np.inf)
        s = np.where(visible, s, -np.inf)

        row_max = s.max(axis=-1, initial=-np.inf)  # [B, H, Sq]
        seen = np.isfinite(row_max)
        offset = np.where(seen, row_max, 0.0)
        with np.errstate(divide="ignore"):
            lse = offset + np.log(np.exp(s - offset[..., None]).sum(axis=-1))
        self.lse = np.where(seen, lse, -np.inf)
        lse_safe = np.where(seen, self.lse, np.inf)
        self.p = np.exp(s - lse_safe[..., None])  # exactly 0 where hidden or for unseen rows

        if keep is not None:
            self.drop = np.broadcast_to(keep, self.p.shape).astype(np.float64) / (1.0 - dropout_p)
        else:
            self.drop = None
        self.p_dropped = self.p if self.drop is None else self.p * self.drop
        out = self.p_dropped @ self.vh  # [B, H, Sq, D]
        self.out = out.transpose(0, 2, 1, 3)

    def backward(self, do, want_dbias):
        B, H, D = do.shape[0], do.shape[2], do.shape[3]
        doh = do.transpose(0, 2, 1, 3)
        Hk = H // self.group
        dvh = self.p_dropped.swapaxes(-1, -2) @ doh  # [B, H, Sk, D]
        dp = doh @ self.vh.swapaxes(-1, -2)  # [B, H, Sq, Sk]
        if self.drop is not None:
            dp = dp * self.drop
        delta = (self.p * dp).sum(axis=-1, keepdims=True)
        ds = self.p * (dp - delta)
        dbias = ds if want_dbias else None
        if self.tanh is not None:
            ds = ds * (1.0 - self.tanh ** 2)
        dq = self.scale * (ds @ self.kh)
        dkh = self.scale * (ds.swapaxes(-1, -2) @ self.qh)
        Sk = dkh.shape[2]

        def fold(x):  # sum the query heads of one group into their key/value head
            return x.reshape(B, Hk, self.group, Sk, D).sum(axis=2).transpose(0, 2, 1, 3)

        return dq.transpose(0, 2, 1, 3), fold(dkh), fold(dvh), dbias


def _slopes(alibi_slopes, B, H):
    if alibi_slopes is None:
        return None
    slopes = _f64(alibi_slopes)
    if slopes.shape not in ((H,), (B, H)):
        raise ValueError(f"alibi_slopes must be ({H},) or ({B}, {H}), got {slopes.shape}")
    return np.broadcast_to(slopes, (B, H))


def _run_dense(q, k, v, scale, kw, slopes, bias, keep, frame=None):
    return _Forward(q, k, v, scale, kw["window_left"], kw["window_right"], kw["bottom_right"],
                    kw["softcap"], slopes, bias, keep, kw["dropout_p"], frame)


def _frame(sq, sk, bottom_right, partial):
    """``(shift, alibi_shift)`` of a partial call (``flashtile.backends.spec``), or None."""
    q_offset, k_offset, total_q, total_k = partial
    if not (q_offset or k_offset or total_q or total_k):
        return None
    total_q, total_k = total_q or sq, total_k or sk
    alibi_shift = total_k - total_q + q_offset - k_offset
    return (alibi_shift if bottom_right else q_offset - k_offset), alibi_shift


def _prepare(q, k, v, softmax_scale, dropout_mask, dropout_p):
    q, k, v = _f64(q), _f64(k), _f64(v)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if dropout_p > 0 and dropout_mask is None:
        raise ValueError("the reference takes dropout as an explicit keep mask (dropout_mask)")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}")
    keep = None
    if dropout_mask is not None:
        keep = (dropout_mask.detach().cpu().numpy() if hasattr(dropout_mask, "detach")
                else np.asarray(dropout_mask)).astype(bool)
    return q, k, v, float(softmax_scale), keep


def _varlen_slices(cu_seqlens_q, cu_seqlens_k):
    cq, ck = _int_array(cu_seqlens_q), _int_array(cu_seqlens_k)
    if cq.shape != ck.shape or cq.ndim != 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must both have shape (B + 1,)")
    return [(int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1]))
            for b in range(len(cq) - 1)]


def _per_sequence(x, b, sq, sk):
    """Slice a (B or 1, H or 1, max_sq, max_sk) bias/keep array down to sequence ``b``."""
    if x is None:
        return None
    x4 = x.reshape((1,) * (4 - x.ndim) + x.shape)
    xb = x4[b:b + 1] if x4.shape[0] > 1 else x4
    return xb[:, :, :sq, :sk]


def _forwards(q, k, v, softmax_scale, window_left, window_right, bottom_right, softcap,
              alibi_slopes, attn_bias, dropout_mask, dropout_p, cu_seqlens_q, cu_seqlens_k,
              partial=(0, 0, 0, 0)):
    q, k, v, scale, keep = _prepare(q, k, v, softmax_scale, dropout_mask, dropout_p)
    bias = _f64(attn_bias)
    kw = dict(window_left=int(window_left), window_right=int(window_right),
              bottom_right=bool(bottom_right), softcap=float(softcap),
              dropout_p=float(dropout_p))
    if cu_seqlens_q is None:
        slopes = _slopes(alibi_slopes, q.shape[0], q.shape[2])
        frame = _frame(q.shape[1], k.shape[1], kw["bottom_right"], partial)
        return [(None, _run_dense(q, k, v, scale, kw, slopes, bias, keep, frame))], q, bias
    if any(partial):
        raise ValueError("partial calls (q_offset, k_offset, seqlen_*_total) are dense only")
    if q.ndim != 3:
        raise ValueError("varlen q must be (total_q, H, D)")
    seqs = _varlen_slices(cu_seqlens_q, cu_seqlens_k)
    slopes = _slopes(alibi_slopes, len(seqs), q.shape[1])
    runs = []
    for b, (q0, q1, k0, k1) in enumerate(seqs):
        runs.append(((b, q0, q1, k0, k1), _run_dense(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, kw,
            None if slopes is None else slopes[b:b + 1],
            _per_sequence(bias, b, q1 - q0, k1 - k0), _per_sequence(keep, b, q1 - q0, k1 - k0))))
    return runs, q, bias


def attention(q, k, v, *, softmax_scale=None, window_left=-1, window_right=-1,
              bottom_right=True, softcap=0.0, alibi_slopes=None, attn_bias=None,
              dropout_mask=None, dropout_p=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
              q_offset=0, k_offset=0, seqlen_q_total=0, seqlen_k_total=0, batch_offset=0,
              head_offset=0, nheads_total=0):
    """Exact attention in float64.  Returns ``(out, lse)``.

    Dense: q ``(B, Sq, H, D)``, k/v ``(B, Sk, Hk, D)`` -> out ``(B, Sq, H, D)``, lse ``(B, H, Sq)``.
    Varlen (``cu_seqlens_*`` given): q ``(total_q, H, D)``, k/v ``(total_k, Hk, D)`` -> out
    ``(total_q, H, D)``, lse ``(H, total_q)``; ``attn_bias``/``dropout_mask`` are then
    ``(B, H, max_sq, max_sk)`` (or broadcastable) and sequence ``b`` uses their top-left corner.
    ``attn_bias`` is added to the scores after softcap and ALiBi; ``dropout_mask`` is a
    boolean keep mask broadcastable to ``(B, H, Sq, Sk)`` and the kept probabilities are
    divided by ``1 - dropout_p``.  ``lse`` ignores dropout.

    Partial calls (dense, ``flashtile.backends.spec``): ``q_offset``/``k_offset`` and
    ``seqlen_*_total`` place the blocks in a longer sequence (masks and ALiBi distances of the
    global positions).  ``batch_offset``/``head_offset``/``nheads_total`` only move dropout
    counters, and the reference takes dropout as an explicit mask, so they change nothing here.
    """
    runs, q64, _ = _forwards(q, k, v, softmax_scale, window_left, window_right, bottom_right,
                             softcap, alibi_slopes, attn_bias, dropout_mask, dropout_p,
                             cu_seqlens_q, cu_seqlens_k,
                             (q_offset, k_offset, seqlen_q_total, seqlen_k_total))
    if cu_seqlens_q is None:
        fw = runs[0][1]
        return fw.out, fw.lse
    out = np.zeros_like(q64)
    lse = np.full((q64.shape[1], q64.shape[0]), -np.inf)
    for (_, q0, q1, _, _), fw in runs:
        out[q0:q1] = fw.out[0]
        lse[:, q0:q1] = fw.lse[0]
    return out, lse


def attention_backward(do, q, k, v, *, softmax_scale=None, window_left=-1, window_right=-1,
                       bottom_right=True, softcap=0.0, alibi_slopes=None, attn_bias=None,
                       dropout_mask=None, dropout_p=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                       q_offset=0, k_offset=0, seqlen_q_total=0, seqlen_k_total=0,
                       batch_offset=0, head_offset=0, nheads_total=0):
    """Analytic gradients of :func:`attention` in float64.

    Returns ``(dq, dk, dv)``, or ``(dq, dk, dv, dbias)`` when ``attn_bias`` is given, with
    ``dbias`` summed down to ``attn_bias``'s own (broadcast) shape.
    """
    runs, q64, bias = _forwards(q, k, v, softmax_scale, window_left, window_right,
                                bottom_right, softcap, alibi_slopes, attn_bias, dropout_mask,
                                dropout_p, cu_seqlens_q, cu_seqlens_k,
                                (q_offset, k_offset, seqlen_q_total, seqlen_k_total))
    do = _f64(do)
    want_dbias = bias is not None
    if cu_seqlens_q is None:
        dq, dk, dv, ds = runs[0][1].backward(do, want_dbias)
        if not want_dbias:
            return dq, dk, dv
        return dq, dk, dv, _sum_to_shape(ds, bias.shape)

    k64 = _f64(k)
    dq = np.zeros_like(q64)
    dk = np.zeros(k64.shape)
    dv = np.zeros(k64.shape)
    ds_full = None
    if want_dbias:
        seqs = [r[0] for r in runs]
        max_sq = max((q1 - q0 for _, q0, q1, _, _ in seqs), default=0)
        max_sk = max((k1 - k0 for _, _, _, k0, k1 in seqs), default=0)
        b4 = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
        ds_full = np.zeros((len(seqs), q64.shape[1], max(max_sq, b4.shape[2]),
                            max(max_sk, b4.shape[3])))
    for (b, q0, q1, k0, k1), fw in runs:
        dqb, dkb, dvb, dsb = fw.backward(do[None, q0:q1], want_dbias)
        dq[q0:q1] = dqb[0]
        dk[k0:k1] = dkb[0]
        dv[k0:k1] = dvb[0]
        if want_dbias:
            ds_full[b, :, :q1 - q0, :k1 - k0] = dsb[0]
    if not want_dbias:
        return dq, dk, dv
    b4 = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    # a bias dimension of 1 is broadcast (so its gradient is a sum); a longer one is read
    # from its top-left corner, and the rest of it got no gradient
    rows = slice(None) if b4.shape[2] == 1 else slice(0, b4.shape[2])
    cols = slice(None) if b4.shape[3] == 1 else slice(0, b4.shape[3])
    ds_full = ds_full[:, :, rows, cols]
    return dq, dk, dv, _sum_to_shape(ds_full, b4.shape).reshape(bias.shape)
