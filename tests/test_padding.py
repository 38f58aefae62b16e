"""unpad_input / pad_input (flash-attn's bert_padding conventions) and their use with the
varlen function."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashtile
from flashtile.backends.triton.fastlaunch import poison_outputs

from helpers import assert_close, randn


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
