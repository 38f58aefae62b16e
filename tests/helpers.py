"""Shared test helpers: one named comparison, flash-attn's error rule, inputs, and the plain
same-dtype attention used as a baseline.

* :func:`assert_close` checks ``|got - want| <= atol + rtol * |want|`` elementwise (tensors or
  arrays), treats equal infinities as equal, never passes NaN, and names the worst element.
* :func:`assert_flash_rule` / :func:`check_flash_rule` are flash-attn's rule: error against
  float64 at most 2x (output) or 3x (gradients) PyTorch's error in the same dtype.
* The oracle is ``flashtile.reference.torch_ref.reference`` (torch, float64) and
  ``flashtile.reference.naive`` (NumPy); :func:`math_attention` is textbook attention computed
  entirely in its inputs' dtype (scores and softmax included), with the log-sum-exp.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from flashtile.masks import visible_mask


def as_f64(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _abs_diff(g: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``|g - w|`` with equal infinities counting as 0 and NaN as inf."""
    same_inf = np.isinf(g) & np.isinf(w) & (np.sign(g) == np.sign(w))
    with np.errstate(invalid="ignore"):
        d = np.where(same_inf, 0.0, np.abs(g - w))
    return np.where(np.isnan(d), np.inf, d)


def assert_close(name: str, got, want, atol: float, rtol: float = 0.0):
    """Elementwise ``|got - want| <= atol + rtol * |want|``; equal infinities count as equal,
    NaN never passes."""
    g, w = as_f64(got), as_f64(want)
    assert g.shape == w.shape, f"{name}: shape {g.shape} != expected {w.shape}"
    assert not np.isnan(g).any(), f"{name}: {int(np.isnan(g).sum())} NaN elements"
    if g.size == 0:
        return
    err = _abs_diff(g, w)
    bound = atol + rtol * np.abs(np.where(np.isfinite(w), w, 0.0))
    bad = ~(err <= bound)
    if bad.any():
        idx = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), g.shape)
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {g.size} elements out of tolerance "
            f"(atol={atol:.3g}, rtol={rtol:.3g}); worst at {tuple(int(i) for i in idx)}: "
            f"got {g[idx]!r}, want {w[idx]!r}, |diff| {err[idx]:.3g}; "
            f"max |diff| overall {float(np.max(err)):.3g}")


def max_err(a, b) -> float:
    """Largest ``|a - b|``, ignoring positions where both are the same infinity."""
    g, w = as_f64(a), as_f64(b)
    return float(np.max(_abs_diff(g, w))) if g.size else 0.0


def assert_flash_rule(name: str, got, ref64, same_dtype, factor: float, floor: float = 1e-6):
    """flash-attn's rule: error vs float64 <= factor x PyTorch's same-dtype error (+ floor).

    The floor is relative to the reference's magnitude: in fp32 PyTorch's own error can be a
    few ulps, and exp2-based recomputation legitimately differs from it by a few more."""
    g = as_f64(got)
    assert np.isfinite(g).all(), f"{name}: NaN/inf in result"
    ref = as_f64(ref64)
    floor = floor * max(1.0, float(np.abs(ref).max()) if ref.size else 0.0)
    err, base = max_err(g, ref), max_err(same_dtype, ref)
    assert err <= factor * base + floor, (f"{name}: error {err:.3e} exceeds {factor} x PyTorch's "
                                          f"same-dtype error {base:.3e} (+{floor:g})")


def assert_grads_flash_rule(got_grads, inputs, do, ref_fn, dtype):
    """``got_grads`` (dq, dk, dv w.r.t. ``inputs``) within 3x PyTorch's same-dtype error of
    float64 (flash-attn's rule for gradients): ``ref_fn(*leaves, dt)`` is the oracle's output
    in ``dt``, run in float64 and in ``dtype``."""
    grads = []
    for dt in (torch.float64, dtype):
        leaves = [x.detach().to(dt).requires_grad_() for x in inputs]
        ref_fn(*leaves, dt).backward(do.to(dt))
        grads.append([x.grad for x in leaves])
    for name, g, r, lo in zip(("dq", "dk", "dv"), got_grads, *grads):
        assert_flash_rule(name, g, r, lo, 3)


def check_flash_rule(name: str, got_out, got_grads, inputs, do, ref_fn, dtype,
                     grad_names=("dq", "dk", "dv", "dbias")):
    """Compares ``got_out`` / ``got_grads`` (w.r.t. ``inputs``) with ``ref_fn(*inputs64)`` in
    float64, using ``ref_fn(*inputs_low, dtype=dtype)`` (PyTorch in the input dtype) as the
    error baseline: out within 2x, gradients within 3x (flash-attn's rule)."""
    floor = 1e-5 if dtype == torch.float32 else 1e-4  # fp32: torch.testing's default atol
    leaves64 = [x.detach().double().requires_grad_() for x in inputs]
    ref = ref_fn(*leaves64, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, leaves64, do.double())
    leaves_low = [x.detach().clone().requires_grad_() for x in inputs]
    low = ref_fn(*leaves_low, dtype=dtype)
    low_grads = torch.autograd.grad(low, leaves_low, do.to(low.dtype))
    assert_flash_rule(f"{name}: out", got_out, ref, low, 2, floor)
    for g_name, got, want, base in zip(grad_names, got_grads, ref_grads, low_grads):
        assert_flash_rule(f"{name}: {g_name}", got, want, base, 3, floor)


def spy_keyword(monkeypatch, owner, name: str, keyword: str) -> list:
    """Wrap ``owner.<name>`` so that each call records its ``keyword`` argument (None where the
    call does not pass it) and then runs the original; the list of recorded values."""
    calls = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **kw: calls.append(kw.get(keyword))
                        or real(*a, **kw))
    return calls


def make_gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, gen=None, device="cpu", scale=1.0):
    """Normal samples drawn in float32 (so every dtype sees the same values), then cast.

    The generator is ``gen=`` or, as in ``randn(gen, 2, 3)``, the first positional argument."""
    if shape and isinstance(shape[0], torch.Generator):
        gen, shape = shape[0], shape[1:]
    x = torch.randn(*shape, dtype=torch.float32, generator=gen, device=device)
    return (x * scale if scale != 1.0 else x).to(dtype)


def next_seed(device="cpu") -> int:
    """The dropout seed the next flashtile call on ``device`` will draw (the generator's state
    is left untouched)."""
    from flashtile.rng import draw_seed
    state = torch.get_rng_state()
    seed = int(draw_seed(torch.device(device))[0])
    torch.set_rng_state(state)
    return seed


_PARTIAL_FIELDS = ("q_offset", "k_offset", "seqlen_q_total", "seqlen_k_total", "batch_offset",
                   "head_offset", "nheads_total")


def naive_kwargs(spec, **extra):
    """``AttnSpec`` -> keyword arguments of ``flashtile.reference.naive``."""
    kw = dataclasses.asdict(spec)
    del kw["deterministic"]  # how the backward sums, not what it computes
    # the partial-call fields (global offsets) are left out at their defaults (plain calls)
    for f in dataclasses.fields(spec):
        if f.name in _PARTIAL_FIELDS and kw[f.name] == f.default:
            del kw[f.name]
    kw.update(extra)
    return kw


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
    vis = visible_mask(Sq, Sk, window_left, window_right, bottom_right, q.device)
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
