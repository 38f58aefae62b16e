"""Property test: any shape (lengths 0..300, head dims 1..256, GQA ratios, causal, Sq != Sk)
computes attention as the float64 formula does, on both backends."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import flashtile
from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton.fastlaunch import poison_outputs
from flashtile.reference.torch_ref import reference

from helpers import assert_flash_rule


@st.composite
def shapes(draw, max_len, max_d):
    hk = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3]))
    return dict(batch=draw(st.integers(1, 2)), sq=draw(st.integers(0, max_len)),
                sk=draw(st.integers(0, max_len)), h=hk * group, hk=hk,
                d=draw(st.integers(1, max_d)), causal=draw(st.booleans()),
                seed=draw(st.integers(0, 2 ** 16)))


def _check(s, backend, dtype):
    gen = torch.Generator().manual_seed(s["seed"])
    q = torch.randn(s["batch"], s["sq"], s["h"], s["d"], generator=gen).to(dtype)
    k = torch.randn(s["batch"], s["sk"], s["hk"], s["d"], generator=gen).to(dtype)
    v = torch.randn(s["batch"], s["sk"], s["hk"], s["d"], generator=gen).to(dtype)
    do = torch.randn(s["batch"], s["sq"], s["h"], s["d"], generator=gen).to(dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with flashtile.use_backend(backend), poison_outputs():
        out = flashtile.flash_attn_func(*leaves, causal=s["causal"])
        grads = torch.autograd.grad(out, leaves, do, allow_unused=True)
    spec = AttnSpec(1 / math.sqrt(s["d"]), -1, 0 if s["causal"] else -1)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = reference(*ref_leaves, spec)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double(), allow_unused=True)
    low_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    low = reference(*low_leaves, spec, dtype=dtype)
    low_grads = torch.autograd.grad(low, low_leaves, do, allow_unused=True)
    floor = 1e-5 if dtype == torch.float32 else 1e-4  # fp32: torch.testing's default atol
    assert_flash_rule("out", out, ref, low, 2, floor)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        z = torch.zeros_like
        assert_flash_rule(name, g, z(ref_leaves[0]) if r is None else r,
                          z(ref_leaves[0]) if b is None else b, 3, floor)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(s=shapes(max_len=300, max_d=256))
@example(s=dict(batch=1, sq=63, sk=1, h=1, hk=1, d=131, causal=False, seed=0))  # exact dk = 0
def test_torch_backend_any_shape(s):
    _check(s, "torch", torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(s=shapes(max_len=300, max_d=256))
def test_triton_interpreter_any_shape(s, dtype):
    _check(s, "triton", dtype)
