"""torch.compile(fullgraph=True, dynamic=True): every public function traces without a graph
break, also when its float arguments (softmax_scale, softcap) become symbolic because their
value changes between calls, and gives the eager result.

The compiled graphs use ``backend="aot_eager"`` (dynamo plus AOT tracing through the ops' fake
implementations, which is where graph breaks and tracing errors come from) except one inductor
case; the torch backend computes (the Triton kernels behind the ops are the same code as eager).
"""
from __future__ import annotations

import pytest
import torch

import flashtile

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def torch_backend():
    torch._dynamo.reset()
    with flashtile.use_backend("torch"):
        yield
    torch._dynamo.reset()


def _i32(*v):
    return torch.tensor(v, dtype=torch.int32)


def _gen(name):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return lambda *shape: torch.randn(*shape, generator=g)


def _dense(scale, cap, q, k, v):
    return flashtile.flash_attn_func(q, k, v, softmax_scale=scale, softcap=cap, causal=True)


def _varlen(scale, cap, q, k, v):
    cu = _i32(0, 5, q.shape[0])
    return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 16, 16, softmax_scale=scale,
                                            softcap=cap, causal=True)


def _qkvpacked(scale, cap, q, k, v):
    return flashtile.flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), softmax_scale=scale,
                                               softcap=cap)


def _kvpacked(scale, cap, q, k, v):
    return flashtile.flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), softmax_scale=scale,
                                              softcap=cap, window_size=(4, 0))


def _sdpa(scale, cap, q, k, v):
    return flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2), is_causal=True, scale=scale)


def _block_sparse(scale, cap, q, k, v):
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    return flashtile.block_sparse_attn_func(q, k, v, mask, block_size=(16, 16),
                                            softmax_scale=scale, causal=True)


FUNCTIONS = {"flash_attn_func": (_dense, (2, 12, 4, 16)), "varlen": (_varlen, (12, 4, 16)),
             "qkvpacked": (_qkvpacked, (2, 12, 4, 16)), "kvpacked": (_kvpacked, (2, 12, 4, 16)),
             "sdpa": (_sdpa, (2, 12, 4, 16)), "block_sparse": (_block_sparse, (2, 12, 4, 16))}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_fullgraph_dynamic_with_changing_scales(name):
    """Two calls with different softmax_scale/softcap values and shapes through one
    fullgraph, dynamic=True compile: no graph break, the eager results, gradients too."""
    fn, shape = FUNCTIONS[name]
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    randn = _gen(name)
    for scale, cap, grow in ((0.3, 5.0, 0), (0.2, 7.5, 1)):
        s = list(shape)
        s[-3] += grow  # another sequence length
        q, k, v = (randn(*s).requires_grad_() for _ in range(3))
        want = fn(scale, cap, q, k, v)
        got = compiled(scale, cap, q, k, v)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        g_want = torch.autograd.grad(want.sum(), (q, k, v))
        g_got = torch.autograd.grad(got.sum(), (q, k, v))
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_inductor_fullgraph_dynamic_default_arguments():
    """The new-user repro: default arguments under dynamic=True with inductor."""
    q = _gen("inductor")(2, 16, 4, 16)
    f = torch.compile(lambda q: flashtile.flash_attn_func(q, q, q, causal=True), fullgraph=True,
                      dynamic=True)
    torch.testing.assert_close(f(q), flashtile.flash_attn_func(q, q, q, causal=True),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_with_tensor_seqlens_compiles_fullgraph(paged):
    """``flash_attn_with_kvcache`` with a tensor ``cache_seqlens`` and an append: one graph
    (the custom op ``flashtile::kvcache_fwd``), the eager output and the same cache update."""
    randn = _gen(f"kvcache{paged}")
    q, k, v = randn(2, 1, 4, 16), randn(2, 1, 2, 16), randn(2, 1, 2, 16)
    if paged:
        kc, vc = randn(6, 16, 2, 16), randn(6, 16, 2, 16)
        table = _i32(5, 0, 3, 1, 2, 4).reshape(2, 3)
    else:
        kc, vc, table = randn(2, 48, 2, 16), randn(2, 48, 2, 16), None
    lens = _i32(10, 30)

    def step(q, kc, vc, k, v, lens, scale):
        return flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,
                                                 block_table=table, softmax_scale=scale,
                                                 causal=True, return_softmax_lse=True)

    kc2, vc2 = kc.clone(), vc.clone()
    want, want_lse = step(q, kc, vc, k, v, lens, 0.3)
    got, got_lse = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")(
        q, kc2, vc2, k, v, lens, 0.3)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)  # the append happened in both


def test_kvcache_compiled_rejects_bad_index_values():
    """The value checks run inside the op: compiled calls reject them too."""
    q, kc, vc = torch.randn(1, 1, 2, 16), torch.randn(2, 16, 2, 16), torch.randn(2, 16, 2, 16)
    table = _i32(0, 1).reshape(1, 2)
    f = torch.compile(lambda q, kc, vc, lens, t: flashtile.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=lens, block_table=t), fullgraph=True, backend="aot_eager")
    f(q, kc, vc, _i32(20), table)
    with pytest.raises(RuntimeError, match="block_table"):
        f(q, kc, vc, _i32(40), table)
    with pytest.raises(flashtile.FlashtileInputError, match=r"block_table\[0, 1\]=7"):
        f(q, kc, vc, _i32(20), _i32(0, 7).reshape(1, 2))
