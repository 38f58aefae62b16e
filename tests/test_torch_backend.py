"""The torch backend against the float64 reference: the tiled engine, and the calls it hands to
PyTorch's fused CPU kernel (``aten_route``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashtile.backends.torch import attention as torch_tiled
from flashtile.backends.spec import AttnSpec
from flashtile.reference import naive

from helpers import (as_f64, assert_close, assert_flash_rule, make_gen,
                               math_attention, naive_kwargs, randn)

FP32_RTOL = 1e-5


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 queries x 16 keys, so that short test sequences still span many tiles."""
    monkeypatch.setattr(torch_tiled, "BLOCK_N_MAX", 16)
    monkeypatch.setattr(torch_tiled, "BLOCK_N_MIN", 16)
    monkeypatch.setattr(torch_tiled, "BLOCK_M_MAX", 8)
    monkeypatch.setattr(torch_tiled, "BLOCK_M_MIN", 8)


@pytest.fixture(params=["tiled", "auto"])
def engine(request, monkeypatch):
    """``tiled``: every call runs the tiled engine; ``auto``: calls PyTorch's fused kernel
    computes exactly go to it (the backend's default)."""
    monkeypatch.setattr(torch_tiled, "USE_ATEN", request.param == "auto")
    return request.param


def _fp32_tol(want):
    """``~1e-5`` relative, measured against the quantity's own scale."""
    w = as_f64(want)
    finite = w[np.isfinite(w)]
    scale = float(np.abs(finite).max()) if finite.size else 1.0
    return dict(atol=FP32_RTOL * max(scale, 1.0), rtol=FP32_RTOL)


def _inputs(seed, B, sq, sk, H, Hk, D, dtype=torch.float32, alibi=None):
    g = make_gen(seed)
    q = randn(g, B, sq, H, D, dtype=dtype)
    k = randn(g, B, sk, Hk, D, dtype=dtype)
    v = randn(g, B, sk, Hk, D, dtype=dtype)
    do = randn(g, B, sq, H, D, dtype=dtype)
    slopes = None
    if alibi == "h":
        slopes = torch.rand(H, generator=g) * 0.5
    elif alibi == "bh":
        slopes = torch.rand(B, H, generator=g) * 0.5
    return q, k, v, do, slopes


def _run(q, k, v, do, spec, slopes, **kw):
    out, lse = torch_tiled.forward(q, k, v, spec, alibi_slopes=slopes, **kw)
    grads = torch_tiled.backward(do, q, k, v, out, lse, spec, alibi_slopes=slopes, **kw)
    return out, lse, grads


def _reference(q, k, v, do, spec, slopes, **kw):
    nkw = naive_kwargs(spec, alibi_slopes=slopes, **kw)
    out, lse = naive.attention(q, k, v, **nkw)
    return out, lse, naive.attention_backward(do, q, k, v, **nkw)


# (id, B, Sq, Sk, H, Hk, D, spec fields, alibi)
CASES = [
    ("plain", 2, 37, 37, 2, 2, 16, {}, None),
    ("sq<sk-odd", 1, 19, 53, 2, 2, 8, {}, None),
    ("sq>sk-odd", 2, 53, 19, 2, 2, 8, {}, None),
    ("causal", 2, 45, 45, 2, 2, 16, dict(window_right=0), None),
    ("causal-sq<sk", 1, 23, 61, 3, 3, 8, dict(window_right=0), None),
    ("causal-sq>sk", 1, 61, 23, 2, 1, 8, dict(window_right=0), None),
    ("causal-top-left", 1, 61, 23, 2, 2, 8, dict(window_right=0, bottom_right=False), None),
    ("window", 2, 50, 50, 2, 2, 8, dict(window_left=7, window_right=3), None),
    ("window-left-only", 1, 50, 64, 2, 2, 8, dict(window_left=9), None),
    ("window-right-only", 1, 50, 40, 2, 2, 8, dict(window_right=5), None),
    ("window-top-left", 1, 33, 47, 2, 2, 8, dict(window_left=4, window_right=11,
                                                bottom_right=False), None),
    ("softcap", 2, 40, 33, 2, 2, 16, dict(softcap=2.0), None),
    ("softcap-causal", 1, 40, 40, 2, 2, 16, dict(softcap=0.7, window_right=0), None),
    ("alibi-h", 2, 35, 41, 4, 4, 8, {}, "h"),
    ("alibi-bh-causal", 2, 41, 35, 4, 2, 8, dict(window_right=0), "bh"),
    ("gqa-2", 2, 30, 30, 4, 2, 8, {}, None),
    ("gqa-4-causal", 1, 30, 45, 8, 2, 8, dict(window_right=0), None),
    ("mqa-window-softcap-alibi", 2, 30, 45, 4, 1, 8,
     dict(window_left=5, window_right=2, softcap=1.5), "bh"),
    ("headdim-1", 1, 21, 21, 2, 2, 1, dict(window_right=0), None),
    ("headdim-3", 1, 21, 21, 2, 2, 3, {}, None),
    ("headdim-256", 1, 20, 24, 2, 1, 256, dict(window_right=0), None),
    ("single-query", 2, 1, 40, 2, 2, 8, dict(window_right=0), None),
    ("single-key", 2, 40, 1, 2, 2, 8, {}, None),
]


