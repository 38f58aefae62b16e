"""Backend selection, torch.compile, and the torch backend's memory bound."""
from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile import backends

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
