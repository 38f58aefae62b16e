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
    """flash-attn's rule: error vs float64 <= factor x PyTorch's same-dtype error (+ floor).

    The floor is relative to the reference's magnitude: in fp32 PyTorch's own error can be a
    few ulps, and exp2-based recomputation legitimately differs from it by a few more."""
    assert torch.isfinite(got).all(), f"{name}: NaN/inf in result"
    floor = floor * max(1.0, ref64.abs().max().item() if ref64.numel() else 0.0)
    err, base = max_err(got, ref64), max_err(same_dtype, ref64)
    assert err <= factor * base + floor, (f"{name}: error {err:.3e} exceeds {factor} x PyTorch's "
                                          f"same-dtype error {base:.3e} (+{floor:g})")


def randn(*shape, dtype=torch.float32, gen=None, device="cpu"):
    return torch.randn(*shape, dtype=torch.float32, generator=gen, device=device).to(dtype)


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


def next_seed(device="cpu") -> int:
    """The dropout seed the next flashtile call on ``device`` will draw (the generator's state
    is left untouched)."""
    from flashtile.rng import draw_seed
    state = torch.get_rng_state()
    seed = int(draw_seed(torch.device(device))[0])
    torch.set_rng_state(state)
    return seed
