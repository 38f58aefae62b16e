"""scaled_dot_product_attention as a drop-in for PyTorch's (torch 2.13 semantics): broadcast
batch/head dims, 2-D inputs, zero sizes, argument checking with PyTorch's names, fully masked
rows, and torch.func transforms.  Outputs and gradients are compared with PyTorch's SDPA in
float64 (flash-attn's rule, tests/helpers.py) after poisoning the kernels' outputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile import _functorch
from flashtile.backends.triton.fastlaunch import poison_outputs

from helpers import assert_close, check_flash_rule, randn

BACKENDS = ["triton", "torch"]
ft_sdpa = flashtile.scaled_dot_product_attention

# (id, query shape, key shape, value shape, kwargs); E = 16 throughout
CASES = [
    ("2d", (9, 16), (13, 16), (13, 16), {}),
    ("2d-causal", (9, 16), (13, 16), (13, 16), {"is_causal": True}),
    ("3d-q-4d-kv", (2, 9, 16), (3, 2, 13, 16), (3, 2, 13, 16), {}),
    ("2d-q-4d-kv-causal", (9, 16), (2, 3, 13, 16), (2, 3, 13, 16), {"is_causal": True}),
    ("kv-batch-1", (3, 2, 9, 16), (1, 2, 13, 16), (1, 2, 13, 16), {}),
    ("q-batch-1", (1, 2, 9, 16), (3, 2, 13, 16), (3, 2, 13, 16), {"is_causal": True}),
    ("kv-heads-1-no-gqa", (2, 4, 9, 16), (2, 1, 13, 16), (2, 1, 13, 16), {}),
    ("q-heads-1", (2, 1, 9, 16), (2, 3, 13, 16), (2, 3, 13, 16), {}),
    ("k-heads-1-v-heads-2", (2, 2, 9, 16), (2, 1, 13, 16), (2, 2, 13, 16), {}),
    ("5d-kv-batch-broadcast", (2, 3, 2, 9, 16), (1, 3, 2, 13, 16), (2, 1, 2, 13, 16), {}),
    ("gqa-kv-batch-1", (2, 4, 9, 16), (1, 2, 13, 16), (1, 2, 13, 16),
     {"enable_gqa": True, "is_causal": True}),
    ("kv-batch-1-bias", (3, 2, 9, 16), (1, 2, 13, 16), (1, 2, 13, 16), {"mask": (9, 13)}),
]


def _ref(kw):
    """The SDPA formula with PyTorch ops in ``dtype`` (matmul broadcasting does the batch
    broadcast): float64 is the reference, the input dtype the error baseline."""
    def ref(q, k, v, *mask, dtype):
        q, k, v = (x.to(dtype) for x in (q, k, v))
        if kw.get("enable_gqa") and k.dim() >= 3 and q.shape[-3] != k.shape[-3]:
            k, v = (x.repeat_interleave(q.shape[-3] // x.shape[-3], dim=-3) for x in (k, v))
        s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        if kw.get("is_causal"):
            L, S = s.shape[-2:]
            s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
        if mask:
            s = s + mask[0].to(dtype)
        return torch.softmax(s, dim=-1) @ v
    return ref


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_broadcast_shapes_match_torch_float64(case, dtype, backend):
    name, qs, ks, vs, kw = case
    gen = torch.Generator().manual_seed(len(name) * 31 + len(qs))
    q, k, v = (randn(*s, dtype=dtype, gen=gen) for s in (qs, ks, vs))
    kw = dict(kw)
    inputs = [q, k, v]
    if "mask" in kw:  # a learnable additive bias, broadcast over batch and heads
        inputs.append(randn(*kw.pop("mask"), dtype=dtype, gen=gen))
    leaves = [x.clone().requires_grad_() for x in inputs]
    with flashtile.use_backend(backend), poison_outputs():
        out = ft_sdpa(*leaves[:3], attn_mask=leaves[3] if len(leaves) > 3 else None, **kw)
        want_shape = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                    enable_gqa=kw.get("enable_gqa", False)).shape
        assert out.shape == want_shape, f"{name}: shape {tuple(out.shape)} != {tuple(want_shape)}"
        do = randn(*out.shape, dtype=dtype, gen=gen)
        grads = torch.autograd.grad(out, leaves, do)
    for g, x in zip(grads, inputs):
        assert g.shape == x.shape
    check_flash_rule(name, out, grads, inputs, do, _ref(kw), dtype,
                     grad_names=("dq", "dk", "dv", "dmask"))


# (id, query, key, value): every zero-size dimension PyTorch accepts
ZERO = [
    ("L0", (2, 3, 0, 16), (2, 3, 7, 16), (2, 3, 7, 16)),
    ("S0", (2, 3, 5, 16), (2, 3, 0, 16), (2, 3, 0, 16)),
    ("L0-S0", (2, 3, 0, 16), (2, 3, 0, 16), (2, 3, 0, 16)),
    ("H0", (2, 0, 5, 16), (2, 0, 7, 16), (2, 0, 7, 16)),
    ("E0", (2, 3, 5, 0), (2, 3, 7, 0), (2, 3, 7, 0)),
    ("B0", (0, 3, 5, 16), (0, 3, 7, 16), (0, 3, 7, 16)),
    ("3d-L0", (3, 0, 16), (3, 7, 16), (3, 7, 16)),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", ZERO, ids=[c[0] for c in ZERO])
def test_zero_sizes_match_torch(case, causal):
    name, qs, ks, vs = case
    inputs = [torch.randn(*s) for s in (qs, ks, vs)]
    leaves = [x.clone().requires_grad_() for x in inputs]
    out = ft_sdpa(*leaves, is_causal=causal)
    t_leaves = [x.clone().requires_grad_() for x in inputs]
    want = F.scaled_dot_product_attention(*t_leaves, is_causal=causal)
    assert_close(f"{name}: out", out, want, atol=0)
    do = torch.randn_like(want)
    grads = torch.autograd.grad(out, leaves, do, allow_unused=True)
    t_grads = torch.autograd.grad(want, t_leaves, do, allow_unused=True)
    for g_name, g, t in zip(("dq", "dk", "dv"), grads, t_grads):
        g = torch.zeros_like(leaves[0 if g_name == "dq" else 1]) if g is None else g
        t = torch.zeros_like(g) if t is None else t
        assert_close(f"{name}: {g_name}", g, t, atol=0)


def test_fully_masked_rows_are_zero_like_torch_math():
    """PyTorch 2.13's MATH backend (the documented formula) also returns 0 for a row whose
    mask hides every key, with zero gradients: flashtile agrees with it."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (randn(1, 2, n, 8, gen=gen) for n in (4, 5, 5))
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1] = False
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = ft_sdpa(*leaves, attn_mask=mask)
    t_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(*t_leaves, attn_mask=mask)
    assert_close("masked row (torch MATH)", want[:, :, 1], torch.zeros_like(want[:, :, 1]), atol=0)
    assert_close("out", out, want, atol=2e-6)
    do = torch.randn_like(out)
    for g_name, g, t in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, do),
                            torch.autograd.grad(want, t_leaves, do)):
        assert_close(g_name, g, t, atol=2e-6)


