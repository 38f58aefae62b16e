"""Variable-length batches: unpad_input / pad_input (flash-attn's bert_padding conventions) and
their use with the varlen function, and flash_attn_varlen_func with ``block_table`` (keys and
values in a paged pool).

Every paged case spreads the keys of each sequence over pages in random order inside a pool
whose spare pages are NaN, and whose unused block-table entries point far outside the pool
(reading either would show).  The paged call must give bitwise the same out / lse / dq as the
same call on the gathered contiguous keys, dk / dv equal to the contiguous ones at the slots the
keys occupy and 0 elsewhere, and pass flash-attn's float64 rule (out within 2x, gradients within
3x PyTorch's same-dtype error).  The Triton forward runs under the interpreter; its key tile is
pinned to be smaller than, equal to, or straddling the page size.
"""
from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch
import torch.nn.functional as F

import flashtile
from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton.configs import KernelConfig, override
from flashtile.backends.triton.fastlaunch import poison_outputs
from flashtile.reference.torch_ref import reference

from helpers import assert_close, check_flash_rule, randn


def _mask(lengths, seqlen):
    return torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]


def test_unpad_outputs():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    x = torch.arange(4 * 4 * 3, dtype=torch.float32).view(4, 4, 3)
    unpad, indices, cu, max_len, used = flashtile.unpad_input(x, mask)
    assert indices.tolist() == [0, 1, 2, 4, 5, 12, 13, 14, 15]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 5, 9]
    assert max_len == 4 and isinstance(max_len, int)
    assert used.dtype == torch.int32 and used.tolist() == [3, 2, 0, 4]
    assert_close("rows", unpad, x.view(16, 3)[indices], atol=0)


def test_pad_roundtrip_and_gradients():
    gen = torch.Generator().manual_seed(0)
    x = randn(3, 7, 2, 5, gen=gen).requires_grad_()
    mask = torch.rand(3, 7, generator=gen) > 0.4  # valid tokens need not be contiguous
    unpad, indices, cu, _, used = flashtile.unpad_input(x, mask)
    assert unpad.shape == (int(mask.sum()), 2, 5)
    back = flashtile.pad_input(unpad, indices, 3, 7)
    assert_close("kept", back[mask], x[mask], atol=0)
    assert_close("padded positions are zero", back[~mask], torch.zeros_like(back[~mask]), atol=0)
    g = torch.randn_like(back)
    (gx,) = torch.autograd.grad(back, x, g)
    assert_close("grad", gx, g * mask[..., None, None], atol=0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_varlen_on_unpadded_matches_padded_sdpa(backend):
    """unpad -> flash_attn_varlen_func -> pad equals SDPA with a key padding mask on the
    valid query rows."""
    gen = torch.Generator().manual_seed(1)
    lengths, seqlen, h, d = [9, 3, 14], 14, 2, 16
    mask = _mask(lengths, seqlen)
    q, k, v = (randn(3, seqlen, h, d, gen=gen) for _ in range(3))
    (qu, idx, cu, max_len, _), (ku, *_), (vu, *_) = (flashtile.unpad_input(x, mask)
                                                     for x in (q, k, v))
    with flashtile.use_backend(backend), poison_outputs():
        out = flashtile.flash_attn_varlen_func(qu, ku, vu, cu, cu, max_len, max_len, causal=True)
    out = flashtile.pad_input(out, idx, 3, seqlen)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    attn = mask[:, None, None, :] & torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    want = t(F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=attn))
    assert_close("valid rows", out[mask], want[mask], atol=2e-5, rtol=1e-5)
    assert_close("padded rows", out[~mask], torch.zeros_like(out[~mask]), atol=0)


