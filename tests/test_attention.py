"""Dense attention on both backends against float64 references: flash_attn_func / varlen / SDPA,
SDPA's attention masks and biases, dropout, any shape (property test) and block-sparse attention.

The Triton kernels run under the interpreter (small shapes, fp16/fp32; the 3.6 interpreter
mis-reads bf16).  Every case checks out, lse and the gradients with flash-attn's rule (error vs
float64 at most 2x PyTorch's same-dtype error for out, 3x for gradients), after poisoning the
kernels' output buffers with NaN.

- masks and biases: bool masks and additive float masks read through their broadcast strides,
  learnable biases (dBias reduced to the mask's shape), composition with GQA / scale / dropout,
  fully masked rows, and bad input;
- dropout: the Philox keep mask (bit-exact between tl.rand, the kernels, the torch backend and
  S_dmask), float64 references rebuilt from S_dmask, keep-rate statistics, seed reproducibility
  and a bitwise-repeatable backward;
- any shape: lengths 0..300, head dims 1..256, GQA ratios, causal, Sq != Sk (hypothesis);
- block-sparse (paper section 3.3): against the dense masked float64 reference, zero blocks never
  loaded by the kernels, the layout builders, and bad input.
"""
from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from hypothesis import HealthCheck, example, given, settings, strategies as st

import flashtile
from flashtile import backends
from flashtile.backends import triton as triton_backend
from flashtile.backends.spec import AttnSpec
from flashtile.backends.torch import attention as torch_tiled
from flashtile.backends.triton.configs import KernelConfig, override
from flashtile.backends.triton.fastlaunch import poison_outputs
from flashtile.backends.triton.sparse_index import block_lists
from flashtile.interface import _mask_4d
from flashtile.masks import attention_probs
from flashtile.reference.torch_ref import reference, scores
from flashtile.rng import keep_mask, philox_uniform

from helpers import assert_close, assert_flash_rule, check_flash_rule, next_seed, randn


BACKENDS = ["triton", "torch"]

# (id, batch, sq, sk, nheads, nheads_k, d, kwargs)
CASES = [
    ("square", 2, 33, 33, 2, 2, 32, {}),
    ("sq<sk-gqa", 1, 17, 45, 4, 2, 16, {}),
    ("sq>sk-mqa-causal", 1, 40, 23, 3, 1, 24, {"causal": True}),
    ("causal-square", 2, 48, 48, 2, 1, 32, {"causal": True}),
    ("causal-sq<sk", 1, 20, 50, 2, 2, 16, {"causal": True}),
    ("d1", 1, 9, 12, 2, 2, 1, {}),
    ("d17-odd", 1, 21, 19, 2, 1, 17, {"causal": True}),
    ("len1", 2, 1, 1, 2, 2, 8, {"causal": True}),
    ("window", 1, 50, 50, 2, 2, 16, {"window_size": (7, 3)}),
    ("window-left-only-causal", 1, 40, 60, 2, 1, 16, {"window_size": (9, -1), "causal": True}),
    ("window-right-only", 1, 30, 30, 2, 2, 16, {"window_size": (-1, 5)}),
    ("softcap", 1, 30, 30, 2, 2, 16, {"softcap": 2.0}),
    ("alibi-h", 1, 30, 40, 2, 2, 16, {"alibi": "h", "causal": True}),
    ("alibi-bh-softcap", 2, 25, 25, 2, 1, 16, {"alibi": "bh", "softcap": 5.0}),
    ("scale", 1, 20, 20, 2, 2, 16, {"softmax_scale": 0.9}),
]


def _inputs(case, dtype, seed):
    _, batch, sq, sk, h, hk, d, kw = case
    gen = torch.Generator().manual_seed(seed)
    q = randn(batch, sq, h, d, dtype=dtype, gen=gen)
    k = randn(batch, sk, hk, d, dtype=dtype, gen=gen)
    v = randn(batch, sk, hk, d, dtype=dtype, gen=gen)
    do = randn(batch, sq, h, d, dtype=dtype, gen=gen)
    kw = dict(kw)
    alibi = kw.pop("alibi", None)
    if alibi == "h":
        kw["alibi_slopes"] = torch.rand(h, generator=gen) * 0.5
    elif alibi == "bh":
        kw["alibi_slopes"] = torch.rand(batch, h, generator=gen) * 0.5
    return q, k, v, do, kw


def _spec(d, kw, bottom_right=True):
    left, right = kw.get("window_size", (-1, -1))
    if kw.get("causal"):
        right = 0
    scale = kw.get("softmax_scale") or 1 / math.sqrt(d)
    return AttnSpec(scale, left, right, bottom_right, kw.get("softcap", 0.0))


