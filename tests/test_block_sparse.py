"""Block-sparse attention (paper section 3.3): against the dense masked float64 reference on
both backends, zero blocks never loaded by the kernels, the layout builders, and bad input."""
from __future__ import annotations

import math

import pytest
import torch

import flashtile
from flashtile import backends
from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton.fastlaunch import poison_outputs
from flashtile.backends.triton.sparse_index import block_lists
from flashtile.reference.torch_ref import reference
from flashtile.rng import keep_mask

from helpers import assert_close, check_flash_rule, next_seed, randn

BACKENDS = ["triton", "torch"]


def _ref(spec, dense, keep=None):
    def ref(q, k, v, dtype):
        return reference(q, k, v, spec, None, dtype=dtype, attn_bias=dense, keep=keep)
    return ref


# (id, batch, sq, sk, nheads, nheads_k, d, block_size, mask batch/heads, kwargs)
CASES = [
    ("16x16-per-head", 2, 40, 40, 2, 2, 16, (16, 16), (1, 2), {}),
    ("32x16-causal-gqa", 1, 50, 50, 4, 2, 16, (32, 16), (1, 4), {"causal": True}),
    ("16x48-sq<sk-per-batch", 2, 21, 70, 2, 1, 16, (16, 48), (2, 1), {}),
    ("48x32-dropout-causal", 1, 60, 45, 2, 2, 16, (48, 32), (1, 1),
     {"causal": True, "dropout_p": 0.2}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
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
