"""Dropout on both backends: the Philox keep mask (bit-exact between tl.rand, the kernels, the
torch backend and S_dmask), float64 references rebuilt from S_dmask, keep-rate statistics,
seed reproducibility and a bitwise-repeatable backward."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import triton
import triton.language as tl

import flashtile
from flashtile import backends
from flashtile.backends.torch import attention as torch_tiled
from flashtile.backends import triton as triton_backend
from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton.fastlaunch import poison_outputs
from flashtile.reference.torch_ref import reference
from flashtile.masks import attention_probs
from flashtile.rng import keep_mask, philox_uniform

from helpers import assert_close, check_flash_rule, next_seed, randn

BACKENDS = ["triton", "torch"]


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
CASES = [
    ("plain-fp16", 2, 24, 24, 2, 2, 16, torch.float16, {}),
    ("causal-gqa-sq<sk", 1, 20, 37, 4, 2, 16, torch.float32, {"causal": True}),
    ("sq>sk-causal-mqa", 1, 33, 18, 2, 1, 16, torch.float16, {"causal": True}),
    ("window-softcap-alibi", 2, 30, 30, 2, 1, 24, torch.float32,
     {"window_size": (6, 2), "softcap": 3.0, "alibi": True}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
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


BAD_P = [(-0.1, ValueError), (1.0, ValueError), (float("nan"), ValueError), ("0.1", TypeError),
         (True, TypeError)]


@pytest.mark.parametrize("p,exc", BAD_P, ids=["negative", "one", "nan", "str", "bool"])
@pytest.mark.parametrize("api", ["flash", "varlen", "sdpa", "block_sparse"])
def test_bad_dropout_p_rejected_before_any_kernel(api, p, exc, monkeypatch):
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