def _compare(name, q, k, v, do, spec, slopes, out, lse, grads, dtype):
    def ref_fn(q, k, v, dtype):
        return reference(q, k, v, spec, slopes, dtype=dtype)

    check_flash_rule(name, out, grads, (q, k, v), do, ref_fn, dtype, ("dq", "dk", "dv"))
    if lse is not None:
        s = scores(q, k, spec, slopes)
        assert_close(f"{name}: lse", lse, torch.logsumexp(s, dim=-1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_flash_attn_func_matches_float64(case, dtype, backend):
    q, k, v, do, kw = _inputs(case, dtype, seed=zlib.crc32(case[0].encode()) % 1000)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with flashtile.use_backend(backend), poison_outputs():
        out, lse, _ = flashtile.flash_attn_func(*leaves, return_attn_probs=True, **kw)
        grads = torch.autograd.grad(out, leaves, do)
    spec = _spec(q.shape[-1], kw)
    _compare(case[0], q, k, v, do, spec, kw.get("alibi_slopes"), out, lse, grads, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_see_no_key_are_zero_not_nan(backend):
    # causal with Sq > Sk (bottom-right): the first Sq - Sk rows see nothing.
    gen = torch.Generator().manual_seed(1)
    q, k, v = (randn(2, n, 2, 16, gen=gen) for n in (30, 10, 10))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with flashtile.use_backend(backend), poison_outputs():
        out, lse, probs = flashtile.flash_attn_func(*leaves, causal=True, return_attn_probs=True)
        dq, dk, dv = torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert_close("out of empty rows", out[:, :20], torch.zeros_like(out[:, :20]), atol=0)
    assert_close("dq of empty rows", dq[:, :20], torch.zeros_like(dq[:, :20]), atol=0)
    assert torch.isneginf(lse[:, :, :20]).all(), "lse of empty rows must be -inf"
    assert torch.isfinite(lse[:, :, 20:]).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert probs.shape == (0,) and probs.dtype == q.dtype, "no S_dmask without dropout"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 5, 5), (2, 0, 5), (2, 5, 0), (2, 0, 0)],
                         ids=["batch0", "sq0", "sk0", "both0"])
def test_empty_inputs(shape, backend):
    batch, sq, sk = shape
    q = torch.randn(batch, sq, 2, 8, requires_grad=True)
    k = torch.randn(batch, sk, 2, 8, requires_grad=True)
    v = torch.randn(batch, sk, 2, 8, requires_grad=True)
    with flashtile.use_backend(backend):
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        assert out.shape == (batch, sq, 2, 8)
        assert_close("out", out, torch.zeros_like(out), atol=0)
        out.sum().backward()
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        assert_close(name, t.grad, torch.zeros_like(t), atol=0)


