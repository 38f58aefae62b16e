"""Block masks (``block_sparse_attn_func``) on the Hopper (Gluon) forward: output and lse against
a float64 reference under flash-attn's error rule, rows with no block, the launch they take,
and the portable backward from the Hopper forward's lse; skipped without an sm_90 GPU."""
import pytest
import torch
from helpers import assert_flash_rule, assert_grads_flash_rule, spy_keyword

from flashtile import block_sparse_attn_func
from flashtile.autograd import attention
from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton import launch_sm90
from flashtile.backends.triton.fastlaunch import poison_outputs
from flashtile.block_sparse import expand_block_mask
from flashtile.reference.torch_ref import reference, scores

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU")

# (id, batch, sq, sk, heads, heads_k, d, causal, block_size, density, per-head mask, empty rows)
CASES = [
    ("d128-128x128", 2, 1024, 1024, 4, 4, 128, False, (128, 128), 0.4, False, False),
    ("d128-causal-256x128-gqa", 2, 1024, 1024, 4, 2, 128, True, (256, 128), 0.5, True, False),
    ("d128-sk-longer-causal", 1, 512, 1024, 4, 4, 128, True, (128, 128), 0.5, False, False),
    ("d128-empty-rows", 2, 1024, 768, 4, 4, 128, False, (128, 128), 0.3, True, True),
    ("d64-128x256", 2, 1024, 2048, 4, 4, 64, False, (128, 256), 0.4, True, False),
    ("d64-causal-128x128-gqa", 1, 2048, 2048, 8, 2, 64, True, (128, 128), 0.3, False, False),
    ("d256-128x64", 2, 512, 512, 2, 2, 256, False, (128, 64), 0.5, True, True),
    ("d256-causal-128x128", 2, 512, 512, 2, 2, 256, True, (128, 128), 0.6, False, False),
]


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    """Each test starts without launch plans, so its first call takes the full launch path
    (a plan an earlier test left for the same shapes would skip the launches spied on)."""
    monkeypatch.setattr(launch_sm90, "_fwd_plans", type(launch_sm90._fwd_plans)())
    monkeypatch.setattr(launch_sm90, "_bwd_plans", type(launch_sm90._bwd_plans)())