def _case_id(c):
    return c[0]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp32_matches_reference(case, engine, small_tiles):
    name, B, sq, sk, H, Hk, D, fields, alibi = case
    q, k, v, do, slopes = _inputs(len(name) + 7 * sq + sk, B, sq, sk, H, Hk, D, alibi=alibi)
    spec = AttnSpec(softmax_scale=D ** -0.5, **fields)
    out, lse, (dq, dk, dv) = _run(q, k, v, do, spec, slopes)
    want_out, want_lse, (want_dq, want_dk, want_dv) = _reference(q, k, v, do, spec, slopes)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert lse.shape == (B, H, sq)
    for n, got, want in (("out", out, want_out), ("lse", lse, want_lse), ("dq", dq, want_dq),
                         ("dk", dk, want_dk), ("dv", dv, want_dv)):
        assert_close(n, got, want, **_fp32_tol(want))


@pytest.mark.parametrize("fields", [{}, dict(window_right=0), dict(window_left=100,
                                                                   window_right=40)],
                         ids=["full", "causal", "window"])
def test_fp32_default_tiles(fields, engine):
    # sequences longer than one default tile, with the module's own tile sizes
    B, sq, sk, H, Hk, D = 1, 300, 520, 2, 1, 32
    q, k, v, do, _ = _inputs(sq + len(fields), B, sq, sk, H, Hk, D)
    spec = AttnSpec(softmax_scale=0.2, **fields)
    out, lse, grads = _run(q, k, v, do, spec, None)
    want_out, want_lse, want_grads = _reference(q, k, v, do, spec, None)
    assert_close("out", out, want_out, **_fp32_tol(want_out))
    assert_close("lse", lse, want_lse, **_fp32_tol(want_lse))
    for n, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_close(n, got, want, **_fp32_tol(want))


LOW_CASES = [c for c in CASES if c[0] in {
    "plain", "causal", "causal-top-left", "gqa-2", "causal-sq>sk", "window", "softcap-causal", "alibi-bh-causal",
    "mqa-window-softcap-alibi", "headdim-256"}]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", LOW_CASES, ids=_case_id)
def test_low_precision_accuracy_rule(case, dtype, engine, small_tiles):
    name, B, sq, sk, H, Hk, D, fields, alibi = case
    q, k, v, do, slopes = _inputs(len(name) + sq, B, sq, sk, H, Hk, D, dtype=dtype,
                                  alibi=alibi)
    spec = AttnSpec(softmax_scale=D ** -0.5, **fields)
    out, lse, (dq, dk, dv) = _run(q, k, v, do, spec, slopes)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert dq.dtype == dtype and dk.dtype == dtype and dv.dtype == dtype
    # float64 truth on exactly the same (rounded) inputs
    want_out, want_lse, (want_dq, want_dk, want_dv) = _reference(q, k, v, do, spec, slopes)

    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    base_out, _ = math_attention(qa, ka, va, **naive_kwargs(spec, alibi_slopes=slopes))
    base_out.backward(do)
    assert_flash_rule("out", out, want_out, base_out, 2.0)
    assert_flash_rule("dq", dq, want_dq, qa.grad, 3.0)
    assert_flash_rule("dk", dk, want_dk, ka.grad, 3.0)
    assert_flash_rule("dv", dv, want_dv, va.grad, 3.0)
    # lse is computed in float32 from the rounded inputs, so it is held to float32 accuracy
    assert_close("lse", lse, want_lse, atol=1e-4, rtol=1e-5)


def _cu(lens):
    return torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32)


VARLEN_CASES = [
    ("plain", [5, 17, 1, 30], [5, 17, 1, 30], {}, None),
    ("causal-uneven", [7, 20, 0, 33], [12, 9, 6, 33], dict(window_right=0), "bh"),
    ("window-gqa-softcap", [25, 3, 40], [25, 30, 2], dict(window_left=4, window_right=6,
                                                         softcap=2.5), "h"),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=_case_id)
