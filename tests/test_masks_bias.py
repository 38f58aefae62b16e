"""SDPA's ``attn_mask`` on both backends: bool masks and additive float masks read through
their broadcast strides, learnable biases (dBias reduced to the mask's shape), composition with
GQA / scale / dropout, fully masked rows, and bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashtile
from flashtile import backends
from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton.fastlaunch import poison_outputs
from flashtile.reference.torch_ref import reference
from flashtile.interface import _mask_4d
from flashtile.rng import keep_mask

from helpers import assert_close, check_flash_rule, next_seed, randn

BACKENDS = ["triton", "torch"]
B, H, HK, L, S, E = 2, 4, 2, 13, 21, 16


def _qkv(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, do = (randn(B, H, L, E, dtype=dtype, gen=gen) for _ in range(2))
    k, v = (randn(B, HK, S, E, dtype=dtype, gen=gen) for _ in range(2))
    return q, k, v, do, gen


def _sdpa_ref(scale, mask=None, keep=None, dropout_p=0.0, learn=False):
    """float64/same-dtype reference in SDPA layout; with ``learn`` the mask is the 4th input."""
    spec = AttnSpec(scale, bottom_right=False, dropout_p=dropout_p)

    def ref(q, k, v, *bias, dtype):
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        m = bias[0] if learn else mask
        return t(reference(t(q), t(k), t(v), spec, None, dtype=dtype, attn_bias=m, keep=keep))
    return ref


MASK_SHAPES = {"LS": (L, S), "B1LS": (B, 1, L, S), "1H1S": (1, H, 1, S), "S": (S,)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", ["LS", "B1LS", "1H1S", "S"])
def test_bool_mask_matches_float64(shape, backend):
    q, k, v, do, gen = _qkv(torch.float16, len(shape))
    mask = torch.rand(*MASK_SHAPES[shape], generator=gen) > 0.35
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with flashtile.use_backend(backend), poison_outputs():
        out = flashtile.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True,
                                                     scale=0.3)
        grads = torch.autograd.grad(out, leaves, do)
    check_flash_rule(f"bool {shape}", out, grads, (q, k, v), do, _sdpa_ref(0.3, mask),
                     torch.float16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_float_mask_with_minus_inf_matches_pytorch(mask_dtype, backend):
    q, k, v, do, gen = _qkv(torch.float16, 3)
    mask = torch.randn(B, 1, L, S, generator=gen) * 2
    mask = mask.masked_fill(torch.rand(B, 1, L, S, generator=gen) < 0.2, float("-inf"))
    mask = mask.to(mask_dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with flashtile.use_backend(backend), poison_outputs():
        out = flashtile.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
        grads = torch.autograd.grad(out, leaves, do)
    check_flash_rule("float mask", out, grads, (q, k, v), do, _sdpa_ref(E ** -0.5, mask),
                     torch.float16)
    want = F.scaled_dot_product_attention(*(x.float() for x in (q, k, v)), attn_mask=mask.float(),
                                          enable_gqa=True)
    assert_close("vs torch sdpa", out, want, atol=2e-3, rtol=2e-3)


BIAS_SHAPES = {"full": (B, H, L, S), "1H1S": (1, H, 1, S), "B1LS": (B, 1, L, S), "LS": (L, S)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", list(BIAS_SHAPES))
def test_learnable_bias_gradient(shape, backend):
    """dBias = dS reduced over the broadcast dims, against float64 (3x rule) and PyTorch."""
    q, k, v, do, gen = _qkv(torch.float32, 10 + len(shape))
    bias = randn(*BIAS_SHAPES[shape], gen=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    with flashtile.use_backend(backend), poison_outputs():
        out = flashtile.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3],
                                                     enable_gqa=True, scale=0.35)
        grads = torch.autograd.grad(out, leaves, do)
    assert grads[3].shape == bias.shape
    check_flash_rule(f"bias {shape}", out, grads, (q, k, v, bias), do,
                     _sdpa_ref(0.35, learn=True), torch.float32)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    want = F.scaled_dot_product_attention(*ref_leaves[:3], attn_mask=ref_leaves[3],
                                          enable_gqa=True, scale=0.35)
    want_db = torch.autograd.grad(want, ref_leaves[3], do)[0]
    assert_close("dbias vs torch", grads[3], want_db, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_learnable_bias_with_dropout_and_gqa(backend):
    q, k, v, do, gen = _qkv(torch.float16, 30)
    bias = randn(1, H, L, S, dtype=torch.float16, gen=gen)
    seed = next_seed()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    with flashtile.use_backend(backend), poison_outputs():
        out = flashtile.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3],
                                                     dropout_p=0.25, enable_gqa=True)
        grads = torch.autograd.grad(out, leaves, do)
    keep = keep_mask(seed, 0.25, B, H, L, S)
    check_flash_rule("bias+dropout", out, grads, (q, k, v, bias), do,
                     _sdpa_ref(E ** -0.5, keep=keep, dropout_p=0.25, learn=True), torch.float16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_output_zero(backend):
    """A row whose mask hides every key outputs 0 with zero gradients (not NaN)."""
    q, k, v, do, gen = _qkv(torch.float32, 40)
    bias = randn(B, 1, L, S, gen=gen)
    bias[0, 0, 3] = float("-inf")
    bias[1, 0, 7:9] = float("-inf")
    leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    bool_mask = torch.rand(1, H, L, S, generator=gen) > 0.5
    bool_mask[0, 1, 4] = False
    with flashtile.use_backend(backend), poison_outputs():
        out = flashtile.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3],
                                                     enable_gqa=True)
        dq, dk, dv, db = torch.autograd.grad(out, leaves, do)
        out_b = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask,
                                                       enable_gqa=True)
    for name, t in (("out", out), ("dq", dq)):
        assert_close(f"{name} row", t[0, :, 3], torch.zeros_like(t[0, :, 3]), atol=0)
        assert_close(f"{name} rows", t[1, :, 7:9], torch.zeros_like(t[1, :, 7:9]), atol=0)
    assert_close("dbias row", db[0, 0, 3], torch.zeros(S), atol=0)
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all() and torch.isfinite(db).all()
    assert_close("bool-masked row", out_b[0, 1, 4], torch.zeros(E), atol=0)
    assert torch.isfinite(out_b).all()


def test_broadcast_masks_are_views_not_copies():
    for shape, target in (((1, H, 1, S), (B, H, L, S)), ((L, S), (B, H, L, S)),
                          ((1, 1, H, L, S), (3, B, H, L, S))):
        m = torch.randn(*shape)
        m4 = _mask_4d(m, target)
        assert m4.dim() == 4 and m4.data_ptr() == m.data_ptr(), shape


def test_5d_query_and_strided_mask_match_pytorch():
    gen = torch.Generator().manual_seed(50)
    q = randn(2, 3, H, L, E, gen=gen)
    k, v = randn(2, 3, H, S, E, gen=gen), randn(2, 3, H, S, E, gen=gen)
    mask = randn(2, 1, H, S, L, gen=gen).transpose(-1, -2)  # strided, broadcast over dim 1
    with flashtile.use_backend("torch"):
        got = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close("5d", got, want, atol=2e-5, rtol=1e-5)


def test_strided_mask_on_triton_matches_contiguous():
    q, k, v, _, gen = _qkv(torch.float32, 60)
    mask = torch.rand(B, H, S, L, generator=gen).transpose(-1, -2) > 0.3
    with flashtile.use_backend("triton"):
        got = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        want = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask.contiguous(),
                                                      enable_gqa=True)
    assert_close("strided mask", got, want, atol=0)


def _bad(kind):
    q = torch.randn(B, H, L, E)
    kv = torch.randn(B, H, S, E)
    masks = {
        "list": ([[True]], {}, TypeError),
        "int-dtype": (torch.ones(L, S, dtype=torch.int32), {}, TypeError),
        "float64": (torch.zeros(L, S, dtype=torch.float64), {}, TypeError),
        "fp16-for-fp32-query": (torch.zeros(L, S, dtype=torch.float16), {}, TypeError),
        "shape-L": (torch.zeros(L + 1, S), {}, ValueError),
        "shape-S": (torch.zeros(L, 1, S - 1), {}, ValueError),
        "shape-heads": (torch.zeros(1, 3, L, S), {}, ValueError),
        "too-many-dims": (torch.zeros(2, B, H, L, S), {}, ValueError),
        "device": (torch.zeros(L, S, device="meta"), {}, ValueError),
        "with-is_causal": (torch.ones(L, S, dtype=torch.bool), {"is_causal": True}, ValueError),
    }
    mask, kw, exc = masks[kind]
    return q, kv, mask, kw, exc


@pytest.mark.parametrize("kind", ["list", "int-dtype", "float64", "fp16-for-fp32-query", "shape-L",
                                  "shape-S", "shape-heads", "too-many-dims", "device",
                                  "with-is_causal"])
def test_bad_attn_mask_rejected_before_any_kernel(kind, monkeypatch):
    monkeypatch.setattr(backends, "get", lambda name: pytest.fail("a backend was reached"))
    q, kv, mask, kw, exc = _bad(kind)
    with pytest.raises(exc, match="attn_mask"):
        flashtile.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_composes_with_window_softcap_alibi_dropout_in_the_backends(backend):
    """The backend contract allows a bias with every other feature: bias + sliding window +
    softcap + ALiBi + GQA + dropout, forward and backward (dbias included) vs float64."""
    from flashtile.backends import get

    impl = get(backend)
    gen = torch.Generator().manual_seed(70)
    b, sq, sk, h, hk, d, p = 2, 19, 26, 4, 2, 16, 0.2
    q, do = (randn(b, sq, h, d, gen=gen) for _ in range(2))
    k, v = (randn(b, sk, hk, d, gen=gen) for _ in range(2))
    bias = randn(b, 1, sq, sk, gen=gen)
    slopes = torch.rand(h, generator=gen) * 0.3
    spec = AttnSpec(0.3, 5, 2, True, 4.0, p)
    seed = 2 ** 50 + 3
    rng = torch.tensor([seed])
    dbias = torch.empty_like(bias)
    with poison_outputs():
        out, lse = impl.forward(q, k, v, spec, alibi_slopes=slopes, attn_bias=bias, rng_seed=rng)
        grads = impl.backward(do, q, k, v, out, lse, spec, alibi_slopes=slopes, attn_bias=bias,
                              rng_seed=rng, dbias=dbias)
    keep = keep_mask(seed, p, b, h, sq, sk)

    def ref(q_, k_, v_, bias_, dtype):
        return reference(q_, k_, v_, spec, slopes, dtype=dtype, attn_bias=bias_, keep=keep)

    check_flash_rule("composed", out, (*grads, dbias), (q, k, v, bias), do, ref, torch.float32)


def _tiled_features_run(bm, bn):
    """SDPA with a learnable bias and dropout, and block-sparse + causal + dropout, on the
    Triton backend with pinned tile sizes: outputs and gradients."""
    from flashtile.backends.triton.configs import KernelConfig, override

    gen = torch.Generator().manual_seed(80)
    q, do = (randn(1, 40, 2, 16, gen=gen) for _ in range(2))
    k, v = (randn(1, 54, 2, 16, gen=gen) for _ in range(2))
    bias = randn(1, 2, 40, 54, gen=gen)
    block_mask = torch.rand(1, 2, 2, 2, generator=gen) > 0.3
    block_mask[0, :, 1, 1] = True
    pins = dict(fwd=KernelConfig(bm, bn), dkdv=KernelConfig(bn, bm), dq=KernelConfig(bm, bn))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, bias)]
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    with flashtile.use_backend("triton"), override(**pins), poison_outputs():
        torch.manual_seed(9)
        a = t(flashtile.scaled_dot_product_attention(*(t(x) for x in leaves[:3]),
                                                     attn_mask=leaves[3], dropout_p=0.3))
        torch.manual_seed(9)
        s = flashtile.block_sparse_attn_func(*leaves[:3], block_mask, block_size=(32, 32),
                                             dropout_p=0.3, causal=True)
        return (a, s, *torch.autograd.grad(a + s, leaves, do))


_BASE = {}


@pytest.mark.parametrize("cfg", [(32, 16), (64, 64)], ids=lambda c: f"{c[0]}x{c[1]}")
def test_triton_features_are_tile_size_invariant(cfg):
    """Dropout counters, bias tiles, dBias and block lists do not depend on the kernels' tile
    sizes (GPUs run larger tiles than the interpreter's default 16 x 16; tiles larger than a
    mask block are cut down to divide it)."""
    if "base" not in _BASE:
        _BASE["base"] = _tiled_features_run(16, 16)
    names = ("sdpa out", "block-sparse out", "dq", "dk", "dv", "dbias")
    for name, got, want in zip(names, _tiled_features_run(*cfg), _BASE["base"]):
        assert_close(f"{name} {cfg}", got, want, atol=2e-5, rtol=1e-5)
