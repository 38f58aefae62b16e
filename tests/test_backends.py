"""Backend selection, torch.compile, and the torch backend's memory bound.

The memory bound is measured, not assumed: a ``TorchDispatchMode`` records the largest tensor
any ATen op produces during a forward+backward through the public API, and the tests assert it
stays at the size of the inputs or of one tile of the engine's memory budget, far below the
``N x N`` of the score matrix.  (Calls routed to PyTorch's fused CPU kernel allocate their
per-thread tiles inside that one op, where no dispatch mode sees them; the kernel is
FlashAttention-2's schedule by construction and is not re-measured here.)
"""
from __future__ import annotations

import os

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


@pytest.mark.parametrize("name", ["FLASHTILE_TEST_ENV_READER", "FLASHTILE_KVCACHE_CHECK"],
                         ids=["new-variable", "read-per-call"])
def test_env_reader_sees_every_write_like_os_environ(monkeypatch, name):
    """``backends.env_reader`` (the per-call reads of the backend, check mode and interpreter
    variables) against ``os.environ.get`` after each way of writing the environment."""
    read = backends.env_reader(name)
    monkeypatch.delenv(name, raising=False)
    assert read() is None and os.environ.get(name) is None
    for value in ("sync", "", "0", "a b=c", "\u00e9t\u00e9"):
        monkeypatch.setenv(name, value)
        assert read() == os.environ.get(name) == value
    os.environ[name] = "off"
    assert read() == "off"
    del os.environ[name]
    assert read() is None
    os.environ.update({name: "async"})
    assert read() == "async"
    os.environ.pop(name)
    assert read() is None


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


@pytest.mark.parametrize("forward_backend", ["torch", "triton"])
@pytest.mark.parametrize("call", ["dense", "bias", "sdpa-layout"])
def test_backward_runs_on_the_forward_backend(monkeypatch, forward_backend, call):
    """A backward run outside the forward's ``use_backend`` block (where autograd's CUDA worker
    thread always runs it) takes the backend the forward ran on, for a plain call (the direct
    path of ``FlashAttnFunction.backward``) and for one with an optional input (the general
    path); its gradients equal those of a backward inside the block."""
    calls = []
    for name in backends.BACKENDS:
        module = backends.get(name)
        original = module.backward

        def spy(*args, _name=name, _original=original, **kw):
            calls.append(_name)
            return _original(*args, **kw)
        monkeypatch.setattr(module, "backward", spy)
    q, k, v = (torch.randn(1, 32, 2, 16, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 32, 2, 16)
    bias = torch.randn(1, 2, 32, 32) if call == "bias" else None

    def fn():
        if call != "dense":
            return flashtile.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias,
                is_causal=bias is None).transpose(1, 2)
        return flashtile.flash_attn_func(q, k, v, causal=True)

    other = "triton" if forward_backend == "torch" else "torch"
    with flashtile.use_backend(forward_backend):
        out = fn()
        want = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    with flashtile.use_backend(other):
        got = torch.autograd.grad(out, (q, k, v), do)
    assert calls == [forward_backend, forward_backend]
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name


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


# ---------------------------------------------------------------------------------------
# the ops' layouts: dense calls in the flash layout and in SDPA's heads-first one


def _qkv(layout, B=2, H=4, Hk=2, S=24, D=16, seed=0):
    """q, k, v and a gradient in one of the dense layouts the op takes.

    ``flash``: contiguous ``(B, S, H, D)``; ``flash-strided``: ``(B, S, H, D)`` views of
    ``(B, H, S, D)`` memory; ``heads-first``: contiguous ``(B, H, S, D)``; ``heads-first-
    strided``: ``(B, H, S, D)`` views of ``(B, S, H, D)`` memory (transformers' layout)."""
    g = torch.Generator().manual_seed(seed)
    flash_shape = layout.startswith("flash")
    strided = layout.endswith("strided")

    def make(h):
        if flash_shape != strided:  # (B, S, h, D) memory
            x = torch.randn(B, S, h, D, generator=g)
        else:
            x = torch.randn(B, h, S, D, generator=g)
        return x.transpose(1, 2) if strided else x
    return make(H), make(Hk), make(Hk), make(H)