def test_varlen_matches_dense_per_sequence(case, small_tiles):
    name, lens_q, lens_k, fields, alibi = case
    H, Hk, D = 4, 2, 16
    g = make_gen(len(name))
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q, k, v = randn(g, tq, H, D), randn(g, tk, Hk, D), randn(g, tk, Hk, D)
    do = randn(g, tq, H, D)
    nseq = len(lens_q)
    slopes = {"h": torch.rand(H, generator=g), "bh": torch.rand(nseq, H, generator=g),
              None: None}[alibi]
    spec = AttnSpec(softmax_scale=0.3, **fields)
    vk = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
              max_seqlen_k=max(lens_k))
    out, lse, (dq, dk, dv) = _run(q, k, v, do, spec, slopes, **vk)
    assert out.shape == q.shape and lse.shape == (H, tq)
    want_out, want_lse, want = _reference(q, k, v, do, spec, slopes, cu_seqlens_q=cu_q,
                                          cu_seqlens_k=cu_k)
    assert_close("varlen out", out, want_out, **_fp32_tol(want_out))
    assert_close("varlen lse", lse, want_lse, **_fp32_tol(want_lse))
    for n, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert_close(f"varlen {n}", got, w, **_fp32_tol(w))
    for b in range(nseq):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        sb = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b:b + 1])
        o_b, lse_b, (dq_b, dk_b, dv_b) = _run(q[None, q0:q1], k[None, k0:k1],
                                              v[None, k0:k1], do[None, q0:q1], spec, sb)
        tol = dict(atol=1e-6, rtol=1e-6)
        assert_close(f"seq{b} out", out[q0:q1], o_b[0], **tol)
        assert_close(f"seq{b} lse", lse[:, q0:q1], lse_b[0], **tol)
        assert_close(f"seq{b} dq", dq[q0:q1], dq_b[0], **tol)
        assert_close(f"seq{b} dk", dk[k0:k1], dk_b[0], **tol)
        assert_close(f"seq{b} dv", dv[k0:k1], dv_b[0], **tol)


