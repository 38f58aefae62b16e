"""The float64 references: paper algorithms vs naive, naive vs torch (SDPA and autograd), and the
IO model (the bytes of ``flashtile.reference.algorithms``) against hand counts and the paper's
formulas."""
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


# ----------------------------------------------------------------------------------------------
# The IO model (bytes moved)
# ----------------------------------------------------------------------------------------------

# n=4 queries and keys, d=2, one head, 2-byte elements, 2x2 tiles: one (4, 2) tensor is 16
# bytes, one float32 row statistic (4,) is 16 bytes, one tile of 4 key rows is 16 bytes.
SMALL = alg.Problem(n=4, d=2, heads=1, batch=1, dtype_bytes=2)


@pytest.mark.parametrize("causal, kv_tile_bytes", [(False, 2 * 2 * 16), (True, 2 * 16 + 2 * 8)],
                         ids=["dense", "causal"])
def test_forward_counts_match_hand_count(causal, kv_tile_bytes):
    # dense: 2 query tiles each load all 4 rows of K and V; causal: query tile 0 loads key
    # tile 0 (2 rows), query tile 1 both key tiles (4 rows)
    p = alg.Problem(n=4, d=2, causal=causal)
    (fwd,) = alg.flashtile_forward(p, 2, 2)
    assert fwd.tile_read == 16 + kv_tile_bytes  # Q once + K, V per query tile
    assert fwd.tile_write == 16 + 16  # O, LSE
    assert (fwd.dram_read, fwd.dram_write) == (48, 32)  # Q, K, V once; O, LSE


def test_backward_counts_match_hand_count():
    dq, dkdv = alg.flashtile_backward(SMALL, dkdv=(2, 2), dq=(2, 2), fused_delta=True)
    assert dq.kernel == "dq" and dkdv.kernel == "dkdv"
    # dQ: Q, dO, O, LSE once; K and V (16 bytes each) for each of 2 query tiles
    assert dq.tile_read == 4 * 16 + 2 * 2 * 16
    assert dq.tile_write == 16 + 16  # dQ, delta
    assert dq.dram_read == 4 * 16 + 2 * 16
    # dK/dV: K, V once; for each of 2 key tiles all of Q, dO, LSE, delta
    assert dkdv.tile_read == 2 * 16 + 2 * 4 * 16
    assert dkdv.tile_write == 2 * 16
    assert dkdv.dram_read == 6 * 16


def test_fused_backward_counts_match_hand_count():
    """The one-kernel backward on SMALL (16 bytes a tensor, 32 bytes of float32 accumulator,
    two key tiles that each see all 4 query rows)."""
    delta, bwd, dq = alg.flashtile_backward_fused(SMALL, 2, 2)
    assert [k.kernel for k in (delta, bwd, dq)] == ["delta", "bwd", "dq"]
    assert (delta.tile_read, delta.tile_write) == (2 * 16, 16 + 32)  # O, dO; delta, zeroes
    # K, V once; per key tile all of Q, dO, LSE and delta
    assert bwd.tile_read == 2 * 16 + 2 * (16 + 16 + 16 + 16)
    # dK, dV; per key tile a reduction of 4 rows x 2 float32 of dq
    assert bwd.tile_write == 2 * 16 + 2 * 4 * 2 * 4
    assert (bwd.dram_read, bwd.dram_write) == (6 * 16 + 32, 2 * 16 + 32)
    assert (dq.tile_read, dq.tile_write) == (32, 16)


def test_compulsory_matches_hand_count():
    assert alg.compulsory(SMALL, "fwd") == 3 * 16 + 16 + 16  # read Q K V, write O LSE
    assert alg.compulsory(SMALL, "bwd") == 5 * 16 + 16 + 3 * 16  # read Q K V O dO LSE, write dQ dK dV
    assert alg.compulsory(SMALL) == 80 + 144


def test_compulsory_of_figure2_shape():
    p = alg.figure2_problem()
    t = 64 * 1024 * 16 * 64 * 2  # one bf16 (B, N, H, d) tensor
    lse = 64 * 16 * 1024 * 4
    assert alg.compulsory(p) == (4 * t + lse) + (8 * t + lse)


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_tile_bytes_fall_as_tiles_grow_and_dram_bytes_do_not(causal):
    p = alg.Problem(n=1024, d=64, heads=4, batch=2, causal=causal)
    fwd = [alg.flashtile_forward(p, bm, 64)[0] for bm in (16, 32, 64, 128, 256)]
    assert all(a.tile > b.tile for a, b in zip(fwd, fwd[1:]))
    assert len({k.dram for k in fwd}) == 1
    dkdv = [alg.flashtile_backward(p, (64, bn), (64, 64))[1] for bn in (16, 32, 64, 128, 256)]
    assert all(a.tile > b.tile for a, b in zip(dkdv, dkdv[1:]))
    dq = [alg.flashtile_backward(p, (64, 64), (bm, 64))[0] for bm in (16, 32, 64, 128, 256)]
    assert all(a.tile > b.tile for a, b in zip(dq, dq[1:]))


