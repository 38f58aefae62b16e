"""The bytes a forward+backward moves besides the attention kernels': none.

A plain ``flash_attn_func`` forward+backward launches the forward kernel, the dQ kernel (which
computes ``delta = rowsum(dO * O)`` in its prologue) and the dK/dV kernel, and issues no fill,
copy or cast of its own; gradients come in their inputs' layouts so autograd does not copy
them either.  Kernels run under the Triton interpreter (tests/conftest.py).
"""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashtile
from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton import launch_bwd, launch_fwd
from flashtile.backends.triton.fastlaunch import poison_outputs
from flashtile.check import reference

from helpers import check_flash_rule


def _ref(causal=False):
    def fn(q, k, v, dtype):
        spec = AttnSpec(1 / math.sqrt(q.shape[-1]), -1, 0 if causal else -1)
        return reference(q, k, v, spec, dtype=dtype)
    return fn

# aten ops that launch a kernel reading or writing a whole tensor on a GPU
SIDE_OPS = ("fill_", "zero_", "zeros", "zeros_like", "full", "ones_like", "full_like", "copy_", "clone",
            "_to_copy", "add", "add_", "sum", "mul", "mul_", "contiguous", "cat", "stack")


class _OpLog(TorchDispatchMode):
    """Names of the aten ops called outside kernel launches."""

    def __init__(self):
        super().__init__()
        self.ops, self.in_launch = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_launch:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def op_log(monkeypatch):
    log = _OpLog()
    kernels = []
    for module in (launch_fwd, launch_bwd):
        def wrapped(kernel, grid, _orig=module.launch, **kwargs):
            kernels.append(getattr(kernel, "__name__", None) or kernel.fn.__name__)
            log.in_launch = True  # the interpreter's own host copies are not the backend's
            try:
                return _orig(kernel, grid, **kwargs)
            finally:
                log.in_launch = False
        monkeypatch.setattr(module, "launch", wrapped)
    log.kernels = kernels
    return log


def _inputs(shape=(1, 24, 2, 16), dtype=torch.float32):
    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(shape, dtype=dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_fwd_bwd_launches_three_kernels_and_no_side_ops(op_log, causal):
    q, k, v, do = _inputs()
    with op_log:  # (poison_outputs would fill the outputs: not here)
        out = flashtile.flash_attn_func(q, k, v, causal=causal)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    assert op_log.kernels == ["attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"]
    side = sorted({op for op in op_log.ops if op in SIDE_OPS})
    assert side == [], f"side ops outside the kernels: {side}"
    check_flash_rule("flash_attn_func", out, (dq, dk, dv), (q, k, v), do, _ref(causal),
                     torch.float32)


def test_dq_kernel_writes_every_delta_row_of_varlen_sequences():
    # delta now comes from the dQ kernel's prologue: with NaN-poisoned buffers a row it missed
    # would turn dK/dV NaN; sequences of 5 and 19 rows cut the 16-row tiles unevenly
    lens = [5, 19]
    cu = torch.tensor([0, 5, 24], dtype=torch.int32)
    q, k, v, do = (torch.randn(24, 1, 16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    with poison_outputs():
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        grads = torch.autograd.grad(out, (q, k, v), do)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(g).all(), name
    for b in range(2):
        s = slice(int(cu[b]), int(cu[b + 1]))
        check_flash_rule(f"sequence {b}", out[s][None], [g[s][None] for g in grads],
                         [x[s][None].detach() for x in (q, k, v)], do[s][None], _ref(True),
                         torch.float32)


def test_sdpa_gradients_come_in_the_inputs_layout(op_log):
    # (B, H, L, E) leaves reach the kernels as (B, L, H, E) views; the gradients must come
    # back with the leaves' own strides, so autograd accumulates them without a copy
    query, key, value = (torch.randn(1, 2, 24, 16, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 2, 24, 16)
    with op_log:
        out = flashtile.scaled_dot_product_attention(query, key, value)
        out.backward(do)
    side = sorted({op for op in op_log.ops if op in SIDE_OPS})
    assert side == [], f"side ops outside the kernels: {side}"
    for x in (query, key, value):
        assert x.grad.stride() == x.stride()
    flash = [x.detach().transpose(1, 2) for x in (query, key, value)]
    check_flash_rule("sdpa", out.detach().transpose(1, 2),
                     [x.grad.transpose(1, 2) for x in (query, key, value)], flash,
                     do.transpose(1, 2), _ref(), torch.float32)


def test_backward_with_a_strided_lse_equals_the_contiguous_call():
    """A non-contiguous ``lse`` (a slice of a larger buffer) gives the same gradients as its
    contiguous copy: the kernels' delta buffer is indexed with lse's strides."""
    from flashtile.backends import triton as triton_backend
    from flashtile.backends.spec import AttnSpec

    g = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(1, 20, 2, 16, generator=g) for _ in range(4))
    spec = AttnSpec(softmax_scale=0.25, window_right=0)
    out, lse = triton_backend.forward(q, k, v, spec)
    wide = torch.full((1, 2, 40), float("nan"))
    wide[..., ::2] = lse
    strided = wide[..., ::2]
    assert not strided.is_contiguous()
    want = triton_backend.backward(do, q, k, v, out, lse, spec)
    got = triton_backend.backward(do, q, k, v, out, strided, spec)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
