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


@pytest.mark.parametrize("bad", ["mask-shape", "hidden-rank", "indices"])
def test_bad_input(bad):
    x = torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match="attention_mask|hidden_states|indices"):
        if bad == "mask-shape":
            flashtile.unpad_input(x, torch.ones(2, 4))
        elif bad == "hidden-rank":
            flashtile.unpad_input(torch.randn(5), torch.ones(5))
        else:
            flashtile.pad_input(torch.randn(3, 4), torch.arange(4), 2, 5)