def test_signature_and_argument_errors_use_pytorch_names():
    q = torch.randn(2, 3, 5, 8)
    with pytest.raises(TypeError, match="positional"):
        ft_sdpa(q, q, q, None, 0.0, False, 0.5)  # scale is keyword-only, as in PyTorch
    with pytest.raises(TypeError, match="positional"):
        ft_sdpa(q, q, q, None, 0.0, False, None, True)  # enable_gqa too
    with pytest.raises(TypeError, match="is_causal must be bool, not int"):
        ft_sdpa(q, q, q, is_causal=1)
    with pytest.raises(TypeError, match="is_causal must be bool, not Tensor"):
        ft_sdpa(q, q, q, is_causal=torch.tensor(True))
    with pytest.raises(ValueError, match="^scale must be finite"):
        ft_sdpa(q, q, q, scale=float("inf"))
    with pytest.raises(TypeError, match="^scale must be a float"):
        ft_sdpa(q, q, q, scale="0.5")
    with pytest.raises(ValueError, match="^query must have shape"):
        ft_sdpa(q[0, 0, 0], q, q)
    with pytest.raises(ValueError, match="query has 3 heads but key/value have 2"):
        ft_sdpa(q, q[:, :2], q[:, :2])
    with pytest.raises(ValueError, match="not broadcastable"):
        ft_sdpa(q, torch.randn(3, 3, 5, 8), torch.randn(3, 3, 5, 8))
    with pytest.raises(ValueError, match="headdim of query"):
        ft_sdpa(*(torch.randn(1, 1, 2, 300) for _ in range(3)))
    with pytest.raises(TypeError, match="^key has dtype float16"):
        ft_sdpa(q, q.half(), q.half())


