"""Backend selection, torch.compile, and the torch backend's memory bound.

The memory bound is measured, not assumed: a ``TorchDispatchMode`` records the largest tensor
any ATen op produces during a forward+backward through the public API, and the tests assert it
stays at the size of the inputs or of one tile of the engine's memory budget, far below the
``N x N`` of the score matrix.  (Calls routed to PyTorch's fused CPU kernel allocate their
per-thread tiles inside that one op, where no dispatch mode sees them; the kernel is
FlashAttention-2's schedule by construction and is not re-measured here.)
"""
from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import flashtile
from flashtile import backends
from flashtile.backends.torch import attention as torch_attention

from helpers import assert_close


def test_default_backend_by_device(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.select(torch.device("cpu")) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backends.select(torch.device("cpu")) == "torch"


def test_env_var_and_context_manager_override(monkeypatch):
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.select(torch.device("cpu")) == "torch"
    with flashtile.use_backend("triton"):
        assert backends.select(torch.device("cpu")) == "triton"
    assert backends.select(torch.device("cpu")) == "torch"


def test_unknown_backend_names_rejected(monkeypatch):
    with pytest.raises(ValueError, match="use_backend='cuda'"):
        with flashtile.use_backend("cuda"):
            pass
    monkeypatch.setenv("FLASHTILE_BACKEND", "tpu")
    with pytest.raises(ValueError, match="FLASHTILE_BACKEND='tpu'"):
        backends.select(torch.device("cpu"))


def test_impossible_triton_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 4, 2, 8)
    with flashtile.use_backend("triton"):
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            flashtile.flash_attn_func(q, q, q)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_compile_fullgraph(backend):
    """A model calling flashtile compiles without graph breaks, forward and backward."""
    torch._dynamo.reset()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(32, 96)

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).unbind(2)
            return flashtile.flash_attn_func(q, k, v, causal=True).flatten(2)

    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 12, 32)
    with flashtile.use_backend(backend):
        eager = model(x)
        eager.square().sum().backward()
        want = model.qkv.weight.grad.clone()
        model.zero_grad()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        got = compiled(x)
        got.square().sum().backward()
    assert_close("out", got, eager, atol=1e-5)
    assert_close("dW", model.qkv.weight.grad, want, atol=1e-4, rtol=1e-4)


class _LargestTensor(TorchDispatchMode):
    """Largest element count of any tensor an op returns inside the block (views included)."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), func.overloadpacket.__name__
        return out


def _fwd_bwd_largest(q, k, v, **kw):
    do = torch.randn_like(q)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    with flashtile.use_backend("torch"), _LargestTensor() as rec:
        out = flashtile.flash_attn_func(*x, **kw)
        torch.autograd.grad(out, x, do)
    return rec


MEMORY_CASES = [
    ("causal", dict(causal=True)),
    ("full-gqa", dict()),
    ("window", dict(window_size=(100, 20))),
    ("softcap-alibi-causal", dict(causal=True, softcap=2.0,
                                  alibi_slopes=torch.tensor([0.5, 0.25]))),
    ("dropout-window", dict(dropout_p=0.2, window_size=(100, 20))),
]


@pytest.mark.parametrize("name,kw", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_tiled_engine_memory_is_budget_bound(name, kw, monkeypatch):
    """With a small tile budget (16K floats) at N=2048, no intermediate tensor of the tiled
    engine exceeds the inputs' size or the budget: 1/64 of N x N."""
    monkeypatch.setattr(torch_attention, "USE_ATEN", False)
    monkeypatch.setattr(torch_attention, "TILE_ELEMS", 1 << 14)
    monkeypatch.setattr(torch_attention, "BLOCK_N_MAX", 256)
    N, H, Hk, D = 2048, 2, 1, 16
    g = torch.Generator().manual_seed(len(name))
    q = torch.randn(1, N, H, D, generator=g)
    k, v = (torch.randn(1, N, Hk, D, generator=g) for _ in range(2))
    rec = _fwd_bwd_largest(q, k, v, **kw)
    bound = max(q.numel(), torch_attention.TILE_ELEMS)
    assert rec.largest <= bound, (f"{name}: {rec.op} produced {rec.largest} elements, over "
                                  f"max(inputs, budget) = {bound}")
    assert rec.largest * 64 <= N * N


def test_default_budget_long_sequence_window():
    """The default tiles at N=16384 (a sliding window, so the test stays fast): the largest
    intermediate is the size of the inputs, under 1/1000 of N x N."""
    N, H, D = 16384, 1, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, N, H, D, generator=g) for _ in range(3))
    rec = _fwd_bwd_largest(q, k, v, causal=True, window_size=(128, 0))
    assert rec.largest <= max(q.numel(), torch_attention.TILE_ELEMS), (rec.op, rec.largest)
    assert rec.largest * 1000 <= N * N