def _inputs(case, dtype):
    _, batch, sq, sk, heads, heads_k, d, causal, bs, density, per_head, empty = case
    gen = torch.Generator().manual_seed(sum(map(ord, case[0])))
    q = torch.randn(batch, sq, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, heads_k, d, device="cuda", dtype=dtype)
    rows, cols = -(-sq // bs[0]), -(-sk // bs[1])
    mask = torch.rand(batch if per_head else 1, heads if per_head else 1, rows, cols,
                      generator=gen) < density
    if causal:  # every row keeps its diagonal block (bottom-right)
        r = torch.arange(rows)
        mask[..., r, ((r + 1) * bs[0] - 1 + sk - sq) // bs[1]] = True
    if empty:  # block rows that see no key: output 0, lse -inf
        mask[..., 1, :] = False
        mask[0, 0, rows - 1, :] = False
    return q, k, v, mask.cuda(), causal, bs


def _reference(q, k, v, mask, bs, causal, dtype):
    """(out, lse) of the oracle (``reference.torch_ref``) in ``dtype`` under the element mask of
    the block mask (and bottom-right causal); a row that sees no key outputs 0, lse -inf."""
    spec = AttnSpec(softmax_scale=q.shape[-1] ** -0.5, window_right=0 if causal else -1)
    elem = expand_block_mask(mask, bs, q.shape[1], k.shape[1])
    out = reference(q, k, v, spec, dtype=dtype, attn_bias=elem)
    return out, torch.logsumexp(scores(q, k, spec, dtype=dtype, attn_bias=elem), -1)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_block_sparse_forward_matches_float64_reference(case, dtype, monkeypatch):
    """The Hopper forward with a block mask: output within 2x PyTorch's same-dtype error of
    float64, lse within 1e-3, a row with no visible key 0 with lse -inf; the portable Triton
    kernel within the same error."""
    q, k, v, mask, causal, bs = _inputs(case, dtype)
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    calls = spy_keyword(monkeypatch, launch_sm90, "forward", "sparse")
    spec = AttnSpec(softmax_scale=q.shape[-1] ** -0.5, window_right=0 if causal else -1)
    with poison_outputs():
        out, lse = attention(q, k, v, spec, block_mask=mask, block_size=bs)
    assert len(calls) == 1 and calls[0] is not None  # the Hopper kernel, with the lists
    ref, ref_lse = _reference(q, k, v, mask, bs, causal, torch.float64)
    low, _ = _reference(q, k, v, mask, bs, causal, dtype)
    assert_flash_rule("out", out, ref, low, 2)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and (lse[~seen] == float("-inf")).all()
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() <= 1e-3
    assert (out.transpose(1, 2)[~seen] == 0).all()  # (B, H, Sq) rows with no key
    monkeypatch.setenv("FLASHTILE_SM90", "0")
    portable = block_sparse_attn_func(q, k, v, mask, bs, causal=causal)
    assert_flash_rule("portable out", portable, ref, low, 2)


BWD_CASES = [c for c in CASES if c[6] != 256]


@pytest.mark.parametrize("case", BWD_CASES, ids=[c[0] for c in BWD_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_block_sparse_backward_matches_float64_reference(case, dtype, monkeypatch):
    """dQ, dK and dV of a block-sparse call within 3x PyTorch's same-dtype error of float64:
    the fused Hopper backward where one mask serves a key/value head's query heads (else the
    portable kernels), from the Hopper forward's output and lse; hidden rows and keys get no
    gradient."""
    q, k, v, mask, causal, bs = _inputs(case, dtype)
    do = torch.randn_like(q)
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    calls = spy_keyword(monkeypatch, launch_sm90, "forward", "sparse")
    fused = spy_keyword(monkeypatch, launch_sm90, "fused_backward", "sparse")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with poison_outputs():
        block_sparse_attn_func(*leaves, mask, bs, causal=causal).backward(do)
    assert len(calls) == 1 and calls[0] is not None
    one_mask = mask.shape[1] == 1 or q.shape[2] == k.shape[2]
    assert len(fused) == (1 if one_mask else 0) and all(f is not None for f in fused)
    assert_grads_flash_rule([x.grad for x in leaves], (q, k, v), do, lambda q_, k_, v_, dt:
                            _reference(q_, k_, v_, mask, bs, causal, dt)[0], dtype)
    # rows that see no key get no dQ
    _, ref_lse = _reference(q, k, v, mask, bs, causal, torch.float64)
    assert (leaves[0].grad.transpose(1, 2)[~torch.isfinite(ref_lse)] == 0).all()


def test_sm90_block_sparse_takes_the_portable_kernels_where_the_tiles_do_not_fit(monkeypatch):
    """Blocks smaller than the Hopper tiles, lengths that are not multiples of them and dropout
    stay on the portable Triton kernels (no Hopper launch)."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    calls = spy_keyword(monkeypatch, launch_sm90, "forward", "sparse")
    q, k, v = (torch.randn(1, 512, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    block_sparse_attn_func(q, k, v, torch.ones(1, 1, 8, 8, dtype=torch.bool, device="cuda"),
                           (64, 64))
    qr = q[:, :500]
    block_sparse_attn_func(qr, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool, device="cuda"))
    block_sparse_attn_func(q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool, device="cuda"),
                           dropout_p=0.1)
    assert calls == []


@pytest.mark.parametrize("case", [CASES[2], CASES[4]], ids=[CASES[2][0], CASES[4][0]])
def test_sm90_block_sparse_plans_repeat_the_launch_with_a_new_mask(case, monkeypatch):
    """A block-sparse call like an earlier one (shapes, strides, the lists' geometry and block
    size) repeats the forward and the fused backward through their plans with its own tensors
    and mask: output, dK and dV bitwise those of the full launch path (outputs poisoned), dQ
    within 3x PyTorch's same-dtype error of float64; the plans hold no tensor."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    q, k, v, mask, causal, bs = _inputs(case, torch.bfloat16)

    def call(q, k, v, do, mask):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = block_sparse_attn_func(*leaves, mask, bs, causal=causal)
        out.backward(do)
        return out, *(x.grad for x in leaves)

    do = torch.randn_like(q)
    call(q, k, v, do, mask)  # compiled
    call(q, k, v, do, mask)  # launched directly: leaves the plans
    for plans in (launch_sm90._fwd_plans, launch_sm90._bwd_plans):
        (plan,) = plans._plans.values()
        assert not any(isinstance(x, torch.Tensor) for x in plan.values)
    new_mask = torch.rand(mask.shape, device="cuda") < 0.5  # the same geometry, other blocks
    if causal:
        new_mask |= mask
    new = [torch.randn_like(x) for x in (q, k, v, do)] + [new_mask]
    used = (spy_keyword(monkeypatch, launch_sm90, "planned_forward", "sparse"),
            spy_keyword(monkeypatch, launch_sm90, "planned_backward", "sparse"))
    full = (spy_keyword(monkeypatch, launch_sm90, "forward", "sparse"),
            spy_keyword(monkeypatch, launch_sm90, "fused_backward", "sparse"))
    planned = call(*new)
    assert all(len(c) == 1 and c[0] is not None for c in used) and full == ([], [])
    monkeypatch.setattr(launch_sm90, "_fwd_plans", type(launch_sm90._fwd_plans)())
    monkeypatch.setattr(launch_sm90, "_bwd_plans", type(launch_sm90._bwd_plans)())
    with poison_outputs():
        direct = call(*new)
    assert len(full[0]) == 1 and len(full[1]) == 1
    for name, a, b in zip(("out", "dk", "dv"), (planned[0], *planned[2:]),
                          (direct[0], *direct[2:])):
        assert torch.equal(a, b), name
    assert_grads_flash_rule([planned[1], direct[2], direct[3]], tuple(new[:3]), new[3],
                            lambda q_, k_, v_, dt: _reference(q_, k_, v_, new_mask, bs, causal,
                                                              dt)[0], torch.bfloat16)
