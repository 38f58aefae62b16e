"""The float64 references: paper algorithms vs naive, naive vs torch (SDPA and autograd)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flashtile.reference import algorithms as alg
from flashtile.reference import naive

from helpers import as_f64, assert_close, make_gen, math_attention, randn

TIGHT = dict(atol=1e-12, rtol=1e-10)


def _head(seed, sq, sk, d, dv=None):
    g = make_gen(seed)
    dv = d if dv is None else dv
    q = randn(g, sq, d, dtype=torch.float64).numpy()
    k = randn(g, sk, d, dtype=torch.float64).numpy()
    v = randn(g, sk, dv, dtype=torch.float64).numpy()
    do = randn(g, sq, dv, dtype=torch.float64).numpy()
    return q, k, v, do


def _naive_head(q, k, v, causal, do=None, keep=None, p=0.0, scale=None):
    """naive on one head through the (B, S, H, D) layout."""
    kw = dict(window_right=0 if causal else -1, softmax_scale=scale,
              dropout_mask=None if keep is None else keep[None, None], dropout_p=p)
    o, lse = naive.attention(q[None, :, None], k[None, :, None], v[None, :, None], **kw)
    if do is None:
        return o[0, :, 0], lse[0, 0]
    grads = naive.attention_backward(do[None, :, None], q[None, :, None], k[None, :, None],
                                     v[None, :, None], **kw)
    return o[0, :, 0], lse[0, 0], [x[0, :, 0] for x in grads]


SHAPES = [(33, 33), (17, 45), (45, 17), (1, 9), (64, 64)]
BLOCKS = [(1, 1), (4, 7), (16, 16), (64, 32)]


def _shape_id(s):
    return f"sq{s[0]}-sk{s[1]}"


def _block_id(b):
    return f"br{b[0]}-bc{b[1]}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("blocks", BLOCKS, ids=_block_id)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_forward_algorithms_match_naive(shape, blocks, causal):
    sq, sk = shape
    q, k, v, _ = _head(sq * 100 + sk, sq, sk, 8)
    want_o, want_lse = _naive_head(q, k, v, causal)

    o1, l1, m1 = alg.flash_attention_forward_v1(q, k, v, block_r=blocks[0], block_c=blocks[1],
                                                causal=causal)
    assert_close("alg1 out", o1, want_o, **TIGHT)
    with np.errstate(divide="ignore"):
        assert_close("alg1 m + log l", m1 + np.log(l1), want_lse, **TIGHT)

    o2, lse2 = alg.flash_attention_forward_v2(q, k, v, block_m=blocks[0], block_n=blocks[1],
                                              causal=causal)
    assert_close("fa2 out", o2, want_o, **TIGHT)
    assert_close("fa2 lse", lse2, want_lse, **TIGHT)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("blocks", [(4, 7), (16, 16)], ids=_block_id)
@pytest.mark.parametrize("shape", [(33, 33), (17, 45), (45, 17)], ids=_shape_id)
def test_dropout_forward_algorithm_matches_naive(shape, blocks, causal):
    sq, sk = shape
    q, k, v, _ = _head(7 + sq, sq, sk, 8)
    p = 0.3
    keep = torch.rand(sq, sk, generator=make_gen(sk)).numpy() >= p
    want_o, want_lse = _naive_head(q, k, v, causal, keep=keep, p=p)
    o, l, m = alg.flash_attention_forward_v1_dropout(q, k, v, keep, p, block_r=blocks[0],
                                                     block_c=blocks[1], causal=causal)
    assert_close("alg2 out", o, want_o, **TIGHT)
    with np.errstate(divide="ignore"):
        assert_close("alg2 m + log l", m + np.log(l), want_lse, **TIGHT)


@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("stats", ["lse", "m-l"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("blocks", [(1, 1), (4, 7), (16, 16)], ids=_block_id)
@pytest.mark.parametrize("shape", [(33, 33), (17, 45), (45, 17)], ids=_shape_id)
def test_backward_algorithm_matches_naive(shape, blocks, causal, stats, dropout):
    sq, sk = shape
    q, k, v, do = _head(3 * sq + sk, sq, sk, 8)
    p = 0.25 if dropout else 0.0
    keep = torch.rand(sq, sk, generator=make_gen(sq)).numpy() >= p if dropout else None
    out, lse, want = _naive_head(q, k, v, causal, do=do, keep=keep, p=p)
    if stats == "lse":
        saved = dict(lse=lse)
    else:
        _, l, m = alg.flash_attention_forward_v1_dropout(q, k, v, keep, p, block_r=blocks[0],
                                                         block_c=blocks[1], causal=causal)
        saved = dict(m=m, l=l)
    got = alg.flash_attention_backward(do, q, k, v, out, block_r=blocks[0], block_c=blocks[1],
                                       causal=causal, keep=keep, dropout_p=p, **saved)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(f"alg4 {name}", g, w, **TIGHT)


def test_algorithms_rows_that_see_nothing():
    # causal, bottom-right, with more queries than keys: the first sq - sk rows see no key
    sq, sk = 20, 7
    q, k, v, do = _head(11, sq, sk, 4)
    with np.errstate(invalid="raise", over="raise"):
        o1, l1, _ = alg.flash_attention_forward_v1(q, k, v, block_r=4, block_c=3, causal=True)
        o2, lse2 = alg.flash_attention_forward_v2(q, k, v, block_m=4, block_n=3, causal=True)
        dq, dk, dv = alg.flash_attention_backward(do, q, k, v, o2, lse=lse2, block_r=4,
                                                  block_c=3, causal=True)
    empty = slice(0, sq - sk)
    assert_close("alg1 out of empty rows", o1[empty], np.zeros((sq - sk, 4)), 0, 0)
    assert_close("fa2 out of empty rows", o2[empty], np.zeros((sq - sk, 4)), 0, 0)
    assert_close("alg1 l of empty rows", l1[empty], np.zeros(sq - sk), 0, 0)
    assert_close("fa2 lse of empty rows", lse2[empty], np.full(sq - sk, -np.inf), 0, 0)
    assert_close("alg4 dq of empty rows", dq[empty], np.zeros((sq - sk, 4)), 0, 0)
    assert np.isfinite(dk).all() and np.isfinite(dv).all()


# ---------------------------------------------------------------------------------------
# naive vs torch


def _dense_inputs(seed, B, sq, sk, H, Hk, D):
    g = make_gen(seed)
    q = randn(g, B, sq, H, D, dtype=torch.float64)
    k = randn(g, B, sk, Hk, D, dtype=torch.float64)
    v = randn(g, B, sk, Hk, D, dtype=torch.float64)
    do = randn(g, B, sq, H, D, dtype=torch.float64)
    return g, q, k, v, do


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_naive_matches_sdpa(causal):
    _, q, k, v, _ = _dense_inputs(5, 2, 29, 29, 3, 3, 16)
    out, lse = naive.attention(q, k, v, window_right=0 if causal else -1)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=causal).transpose(1, 2)
    assert_close("naive out vs sdpa", out, ref, **TIGHT)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(16)
    if causal:
        s = s.masked_fill(torch.ones(29, 29, dtype=torch.bool).triu(1), float("-inf"))
    assert_close("naive lse", lse, torch.logsumexp(s, dim=-1), **TIGHT)


def _alibi(g, kind, B, H):
    if kind == "h":
        return torch.rand(H, generator=g, dtype=torch.float64)
    if kind == "bh":
        return torch.rand(B, H, generator=g, dtype=torch.float64)
    return None


# (id, B, Sq, Sk, H, Hk, D, kwargs)
AUTOGRAD_CASES = [
    ("plain", 2, 13, 13, 2, 2, 8, {}),
    ("causal-sq<sk", 1, 9, 21, 2, 2, 8, dict(window_right=0)),
    ("causal-sq>sk-empty-rows", 1, 21, 9, 2, 1, 8, dict(window_right=0)),
    ("causal-top-left", 1, 21, 9, 2, 2, 8, dict(window_right=0, bottom_right=False)),
    ("window", 2, 17, 23, 2, 2, 4, dict(window_left=3, window_right=2)),
    ("window-left-only", 1, 17, 17, 2, 2, 4, dict(window_left=4)),
    ("softcap", 2, 11, 15, 2, 2, 8, dict(softcap=1.5)),
    ("alibi-h", 2, 11, 15, 4, 2, 8, dict(alibi="h", window_right=0)),
    ("alibi-bh", 2, 11, 15, 4, 4, 8, dict(alibi="bh")),
    ("gqa-4", 1, 12, 12, 8, 2, 8, dict(softcap=3.0, window_left=5)),
    ("bias-full", 2, 10, 14, 2, 2, 8, dict(bias=(2, 2, 10, 14))),
    ("bias-per-head-key", 2, 10, 14, 2, 2, 8, dict(bias=(2, 1, 14))),
    ("bias-shared", 2, 10, 14, 2, 1, 8, dict(bias=(1, 1, 10, 14), window_right=0)),
    ("dropout", 2, 10, 14, 2, 2, 8, dict(dropout=0.2)),
    ("everything", 2, 19, 12, 4, 2, 8, dict(window_left=6, window_right=1, softcap=2.0,
                                            alibi="bh", bias=(4, 19, 12), dropout=0.1)),
]


@pytest.mark.parametrize("case", AUTOGRAD_CASES, ids=[c[0] for c in AUTOGRAD_CASES])
def test_naive_forward_and_backward_match_autograd(case):
    _, B, sq, sk, H, Hk, D, opts = case
    opts = dict(opts)
    g, q, k, v, do = _dense_inputs(len(case[0]) * 31 + sq, B, sq, sk, H, Hk, D)
    alibi = _alibi(g, opts.pop("alibi", None), B, H)
    bias_shape = opts.pop("bias", None)
    bias = None if bias_shape is None else randn(g, *bias_shape, dtype=torch.float64)
    p = opts.pop("dropout", 0.0)
    keep = None if not p else torch.rand(B, H, sq, sk, generator=g) >= p
    kw = dict(opts, alibi_slopes=alibi, dropout_mask=keep, dropout_p=p, softmax_scale=0.4)

    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    ba = None if bias is None else bias.clone().requires_grad_()
    out_t, lse_t = math_attention(qa, ka, va, attn_bias=ba, **kw)
    out_t.backward(do)

    out, lse = naive.attention(q, k, v, attn_bias=bias, **kw)
    grads = naive.attention_backward(do, q, k, v, attn_bias=bias, **kw)
    assert_close("out", out, out_t, **TIGHT)
    assert_close("lse", lse, lse_t, **TIGHT)
    names = ("dq", "dk", "dv") + (("dbias",) if bias is not None else ())
    wants = (qa.grad, ka.grad, va.grad) + ((ba.grad,) if bias is not None else ())
    assert len(grads) == len(names)
    for name, got, want in zip(names, grads, wants):
        assert_close(name, got, want, **TIGHT)


@pytest.mark.parametrize("bias_shape", [(4, 4, 9, 9), (4, 1, 9)],
                         ids=["bias-per-sequence", "bias-per-head-key-shared"])
def test_naive_varlen_matches_per_sequence(bias_shape):
    g = make_gen(99)
    lens_q, lens_k = [5, 0, 9, 3], [7, 4, 9, 0]
    H, Hk, D = 4, 2, 8
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = randn(g, cu_q[-1], H, D, dtype=torch.float64)
    k = randn(g, cu_k[-1], Hk, D, dtype=torch.float64)
    v = randn(g, cu_k[-1], Hk, D, dtype=torch.float64)
    do = randn(g, cu_q[-1], H, D, dtype=torch.float64)
    slopes = torch.rand(4, H, generator=g, dtype=torch.float64)
    bias = randn(g, *bias_shape, dtype=torch.float64)
    kw = dict(window_right=0, softcap=2.0)
    out, lse = naive.attention(q, k, v, alibi_slopes=slopes, attn_bias=bias,
                               cu_seqlens_q=torch.from_numpy(cu_q), cu_seqlens_k=cu_k, **kw)
    dq, dk, dv, dbias = naive.attention_backward(do, q, k, v, alibi_slopes=slopes,
                                                 attn_bias=bias, cu_seqlens_q=cu_q,
                                                 cu_seqlens_k=cu_k, **kw)
    assert out.shape == (cu_q[-1], H, D) and lse.shape == (H, cu_q[-1])
    bias4 = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    want_dbias = np.zeros(tuple(bias4.shape))
    for b in range(4):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        rows = q1 - q0 if bias4.shape[2] > 1 else 1
        bb = b if bias4.shape[0] > 1 else 0
        bias_b = bias4[bb:bb + 1, :, :rows, :k1 - k0]
        args = (q[None, q0:q1], k[None, k0:k1], v[None, k0:k1])
        kb = dict(kw, alibi_slopes=slopes[b:b + 1], attn_bias=bias_b)
        o_b, lse_b = naive.attention(*args, **kb)
        dq_b, dk_b, dv_b, db_b = naive.attention_backward(do[None, q0:q1], *args, **kb)
        assert_close(f"seq{b} out", out[q0:q1], o_b[0], **TIGHT)
        assert_close(f"seq{b} lse", lse[:, q0:q1], lse_b[0], **TIGHT)
        assert_close(f"seq{b} dq", dq[q0:q1], dq_b[0], **TIGHT)
        assert_close(f"seq{b} dk", dk[k0:k1], dk_b[0], **TIGHT)
        assert_close(f"seq{b} dv", dv[k0:k1], dv_b[0], **TIGHT)
        want_dbias[bb:bb + 1, :, :rows, :k1 - k0] += db_b
    assert_close("dbias", dbias, want_dbias.reshape(bias_shape), **TIGHT)


def test_naive_rows_that_see_nothing_are_zero_not_nan():
    _, q, k, v, do = _dense_inputs(3, 1, 12, 5, 2, 2, 4)
    kw = dict(window_left=0, window_right=0)  # bottom-right diagonal only: rows 0..6 see nothing
    with np.errstate(invalid="raise", over="raise", divide="raise"):
        out, lse = naive.attention(q, k, v, **kw)
        dq, dk, dv = naive.attention_backward(do, q, k, v, **kw)
    assert_close("out of empty rows", out[:, :7], np.zeros((1, 7, 2, 4)), 0, 0)
    assert_close("lse of empty rows", lse[:, :, :7], np.full((1, 2, 7), -np.inf), 0, 0)
    assert_close("dq of empty rows", dq[:, :7], np.zeros((1, 7, 2, 4)), 0, 0)
    assert np.isfinite(as_f64(lse[:, :, 7:])).all()
    assert np.isfinite(dk).all() and np.isfinite(dv).all()


@pytest.mark.parametrize("sq,sk", [(0, 5), (5, 0), (0, 0)], ids=["sq0", "sk0", "both0"])
def test_naive_empty_sequences(sq, sk):
    _, q, k, v, do = _dense_inputs(1, 2, sq, sk, 2, 1, 4)
    out, lse = naive.attention(q, k, v)
    dq, dk, dv = naive.attention_backward(do, q, k, v)
    assert out.shape == (2, sq, 2, 4) and lse.shape == (2, 2, sq)
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert np.all(dq == 0) and np.all(dk == 0) and np.all(dv == 0)
