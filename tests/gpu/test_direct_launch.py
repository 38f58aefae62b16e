"""Cached direct launches (the fast path past ``JITFunction.run``) against ``kernel[grid]``.

Forward and backward must be bitwise equal for every variant, including inputs whose pointer
alignment differs from the call that filled the cache. CUDA only: run with
``TRITON_INTERPRET=0 python -m pytest tests/gpu``.
"""
from __future__ import annotations

import os

import pytest
import torch

from flashtile import flash_attn_func, scaled_dot_product_attention

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                       reason="needs a CUDA GPU and compiled kernels (TRITON_INTERPRET=0)"),
]

SHAPE = (2, 200, 4, 64)
VARIANTS = {
    "causal": lambda q, k, v, bias: flash_attn_func(q, k, v, causal=True),
    "window_softcap": lambda q, k, v, bias: flash_attn_func(q, k, v, window_size=(37, 5),
                                                            softcap=20.0),
    "gqa": lambda q, k, v, bias: flash_attn_func(q, k[:, :, :2], v[:, :, :2]),
    "dropout": lambda q, k, v, bias: flash_attn_func(q, k, v, dropout_p=0.2),
    "bias": lambda q, k, v, bias: scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias).transpose(1, 2),
}


def _run(fn, buf, offset, bias):
    """out, dq, dk, dv of ``fn`` on q, k, v viewed ``offset`` elements into ``buf``."""
    n = torch.Size(SHAPE).numel()
    q, k, v = (buf[offset + i * n: offset + (i + 1) * n].view(SHAPE).detach().requires_grad_()
               for i in range(3))
    torch.manual_seed(11)  # the dropout seed
    out = fn(q, k, v, bias)
    out.backward(torch.ones_like(out))
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_direct_launch_equals_kernel_grid_bitwise(variant, offset, monkeypatch):
    from flashtile.backends.triton.fastlaunch import direct_launches

    gen = torch.Generator(device="cuda").manual_seed(7)
    buf = torch.randn(3 * torch.Size(SHAPE).numel() + 8, generator=gen, device="cuda",
                      dtype=torch.float16)
    bias = torch.randn(2, 4, 200, 200, generator=gen, device="cuda", dtype=torch.float16)
    fn = VARIANTS[variant]
    with direct_launches(False):
        generic = _run(fn, buf, offset, bias)
    # the first direct call fills the cache, the second reuses it; an aligned call after a
    # misaligned one (and the reverse) must pick its own specialisation
    for other in (offset, 1 - offset, offset):
        with direct_launches(True):
            direct = _run(fn, buf, other, bias)
        if other == offset:
            for name, a, b in zip(("out", "dq", "dk", "dv"), generic, direct):
                assert torch.equal(a, b), f"{variant}@{offset}: {name} differs from kernel[grid]"


@pytest.mark.parametrize("first", ["shared", "distinct"])
def test_launch_plan_places_q_k_v_by_parameter(first, monkeypatch):
    """Forward and backward launch plans, recorded by a call with one tensor as q, k and v
    (``shared``) or with three (``distinct``), replayed by a call of the same signature with the
    other kind: out and grads bitwise those of ``kernel[grid]`` launches.  The Triton kernels'
    plans (on Hopper the kernels of sm_90 keep plans of their own:
    tests/gpu/test_sm90_forward.py)."""
    from flashtile.backends.triton import launch_bwd, launch_fwd
    from flashtile.backends.triton.fastlaunch import PlanCache, direct_launches

    monkeypatch.setenv("FLASHTILE_SM90", "0")

    gen = torch.Generator(device="cuda").manual_seed(5)
    x, k, v, dout = (torch.randn(SHAPE, generator=gen, device="cuda", dtype=torch.float16)
                     for _ in range(4))

    def call(shared):
        leaves = [x.detach().requires_grad_()]
        if not shared:
            leaves += [k.detach().requires_grad_(), v.detach().requires_grad_()]
        q_, k_, v_ = (leaves * 3) if shared else leaves
        out = flash_attn_func(q_, k_, v_, causal=True)
        out.backward(dout)  # contiguous output gradient: the backward's plans apply
        return [out.detach()] + [t.grad for t in leaves]

    second = first != "shared"
    with direct_launches(False):
        want = call(second)
    monkeypatch.setattr(launch_fwd, "_plans", PlanCache())
    monkeypatch.setattr(launch_bwd, "_plans", PlanCache())
    with direct_launches(True):
        call(first == "shared")  # records one forward and one backward plan
        assert len(launch_fwd._plans._plans) == 1 and len(launch_bwd._plans._plans) == 1
        got = call(second)  # replays them
    for name, a, b in zip(("out", "dq", "dk", "dv"), want, got):
        assert torch.equal(a, b), f"{name} of a replayed plan differs from kernel[grid]"


def _fwd_bwd(q, k, v, dout, causal):
    for t in (q, k, v):
        t.grad = None
    flash_attn_func(q, k, v, causal=causal).backward(dout)
    return q.grad.clone(), k.grad.clone(), v.grad.clone()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_chunked_backward_on_two_streams_is_bitwise(causal, monkeypatch):
    """``FLASHTILE_BWD_CHUNK=2`` on a batch of 5 (chunks 2, 2, 1; the dK/dV launches on a side
    stream, later chunks relaunching the first one's kernels): eager and as a CUDA-graph replay,
    gradients equal to the unchunked backward's bit for bit.  The chunks take the Triton
    kernels, so the Hopper kernels are off for both (on, the unchunked call would take the Gluon
    dK/dV kernel or the fused one, whose sums run in another order)."""
    monkeypatch.setenv("FLASHTILE_SM90", "0")
    g = torch.Generator(device="cuda").manual_seed(5)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q = r(5, 300, 4, 64).requires_grad_()
    k, v = r(5, 333, 2, 64).requires_grad_(), r(5, 333, 2, 64).requires_grad_()
    dout = r(5, 300, 4, 64)
    monkeypatch.setenv("FLASHTILE_BWD_CHUNK", "off")
    want = _fwd_bwd(q, k, v, dout, causal)
    monkeypatch.setenv("FLASHTILE_BWD_CHUNK", "2")
    for _ in range(2):  # the first call compiles and relaunches, the second only relaunches
        got = _fwd_bwd(q, k, v, dout, causal)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _fwd_bwd(q, k, v, dout, causal)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in (q, k, v):
        t.grad = None
    with torch.cuda.graph(graph):
        flash_attn_func(q, k, v, causal=causal).backward(dout)
    for t in (q, k, v):
        t.grad.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(t.grad, w) for t, w in zip((q, k, v), want))
