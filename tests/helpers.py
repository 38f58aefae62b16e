"""Shared test helpers: named comparisons and flash-attn's error rule."""
from __future__ import annotations

import torch


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float = 0.0):
    """Element-wise |got - want| <= atol + rtol * |want|, with NaN/inf never passing."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = got.double(), want.double()
    assert torch.isfinite(g).all() or not torch.isfinite(w).all(), f"{name}: non-finite values"
    both_inf = torch.isinf(g) & torch.isinf(w) & (torch.sign(g) == torch.sign(w))
    diff = torch.where(both_inf, torch.zeros_like(g), (g - w).abs())
    bound = atol + rtol * w.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    bad = ~(diff <= bound)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{name}: {int(bad.sum())}/{g.numel()} elements off; max error "
                             f"{diff[bad].max().item():.3e}; first at {idx}: got {g[idx].item()} "
                             f"want {w[idx].item()}")


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_flash_rule(name: str, got, ref64, same_dtype, factor: float, floor: float = 1e-6):
    """flash-attn's rule: error vs float64 <= factor x PyTorch's same-dtype error (+ floor)."""
    assert torch.isfinite(got).all(), f"{name}: NaN/inf in result"
    err, base = max_err(got, ref64), max_err(same_dtype, ref64)
    assert err <= factor * base + floor, (f"{name}: error {err:.3e} exceeds {factor} x PyTorch's "
                                          f"same-dtype error {base:.3e} (+{floor:g})")


def randn(*shape, dtype=torch.float32, gen=None, device="cpu"):
    return torch.randn(*shape, dtype=torch.float32, generator=gen, device=device).to(dtype)