@pytest.mark.parametrize("bad", ["mask-shape", "hidden-rank", "indices", "unused-shape"])
def test_bad_input(bad):
    x = torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match="attention_mask|hidden_states|indices|unused_mask"):
        if bad == "mask-shape":
            flashtile.unpad_input(x, torch.ones(2, 4))
        elif bad == "hidden-rank":
            flashtile.unpad_input(torch.randn(5), torch.ones(5))
        elif bad == "unused-shape":
            flashtile.unpad_input(x, torch.ones(2, 5), torch.ones(5, 2))
        else:
            flashtile.pad_input(torch.randn(3, 4), torch.arange(4), 2, 5)


# (id, indices, exception, message): pad_input's index checks name the argument
BAD_INDICES = [
    ("out-of-range", torch.tensor([0, 3, 10]), ValueError, r"indices must be in \[0, 10\).*got 10"),
    ("negative", torch.tensor([0, -1, 4]), ValueError, r"indices must be in \[0, 10\).*got -1"),
    ("float", torch.tensor([0.0, 1.0, 2.0]), TypeError, "indices must be int64"),
    ("2-d", torch.tensor([[0, 1, 2]]), ValueError, r"indices must have shape \(total,\)"),
    ("list", [0, 1, 2], TypeError, "indices must be an int64 torch.Tensor"),
]


@pytest.mark.parametrize("indices,exc,msg", [c[1:] for c in BAD_INDICES],
                         ids=[c[0] for c in BAD_INDICES])
def test_pad_input_checks_indices(indices, exc, msg):
    with pytest.raises(exc, match=msg):
        flashtile.pad_input(torch.randn(3, 4), indices, 2, 5)


def test_pad_input_accepts_int32_indices():
    x = torch.randn(3, 4)
    idx = torch.tensor([1, 4, 7])
    assert_close("int32 indices", flashtile.pad_input(x, idx.int(), 2, 5),
                 flashtile.pad_input(x, idx, 2, 5), atol=0)


