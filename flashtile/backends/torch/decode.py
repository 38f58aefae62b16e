"""Decode against a KV cache with PyTorch ops (the ``"torch"`` backend's
``flash_attn_with_kvcache``; any device, the CPU default).

Row by row: append the new keys/values (``flashtile.paged_kv``), gather the row's keys, and
attend slice by slice with the window / tree / ALiBi / softcap rules of
``flashtile.backends.spec`` (the CPU form of the Triton split-KV kernel), merging the slices'
partial results with their log-sum-exp.
"""
from __future__ import annotations

import torch

from ... import paged_kv
from ...rotary import apply_rotary
from ..spec import KVCacheSpec

__all__ = ["decode", "merge_states"]


def merge_states(out_a, lse_a, out_b, lse_b):
    """``flashtile.merge_attention_states`` on validated inputs: ``out`` in ``out_a``'s dtype,
    ``lse`` float32."""
    with torch.no_grad():
        out, lse = _merge(out_a, lse_a, out_b, lse_b)
    return out.to(out_a.dtype), lse


def _merge(out_a, lse_a, out_b, lse_b):
    """Merge two partial results ``out_* (B, S, H, D)``, ``lse_* (B, H, S)`` over disjoint key
    sets: float32 ``(out, lse)`` of their union (an empty side, ``lse = -inf``, adds nothing)."""
    lse_a = lse_a.float()
    lse_b = lse_b.float()
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    wa = torch.exp(lse_a - m)  # 0 for an empty side
    wb = torch.exp(lse_b - m)
    total = wa + wb
    seen = total > 0
    safe = torch.where(seen, total, torch.ones_like(total))
    lse = torch.where(seen, m + torch.log(safe), torch.full_like(m, float("-inf")))
    wa = (wa / safe).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    wb = (wb / safe).transpose(1, 2).unsqueeze(-1)
    zero = torch.zeros((), dtype=torch.float32, device=out_a.device)
    # an empty side adds nothing, even if its output holds garbage
    out = torch.where(wa > 0, out_a.float() * wa, zero) + torch.where(wb > 0, out_b.float() * wb, zero)
    return out, lse


def _attend_slice(qb, kb, vb, j0, n_keys, *, scale, wl, wr, softcap, slopes, tree_b):
    """Attention of one row's queries to keys ``j0 .. j0 + m - 1`` (of ``n_keys``).

    ``qb (Sq, H, D)``, ``kb/vb (m, Hk, D)``; returns ``out (Sq, H, D)`` float32 normalised over
    these keys and ``lse (H, Sq)`` float32.
    """
    sq, h, d = qb.shape
    m, hk, _ = kb.shape
    g = h // hk
    qf = qb.float().reshape(sq, hk, g, d).permute(1, 2, 0, 3)  # (Hk, G, Sq, D)
    kf = kb.float().permute(1, 0, 2).unsqueeze(1)  # (Hk, 1, m, D)
    vf = vb.float().permute(1, 0, 2).unsqueeze(1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # (Hk, G, Sq, m)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    t = torch.arange(sq, device=qb.device)[:, None]
    j = torch.arange(j0, j0 + m, device=qb.device)[None, :]
    shift = n_keys - sq
    if slopes is not None:
        s = s - slopes.float().reshape(hk, g, 1, 1) * (t + shift - j).abs().float()
    vis = torch.ones(sq, m, dtype=torch.bool, device=qb.device)
    if wl >= 0:
        vis &= j >= t + shift - wl
    if wr >= 0:
        vis &= j <= t + shift + wr
    if tree_b is not None:
        c = (j - (n_keys - sq)).expand(sq, m)
        allowed = torch.gather(tree_b, 1, c.clamp(min=0))
        vis &= (c < 0) | allowed
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (Hk, G, Sq), -inf where nothing is visible
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    out = torch.matmul(p, vf)  # (Hk, G, Sq, D)
    return out.permute(2, 0, 1, 3).reshape(sq, h, d), lse.reshape(h, sq)


@torch.no_grad()
def decode(a: KVCacheSpec, k_cache, v_cache, rotary_cos, rotary_sin, alibi_slopes,
           rotary_interleaved: bool):
    """``(out (B, Sq, H, D), lse (B, H, Sq))`` of a validated call (values checked on the host
    by ``_validate.kvcache_values``), appending ``a.k``/``a.v`` to the cache first.  Each row's
    keys are cut into ``num_splits`` slices merged with :func:`_merge`, as the Triton
    path does."""
    q, k, v, cache_seqlens = a.q, a.k, a.v, a.cache_seqlens
    cache_batch_idx, cache_leftpad, block_table = a.cache_batch_idx, a.cache_leftpad, a.block_table
    b, sq, h, d = q.shape
    s_new = a.seqlen_new
    lens = cache_seqlens.tolist()
    pads = cache_leftpad.tolist() if cache_leftpad is not None else [0] * b
    rows = cache_batch_idx.tolist() if cache_batch_idx is not None else list(range(b))
    if block_table is not None:
        rows = list(range(b))  # a paged cache is addressed through block_table[b]
    dev = q.device

    if k is not None and s_new > 0:
        if rotary_cos is not None:
            pos = cache_seqlens.to(torch.int64)[:, None] + torch.arange(s_new, device=dev)
            k = apply_rotary(k, rotary_cos, rotary_sin, pos, rotary_interleaved)
        for i in range(b):
            paged_kv.scatter_kv(k_cache, k[i], lens[i], row=rows[i], block_table=block_table)
            paged_kv.scatter_kv(v_cache, v[i], lens[i], row=rows[i], block_table=block_table)
    if rotary_cos is not None:
        offs = torch.arange(sq, device=dev) if a.rotary_q_per_token else torch.zeros(sq, dtype=torch.int64, device=dev)
        q = apply_rotary(q, rotary_cos, rotary_sin, cache_seqlens.to(torch.int64)[:, None] + offs, rotary_interleaved)

    out = torch.empty((b, sq, h, d), dtype=q.dtype, device=dev)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=dev)
    n_splits = max(1, a.num_splits)
    for i in range(b):
        start, end = pads[i], min(lens[i] + s_new, a.capacity)
        n = max(end - start, 0)
        kb = paged_kv.gather_kv(k_cache, start, start + n, row=rows[i], block_table=block_table)
        vb = paged_kv.gather_kv(v_cache, start, start + n, row=rows[i], block_table=block_table)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i]
        tree_b = None
        if a.tree_mask is not None:
            tree_b = a.tree_mask[i if a.tree_mask.shape[0] > 1 else 0]
        chunk = -(-n // n_splits) if n > 0 else 0
        o_acc = l_acc = None
        for s in range(n_splits):
            j0 = min(s * chunk, n)
            j1 = min(j0 + chunk, n)
            o_s, l_s = _attend_slice(q[i], kb[j0:j1], vb[j0:j1], j0, n, scale=a.softmax_scale,
                                     wl=a.window_left, wr=a.window_right, softcap=a.softcap,
                                     slopes=slopes, tree_b=tree_b)
            o_s, l_s = o_s.unsqueeze(0), l_s.unsqueeze(0)
            if o_acc is None:
                o_acc, l_acc = o_s, l_s
            else:
                o_acc, l_acc = _merge(o_acc, l_acc, o_s, l_s)
        out[i] = o_acc[0].to(q.dtype)
        lse[i] = l_acc[0]
    return out, lse