def test_scale_as_a_one_element_tensor():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(1, 2, 6, 8, gen=gen) for _ in range(3))
    assert_close("tensor scale", ft_sdpa(q, k, v, scale=torch.tensor(0.3)),
                 ft_sdpa(q, k, v, scale=0.3), atol=0)


def _graph_nodes(fn, depth=4) -> set[str]:
    """Names of the autograd nodes within ``depth`` steps of ``fn``."""
    if fn is None or depth == 0:
        return set()
    names = {type(fn).__name__}
    for nxt, _ in fn.next_functions:
        names |= _graph_nodes(nxt, depth - 1)
    return names


def _per_sample_loss(fn):
    return lambda q, k, v: (fn(q, k, v, is_causal=True) ** 2).sum()


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_func_transforms_match_torch(backend):
    """grad, vmap and vmap(grad) (per-sample gradients) equal PyTorch SDPA's; eager calls
    outside a transform keep the fast autograd function."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (randn(2, 2, n, 8, gen=gen) for n in (5, 7, 7))
    with flashtile.use_backend(backend), poison_outputs():
        assert not _functorch.active()
        eager = ft_sdpa(q.clone().requires_grad_(), k, v)
        assert "FlashAttnFunctionBackward" in _graph_nodes(eager.grad_fn)
        g = torch.func.grad(_per_sample_loss(ft_sdpa), argnums=(0, 1, 2))(q, k, v)
        o = torch.vmap(ft_sdpa, in_dims=(0, None, None))(q, k[0], v[0])
        ps = torch.vmap(torch.func.grad(_per_sample_loss(ft_sdpa)),
                        in_dims=(0, 0, None))(q, k, v[0])
    g_t = torch.func.grad(_per_sample_loss(F.scaled_dot_product_attention),
                          argnums=(0, 1, 2))(q, k, v)
    o_t = torch.vmap(F.scaled_dot_product_attention, in_dims=(0, None, None))(q, k[0], v[0])
    ps_t = torch.vmap(torch.func.grad(_per_sample_loss(F.scaled_dot_product_attention)),
                      in_dims=(0, 0, None))(q, k, v[0])
    for name, a, b in (("grad dq", g[0], g_t[0]), ("grad dk", g[1], g_t[1]),
                       ("grad dv", g[2], g_t[2]), ("vmap out", o, o_t),
                       ("vmap(grad) dq", ps, ps_t)):
        assert_close(name, a, b, atol=2e-5, rtol=1e-5)


def test_vmap_dropout_follows_randomness_mode():
    q = torch.randn(3, 2, 5, 8)
    f = lambda x: ft_sdpa(x, x, x, dropout_p=0.5)  # noqa: E731
    with pytest.raises(RuntimeError, match="randomness"):
        torch.vmap(f)(q)
    same = torch.vmap(f, randomness="same")(q[:1].expand(3, -1, -1, -1))
    assert_close("randomness='same': one mask", same[1:], same[:1].expand(2, -1, -1, -1), atol=0)
    diff = torch.vmap(f, randomness="different")(q[:1].expand(3, -1, -1, -1))
    assert not torch.equal(diff[0], diff[1]), "randomness='different' drew one mask"
