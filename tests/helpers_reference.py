"""Helpers shared by the tests that check attention implementations against references.

* :func:`assert_close` compares with ``|got - want| <= atol + rtol * |want|`` elementwise,
  treats equal infinities as equal, and names the quantity and the worst element on failure.
* :func:`math_attention` is plain PyTorch attention (materialised scores, autograd-able) in
  whatever dtype its inputs have: the float64 autograd oracle for the analytic backward, and
  the same-dtype baseline of flash-attn's accuracy rule (a low-precision kernel may be at most
  a small multiple less accurate, against float64, than this math in the same dtype).
* :func:`naive_kwargs` turns an ``AttnSpec`` into keyword arguments of
  ``flashtile.reference.naive``.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

__all__ = [
    "assert_close",
    "as_f64",
    "max_abs_err",
    "make_gen",
    "randn",
    "math_attention",
    "naive_kwargs",
    "visible_mask_torch",
    "low_precision_bound",
]


def as_f64(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def assert_close(name, got, want, atol, rtol):
    """Elementwise ``|got - want| <= atol + rtol * |want|``; equal infinities count as equal."""
    g, w = as_f64(got), as_f64(want)
    assert g.shape == w.shape, f"{name}: shape {g.shape} != expected {w.shape}"
    assert not np.isnan(g).any(), f"{name}: {int(np.isnan(g).sum())} NaN elements"
    if g.size == 0:
        return
    same_inf = np.isinf(g) & np.isinf(w) & (np.sign(g) == np.sign(w))
    with np.errstate(invalid="ignore"):
        err = np.where(same_inf, 0.0, np.abs(g - w))
    err = np.where(np.isnan(err), np.inf, err)
    bound = atol + rtol * np.abs(np.where(np.isinf(w), 0.0, w))
    bad = err > bound
    if bad.any():
        idx = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), g.shape)
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {g.size} elements out of tolerance "
            f"(atol={atol:.3g}, rtol={rtol:.3g}); worst at {tuple(int(i) for i in idx)}: "
            f"got {g[idx]!r}, want {w[idx]!r}, |diff| {err[idx]:.3g}; "
            f"max |diff| overall {float(np.max(err)):.3g}")


def max_abs_err(got, want) -> float:
    """Largest ``|got - want|`` ignoring positions where both are the same infinity."""
    g, w = as_f64(got), as_f64(want)
    if g.size == 0:
        return 0.0
    same_inf = np.isinf(g) & np.isinf(w) & (np.sign(g) == np.sign(w))
    with np.errstate(invalid="ignore"):
        d = np.where(same_inf, 0.0, np.abs(g - w))
    return float(np.nanmax(np.where(np.isnan(d), np.inf, d)))


def low_precision_bound(name, got, want64, baseline, factor, floor=1e-6):
    """flash-attn's rule: ``err(got) <= factor * err(baseline) + floor``, errors vs float64."""
    e_got = max_abs_err(got, want64)
    e_base = max_abs_err(baseline, want64)
    assert e_got <= factor * e_base + floor, (
        f"{name}: max error {e_got:.3g} vs float64 exceeds {factor} x the same-dtype math "
        f"attention's {e_base:.3g} (+ {floor:.1g})")


def make_gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    """Seeded normal samples drawn in float32 (so every dtype sees the same values)."""
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(dtype)


_PARTIAL_FIELDS = ("q_offset", "k_offset", "seqlen_q_total", "seqlen_k_total", "batch_offset",
                   "head_offset", "nheads_total")


def naive_kwargs(spec, **extra):
    """``AttnSpec`` -> keyword arguments of ``flashtile.reference.naive``."""
    kw = dataclasses.asdict(spec)
    # the partial-call fields (global offsets) are left out at their defaults (plain calls)
    for f in dataclasses.fields(spec):
        if f.name in _PARTIAL_FIELDS and kw[f.name] == f.default:
            del kw[f.name]
    kw.update(extra)
    return kw


def visible_mask_torch(sq, sk, window_left=-1, window_right=-1, bottom_right=True,
                       device=None):
    """Boolean ``(sq, sk)`` visibility of the spec's window rule, built in torch."""
    i = torch.arange(sq, device=device).view(-1, 1)
    j = torch.arange(sk, device=device).view(1, -1)
    shift = sk - sq if bottom_right else 0
    vis = torch.ones((sq, sk), dtype=torch.bool, device=device)
    if window_left >= 0:
        vis &= j >= i + shift - window_left
    if window_right >= 0:
        vis &= j <= i + shift + window_right
    return vis


def math_attention(q, k, v, *, softmax_scale=None, window_left=-1, window_right=-1,
                   bottom_right=True, softcap=0.0, alibi_slopes=None, attn_bias=None,
                   dropout_mask=None, dropout_p=0.0):
    """Textbook attention in the dtype of ``q`` (dense flash layout); autograd works through it.

    Returns ``(out, lse)`` with ``lse`` in the same dtype.  Rows that see no key give 0 and
    gradients 0 (their softmax is taken over zeros and then multiplied by the empty mask,
    which keeps NaN out of both directions).
    """
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    group = H // Hk
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    qh = q.transpose(1, 2)  # (B, H, Sq, D)
    kh = k.repeat_interleave(group, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(group, dim=2).transpose(1, 2)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # (B, H, Sq, Sk)
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype).expand(B, H).reshape(B, H, 1, 1)
        i = torch.arange(Sq, device=q.device).view(-1, 1)
        j = torch.arange(Sk, device=q.device).view(1, -1)
        dist = (i + Sk - Sq - j).abs().to(s.dtype)
        s = s - slopes * dist
    if attn_bias is not None:
        s = s + attn_bias.to(s.dtype)
    vis = visible_mask_torch(Sq, Sk, window_left, window_right, bottom_right, q.device)
    vis = vis.expand(B, H, Sq, Sk) & (s > float("-inf"))
    row_seen = vis.any(dim=-1, keepdim=True)
    s = s.masked_fill(~vis, float("-inf"))
    s_rows = torch.where(row_seen, s, torch.zeros_like(s))
    lse = torch.logsumexp(s_rows, dim=-1)
    lse = lse.masked_fill(~row_seen.squeeze(-1), float("-inf"))
    p = torch.softmax(s_rows, dim=-1) * vis
    if dropout_mask is not None:
        p = p * dropout_mask.to(p.dtype) / (1.0 - dropout_p)
    out = torch.matmul(p, vh).transpose(1, 2)
    return out, lse
