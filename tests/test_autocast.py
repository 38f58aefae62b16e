"""Under ``torch.autocast`` flashtile follows ``F.scaled_dot_product_attention``: it computes in
the autocast dtype and returns it, whatever the inputs' dtype, and gradients flow back to
float32 leaves.  CPU: the torch backend in bfloat16 and float16, the Triton kernels (interpreter)
in float16 (the Triton 3.6 interpreter mis-reads bfloat16).  CUDA (when present, run with
``TRITON_INTERPRET=0``): both backends in bfloat16 and float16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashtile
from flashtile.backends import triton_unavailable_reason
from tests.helpers import assert_flash_rule

_CPU_TRITON = triton_unavailable_reason(torch.device("cpu"))
_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CASES = [pytest.param("cpu", "torch", torch.bfloat16, id="cpu-torch-bf16"),
         pytest.param("cpu", "torch", torch.float16, id="cpu-torch-fp16"),
         pytest.param("cpu", "triton", torch.float16, id="cpu-triton-fp16", marks=pytest.mark.skipif(
             _CPU_TRITON is not None, reason=str(_CPU_TRITON)))]
CASES += [pytest.param("cuda", b, dt, id=f"cuda-{b}-{n}", marks=_CUDA)
          for b in ("triton", "torch") for dt, n in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))]


def _inputs(name, *shape, device="cpu"):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return [torch.randn(*shape, generator=g).to(device).requires_grad_() for _ in range(4)]


@pytest.mark.parametrize("device,backend,dtype", CASES)
def test_sdpa_under_autocast(device, backend, dtype):
    """float32 inputs, causal GQA: output in the autocast dtype, within flash-attn's rule of
    torch's SDPA under the same autocast (out 2x, grads 3x its error vs float64)."""
    q, k, v, do = _inputs(f"sdpa{backend}{dtype}", 2, 4, 40, 16, device=device)
    k, v = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()
    with flashtile.use_backend(backend):  # the backward too: it picks the backend again
        with torch.autocast(device, dtype=dtype):
            out = flashtile.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            ref_low = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        grads = torch.autograd.grad(out, (q, k, v), do.detach())
    assert out.dtype == dtype == ref_low.dtype
    low_grads = torch.autograd.grad(ref_low, (q, k, v), do.detach())
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    # the float64 reference sees the inputs rounded to the autocast dtype, as both kernels do
    ref = F.scaled_dot_product_attention(*(x.to(dtype).double() for x in (q64, k64, v64)),
                                         is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.detach().to(dtype).double())
    assert_flash_rule("out", out, ref, ref_low, 2, 1e-4)
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert got.dtype == torch.float32, name  # back to the float32 leaves
        assert_flash_rule(name, got, want, base, 3, 1e-4)


@pytest.mark.parametrize("device,backend,dtype", CASES)
def test_flash_attn_func_and_varlen_under_autocast(device, backend, dtype):
    """``flash_attn_func`` and ``flash_attn_varlen_func`` return the autocast dtype and equal the
    same call on inputs cast to it outside autocast."""
    q, k, v, _ = _inputs(f"fa{backend}{dtype}", 2, 24, 4, 16, device=device)
    cu = torch.tensor([0, 24, 48], dtype=torch.int32, device=device)
    with flashtile.use_backend(backend):
        with torch.autocast(device, dtype=dtype):
            out = flashtile.flash_attn_func(q, k, v, causal=True)
            out_varlen = flashtile.flash_attn_varlen_func(
                q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 24, 24, causal=True)
        want = flashtile.flash_attn_func(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
        want_varlen = flashtile.flash_attn_varlen_func(
            *(x.to(dtype).flatten(0, 1) for x in (q, k, v)), cu, cu, 24, 24, causal=True)
    assert out.dtype == out_varlen.dtype == dtype
    assert torch.equal(out, want)
    # (the dense call may take PyTorch's fused CPU kernel, the varlen call the tiled engine)
    assert torch.equal(out_varlen, want_varlen)


def test_autocast_disabled_region_keeps_input_dtype():
    """``autocast(enabled=False)`` and inputs already in the autocast dtype change nothing."""
    q, k, v, _ = _inputs("off", 1, 2, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert flashtile.scaled_dot_product_attention(q, k, v).dtype == torch.float32
    qb = q.detach().bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert flashtile.scaled_dot_product_attention(qb, qb, qb).dtype == torch.bfloat16