LAYOUTS = ["flash", "flash-strided", "heads-first", "heads-first-strided"]


@pytest.mark.parametrize("path", ["routed", "tiled"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_ops_fake_layouts_match_the_real_ones(layout, path):
    """``torch.library.opcheck`` of ``flashtile::attn_fwd`` / ``attn_bwd`` on the torch
    backend: the fake implementations give the shapes and strides the real ops return (a
    compiled graph reads the results with them), through PyTorch's fused kernel (causal) and
    the tiled engine (a sliding window)."""
    from flashtile import autograd as A
    q, k, v, do = _qkv(layout)
    window_left = 4 if path == "tiled" else -1
    heads_first = layout.startswith("heads-first")
    tail = (None, None, None, 0, 0, 0.25, window_left, 0, False, 0.0, 0.0, None, None, None,
            0, 0)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_()) + tail
    with flashtile.use_backend("torch"):
        torch.library.opcheck(torch.ops.flashtile.attn_fwd.default,
                              args + (None, heads_first, False))
        out, lse = A._forward(*args, None, heads_first)
        routed = torch_attention.aten_route(q, k, v, A._spec(0.25, window_left, 0, False,
                                                             0.0, 0.0),
                                            heads_first=heads_first) is not None
        assert routed == (path == "routed")
        torch.library.opcheck(torch.ops.flashtile.attn_bwd.default,
                              (do, q.detach(), k.detach(), v.detach(), out.detach(), lse)
                              + tail + (False, None, heads_first, False))


@pytest.mark.parametrize("layout", ["heads-first", "heads-first-strided"])
def test_inductor_sdpa_fwd_bwd_on_cpu(layout):
    """The SDPA drop-in compiled by inductor (fullgraph, dynamic) with its backward on the CPU
    torch backend gives the eager results; inductor asserts that every op result has the
    strides of its fake."""
    torch._dynamo.reset()
    q, k, v, do = _qkv(layout, seed=7)
    x = [t.requires_grad_() for t in (q, k, v)]

    def f(q, k, v):
        return flashtile.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with flashtile.use_backend("torch"):
        want = f(*x)
        want_grads = torch.autograd.grad(want, x, do)
        got = torch.compile(f, fullgraph=True, dynamic=True)(*x)
        grads = torch.autograd.grad(got, x, do)
    torch._dynamo.reset()
    assert_close("out", got, want, atol=1e-6, rtol=1e-6)
    for n, a, b in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_close(n, a, b, atol=1e-6, rtol=1e-6)


def test_heads_first_on_a_flash_layout_backend():
    """``attention(heads_first=True)`` on the Triton backend (which takes the flash layout
    only) runs on flash-layout views and hands the results back in the heads-first layout:
    bitwise the flash-layout call."""
    from flashtile.autograd import attention
    from flashtile.backends.spec import AttnSpec
    q, k, v, do = _qkv("heads-first", B=1, H=2, Hk=1, S=16, seed=3)
    spec = AttnSpec(softmax_scale=0.25, window_right=0)
    results = []
    with flashtile.use_backend("triton"):
        for heads_first in (True, False):
            x = [(t if heads_first else t.transpose(1, 2)).detach().requires_grad_()
                 for t in (q, k, v)]
            out, lse = attention(*x, spec, heads_first=heads_first)
            g = do if heads_first else do.transpose(1, 2)
            grads = torch.autograd.grad(out, x, g)
            if not heads_first:
                out, grads = out.transpose(1, 2), [t.transpose(1, 2) for t in grads]
            results.append((out, lse, *grads))
    for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert_close(n, a, b, 0, 0)