def test_forward_tile_bytes_are_theorem2_term():
    # dense, tiles dividing n: Q + O + LSE + 2 T_r n d e, T_r = n / B_r
    p = alg.Problem(n=2048, d=128, heads=3, batch=2)
    for bm in (32, 64, 128):
        (fwd,) = alg.flashtile_forward(p, bm, 64)
        tr = 2048 // bm
        assert fwd.tile == 2 * p.q_bytes() + p.stat_bytes() + 2 * tr * p.kv_bytes()


def test_standard_count_matches_formula():
    for p in (SMALL, alg.Problem(n=512, d=64, heads=2, batch=3, n_k=256),
              alg.figure2_problem()):
        bh, n, nk, d, e = p.batch * p.heads, p.n, p.nk, p.d, p.dtype_bytes
        for s in (2, 4):
            assert alg.standard_forward(p, s) == bh * (2 * n * d * e + 2 * nk * d * e + 4 * n * nk * s)
            # dO three times, O, dQ, Q once (query-sized); V, K, dK, dV once (key-sized);
            # 7 score matrices; D written and read
            assert alg.standard_backward(p, s) == bh * (
                6 * n * d * e + 4 * nk * d * e + 7 * n * nk * s + 2 * n * 4)
    assert alg.standard(SMALL, "fwd") == 2 * 16 + 2 * 16 + 4 * 32


def test_fused_delta_saves_one_read_of_do_and_the_row_statistics():
    p = alg.figure2_problem()
    cfg = dict(dkdv=(64, 64), dq=(128, 64))
    old = alg.total(alg.flashtile_backward(p, fused_delta=False, **cfg))
    new = alg.total(alg.flashtile_backward(p, fused_delta=True, **cfg))
    assert old - new == p.q_bytes() + 3 * p.stat_bytes()
    assert [k.kernel for k in alg.flashtile_backward(p, fused_delta=False, **cfg)] == ["pre", "dkdv", "dq"]


def test_backward_with_l2_reuse_reads_the_dkdv_inputs_once():
    """Chunked so that the dK/dV kernel finds in L2 what the dQ kernel of its chunk read, the
    backward's HBM bytes drop by the dK/dV kernel's reads: Q, dO, K, V, LSE and delta."""
    p = alg.figure2_problem()
    cfg = dict(dkdv=(64, 64), dq=(128, 64))
    two = alg.flashtile_backward(p, **cfg)
    reuse = alg.flashtile_backward(p, l2_reuse=True, **cfg)
    assert [k.kernel for k in reuse] == ["dq", "dkdv"] and reuse[0] == two[0]
    assert reuse[1].dram_read == 0 and reuse[1].dram_write == two[1].dram_write
    saved = alg.total(two) - alg.total(reuse)
    assert saved == 2 * p.kv_bytes() + 2 * p.q_bytes() + 2 * p.stat_bytes()
    fwd = alg.flashtile_forward(p, 128, 64)
    assert alg.total(fwd + reuse) / alg.compulsory(p) < 1.05


def test_two_kernel_backward_floor_is_above_1_25x_at_figure2_shape():
    # The dQ kernel re-reads Q, dO, K, V, which the dK/dV kernel also reads: 4 extra tensors.
    p = alg.figure2_problem()
    k = alg.flashtile_kernels(p, (64, 64), (64, 64), (128, 64))
    ratio = alg.total(k["fwd"] + k["bwd"]) / alg.compulsory(p)
    # Q, dO, K, V read twice; delta written and read; LSE read by both kernels
    extra = 2 * p.q_bytes() + 2 * p.kv_bytes() + 3 * p.stat_bytes()
    assert alg.total(k["fwd"] + k["bwd"]) == alg.compulsory(p) + extra
    assert 1.33 < ratio < 1.35


def test_cache_model_falls_back_to_tile_bytes_when_reread_set_does_not_fit():
    p = alg.Problem(n=8192, d=128, heads=8, batch=2)  # K and V of one head: 4 MB
    ks = alg.flashtile_forward(p, 128, 64)
    assert alg.dram_bytes(p, ks, cache_bytes=2**20) == ks[0].tile
    assert alg.dram_bytes(p, ks, cache_bytes=10**12) == ks[0].dram


def test_paper_forward_is_theta_n2_d2_over_m():
    assert alg.sram_tiles(100 * 1024, 64) == (64, 200)  # B_r = min(ceil(M / 4d), d), B_c
    br, bc = 64, 256
    p1, p2 = alg.Problem(n=4096, d=64), alg.Problem(n=8192, d=64)
    # doubling N doubles T_c and the rows per pass: 4x, less the Theta(N d) reads of K and V
    assert 3.9 < alg.paper_forward(p2, br, bc) / alg.paper_forward(p1, br, bc) < 4.0
    costs = [alg.paper_forward(p1, br, c) for c in (64, 128, 256, 512)]
    assert all(a > b for a, b in zip(costs, costs[1:]))
