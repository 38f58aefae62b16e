"""flash_attn_func / varlen / SDPA on both backends against float64 references.

The Triton kernels run under the interpreter (small shapes, fp16/fp32; the 3.6 interpreter
mis-reads bf16).  Every case checks out, lse and dq/dk/dv with flash-attn's rule, after
poisoning the kernels' output buffers with NaN.
"""
from __future__ import annotations

import itertools
import zlib
import math

import pytest
import torch

import flashtile
from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton.configs import KernelConfig, override
from flashtile.backends.triton.fastlaunch import poison_outputs
from flashtile.reference.torch_ref import reference, scores

from helpers import assert_close, check_flash_rule, randn

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