def test_unpad_with_unused_mask():
    """flash-attn >= 2.6: slots in unused_mask are packed (and counted in cu_seqlens /
    max_seqlen) but not in seqused."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)
    x = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    unpad, indices, cu, max_len, used = flashtile.unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 6]
    assert max_len == 3 and used.dtype == torch.int32 and used.tolist() == [2, 1]
    assert_close("rows", unpad, x.view(8, 3)[indices], atol=0)
    plain = flashtile.unpad_input(x, mask)
    assert plain[1].tolist() == [0, 1, 4] and plain[2].tolist() == [0, 2, 3]


def test_index_helpers_and_gradients():
    gen = torch.Generator().manual_seed(7)
    x = randn(6, 2, 3, gen=gen).requires_grad_()
    idx = torch.tensor([4, 0, 4, 2])  # a repeated index sums its gradients
    got = flashtile.index_first_axis(x, idx)
    assert_close("index_first_axis", got, x.detach()[idx], atol=0)
    g = randn(4, 2, 3, gen=gen)
    (gx,) = torch.autograd.grad(got, x, g)
    want = torch.zeros(6, 2, 3).index_add(0, idx, g)
    assert_close("index_first_axis grad", gx, want, atol=0)

    vals = randn(3, 5, gen=gen).requires_grad_()
    put = flashtile.index_put_first_axis(vals, torch.tensor([5, 1, 3]), 7)
    want = torch.zeros(7, 5)
    want[[5, 1, 3]] = vals.detach()
    assert_close("index_put_first_axis", put, want, atol=0)
    gp = randn(7, 5, gen=gen)
    (gv,) = torch.autograd.grad(put, vals, gp)
    assert_close("index_put_first_axis grad", gv, gp[[5, 1, 3]], atol=0)

    out, residual = flashtile.index_first_axis_residual(x, torch.tensor([1, 3]))
    assert_close("residual output", residual, x.detach(), atol=0)
    g_out, g_res = randn(2, 2, 3, gen=gen), randn(6, 2, 3, gen=gen)
    (gx,) = torch.autograd.grad((out, residual), x, (g_out, g_res))
    assert_close("index_first_axis_residual grad", gx,
                 g_res.index_add(0, torch.tensor([1, 3]), g_out), atol=0)


def test_unpad_concatenated_sequences():
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    x = torch.arange(3 * 6, dtype=torch.float32).view(3, 6, 1)
    unpad, indices, cu, max_len = flashtile.unpad_input_for_concatenated_sequences(x, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 11, 12] and max_len == 6
    assert_close("rows", unpad, x.view(18, 1)[indices], atol=0)


# ----------------------------------------------------------------------------------------------
# Paged keys and values (block_table)
# ----------------------------------------------------------------------------------------------

BACKENDS = ["triton", "torch"]
DTYPES = [torch.float32, torch.float16]
DTYPE_IDS = ["fp32", "fp16"]
UNUSED = 1000  # added to num_blocks for block-table entries the call must never read


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def _cu(lens):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def _layout(lens_k, page, gen, shared_prefix_pages=0):
    """``(block_table, slots, num_blocks)``: the pages of every sequence drawn in random order
    from a pool with two spare pages.  ``slots[t]`` is the flat pool slot of packed key ``t``.
    With ``shared_prefix_pages``, every sequence reuses sequence 0's first pages."""
    need = [-(-n // page) for n in lens_k]
    own = [n - (shared_prefix_pages if b else 0) for b, n in enumerate(need)]
    num_blocks = sum(own) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(lens_k), max(need + [0]) + 1), num_blocks + UNUSED, dtype=torch.int32)
    for b, n in enumerate(need):
        pages = perm[:own[b]]
        del perm[:own[b]]
        if b:
            pages = table[0, :shared_prefix_pages].tolist() + pages
        table[b, :n] = torch.tensor(pages, dtype=torch.int32)
    slots = [int(table[b, j // page]) * page + j % page
             for b, n in enumerate(lens_k) for j in range(n)]
    return table, torch.tensor(slots, dtype=torch.int64), num_blocks


def _pool(x, slots, num_blocks, page):
    """Packed ``x (total_k, Hk, D)`` written into a NaN pool ``(num_blocks, page, Hk, D)``."""
    pool = torch.full((num_blocks * page, *x.shape[1:]), float("nan"), dtype=x.dtype)
    pool[slots] = x
    return pool.view(num_blocks, page, *x.shape[1:])


def _run(backend, q, k, v, do, cu_q, cu_k, lens_q, lens_k, kw, block_table=None, block_n=16):
    """``(out, lse, s_dmask, dq, dk, dv)`` of one varlen call with poisoned kernel outputs."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with flashtile.use_backend(backend), override(fwd=KernelConfig(16, block_n)), \
            poison_outputs():
        out, lse, probs = flashtile.flash_attn_varlen_func(
            *leaves, cu_q, cu_k, max(lens_q), max(lens_k), return_attn_probs=True,
            block_table=block_table, **kw)
        grads = torch.autograd.grad(out, leaves, do)
    return (out, lse, probs, *grads)


def _varlen_reference(cu_q, cu_k, spec, slopes):
    """float64-capable reference on packed q / k / v: one dense call per sequence."""
    bounds = list(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]))

    def ref(q, k, v, dtype):
        outs = []
        for b, (q0, q1, k0, k1) in enumerate(bounds):
            s = None if slopes is None else slopes[b:b + 1] if slopes.dim() == 2 else slopes
            outs.append(reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], spec, s,
                                  dtype=dtype)[0])
        return torch.cat(outs)

    return ref


# (id, page_size, fwd BLOCK_N, lens_q, lens_k, nheads, nheads_k, headdim, kwargs)
CASES = [
    # four 16-slot pages per 64-key tile; a sequence without keys and one without queries
    ("p16-bn64-causal-gqa", 16, 64, [5, 0, 17, 9], [40, 4, 17, 0], 4, 2, 16, {"causal": True}),
    # pages larger than the tile
    ("p32-bn16-window", 32, 16, [20, 7], [45, 70], 2, 2, 16, {"window_size": (7, 3)}),
    # 32-key tiles straddle 48-slot pages at offset 32; odd head dim
    ("p48-bn32-softcap-alibi-mqa", 48, 32, [30, 3], [100, 0], 3, 1, 24,
     {"softcap": 5.0, "alibi": "bh", "causal": True}),
    # page equal to the tile, more queries than keys, left window
    ("p16-bn16-sq>sk-window-left", 16, 16, [33, 12], [16, 31], 2, 1, 16,
     {"window_size": (5, -1)}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_paged_equals_contiguous_and_float64(case, dtype, backend):
    name, page, block_n, lens_q, lens_k, h, hk, d, kw = case
    gen = _gen(name, str(dtype))
    q = randn(sum(lens_q), h, d, dtype=dtype, gen=gen)
    k = randn(sum(lens_k), hk, d, dtype=dtype, gen=gen)
    v = randn(sum(lens_k), hk, d, dtype=dtype, gen=gen)
    do = randn(sum(lens_q), h, d, dtype=dtype, gen=gen)
    kw = dict(kw)
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = torch.rand(len(lens_q), h, generator=gen) * 0.5
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    table, slots, num_blocks = _layout(lens_k, page, gen)
    k_pool, v_pool = _pool(k, slots, num_blocks, page), _pool(v, slots, num_blocks, page)

    paged = _run(backend, q, k_pool, v_pool, do, cu_q, cu_k, lens_q, lens_k, kw, table, block_n)
    contig = _run(backend, q, k, v, do, cu_q, cu_k, lens_q, lens_k, kw, None, block_n)
    out, lse, probs, dq, dk_pool, dv_pool = paged
    assert dk_pool.shape == k_pool.shape and dv_pool.shape == v_pool.shape
    assert dk_pool.dtype == dtype and dv_pool.dtype == dtype
    for what, got, want in zip(("out", "lse", "S_dmask", "dq"), paged[:4], contig[:4]):
        assert torch.equal(got, want), f"{name}: {what} differs from the contiguous call"
    dk, dv = dk_pool.reshape(-1, hk, d)[slots], dv_pool.reshape(-1, hk, d)[slots]
    assert torch.equal(dk, contig[4]), f"{name}: dk differs from the contiguous call"
    assert torch.equal(dv, contig[5]), f"{name}: dv differs from the contiguous call"
    unused = torch.ones(num_blocks * page, dtype=torch.bool)
    unused[slots] = False
    for what, g in (("dk", dk_pool), ("dv", dv_pool)):
        rest = g.reshape(-1, hk, d)[unused]
        assert torch.equal(rest, torch.zeros_like(rest)), f"{name}: {what} of unused slots != 0"

    left, right = kw.get("window_size", (-1, -1))
    spec = AttnSpec(1 / math.sqrt(d), left, 0 if kw.get("causal") else right, True,
                    kw.get("softcap", 0.0))
    ref = _varlen_reference(cu_q, cu_k, spec, kw.get("alibi_slopes"))
    check_flash_rule(name, out, (dq, dk, dv), (q, k, v), do, ref, dtype,
                     grad_names=("dq", "dk", "dv"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_shared_pages_sum_their_gradients(dtype, backend):
    """Two sequences reading the same prefix pages: out as if each had its own copy, and the
    shared slots receive the sum of both sequences' gradients (deterministically)."""
    lens_q, lens_k, page, h, hk, d = [6, 9], [40, 37], 16, 2, 1, 16
    gen = _gen("shared", str(dtype))
    table, slots, num_blocks = _layout(lens_k, page, gen, shared_prefix_pages=2)
    # sequence 1's first 32 keys are sequence 0's: the packed keys repeat them
    k = randn(sum(lens_k), hk, d, dtype=dtype, gen=gen)
    v = randn(sum(lens_k), hk, d, dtype=dtype, gen=gen)
    k[40:72], v[40:72] = k[:32], v[:32]
    q = randn(sum(lens_q), h, d, dtype=dtype, gen=gen)
    do = randn(sum(lens_q), h, d, dtype=dtype, gen=gen)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    assert torch.equal(slots[40:72], slots[:32])
    k_pool, v_pool = _pool(k, slots, num_blocks, page), _pool(v, slots, num_blocks, page)

    paged = _run(backend, q, k_pool, v_pool, do, cu_q, cu_k, lens_q, lens_k, {}, table)
    again = _run(backend, q, k_pool, v_pool, do, cu_q, cu_k, lens_q, lens_k, {}, table)
    contig = _run(backend, q, k, v, do, cu_q, cu_k, lens_q, lens_k, {})
    for what, got, want in zip(("out", "dq"), (paged[0], paged[3]), (contig[0], contig[3])):
        assert torch.equal(got, want), f"{what} differs from the contiguous call"
    for what, got, packed, pool in (("dk", paged[4], contig[4], k_pool),
                                    ("dv", paged[5], contig[5], v_pool)):
        want = torch.zeros((pool.shape[0] * page, hk, d), dtype=torch.float32)
        want.index_add_(0, slots, packed.float())
        assert torch.equal(got, want.to(dtype).view(pool.shape)), f"{what}: shared-page sum"
    for got, want in zip(paged, again):
        assert torch.equal(got, want), "two paged calls differ"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dropout_mask_equals_contiguous_call(dtype, backend):
    """The keep mask counts local positions: the paged call drops exactly what the same call
    on contiguous keys drops, forward and backward."""
    lens_q, lens_k, page, h, hk, d = [7, 12], [33, 20], 16, 2, 1, 16
    gen = _gen("dropout", str(dtype))
    q = randn(sum(lens_q), h, d, dtype=dtype, gen=gen)
    k = randn(sum(lens_k), hk, d, dtype=dtype, gen=gen)
    v = randn(sum(lens_k), hk, d, dtype=dtype, gen=gen)
    do = randn(sum(lens_q), h, d, dtype=dtype, gen=gen)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    table, slots, num_blocks = _layout(lens_k, page, gen)
    k_pool, v_pool = _pool(k, slots, num_blocks, page), _pool(v, slots, num_blocks, page)
    kw = {"dropout_p": 0.3, "causal": True}
    torch.manual_seed(zlib.crc32(b"paged-dropout"))
    paged = _run(backend, q, k_pool, v_pool, do, cu_q, cu_k, lens_q, lens_k, kw, table)
    torch.manual_seed(zlib.crc32(b"paged-dropout"))
    contig = _run(backend, q, k, v, do, cu_q, cu_k, lens_q, lens_k, kw)
    assert (paged[2] < 0).any(), "no element was dropped"
    for what, got, want in zip(("out", "lse", "S_dmask", "dq"), paged[:4], contig[:4]):
        assert torch.equal(got, want), f"{what} differs from the contiguous call"
    for what, got, want in (("dk", paged[4], contig[4]), ("dv", paged[5], contig[5])):
        assert torch.equal(got.reshape(-1, hk, d)[slots], want), f"{what} differs"


# ----------------------------------------------------------------------------------------
# bad input


def _bad_args():
    """A valid paged call: 2 sequences of 20 and 5 keys in 16-slot pages; row 1 needs one page,
    so its second entry (-1) is never read and not checked."""
    gen = _gen("bad-input")
    return dict(q=randn(10, 4, 16, dtype=torch.float16, gen=gen),
                k=randn(6, 16, 2, 16, dtype=torch.float16, gen=gen),
                v=randn(6, 16, 2, 16, dtype=torch.float16, gen=gen),
                cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 20, 25], dtype=torch.int32),
                max_seqlen_q=6, max_seqlen_k=20,
                block_table=torch.tensor([[3, 1], [5, -1]], dtype=torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_valid_paged_call_ignores_unused_entries_and_pool_size(backend):
    """``cu_seqlens_k[-1]`` (25) is not tied to the pool (6 x 16 slots), and the unread
    block-table entry -1 is accepted: the output equals that of the same call on the gathered
    contiguous keys/values."""
    args = _bad_args()
    table, k_pool, v_pool = args.pop("block_table"), args.pop("k"), args.pop("v")
    page = k_pool.shape[1]
    lens_k = (args["cu_seqlens_k"][1:] - args["cu_seqlens_k"][:-1]).tolist()
    slots = [int(table[b, j // page]) * page + j % page
             for b, n in enumerate(lens_k) for j in range(n)]
    k, v = (x.reshape(-1, *x.shape[2:])[slots] for x in (k_pool, v_pool))
    with flashtile.use_backend(backend), override(fwd=KernelConfig(16, 16)), poison_outputs():
        out = flashtile.flash_attn_varlen_func(k=k_pool, v=v_pool, block_table=table, **args)
        contig = flashtile.flash_attn_varlen_func(k=k, v=v, **args)
    assert torch.equal(out, contig), "the paged call differs from the gathered contiguous call"


BAD = [
    ("table-not-tensor", lambda a: {"block_table": a["block_table"].tolist()}, TypeError,
     "block_table must be an int32 torch.Tensor"),
    ("table-int64", lambda a: {"block_table": a["block_table"].long()}, TypeError,
     "block_table must be int32"),
    ("table-1d", lambda a: {"block_table": a["block_table"][0]}, ValueError,
     r"block_table must have shape \(batch, max_num_blocks\)"),
    ("table-rows", lambda a: {"block_table": a["block_table"][:1]}, ValueError,
     "block_table must have shape .* batch = 2"),
    ("table-device", lambda a: {"block_table": a["block_table"].to("meta")}, ValueError,
     "block_table is on meta"),
    ("page-past-pool", lambda a: {"block_table": torch.tensor([[3, 6], [5, 0]], dtype=torch.int32)},
     ValueError, r"block_table\[0, 1\] = 6 is not a page of k/v \(num_blocks = 6\)"),
    ("page-negative", lambda a: {"block_table": torch.tensor([[3, 1], [-2, 0]], dtype=torch.int32)},
     ValueError, r"block_table\[1, 0\] = -2 is not a page"),
    ("too-few-pages", lambda a: {"cu_seqlens_k": torch.tensor([0, 40, 45], dtype=torch.int32),
                                 "max_seqlen_k": 40},
     ValueError, r"sequence 0 has 40 keys .* needs ceil\(40 / 16\) = 3 pages"),
    ("page-size-8", lambda a: {"k": a["k"].view(12, 8, 2, 16), "v": a["v"].view(12, 8, 2, 16)},
     ValueError, "paged k/v .*page_size .* multiple of 16, got 8"),
    ("kv-shapes", lambda a: {"v": a["v"][:5]}, ValueError, "k and v must have the same shape"),
    ("k-packed", lambda a: {"k": a["k"].reshape(-1, 2, 16)[:25], "v": a["v"].reshape(-1, 2, 16)[:25]},
     ValueError, r"k must have 4 dimensions \(num_blocks, page_size, nheads_k, headdim\)"),
    ("max-seqlen-k", lambda a: {"max_seqlen_k": 10}, ValueError, "max_seqlen_k = 10"),
    ("cu-k-batch", lambda a: {"cu_seqlens_k": torch.tensor([0, 20], dtype=torch.int32)},
     ValueError, "cu_seqlens_q describes 2 sequences but cu_seqlens_k describes 1"),
    ("k-dtype", lambda a: {"k": a["k"].float(), "v": a["v"].float()}, TypeError, "dtype"),
]


@pytest.mark.parametrize("make,exc,needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_paged_rejects(make, exc, needle):
    args = _bad_args()
    args.update(make(args))
    with pytest.raises(exc, match=needle):
        flashtile.flash_attn_varlen_func(**args)