@pytest.mark.parametrize("cfg", [(16, 16), (32, 16), (16, 32), (64, 32)], ids=lambda c: f"{c[0]}x{c[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_block_size_invariance(cfg, causal):
    """The same function for every tiling: results agree with the 16x16 tiling to rounding."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (randn(1, n, 2, 24, gen=gen) for n in (70, 90, 90))
    do = randn(1, 70, 2, 24, gen=gen)

    def run(bm, bn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        pins = dict(fwd=KernelConfig(bm, bn), dkdv=KernelConfig(bn, bm), dq=KernelConfig(bm, bn))
        with flashtile.use_backend("triton"), override(**pins), poison_outputs():
            out = flashtile.flash_attn_func(*leaves, causal=causal, window_size=(40, -1))
            return (out, *torch.autograd.grad(out, leaves, do))

    base = run(16, 16)
    for name, got, want in zip(("out", "dq", "dk", "dv"), run(*cfg), base):
        assert_close(f"{name} {cfg}", got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", ["1", "2", "auto"])
@pytest.mark.parametrize("case", [
    ("full", dict()),
    ("causal-gqa", dict(causal=True)),
    ("window-softcap", dict(window_size=(9, 4), softcap=5.0)),
], ids=lambda c: c if isinstance(c, str) else c[0])
def test_triton_backward_in_batch_chunks_is_bitwise(case, chunk, monkeypatch):
    """``FLASHTILE_BWD_CHUNK``: the backward launched a few batch entries at a time (each chunk's
    dQ then dK/dV kernel) gives the gradients of one launch per kernel, bit for bit (the same
    programs, on views of the same tensors); ``auto`` on the CPU keeps one launch."""
    _, kw = case
    gen = torch.Generator().manual_seed(next_seed())
    hk = 1 if case[0] == "causal-gqa" else 2
    q = randn(3, 37, 2, 16, gen=gen)
    k, v = (randn(3, 45, hk, 16, gen=gen) for _ in range(2))
    do = randn(3, 37, 2, 16, gen=gen)

    def grads(mode):
        monkeypatch.setenv("FLASHTILE_BWD_CHUNK", mode)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with flashtile.use_backend("triton"), poison_outputs():
            out = flashtile.flash_attn_func(*leaves, **kw)
            return torch.autograd.grad(out, leaves, do)

    for name, got, want in zip(("dq", "dk", "dv"), grads(chunk), grads("off")):
        assert not got.isnan().any(), name
        assert torch.equal(got, want), name


def test_backward_chunk_setting_is_checked(monkeypatch):
    """A bad ``FLASHTILE_BWD_CHUNK`` names the variable; a chunk as large as the batch is none."""
    from flashtile.backends.triton.launch_bwd import batch_chunk
    cpu = torch.device("cpu")
    monkeypatch.setenv("FLASHTILE_BWD_CHUNK", "some")
    with pytest.raises(ValueError, match="FLASHTILE_BWD_CHUNK"):
        batch_chunk(4, 8, 8, 2, 2, 16, 4, cpu)
    monkeypatch.setenv("FLASHTILE_BWD_CHUNK", "4")
    assert batch_chunk(4, 8, 8, 2, 2, 16, 4, cpu) == 0
    monkeypatch.setenv("FLASHTILE_BWD_CHUNK", "3")
    assert batch_chunk(4, 8, 8, 2, 2, 16, 4, cpu) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_match_contiguous(backend):
    """Views with a contiguous last dim (packed qkv, a (B, H, S, D) transpose) need no copy."""
    gen = torch.Generator().manual_seed(3)
    qkv = randn(2, 3, 4, 19, 16, gen=gen)  # (B, 3, H, S, D): heads before positions
    q, k, v = (qkv[:, i].transpose(1, 2) for i in range(3))  # (B, S, H, D) strided views
    assert not q.is_contiguous()
    with flashtile.use_backend(backend):
        got = flashtile.flash_attn_func(q, k, v, causal=True)
        want = flashtile.flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert_close("out", got, want, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_matches_per_sequence(backend, causal):
    gen = torch.Generator().manual_seed(11)
    lens_q, lens_k = [5, 0, 17, 9], [12, 4, 17, 3]
    h, hk, d = 4, 2, 16
    q = randn(sum(lens_q), h, d, dtype=torch.float16, gen=gen)
    k = randn(sum(lens_k), hk, d, dtype=torch.float16, gen=gen)
    v = randn(sum(lens_k), hk, d, dtype=torch.float16, gen=gen)
    do = randn(sum(lens_q), h, d, dtype=torch.float16, gen=gen)
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with flashtile.use_backend(backend), poison_outputs():
        out, lse, _ = flashtile.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k),
                                                       causal=causal, return_attn_probs=True)
        grads = torch.autograd.grad(out, leaves, do)
    assert lse.shape == (h, sum(lens_q))
    for b in range(len(lens_q)):
        sq_, sk_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0:
            continue
        one = [x[s][None] for x, s in ((q, sq_), (k, sk_), (v, sk_))]
        spec = _spec(d, {"causal": causal})
        _compare(f"seq {b}", *one, do[sq_][None], spec, None, out[sq_][None],
                 lse[:, sq_][None], (grads[0][sq_][None], grads[1][sk_][None], grads[2][sk_][None]),
                 torch.float16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lq,lk", [(20, 20), (12, 30), (30, 12)], ids=["eq", "L<S", "L>S"])
def test_sdpa_matches_pytorch(backend, causal, lq, lk):
    gen = torch.Generator().manual_seed(5)
    q = randn(2, 4, lq, 16, gen=gen)
    k, v = randn(2, 2, lk, 16, gen=gen), randn(2, 2, lk, 16, gen=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with flashtile.use_backend(backend):
        got = flashtile.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True,
                                                     scale=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, is_causal=causal,
                                                            enable_gqa=True, scale=0.3)
    assert_close("out", got, want, atol=2e-5, rtol=1e-5)
    do = torch.randn_like(want)
    for name, a, b in zip(("dq", "dk", "dv"), torch.autograd.grad(got, leaves, do),
                          torch.autograd.grad(want, ref_leaves, do)):
        assert_close(name, a, b, atol=2e-5, rtol=1e-5)


def test_sdpa_accepts_3d_and_5d_inputs():
    q = torch.randn(2, 3, 4, 10, 8)
    with flashtile.use_backend("torch"):
        got5 = flashtile.scaled_dot_product_attention(q, q, q)
        got3 = flashtile.scaled_dot_product_attention(q[0, 0], q[0, 0], q[0, 0])
    assert_close("5d", got5, torch.nn.functional.scaled_dot_product_attention(q, q, q), atol=1e-5)
    assert_close("3d", got3, got5[0, 0], atol=1e-6)


def test_packed_variants_match_unpacked():
    gen = torch.Generator().manual_seed(2)
    qkv = randn(2, 13, 3, 2, 8, gen=gen)
    with flashtile.use_backend("torch"):
        a = flashtile.flash_attn_qkvpacked_func(qkv, causal=True)
        b = flashtile.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], causal=True)
        c = flashtile.flash_attn_func(*qkv.unbind(2), causal=True)
    assert_close("qkvpacked", a, c, atol=0)
    assert_close("kvpacked", b, c, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_return_attn_probs_are_softmax(backend):
    """With dropout, |S_dmask| is the normalised softmax (rows sum to 1: no other scaling)
    and its sign is the keep mask: out = ((S_dmask >= 0) * |S_dmask| / (1 - p)) @ V."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = (randn(1, n, 2, 8, gen=gen) for n in (6, 9, 9))
    p = 0.25
    with flashtile.use_backend(backend):
        out, lse, s = flashtile.flash_attn_func(q, k, v, dropout_p=p, causal=True,
                                                return_attn_probs=True)
    assert s.shape == (1, 2, 6, 9) and s.dtype == torch.float32
    assert_close("row sums of |S_dmask|", s.abs().sum(-1), torch.ones(1, 2, 6), atol=1e-5)
    kept = (s >= 0) * s.abs() / (1 - p)
    assert_close("S_dmask @ V", (kept @ v.transpose(1, 2)).transpose(1, 2), out, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Attention masks and biases (SDPA attn_mask)
# ----------------------------------------------------------------------------------------------

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
    # the dropout stream fixed like the inputs (its seed comes from the default generator,
    # whose state depends on the tests run before this one)
    torch.manual_seed(30)
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


# ----------------------------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------------------------

@triton.jit
def _rand_kernel(SEED, OFF, OUT, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(OUT + o, tl.rand(tl.load(SEED), tl.load(OFF + o)))


@pytest.mark.parametrize("seed", [0, 1, 2 ** 31 + 7, 2 ** 40 + 3, 2 ** 62 - 1],
                         ids=["0", "1", "2^31+7", "2^40+3", "2^62-1"])
def test_philox_matches_tl_rand_bit_for_bit(seed):
    gen = torch.Generator().manual_seed(seed % 1000)
    offsets = torch.cat([torch.arange(32), torch.randint(0, 2 ** 62, (64,), generator=gen),
                         torch.tensor([2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32] * 8)])
    got = torch.empty(offsets.numel(), dtype=torch.float32)
    _rand_kernel[(1,)](torch.tensor([seed]), offsets, got, N=offsets.numel())
    want = philox_uniform(seed, offsets)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), "tl.rand != philox_uniform"
    assert (want >= 0).all() and (want < 1).all()


def _one_hot_v(batch, sk, hk):
    """v[b, j, hk] = e_j, so that out[b, i, h, j] = P_ij * keep_ij / (1 - p)."""
    return torch.eye(sk).expand(batch, hk, sk, sk).permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_kernel_and_torch_backend_keep_masks_are_identical(layout):
    """The kernels' forward keep mask, read through a one-hot V, equals rng.keep_mask bit for
    bit; the backward (which regenerates it) and the torch backend then agree to rounding."""
    p, seed, h, hk = 0.4, 2 ** 45 + 12345, 4, 2
    gen = torch.Generator().manual_seed(0)
    if layout == "dense":
        batch, sq, sk = 2, 16, 16
        q = randn(batch, sq, h, sk, gen=gen)
        k = randn(batch, sk, hk, sk, gen=gen)
        v = _one_hot_v(batch, sk, hk)
        kw = {}
        want = keep_mask(seed, p, batch, h, sq, sk)
    else:
        lens_q, lens_k, max_q, max_k = [5, 11], [16, 9], 12, 16
        q = randn(sum(lens_q), h, max_k, gen=gen)
        k = randn(sum(lens_k), hk, max_k, gen=gen)
        v = torch.cat([_one_hot_v(1, max_k, hk)[0, :n] for n in lens_k])
        cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
        cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
        want = keep_mask(seed, p, 2, h, max_q, max_k)
    do = torch.randn_like(q)
    spec = AttnSpec(0.25, dropout_p=p)
    rng = torch.tensor([seed])
    results = {}
    for name, impl in (("triton", triton_backend), ("torch", torch_tiled)):
        with poison_outputs():
            out, lse = impl.forward(q, k, v, spec, rng_seed=rng, **kw)
            results[name] = (out, *impl.backward(do, q, k, v, out, lse, spec, rng_seed=rng, **kw))
    out = results["triton"][0]
    if layout == "dense":
        got = (out != 0).permute(0, 2, 1, 3)  # [B, H, Sq, Sk]
        assert torch.equal(got, want), f"{int((got != want).sum())} keep decisions differ"
    else:
        for b in range(2):
            o = out[cu_q[b]:cu_q[b + 1], :, :lens_k[b]]  # [len_q, H, len_k]
            got = (o != 0).permute(1, 0, 2)
            exp = want[b, :, :lens_q[b], :lens_k[b]]
            assert torch.equal(got, exp), f"seq {b}: {int((got != exp).sum())} decisions differ"
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["triton"], results["torch"]):
        assert_close(f"triton vs torch {name}", a, b, atol=2e-5, rtol=1e-5)


def _dense_ref(spec, slopes, keep):
    def ref(q, k, v, dtype):
        return reference(q, k, v, spec, slopes, dtype=dtype, keep=keep)
    return ref


# (id, batch, sq, sk, nheads, nheads_k, d, dtype, kwargs)
DROPOUT_CASES = [
    ("plain-fp16", 2, 24, 24, 2, 2, 16, torch.float16, {}),
    ("causal-gqa-sq<sk", 1, 20, 37, 4, 2, 16, torch.float32, {"causal": True}),
    ("sq>sk-causal-mqa", 1, 33, 18, 2, 1, 16, torch.float16, {"causal": True}),
    ("window-softcap-alibi", 2, 30, 30, 2, 1, 24, torch.float32,
     {"window_size": (6, 2), "softcap": 3.0, "alibi": True}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", DROPOUT_CASES, ids=[c[0] for c in DROPOUT_CASES])
def test_dropout_matches_float64_reference_rebuilt_from_s_dmask(case, backend):
    name, batch, sq, sk, h, hk, d, dtype, kw = case
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    q, do = (randn(batch, sq, h, d, dtype=dtype, gen=gen) for _ in range(2))
    k, v = (randn(batch, sk, hk, d, dtype=dtype, gen=gen) for _ in range(2))
    kw = dict(kw)
    slopes = torch.rand(batch, h, generator=gen) * 0.5 if kw.pop("alibi", False) else None
    p = 0.3
    seed = next_seed()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with flashtile.use_backend(backend), poison_outputs():
        out, lse, s_dmask = flashtile.flash_attn_func(*leaves, dropout_p=p, alibi_slopes=slopes,
                                                      return_attn_probs=True, **kw)
        grads = torch.autograd.grad(out, leaves, do)
    left, right = kw.get("window_size", (-1, -1))
    spec = AttnSpec(1 / math.sqrt(d), left, 0 if kw.get("causal") else right, True,
                    kw.get("softcap", 0.0), p)
    keep = s_dmask >= 0
    assert s_dmask.shape == (batch, h, sq, sk) and s_dmask.dtype == torch.float32
    probs = attention_probs(q, k, lse, spec, slopes)
    assert_close("|S_dmask| = P", s_dmask.abs(), probs, atol=1e-6)
    # S_dmask >= 0 is the keep mask wherever P > 0; entries with P == 0 read as kept
    zero = probs == 0
    assert torch.equal(keep | zero, keep_mask(seed, p, batch, h, sq, sk) | zero)
    assert keep[zero].all()
    check_flash_rule(name, out, grads, (q, k, v), do, _dense_ref(spec, slopes, keep), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_causal_window_gqa_dropout(backend):
    """All at once: packed sequences (one empty), bottom-right causal window, GQA, dropout;
    per-sequence float64 references with the keep mask from the padded S_dmask."""
    gen = torch.Generator().manual_seed(21)
    lens_q, lens_k = [7, 0, 19, 12], [15, 6, 19, 5]
    max_q, max_k = max(lens_q), max(lens_k)
    h, hk, d, p, dtype = 4, 2, 16, 0.25, torch.float16
    q, do = (randn(sum(lens_q), h, d, dtype=dtype, gen=gen) for _ in range(2))
    k, v = (randn(sum(lens_k), hk, d, dtype=dtype, gen=gen) for _ in range(2))
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)
    seed = next_seed()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with flashtile.use_backend(backend), poison_outputs():
        out, lse, s_dmask = flashtile.flash_attn_varlen_func(
            *leaves, cu_q, cu_k, max_q, max_k, dropout_p=p, causal=True, window_size=(8, -1),
            return_attn_probs=True)
        grads = torch.autograd.grad(out, leaves, do)
    assert s_dmask.shape == (4, h, max_q, max_k)
    zero = s_dmask == 0
    assert torch.equal((s_dmask >= 0) | zero, keep_mask(seed, p, 4, h, max_q, max_k) | zero)
    spec = AttnSpec(1 / math.sqrt(d), 8, 0, True, 0.0, p)
    for b in range(4):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0:
            continue
        keep = (s_dmask[b:b + 1, :, :lens_q[b], :lens_k[b]] >= 0)
        one = [x[r][None] for x, r in ((q, rq), (k, rk), (v, rk))]
        got_grads = (grads[0][rq][None], grads[1][rk][None], grads[2][rk][None])
        check_flash_rule(f"seq {b}", out[rq][None], got_grads, one, do[rq][None],
                         _dense_ref(spec, None, keep), dtype)
    # keys of the sequence with no queries get zero gradients
    assert_close("dk of seq 1", grads[1][cu_k[1]:cu_k[2]], torch.zeros(6, hk, d), atol=0)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_binomial(p):
    batch, h, sq, sk = 2, 4, 128, 96
    keep = keep_mask(2 ** 33 + 17, p, batch, h, sq, sk)
    n = keep.numel()
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(int(keep.sum()) - n * (1 - p)) <= 5 * sigma, f"keep rate {keep.float().mean():.4f}"
    # every (b, h) slab and every query row keeps about 1 - p too (6 sigma, many rows)
    per_head = keep.sum(dim=(2, 3)).double()
    m = sq * sk
    assert ((per_head - m * (1 - p)).abs() <= 5 * math.sqrt(m * p * (1 - p))).all()
    per_row = keep.sum(dim=-1).double()
    assert ((per_row - sk * (1 - p)).abs() <= 6 * math.sqrt(sk * p * (1 - p))).all()
    # a different seed gives an (almost) independent mask
    other = keep_mask(2 ** 33 + 18, p, batch, h, sq, sk)
    agree = (keep == other).double().mean().item()
    want = p * p + (1 - p) * (1 - p)
    assert abs(agree - want) <= 5 * math.sqrt(want * (1 - want) / n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_manual_seed_makes_calls_reproducible(backend):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (randn(1, 20, 2, 16, gen=gen) for _ in range(3))
    do = randn(1, 20, 2, 16, gen=gen)

    def run(s):
        torch.manual_seed(s)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with flashtile.use_backend(backend):
            out = flashtile.flash_attn_func(*leaves, dropout_p=0.2, causal=True)
            return (out, *torch.autograd.grad(out, leaves, do))

    first, again, other = run(123), run(123), run(124)
    for name, a, b in zip(("out", "dq", "dk", "dv"), first, again):
        assert torch.equal(a, b), f"{name} differs between two calls after manual_seed(123)"
    assert not torch.equal(first[0], other[0]), "another seed gave the same dropout"


def test_no_seed_is_drawn_without_dropout():
    """dropout_p=0 costs nothing: the default generator is not touched."""
    q = torch.randn(1, 8, 2, 16)
    state = torch.get_rng_state()
    with flashtile.use_backend("torch"):
        flashtile.flash_attn_func(q, q, q, dropout_p=0.0)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_is_bitwise_deterministic(backend):
    gen = torch.Generator().manual_seed(8)
    q, k, v = (randn(2, n, h, 16, dtype=torch.float16, gen=gen)
               for n, h in ((24, 4), (31, 2), (31, 2)))
    do = randn(2, 24, 4, 16, dtype=torch.float16, gen=gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with flashtile.use_backend(backend):
        out = flashtile.flash_attn_func(*leaves, dropout_p=0.3, causal=True, deterministic=True)
        first = torch.autograd.grad(out, leaves, do, retain_graph=True)
        second = torch.autograd.grad(out, leaves, do)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} is not bitwise repeatable"


@pytest.mark.parametrize("backend", BACKENDS)
def test_sdpa_dropout_matches_reference(backend):
    """SDPA's dropout (top-left causal, GQA, custom scale) against a float64 reference using the
    keep mask regenerated from the seed the call drew."""
    gen = torch.Generator().manual_seed(6)
    q, do = (randn(2, 4, 14, 16, gen=gen) for _ in range(2))
    k, v = (randn(2, 2, 22, 16, gen=gen) for _ in range(2))
    seed = next_seed()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with flashtile.use_backend(backend), poison_outputs():
        out = flashtile.scaled_dot_product_attention(*leaves, dropout_p=0.35, is_causal=True,
                                                     scale=0.4, enable_gqa=True)
        grads = torch.autograd.grad(out, leaves, do)
    spec = AttnSpec(0.4, -1, 0, False, 0.0, 0.35)
    keep = keep_mask(seed, 0.35, 2, 4, 14, 22)

    def ref(q_, k_, v_, dtype):
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        return t(reference(t(q_), t(k_), t(v_), spec, None, dtype=dtype, keep=keep))

    check_flash_rule("sdpa dropout", out, grads, (q, k, v), do, ref, torch.float32)


BAD_P = [("negative", -0.1, ValueError), ("one", 1.0, ValueError),
         ("nan", float("nan"), ValueError), ("str", "0.1", TypeError), ("bool", True, TypeError)]
# (the SDPA drop-in takes dropout_p = 1 as PyTorch does: test_dropin.py)
BAD_P_CASES = [(api, *case) for api in ("flash", "varlen", "sdpa", "block_sparse")
               for case in BAD_P if not (api == "sdpa" and case[0] == "one")]


@pytest.mark.parametrize("api,name,p,exc", BAD_P_CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in BAD_P_CASES])
def test_bad_dropout_p_rejected_before_any_kernel(api, name, p, exc, monkeypatch):
    monkeypatch.setattr(backends, "get", lambda name: pytest.fail("a backend was reached"))
    q = torch.randn(1, 16, 2, 16)
    with pytest.raises(exc, match="dropout_p"):
        if api == "flash":
            flashtile.flash_attn_func(q, q, q, dropout_p=p)
        elif api == "varlen":
            cu = torch.tensor([0, 16], dtype=torch.int32)
            flashtile.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 16, 16, dropout_p=p)
        elif api == "sdpa":
            flashtile.scaled_dot_product_attention(q, q, q, dropout_p=p)
        else:
            flashtile.block_sparse_attn_func(q, q, q, torch.ones(1, 1, 1, 1, dtype=torch.bool),
                                             block_size=16, dropout_p=p)


# ----------------------------------------------------------------------------------------------
# Any shape (property test)
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# Block-sparse attention
# ----------------------------------------------------------------------------------------------

def _ref(spec, dense, keep=None):
    def ref(q, k, v, dtype):
        return reference(q, k, v, spec, None, dtype=dtype, attn_bias=dense, keep=keep)
    return ref


# (id, batch, sq, sk, nheads, nheads_k, d, block_size, mask batch/heads, kwargs)
SPARSE_CASES = [
    ("16x16-per-head", 2, 40, 40, 2, 2, 16, (16, 16), (1, 2), {}),
    ("32x16-causal-gqa", 1, 50, 50, 4, 2, 16, (32, 16), (1, 4), {"causal": True}),
    ("16x48-sq<sk-per-batch", 2, 21, 70, 2, 1, 16, (16, 48), (2, 1), {}),
    ("48x32-dropout-causal", 1, 60, 45, 2, 2, 16, (48, 32), (1, 1),
     {"causal": True, "dropout_p": 0.2}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SPARSE_CASES, ids=[c[0] for c in SPARSE_CASES])
def test_matches_dense_masked_float64(case, backend):
    name, batch, sq, sk, h, hk, d, bs, (mb, mh), kw = case
    dtype = torch.float16 if "gqa" in name else torch.float32
    gen = torch.Generator().manual_seed(sq + sk)
    q, do = (randn(batch, sq, h, d, dtype=dtype, gen=gen) for _ in range(2))
    k, v = (randn(batch, sk, hk, d, dtype=dtype, gen=gen) for _ in range(2))
    nr, nc = math.ceil(sq / bs[0]), math.ceil(sk / bs[1])
    block_mask = torch.rand(mb, mh, nr, nc, generator=gen) > 0.45
    block_mask[..., 0, :] = False  # a block row with no block: its queries output 0
    seed = next_seed()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with flashtile.use_backend(backend), poison_outputs():
        out = flashtile.block_sparse_attn_func(*leaves, block_mask, block_size=bs, **kw)
        grads = torch.autograd.grad(out, leaves, do)
    p = kw.get("dropout_p", 0.0)
    spec = AttnSpec(d ** -0.5, -1, 0 if kw.get("causal") else -1, True, 0.0, p)
    dense = flashtile.expand_block_mask(block_mask, bs, sq, sk)
    keep = keep_mask(seed, p, batch, h, sq, sk) if p else None
    check_flash_rule(name, out, grads, (q, k, v), do, _ref(spec, dense, keep), dtype)
    rows = min(bs[0], sq)
    assert_close("empty block row", out[:, :rows], torch.zeros_like(out[:, :rows]), atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_builders_match_sdpa_with_the_expanded_mask(backend):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(1, 64, 2, 16, gen=gen) for _ in range(3))
    bm = (flashtile.local_block_mask(64, 64, 16, 1) | flashtile.global_block_mask(64, 64, 16)
          | flashtile.butterfly_block_mask(64, 64, 16))
    dense = flashtile.expand_block_mask(bm, 16, 64, 64)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    with flashtile.use_backend(backend):
        got = flashtile.block_sparse_attn_func(q, k, v, bm, block_size=(16, 16))
        want = t(flashtile.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=dense))
    assert_close("block-sparse vs sdpa+mask", got, want, atol=1e-5, rtol=1e-5)


def test_zero_blocks_are_never_loaded():
    """NaN in key/value blocks no query block uses, and in query blocks with no nonzero block,
    cannot reach any output of the Triton kernels: those tiles are never read."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (randn(1, 64, 2, 16, gen=gen) for _ in range(4))
    bm = torch.rand(1, 1, 4, 4, generator=gen) > 0.3
    bm[..., 2] = False  # key block 2 unused by everyone
    bm[..., 1, :] = False  # query block 1 sees nothing
    bm[..., 0, 0] = bm[..., 3, 3] = True
    qn, kn, vn = q.clone(), k.clone(), v.clone()
    kn[:, 32:48] = vn[:, 32:48] = float("nan")
    qn[:, 16:32] = float("nan")
    leaves = [x.clone().requires_grad_() for x in (qn, kn, vn)]
    with flashtile.use_backend("triton"), poison_outputs():
        out = flashtile.block_sparse_attn_func(*leaves, bm, block_size=16)
        dq, dk, dv = torch.autograd.grad(out, leaves, do)
    clean = [x.clone().requires_grad_() for x in (q, k, v)]
    with flashtile.use_backend("triton"):
        want = flashtile.block_sparse_attn_func(*clean, bm, block_size=16)
        wq, wk, wv = torch.autograd.grad(want, clean, do)
    rest = lambda x, a, b: torch.cat([x[:, :a], x[:, b:]], dim=1)  # noqa: E731
    assert_close("out", out, want, atol=0)
    assert_close("dq outside the empty block row", rest(dq, 16, 32), rest(wq, 16, 32), atol=0)
    assert_close("dq of the empty block row", dq[:, 16:32], torch.zeros_like(dq[:, 16:32]), atol=0)
    for name, g, w in (("dk", dk, wk), ("dv", dv, wv)):
        assert_close(f"{name} of the unused block", g[:, 32:48], torch.zeros_like(g[:, 32:48]),
                     atol=0)
        assert_close(f"{name} elsewhere", rest(g, 32, 48), rest(w, 32, 48), atol=0)


def test_block_lists_hold_the_nonzero_blocks_full_ones_first():
    m = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.bool)[None, None]
    lists = block_lists(m)[0, 0]
    assert lists[:, 0].tolist() == [0, 0, 0], "no full blocks without a full matrix"
    assert lists[:, 1].tolist() == [3, 0, 1]
    assert lists[0, 2:5].tolist() == [0, 2, 3] and lists[2, 2].item() == 1
    full = torch.tensor([[0, 0, 1, 0], [1, 1, 1, 1], [0, 1, 0, 0]], dtype=torch.bool)
    lists = block_lists(m, full)[0, 0]
    assert lists[:, :2].tolist() == [[1, 2], [0, 0], [1, 0]]
    assert lists[0, 2:5].tolist() == [2, 0, 3], "full blocks first, then partial, each ascending"
    t = block_lists(m, full, transpose=True)[0, 0]
    assert t[:, :2].tolist() == [[0, 1], [1, 0], [1, 0], [0, 1]]
    assert t[:, 2].tolist() == [0, 2, 0, 0]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_full_blocks_match_the_element_mask(causal):
    """A block is 'full' iff all of its pairs exist and are visible, 'empty' iff none is."""
    from flashtile.backends.spec import AttnSpec
    from flashtile.backends.triton.sparse_index import full_blocks
    from flashtile.masks import visible_mask
    sq, sk, bs = 70, 90, 16
    for spec in (AttnSpec(1.0, -1, 0 if causal else -1), AttnSpec(1.0, 20, 5)):
        full, empty = full_blocks(-(-sq // bs), -(-sk // bs), bs, bs, sq, sk, spec, "cpu")
        vis = torch.zeros(-(-sq // bs) * bs, -(-sk // bs) * bs, dtype=torch.bool)
        vis[:sq, :sk] = visible_mask(sq, sk, spec.window_left, spec.window_right, spec.bottom_right)
        blocks = vis.view(full.shape[0], bs, full.shape[1], bs).permute(0, 2, 1, 3)
        assert torch.equal(full, blocks.all(-1).all(-1)), "full blocks"
        assert torch.equal(empty, ~blocks.any(-1).any(-1)), "empty blocks"


def test_layout_builders():
    rows = lambda m: [[int(x) for x in r] for r in m[0, 0].tolist()]  # noqa: E731
    assert rows(flashtile.local_block_mask(64, 64, 16, 1)) == [
        [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]
    assert rows(flashtile.local_block_mask(64, 48, (16, 16), 1, causal=True)) == [
        [1, 0, 0], [1, 1, 0], [0, 1, 1], [0, 0, 1]]
    assert rows(flashtile.strided_block_mask(64, 64, 16, 2)) == [
        [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1]]
    assert rows(flashtile.strided_block_mask(48, 48, 16, 2, causal=True)) == [
        [1, 0, 0], [0, 1, 0], [1, 0, 1]]
    assert rows(flashtile.global_block_mask(48, 64, 16, 1)) == [
        [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]]
    bf = flashtile.butterfly_block_mask(128, 128, 16)[0, 0]
    assert bf.shape == (8, 8) and torch.equal(bf, bf.T)
    assert bf.sum(dim=1).tolist() == [4] * 8  # itself + log2(8) partners
    assert rows(flashtile.butterfly_block_mask(64, 64, 16)) == [
        [1, 1, 1, 0], [1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]]
    # ragged sizes: ceil(Sq / bm) x ceil(Sk / bn) blocks
    assert flashtile.local_block_mask(33, 17, (16, 32)).shape == (1, 1, 3, 1)


def test_block_mask_from_dense_is_any_and_roundtrips():
    gen = torch.Generator().manual_seed(1)
    dense = torch.zeros(2, 3, 40, 50, dtype=torch.bool)
    dense[0, 1, 5, 33] = True  # block (0, 2) with 16 x 16 blocks
    dense[1, 2, 39, 49] = True  # last, partial block (2, 3)
    bm = flashtile.block_mask_from_dense(dense, 16)
    assert bm.shape == (2, 3, 3, 4)
    assert bm.sum().item() == 2 and bm[0, 1, 0, 2] and bm[1, 2, 2, 3]
    blocks = torch.rand(1, 2, 3, 4, generator=gen) > 0.5
    again = flashtile.block_mask_from_dense(flashtile.expand_block_mask(blocks, 16, 40, 50), 16)
    assert torch.equal(again, blocks)
    # a 2-D mask gives a (1, 1, R, C) block mask that covers it
    m2 = torch.rand(40, 50, generator=gen) > 0.97
    cover = flashtile.expand_block_mask(flashtile.block_mask_from_dense(m2, (16, 32)), (16, 32),
                                        40, 50)[0, 0]
    assert (cover | ~m2).all()


def _bad_case(kind):
    q = torch.randn(2, 40, 4, 16)
    ok = torch.ones(2, 4, 3, 3, dtype=torch.bool)
    return {
        "mask-not-tensor": (q, [[True]], 16, TypeError, "block_mask"),
        "mask-dtype": (q, ok.int(), 16, TypeError, "block_mask"),
        "mask-rank": (q, ok[0], 16, ValueError, "block_mask"),
        "mask-blocks": (q, torch.ones(2, 4, 3, 2, dtype=torch.bool), 16, ValueError, "block_mask"),
        "mask-batch": (q, torch.ones(3, 4, 3, 3, dtype=torch.bool), 16, ValueError, "block_mask"),
        "mask-heads": (q, torch.ones(1, 2, 3, 3, dtype=torch.bool), 16, ValueError, "block_mask"),
        "mask-device": (q, ok.to("meta"), 16, ValueError, "block_mask"),
        "size-not-16": (q, ok, (24, 16), ValueError, "block_size"),
        "size-zero": (q, ok, 0, ValueError, "block_size"),
        "size-type": (q, ok, (16.0, 16), TypeError, "block_size"),
        "size-triple": (q, ok, (16, 16, 16), TypeError, "block_size"),
    }[kind]


@pytest.mark.parametrize("kind", ["mask-not-tensor", "mask-dtype", "mask-rank", "mask-blocks",
                                  "mask-batch", "mask-heads", "mask-device", "size-not-16",
                                  "size-zero", "size-type", "size-triple"])
def test_bad_input_rejected_before_any_kernel(kind, monkeypatch):
    monkeypatch.setattr(backends, "get", lambda name: pytest.fail("a backend was reached"))
    q, mask, bs, exc, needle = _bad_case(kind)
    with pytest.raises(exc, match=needle):
        flashtile.block_sparse_attn_func(q, q, q, mask, block_size=bs)


def test_block_lists_follow_in_place_mask_changes():
    """The lists built for a mask are reused while the mask is unchanged, and rebuilt after an
    in-place change (same tensor object, new version)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (randn(1, 64, 2, 16, dtype=torch.float32, gen=gen) for _ in range(3))
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    with flashtile.use_backend("triton"):
        first = flashtile.block_sparse_attn_func(q, k, v, mask, block_size=(16, 16))
        again = flashtile.block_sparse_attn_func(q, k, v, mask, block_size=(16, 16))
        mask[..., 1:, 0] = False  # in place: only the first query block still sees key block 0
        changed = flashtile.block_sparse_attn_func(q, k, v, mask, block_size=(16, 16))
        fresh = flashtile.block_sparse_attn_func(q, k, v, mask.clone(), block_size=(16, 16))
    assert_close("same mask, same output", again, first, atol=0)
    assert_close("after the in-place change", changed, fresh, atol=0)
    assert not torch.equal(changed[:, 16:], first[:, 16:]), "the change must matter"


def test_block_sparse_under_inference_mode_equals_no_grad():
    """Under ``torch.inference_mode`` (inference tensors have no version counter, so their
    block lists are not cached) a block-sparse call gives the ``torch.no_grad`` output, call
    after call."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (randn(1, 64, 2, 16, dtype=torch.float32, gen=gen) for _ in range(3))
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 2:, 0] = False
    with flashtile.use_backend("triton"):
        with torch.no_grad():
            want = flashtile.block_sparse_attn_func(q, k, v, mask, block_size=(16, 16))
        with torch.inference_mode():
            frozen = [x.clone() for x in (q, k, v, mask)]
            got = [flashtile.block_sparse_attn_func(*frozen, block_size=(16, 16))
                   for _ in range(2)]
    for out in got:
        assert_close("inference mode vs no_grad", out, want, atol=0)