@pytest.mark.parametrize("sq,sk", [(0, 9), (9, 0), (0, 0)], ids=["sq0", "sk0", "both0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_empty_sequences(sq, sk, dtype, engine):
    q, k, v, do, _ = _inputs(3, 2, sq, sk, 4, 2, 8, dtype=dtype)
    spec = AttnSpec(softmax_scale=0.35, window_right=0)
    out, lse, (dq, dk, dv) = _run(q, k, v, do, spec, None)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, 4, sq) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert_close("out", out, torch.zeros(out.shape), 0, 0)
    assert_close("lse", lse, torch.full(lse.shape, float("-inf")), 0, 0)
    for n, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert_close(n, g, torch.zeros(g.shape), 0, 0)


MASKED_ROWS = [
    # bottom-right causal with more queries than keys: the first sq - sk rows see nothing
    ("causal-sq>sk", 40, 13, dict(window_right=0), None),
    # a one-key band on the bottom-right diagonal
    ("diagonal-band", 40, 13, dict(window_left=0, window_right=0), None),
    # the same with softcap and ALiBi, whose extra terms must not leak into empty rows
    ("band-softcap-alibi", 40, 21, dict(window_left=3, window_right=1, softcap=1.0), "bh"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", MASKED_ROWS, ids=_case_id)
def test_rows_that_see_nothing(case, dtype, small_tiles):
    name, sq, sk, fields, alibi = case
    q, k, v, do, slopes = _inputs(sq + sk, 2, sq, sk, 4, 2, 8, dtype=dtype, alibi=alibi)
    spec = AttnSpec(softmax_scale=0.35, **fields)
    out, lse, (dq, dk, dv) = _run(q, k, v, do, spec, slopes)
    want_out, want_lse, (want_dq, want_dk, want_dv) = _reference(q, k, v, do, spec, slopes)
    for n, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{n}: NaN"
    empty = torch.from_numpy(np.isneginf(want_lse))  # (B, H, Sq)
    assert empty.any(), "the case should have rows that see no key"
    assert torch.equal(torch.isneginf(lse), empty), "lse must be -inf exactly on empty rows"
    rows_out = out.permute(0, 2, 1, 3)[empty]  # (n_empty, D)
    rows_dq = dq.permute(0, 2, 1, 3)[empty]
    assert_close("out of empty rows", rows_out, torch.zeros(rows_out.shape), 0, 0)
    assert_close("dq of empty rows", rows_dq, torch.zeros(rows_dq.shape), 0, 0)
    if dtype == torch.float32:
        # empty rows must add nothing to dK/dV either
        assert_close("dk", dk, want_dk, **_fp32_tol(want_dk))
        assert_close("dv", dv, want_dv, **_fp32_tol(want_dv))


def test_non_contiguous_inputs(engine, small_tiles):
    g = make_gen(12)
    # (B, H, S, D) storage seen through a transpose, as an SDPA-layout caller would pass it
    q = randn(g, 2, 4, 33, 16).transpose(1, 2)
    k = randn(g, 2, 2, 40, 16).transpose(1, 2)
    v = randn(g, 2, 2, 40, 16).transpose(1, 2)
    do = randn(g, 2, 4, 33, 16).transpose(1, 2)
    spec = AttnSpec(softmax_scale=0.25, window_right=0)
    out, lse, grads = _run(q, k, v, do, spec, None)
    want_out, want_lse, want_grads = _reference(q, k, v, do, spec, None)
    assert_close("out", out, want_out, **_fp32_tol(want_out))
    assert_close("lse", lse, want_lse, **_fp32_tol(want_lse))
    for n, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_close(n, got, want, **_fp32_tol(want))
    # the saved out/lse handed back with other strides give the same gradients
    out_nc = out.transpose(1, 2).contiguous().transpose(1, 2)
    lse_nc = lse.transpose(1, 2).contiguous().transpose(1, 2)
    grads_nc = torch_tiled.backward(do, q, k, v, out_nc, lse_nc, spec)
    for n, got, want in zip(("dq", "dk", "dv"), grads_nc, grads):
        assert_close(f"{n} from strided out/lse", got, want, 0, 0)


def test_dropout_needs_a_seed():
    q, k, v, do, _ = _inputs(0, 1, 8, 8, 2, 2, 8)
    spec = AttnSpec(softmax_scale=0.35, dropout_p=0.1)
    with pytest.raises(ValueError, match="rng_seed"):
        torch_tiled.forward(q, k, v, spec)
    out = torch.zeros_like(q)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="rng_seed"):
        torch_tiled.backward(do, q, k, v, out, lse, spec)


def test_rejects_bad_head_ratio():
    q, k, v, _, _ = _inputs(0, 1, 8, 8, 3, 2, 8)
    with pytest.raises(ValueError, match="multiple"):
        torch_tiled.forward(q, k, v, AttnSpec(softmax_scale=0.3))


# ---------------------------------------------------------------------------------------
# routing to PyTorch's fused CPU kernel


class _OpLog(TorchDispatchMode):
    """Names of the ATen ops a block runs (as the dispatcher sees them from Python)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


_FUSED = "_scaled_dot_product_flash_attention_for_cpu"


def _bool_mask(B, H, sq, sk, empty_rows=True):
    """A random bool mask (True = visible); with ``empty_rows``, row 3 hides every key and
    row 2 sees only keys after itself (empty under top-left causal masking)."""
    g = make_gen(B * 100 + H * 10 + sq + sk)
    m = torch.rand(B, H, sq, sk, generator=g) > 0.3
    if empty_rows:
        m[..., 3, :] = False
        m[..., 2, :] = False
        m[..., 2, 5:] = True
    return m

# (id, Sq, Sk, H, Hk, spec fields, extra forward kwargs, expected is_causal or None)
ROUTES = [
    ("full", 33, 47, 4, 4, {}, {}, False),
    ("full-gqa", 33, 47, 4, 2, {}, {}, False),
    ("causal-square", 40, 40, 4, 1, dict(window_right=0), {}, True),
    ("causal-top-left-sq<sk", 20, 47, 2, 2, dict(window_right=0, bottom_right=False), {}, True),
    ("causal-top-left-sq>sk", 47, 20, 2, 2, dict(window_right=0, bottom_right=False), {},
     True),
    ("causal-bottom-right-sq<sk", 20, 47, 2, 2, dict(window_right=0), {}, None),
    ("causal-bottom-right-sq>sk", 47, 20, 2, 2, dict(window_right=0), {}, None),
    ("window", 40, 40, 2, 2, dict(window_left=8, window_right=0), {}, None),
    ("right-window", 40, 40, 2, 2, dict(window_right=3), {}, None),
    ("softcap", 40, 40, 2, 2, dict(softcap=3.0), {}, None),
    ("dropout", 40, 40, 2, 2, dict(dropout_p=0.1), {}, None),
    ("alibi", 40, 40, 2, 2, {}, dict(alibi_slopes=torch.ones(2)), None),
    ("float-bias", 40, 40, 2, 2, {}, dict(attn_bias=torch.zeros(1, 1, 40, 40)), None),
    ("bool-mask-empty-rows", 40, 33, 4, 2, {}, dict(attn_bias=_bool_mask(2, 4, 40, 33)), False),
    ("bool-mask-keys-only", 40, 33, 4, 4, {},
     dict(attn_bias=_bool_mask(2, 1, 1, 33, empty_rows=False)), False),
    ("bool-mask-causal-top-left", 40, 33, 4, 2, dict(window_right=0, bottom_right=False),
     dict(attn_bias=_bool_mask(1, 4, 40, 33)), True),
    ("bool-mask-window", 40, 40, 2, 2, dict(window_left=5, window_right=0),
     dict(attn_bias=_bool_mask(1, 2, 40, 40)), None),
    ("empty-keys", 40, 0, 2, 2, {}, {}, None),
]


@pytest.mark.parametrize("case", ROUTES, ids=_case_id)
def test_routes_exactly_the_calls_the_fused_kernel_computes(case):
    name, sq, sk, H, Hk, fields, kw, want = case
    q, k, v, _, _ = _inputs(1, 2, sq, sk, H, Hk, 16)
    spec = AttnSpec(softmax_scale=0.25, **fields)
    got = torch_tiled.aten_route(q, k, v, spec, alibi_slopes=kw.get("alibi_slopes"),
                                 attn_bias=kw.get("attn_bias"))
    assert got is want, f"{name}: aten_route gave {got}, expected {want}"
    for dtype in (torch.float16, torch.bfloat16):
        low = [x.to(dtype) for x in (q, k, v)]
        assert torch_tiled.aten_route(*low, spec, alibi_slopes=kw.get("alibi_slopes"),
                                      attn_bias=kw.get("attn_bias")) is want
    # float64 and mixed dtypes stay on the tiled engine
    assert torch_tiled.aten_route(q.double(), k.double(), v.double(), spec) is None
    assert torch_tiled.aten_route(q, k.half(), v.half(), spec) is None
    # varlen and paged calls too
    assert torch_tiled.aten_route(q, k, v, spec, varlen=True) is None


ROUTED = [c for c in ROUTES if c[-1] is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", ROUTED, ids=_case_id)
def test_routed_equals_tiled_equals_reference(case, dtype, monkeypatch, small_tiles):
    """A routed call runs the fused kernel once per pass and no tiled op, and agrees with the
    tiled engine and with float64 (flash-attn's rule in fp16/bf16)."""
    name, sq, sk, H, Hk, fields, kw, _ = case
    B = kw["attn_bias"].shape[0] if "attn_bias" in kw else 2
    q, k, v, do, _ = _inputs(len(name) + sq, B, sq, sk, H, Hk, 16, dtype=dtype)
    spec = AttnSpec(softmax_scale=0.25, **fields)
    with _OpLog() as log:
        out, lse, grads = _run(q, k, v, do, spec, None, **kw)
    assert log.names.count(_FUSED) == 1 and log.names.count(_FUSED + "_backward") == 1
    assert not {"bmm", "baddbmm", "exp2"} & set(log.names), "the tiled engine ran"
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (B, H, sq)
    # nothing is copied: out in q's layout, lse a view of the kernel's (B, Sq, H) buffer, the
    # gradients in the kernel's flash-layout buffers
    assert out.stride() == q.stride() and lse.transpose(1, 2).is_contiguous()
    assert all(g.dtype == dtype and g.is_contiguous() for g in grads)
    if "attn_bias" not in kw:  # (a bool mask is turned into the kernel's additive one)
        assert not {"clone", "copy_", "_to_copy", "contiguous"} & set(log.names)
    monkeypatch.setattr(torch_tiled, "USE_ATEN", False)
    t_out, t_lse, t_grads = _run(q, k, v, do, spec, None, **kw)
    # the references take additive biases: a bool mask becomes 0 / -inf
    add_kw = {n: torch.zeros(m.shape).masked_fill(~m, float("-inf")) for n, m in kw.items()}
    want_out, want_lse, want_grads = _reference(q, k, v, do, spec, None, **add_kw)
    want_grads = tuple(want_grads[:3])
    empty = torch.from_numpy(np.isneginf(want_lse))  # (B, H, Sq): rows that see no key
    assert torch.equal(torch.isneginf(lse), empty), "lse must be -inf exactly on empty rows"
    if "empty-rows" in name or "causal" in name and "attn_bias" in kw:
        assert empty.any(), "the case should have rows that see no key"
    rows = out.permute(0, 2, 1, 3)[empty]
    assert_close("out of empty rows", rows, torch.zeros(rows.shape), 0, 0)
    names = ("out", "dq", "dk", "dv")
    if dtype == torch.float32:
        for n, got, tiled, want in zip(names, (out,) + grads, (t_out,) + t_grads,
                                       (want_out,) + want_grads):
            assert_close(f"routed {n} vs float64", got, want, **_fp32_tol(want))
            assert_close(f"routed {n} vs tiled", got, tiled, **_fp32_tol(want))
    else:
        qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
        base_out, _ = math_attention(qa, ka, va, **naive_kwargs(spec, **add_kw))
        base_out.backward(do)
        for n, got, tiled, want, base, f in zip(
                names, (out,) + grads, (t_out,) + t_grads, (want_out,) + want_grads,
                (base_out, qa.grad, ka.grad, va.grad), (2.0, 3.0, 3.0, 3.0)):
            assert_flash_rule(f"routed {n}", got, want, base, f)
            assert_flash_rule(f"tiled {n}", tiled, want, base, f)
    assert_close("routed lse vs float64", lse, want_lse, atol=1e-4, rtol=1e-5)
    assert_close("routed lse vs tiled", lse, t_lse, atol=1e-4, rtol=1e-5)


def test_mixed_paths_share_one_lse():
    """The forward of one engine and the backward of the other give the same gradients: both
    save the same natural-log lse (so a saved forward is valid whichever path runs later)."""
    q, k, v, do, _ = _inputs(5, 1, 64, 64, 4, 2, 32)
    spec = AttnSpec(softmax_scale=0.2, window_right=0)
    out, lse = torch_tiled.forward(q, k, v, spec)  # routed
    routed = torch_tiled.backward(do, q, k, v, out, lse, spec)
    torch_tiled.USE_ATEN = False
    try:
        t_out, t_lse = torch_tiled.forward(q, k, v, spec)
        tiled_bwd = torch_tiled.backward(do, q, k, v, out, lse, spec)
    finally:
        torch_tiled.USE_ATEN = True
    routed_bwd = torch_tiled.backward(do, q, k, v, t_out, t_lse, spec)
    tol = dict(atol=1e-5, rtol=1e-5)
    assert_close("lse", t_lse, lse, **tol)
    for n, a, b, c in zip(("dq", "dk", "dv"), routed, tiled_bwd, routed_bwd):
        assert_close(f"{n}: tiled backward of the routed forward", b, a, **tol)
        assert_close(f"{n}: routed backward of the tiled forward", c, a, **tol)


@pytest.mark.parametrize("api", ["sdpa", "flash_attn_func"])
def test_public_functions_route(api):
    """The public functions reach the fused kernel through the backend registry."""
    import flashtile
    g = make_gen(9)
    x = [randn(g, 2, 4, 48, 16).requires_grad_() for _ in range(3)]
    with flashtile.use_backend("torch"), _OpLog() as log:
        if api == "sdpa":
            out = flashtile.scaled_dot_product_attention(*x, is_causal=True)
        else:
            out = flashtile.flash_attn_func(*(t.transpose(1, 2) for t in x), causal=True)
        out.sum().backward()
    assert log.names.count(_FUSED) == 1 and log.names.count(_FUSED + "_backward") == 1


def test_tiled_engine_op_count_is_coarse():
    """One causal fwd+bwd at N=1024 (B1 H8 d64) in the tiled engine stays a few hundred ATen
    ops (tiles of all heads, sized by a memory budget; 128-key tiles issued ~1,100)."""
    q, k, v, do, _ = _inputs(2, 1, 1024, 1024, 8, 8, 64)
    spec = AttnSpec(softmax_scale=0.125, window_right=0)
    torch_tiled.USE_ATEN = False
    try:
        with _OpLog() as log:
            _run(q, k, v, do, spec, None)
    finally:
        torch_tiled.USE_ATEN = True
    assert len(log.names) <= 300, f"{len(log.names)} ATen ops"


@pytest.mark.parametrize("case", ROUTES, ids=_case_id)
def test_heads_first_routes_as_the_flash_layout(case):
    """The same decision for the same call in SDPA's ``(B, H, S, D)`` layout."""
    name, sq, sk, H, Hk, fields, kw, want = case
    q, k, v, _, _ = _inputs(3, 2, sq, sk, H, Hk, 16)
    spec = AttnSpec(softmax_scale=0.25, **fields)
    got = torch_tiled.aten_route(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec,
                                 alibi_slopes=kw.get("alibi_slopes"),
                                 attn_bias=kw.get("attn_bias"), heads_first=True)
    assert got is want, f"{name}: aten_route gave {got}, expected {want}"


HEADS_FIRST_CASES = [c for c in CASES if c[0] in ("causal", "gqa-2", "causal-sq<sk", "window",
                                                   "alibi-bh-causal", "softcap")]


@pytest.mark.parametrize("case", HEADS_FIRST_CASES, ids=_case_id)
def test_heads_first_equals_flash_layout(case, engine, small_tiles):
    """``heads_first=True`` on ``(B, H, S, D)`` views gives bitwise the results of the flash
    layout, through the fused kernel and through the tiled engine (views there and back)."""
    name, B, sq, sk, H, Hk, D, fields, alibi = case
    q, k, v, do, slopes = _inputs(len(name), B, sq, sk, H, Hk, D, alibi=alibi)
    spec = AttnSpec(softmax_scale=0.3, **fields)
    out, lse, grads = _run(q, k, v, do, spec, slopes)
    hf = [x.transpose(1, 2) for x in (q, k, v, do)]
    h_out, h_lse = torch_tiled.forward(*hf[:3], spec, alibi_slopes=slopes, heads_first=True)
    h_grads = torch_tiled.backward(hf[3], *hf[:3], h_out, h_lse, spec, alibi_slopes=slopes,
                                   heads_first=True)
    assert h_out.shape == hf[0].shape and h_lse.shape == lse.shape
    assert_close("out", h_out.transpose(1, 2), out, 0, 0)
    assert_close("lse", h_lse, lse, 0, 0)
    for n, got, want in zip(("dq", "dk", "dv"), h_grads, grads):
        assert_close(n, got.transpose(1, 2), want, 0, 0)


# ---------------------------------------------------------------------------------------
# the public functions on the routed path: ATen ops issued, and every routing decision

# One causal fwd+bwd of flashtile.scaled_dot_product_attention issues exactly the ATen ops of
# torch's own F.scaled_dot_product_attention: the kernel, the detach of the saved output
# (forward and backward) and the backward kernel.  flash_attn_func adds the 12 transposes its
# (B, S, H, D) layout needs to reach the kernel's (B, H, S, D) views (5 in, 1 out, 3 + 3).
SDPA_OPS = [_FUSED, "detach", "detach", _FUSED + "_backward"]
FLASH_ATTN_FUNC_OPS = 16
_COPIES = {"clone", "copy_", "_to_copy", "contiguous", "empty_like", "new_empty", "empty",
           "empty_strided", "zeros", "zeros_like"}


def _sdpa_qkv(seed, layout, B, H, Hk, L, S, D, dtype=torch.float32):
    """SDPA-layout ``(B, H, L, D)`` tensors: contiguous (``bhsd``), or ``(B, L, H, D)``
    memory seen through a transpose (``bshd``: a projection's output reshaped, as in
    transformers' attention layers)."""
    g = make_gen(seed)

    def make(h, n):
        if layout == "bhsd":
            return randn(g, B, h, n, D, dtype=dtype)
        return randn(g, B, n, h, D, dtype=dtype).transpose(1, 2)
    return make(H, L), make(Hk, S), make(Hk, S), make(H, L)


def _logged_fwd_bwd(fn, xs, do):
    """``(out, grads, op names)`` of one forward+backward of ``fn(*xs)`` (do made outside)."""
    xs = [x.detach().requires_grad_() for x in xs]
    with _OpLog() as log:
        out = fn(*xs)
        grads = torch.autograd.grad(out, xs, do)
    return out, grads, log.names


SDPA_ROUTED = [  # (id, H, Hk, L, S, kwargs)
    ("causal", 4, 4, 40, 40, dict(is_causal=True)),
    ("full-scale", 4, 4, 33, 47, dict(scale=0.3)),
    ("gqa-causal", 8, 2, 40, 40, dict(is_causal=True, enable_gqa=True)),
    ("causal-L<S", 2, 2, 20, 47, dict(is_causal=True)),
]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", SDPA_ROUTED, ids=lambda c: c[0])
def test_sdpa_issues_torch_sdpas_ops_and_results(case, dtype, layout):
    """flashtile's SDPA on the routed path issues exactly torch SDPA's ATen ops (4 a
    fwd+bwd, no copy, no layout change) and returns bitwise its output and gradients, in the
    same strides."""
    import flashtile
    import torch.nn.functional as F
    name, H, Hk, L, S, kw = case
    q, k, v, do = _sdpa_qkv(len(name), layout, 2, H, Hk, L, S, 16, dtype)
    with flashtile.use_backend("torch"):
        out, grads, ops = _logged_fwd_bwd(
            lambda *x: flashtile.scaled_dot_product_attention(*x, **kw), (q, k, v), do)
    want_out, want_grads, want_ops = _logged_fwd_bwd(
        lambda *x: F.scaled_dot_product_attention(*x, **kw), (q, k, v), do)
    assert want_ops == SDPA_OPS, f"torch's SDPA issued {want_ops}"
    assert ops == want_ops, f"flashtile issued {ops}"
    assert out.stride() == want_out.stride()
    assert_close("out vs torch SDPA", out, want_out, 0, 0)
    for n, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        assert got.stride() == want.stride(), n
        assert_close(f"{n} vs torch SDPA", got, want, 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flash_attn_func_routed_ops(dtype):
    """flash_attn_func on the routed path: the two kernels, the saved output's two detaches
    and views only (the transposes between its layout and the kernel's), nothing copied."""
    import flashtile
    g = make_gen(21)
    q, do = randn(g, 2, 40, 8, 16, dtype=dtype), randn(g, 2, 40, 8, 16, dtype=dtype)
    k, v = randn(g, 2, 40, 2, 16, dtype=dtype), randn(g, 2, 40, 2, 16, dtype=dtype)
    with flashtile.use_backend("torch"):
        out, grads, ops = _logged_fwd_bwd(
            lambda *x: flashtile.flash_attn_func(*x, causal=True), (q, k, v), do)
    assert len(ops) <= FLASH_ATTN_FUNC_OPS, ops
    assert ops.count(_FUSED) == 1 and ops.count(_FUSED + "_backward") == 1
    assert set(ops) == {_FUSED, _FUSED + "_backward", "detach", "transpose"}, ops
    assert out.is_contiguous() and all(x.is_contiguous() for x in grads)
    with flashtile.use_backend("torch"):
        torch_tiled.USE_ATEN = False
        try:
            t_out, t_grads, _ = _logged_fwd_bwd(
                lambda *x: flashtile.flash_attn_func(*x, causal=True), (q, k, v), do)
        finally:
            torch_tiled.USE_ATEN = True
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for n, got, want in zip(("out", "dq", "dk", "dv"), (out,) + grads, (t_out,) + t_grads):
        assert_close(f"routed {n} vs tiled", got, want, **tol)


def _sdpa_call(**kw):
    import flashtile
    return lambda q, k, v: flashtile.scaled_dot_product_attention(q, k, v, **kw)


def _flash_call(**kw):
    import flashtile
    return lambda q, k, v: flashtile.flash_attn_func(q, k, v, **kw)


def _varlen_call(q, k, v):
    import flashtile
    B, L, H, D = q.shape
    cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int32)
    S = k.shape[1]
    cuk = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
    out = flashtile.flash_attn_varlen_func(q.reshape(B * L, H, D), k.reshape(B * S, -1, D),
                                           v.reshape(B * S, -1, D), cu, cuk, L, S, causal=True)
    return out.view(B, L, H, D)


def _qkvpacked_call(q, k, v):
    import flashtile
    return flashtile.flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), causal=True)


_MASK = torch.rand(1, 4, 24, 24, generator=make_gen(5)) > 0.4
_MASK[..., 0] = True  # every row sees a key

# (id, function of (q, k, v), layout of the inputs, (H, Hk, L, S), routed?, torch's SDPA
# arguments giving the same result or None); flash-layout inputs are (B, L|S, H|Hk, D)
DECISIONS = [
    ("sdpa-causal", _sdpa_call(is_causal=True), "sdpa", (4, 4, 24, 24), True,
     dict(is_causal=True)),
    ("sdpa-full-scale", _sdpa_call(scale=0.2), "sdpa", (4, 4, 24, 30), True, dict(scale=0.2)),
    ("sdpa-gqa", _sdpa_call(enable_gqa=True), "sdpa", (4, 2, 24, 24), True,
     dict(enable_gqa=True)),
    ("sdpa-causal-L>S", _sdpa_call(is_causal=True), "sdpa", (2, 2, 30, 20), True,
     dict(is_causal=True)),
    ("sdpa-bool-mask", _sdpa_call(attn_mask=_MASK), "sdpa", (4, 4, 24, 24), True,
     dict(attn_mask=_MASK)),
    ("sdpa-float-mask", _sdpa_call(attn_mask=torch.where(_MASK, 0.5, -2.0)), "sdpa",
     (4, 4, 24, 24), False, dict(attn_mask=torch.where(_MASK, 0.5, -2.0))),
    ("sdpa-dropout", _sdpa_call(dropout_p=0.3), "sdpa", (4, 4, 24, 24), False, None),
    ("sdpa-3d", lambda q, k, v: _sdpa_call(is_causal=True)(q[0], k[0], v[0]), "sdpa",
     (4, 4, 24, 24), True, None),
    ("sdpa-broadcast-kv-batch", lambda q, k, v: _sdpa_call(is_causal=True)(q, k[:1], v[:1]),
     "sdpa", (4, 4, 24, 24), True, None),
    ("sdpa-strided-last-dim", lambda q, k, v: _sdpa_call(is_causal=True)(
        q, torch.stack([k, k], -1)[..., 0], v), "sdpa", (4, 4, 24, 24), True, None),
    ("flash-causal", _flash_call(causal=True), "flash", (4, 4, 24, 24), True, None),
    ("flash-full-gqa", _flash_call(), "flash", (4, 2, 24, 30), True, None),
    ("flash-causal-bottom-right", _flash_call(causal=True), "flash", (2, 2, 20, 30), False,
     None),
    ("flash-window", _flash_call(window_size=(5, 0)), "flash", (2, 2, 24, 24), False, None),
    ("flash-softcap", _flash_call(causal=True, softcap=3.0), "flash", (2, 2, 24, 24), False,
     None),
    ("flash-alibi", _flash_call(alibi_slopes=torch.tensor([0.5, 0.25])), "flash",
     (2, 2, 24, 24), False, None),
    ("flash-dropout", _flash_call(dropout_p=0.2), "flash", (2, 2, 24, 24), False, None),
    # varlen: each sequence of as many queries as keys takes the fused kernel (2 sequences)
    ("varlen-causal", _varlen_call, "flash", (2, 2, 24, 24), 2, None),
    ("varlen-causal-bottom-right", _varlen_call, "flash", (2, 2, 20, 30), False, None),
    ("qkvpacked-causal", _qkvpacked_call, "flash", (2, 2, 24, 24), True, None),
]


@pytest.mark.parametrize("case", DECISIONS, ids=lambda c: c[0])
def test_public_routing_decisions(case):
    """Each public call reaches the fused kernel (once a pass, a varlen call once a sequence; no
    tiled op) exactly when it computes that call; routed results equal the tiled engine's, and
    torch's SDPA where its arguments are the same."""
    import flashtile
    import torch.nn.functional as F
    name, fn, layout, (H, Hk, L, S), routed, torch_kw = case
    g = make_gen(len(name))
    shape = (lambda h, n: (2, h, n, 16)) if layout == "sdpa" else (lambda h, n: (2, n, h, 16))
    q, k, v, do = (randn(g, *shape(h, n)) for h, n in ((H, L), (Hk, S), (Hk, S), (H, L)))
    if name == "sdpa-3d":
        do = do[0]
    with flashtile.use_backend("torch"):
        torch.manual_seed(0)
        out, grads, ops = _logged_fwd_bwd(fn, (q, k, v), do)
    tiled_ops = {"bmm", "baddbmm", "exp2"} & set(ops)
    if routed:
        calls = 1 if routed is True else routed
        assert ops.count(_FUSED) == calls and ops.count(_FUSED + "_backward") == calls, ops
        assert not tiled_ops, f"the tiled engine ran: {tiled_ops}"
    else:
        assert _FUSED not in ops and _FUSED + "_backward" not in ops, ops
        assert tiled_ops, ops
    if "dropout" in name:
        return
    if routed:
        with flashtile.use_backend("torch"):
            torch_tiled.USE_ATEN = False
            try:
                t_out, t_grads, _ = _logged_fwd_bwd(fn, (q, k, v), do)
            finally:
                torch_tiled.USE_ATEN = True
        for n, got, want in zip(("out", "dq", "dk", "dv"), (out,) + grads, (t_out,) + t_grads):
            assert_close(f"routed {n} vs tiled", got, want, **_fp32_tol(want))
    if torch_kw is not None:
        w_out, w_grads, _ = _logged_fwd_bwd(
            lambda *x: F.scaled_dot_product_attention(*x, **torch_kw), (q, k, v), do)
        for n, got, want in zip(("out", "dq", "dk", "dv"), (out,) + grads, (w_out,) + w_grads):
            assert_close(f"{n} vs torch SDPA", got, want, **_fp32_tol(want))
