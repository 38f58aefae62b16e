"""Real use: flashtile under ``torch.autocast``, ``torch.compile`` and inside HuggingFace
transformers models.

Autocast: flashtile follows ``F.scaled_dot_product_attention``: it computes in the autocast
dtype and returns it, whatever the inputs' dtype, and gradients flow back to float32 leaves.
CPU: the torch backend in bfloat16 and float16, the Triton kernels (interpreter) in float16 (the
Triton 3.6 interpreter mis-reads bfloat16).  CUDA (when present, run with
``TRITON_INTERPRET=0``): both backends in bfloat16 and float16.

torch.compile(fullgraph=True, dynamic=True): every public function traces without a graph
break, also when its float arguments (softmax_scale, softcap) become symbolic because their
value changes between calls, and gives the eager result.  The compiled graphs use
``backend="aot_eager"`` (dynamo plus AOT tracing through the ops' fake implementations, which is
where graph breaks and tracing errors come from) except one inductor case; the torch backend
computes (the Triton kernels behind the ops are the same code as eager).

transformers (tiny random configs, CPU): every comparison builds both models from their own
config object (``_from_config`` writes the implementation into the config it is given) with the
same weights, and compares flashtile's implementation with transformers' own (``sdpa``;
``eager`` for Gemma 2, whose softcap SDPA refuses; DeepSeek-V3's value head dim differs from
its query head dim) within the tolerances transformers'
test-suite uses for eager vs SDPA (fp32: atol 1e-6, rtol 1e-4; bf16: atol 1e-2, rtol 1e-2).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashtile
from flashtile.backends import triton_unavailable_reason
from flashtile.integrations import transformers as ft_hf

from helpers import assert_flash_rule

try:
    import transformers
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Gemma2Config,
                              Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM, MistralConfig, MistralForCausalLM)
except ImportError:  # a [test] extra: without it only the transformers tests are skipped
    transformers = None
    Gemma2Config = Gemma2ForCausalLM = GPT2Config = GPT2LMHeadModel = None
    LlamaConfig = LlamaForCausalLM = MistralConfig = MistralForCausalLM = None
    DeepseekV3Config = DeepseekV3ForCausalLM = None

_CPU_TRITON = triton_unavailable_reason(torch.device("cpu"))
_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CASES = [pytest.param("cpu", "torch", torch.bfloat16, id="cpu-torch-bf16"),
         pytest.param("cpu", "torch", torch.float16, id="cpu-torch-fp16"),
         pytest.param("cpu", "triton", torch.float16, id="cpu-triton-fp16", marks=pytest.mark.skipif(
             _CPU_TRITON is not None, reason=str(_CPU_TRITON)))]
CASES += [pytest.param("cuda", b, dt, id=f"cuda-{b}-{n}", marks=_CUDA)
          for b in ("triton", "torch") for dt, n in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))]


def _inputs(name, *shape, device="cpu"):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return [torch.randn(*shape, generator=g).to(device).requires_grad_() for _ in range(4)]


@pytest.mark.parametrize("device,backend,dtype", CASES)
def test_sdpa_under_autocast(device, backend, dtype):
    """float32 inputs, causal GQA: output in the autocast dtype, within flash-attn's rule of
    torch's SDPA under the same autocast (out 2x, grads 3x its error vs float64)."""
    q, k, v, do = _inputs(f"sdpa{backend}{dtype}", 2, 4, 40, 16, device=device)
    k, v = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()
    with flashtile.use_backend(backend):  # the backward too: it picks the backend again
        with torch.autocast(device, dtype=dtype):
            out = flashtile.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            ref_low = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        grads = torch.autograd.grad(out, (q, k, v), do.detach())
    assert out.dtype == dtype == ref_low.dtype
    low_grads = torch.autograd.grad(ref_low, (q, k, v), do.detach())
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    # the float64 reference sees the inputs rounded to the autocast dtype, as both kernels do
    ref = F.scaled_dot_product_attention(*(x.to(dtype).double() for x in (q64, k64, v64)),
                                         is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.detach().to(dtype).double())
    assert_flash_rule("out", out, ref, ref_low, 2, 1e-4)
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
        assert got.dtype == torch.float32, name  # back to the float32 leaves
        assert_flash_rule(name, got, want, base, 3, 1e-4)


@pytest.mark.parametrize("device,backend,dtype", CASES)
def test_flash_attn_func_and_varlen_under_autocast(device, backend, dtype):
    """``flash_attn_func`` and ``flash_attn_varlen_func`` return the autocast dtype and equal the
    same call on inputs cast to it outside autocast."""
    q, k, v, _ = _inputs(f"fa{backend}{dtype}", 2, 24, 4, 16, device=device)
    cu = torch.tensor([0, 24, 48], dtype=torch.int32, device=device)
    with flashtile.use_backend(backend):
        with torch.autocast(device, dtype=dtype):
            out = flashtile.flash_attn_func(q, k, v, causal=True)
            out_varlen = flashtile.flash_attn_varlen_func(
                q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 24, 24, causal=True)
        want = flashtile.flash_attn_func(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
        want_varlen = flashtile.flash_attn_varlen_func(
            *(x.to(dtype).flatten(0, 1) for x in (q, k, v)), cu, cu, 24, 24, causal=True)
    assert out.dtype == out_varlen.dtype == dtype
    assert torch.equal(out, want)
    # (the dense call may take PyTorch's fused CPU kernel, the varlen call the tiled engine)
    assert torch.equal(out_varlen, want_varlen)


def test_autocast_disabled_region_keeps_input_dtype():
    """``autocast(enabled=False)`` and inputs already in the autocast dtype change nothing."""
    q, k, v, _ = _inputs("off", 1, 2, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert flashtile.scaled_dot_product_attention(q, k, v).dtype == torch.float32
    qb = q.detach().bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert flashtile.scaled_dot_product_attention(qb, qb, qb).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def compile_torch_backend():
    """Fresh dynamo caches around each compile test, on the torch backend."""
    torch._dynamo.reset()
    with flashtile.use_backend("torch"):
        yield
    torch._dynamo.reset()


def _compile_test(fn):
    """A torch.compile test: the torch backend, fresh dynamo caches, compile warnings quiet."""
    fn = pytest.mark.usefixtures("compile_torch_backend")(fn)
    return pytest.mark.filterwarnings("ignore::UserWarning")(fn)


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


def _sdpa_value_dim(scale, cap, q, k, v):  # a value head dim of 8 for the query's 16
    return _sdpa(scale, cap, q, k, v[..., :8])


def _block_sparse(scale, cap, q, k, v):
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    return flashtile.block_sparse_attn_func(q, k, v, mask, block_size=(16, 16),
                                            softmax_scale=scale, causal=True)


FUNCTIONS = {"flash_attn_func": (_dense, (2, 12, 4, 16)), "varlen": (_varlen, (12, 4, 16)),
             "qkvpacked": (_qkvpacked, (2, 12, 4, 16)), "kvpacked": (_kvpacked, (2, 12, 4, 16)),
             "sdpa": (_sdpa, (2, 12, 4, 16)), "sdpa-value-dim": (_sdpa_value_dim, (2, 12, 4, 16)),
             "block_sparse": (_block_sparse, (2, 12, 4, 16))}


@_compile_test
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


@_compile_test
def test_inductor_fullgraph_dynamic_default_arguments():
    """The new-user repro: default arguments under dynamic=True with inductor."""
    q = _gen("inductor")(2, 16, 4, 16)
    f = torch.compile(lambda q: flashtile.flash_attn_func(q, q, q, causal=True), fullgraph=True,
                      dynamic=True)
    torch.testing.assert_close(f(q), flashtile.flash_attn_func(q, q, q, causal=True),
                               atol=1e-5, rtol=1e-5)


@_compile_test
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


@_compile_test
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kvcache_compiled_rejects_bad_index_values(mode, monkeypatch):
    """The value checks run inside the op: compiled calls reject them too (in the call with
    ``FLASHTILE_KVCACHE_CHECK=sync``; by default at the next call or check)."""
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", mode)
    q, kc, vc = torch.randn(1, 1, 2, 16), torch.randn(2, 16, 2, 16), torch.randn(2, 16, 2, 16)
    table = _i32(0, 1).reshape(1, 2)
    f = torch.compile(lambda q, kc, vc, lens, t: flashtile.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=lens, block_table=t), fullgraph=True, backend="aot_eager")
    f(q, kc, vc, _i32(20), table)
    late = flashtile.check_kvcache_errors if mode == "async" else (lambda: None)
    with pytest.raises(RuntimeError, match="block_table"):
        f(q, kc, vc, _i32(40), table)
        late()
    with pytest.raises(flashtile.FlashtileInputError, match=r"block_table\[0, 1\]=7"):
        f(q, kc, vc, _i32(20), _i32(0, 7).reshape(1, 2))
        late()
    f(q, kc, vc, _i32(20), table)
    flashtile.check_kvcache_errors()


# ----------------------------------------------------------------------------------------------
# transformers models
# ----------------------------------------------------------------------------------------------

NAME = VARLEN_NAME = None
if transformers is not None:
    NAME = ft_hf.register()
    VARLEN_NAME = ft_hf.register("tile_attention_varlen", padded="varlen")
TOL = {torch.float32: (1e-6, 1e-4), torch.bfloat16: (1e-2, 1e-2)}
VOCAB = 96


@pytest.fixture
def hf_torch_backend():
    """The CPU engine (what a CPU user gets; the Triton interpreter set up by conftest.py
    cannot read bf16)."""
    with flashtile.use_backend("torch"):
        yield


def _transformers_test(fn):
    """A test of the transformers integration: skipped without transformers, on the torch
    backend."""
    fn = pytest.mark.usefixtures("hf_torch_backend")(fn)
    return pytest.mark.skipif(transformers is None, reason="transformers is not installed")(fn)


def _llama():
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                       max_position_embeddings=128)


def _gpt2():
    return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _mistral():  # window 6 < sequence length: the window is active
    return MistralConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                         max_position_embeddings=128, sliding_window=6)


def _gemma2():  # alternating sliding / full layers, attention softcap, query_pre_attn_scalar
    return Gemma2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=96, max_position_embeddings=128, sliding_window=6,
                        attn_logit_softcapping=5.0, final_logit_softcapping=None,
                        query_pre_attn_scalar=24)


def _deepseek_v3():  # multi-head latent attention: query head dim 24, value head dim 16
    return DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                            moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=32,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                            first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
                            n_group=1, topk_group=1, max_position_embeddings=128)


MODELS = {
    "llama-gqa": (LlamaForCausalLM, _llama, "sdpa"),
    "deepseek-v3-mla": (DeepseekV3ForCausalLM, _deepseek_v3, "sdpa"),
    "gpt2": (GPT2LMHeadModel, _gpt2, "sdpa"),
    "mistral-window": (MistralForCausalLM, _mistral, "sdpa"),
    "gemma2-softcap-window": (Gemma2ForCausalLM, _gemma2, "eager"),
}


def _pair(model: str, dtype=torch.float32, name: str = NAME):
    """(flashtile model, reference model) with identical random weights."""
    cls, make_cfg, ref_impl = MODELS[model]
    ref = cls._from_config(make_cfg(), attn_implementation=ref_impl, dtype=dtype).eval()
    ours = cls._from_config(make_cfg(), attn_implementation=name, dtype=dtype).eval()
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == name
    assert ref.config._attn_implementation == ref_impl
    return ours, ref


def _batch(padding: str, batch=3, seqlen=20, gen=None):
    """Row 0 has a little padding, row 1 a lot (more than the sliding windows), row 2 none."""
    ids = torch.randint(0, VOCAB, (batch, seqlen), generator=gen)
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    little, lots = seqlen // 4, seqlen // 2 + 1
    if padding == "left":
        mask[0, :little] = 0
        mask[1, :lots] = 0
    elif padding == "right":
        mask[0, -little:] = 0
        mask[1, -lots:] = 0
    return ids, (None if padding == "none" else mask)


def _valid(mask, ids):
    return torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()


def _assert_close(what, got, want, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def _loss(model, ids, mask, **kw):
    """Loss over the tokens predicted from valid positions (the logits at padded positions
    are unspecified: a query that sees no key outputs 0 here, uniform weights in eager)."""
    valid = _valid(mask, ids)
    from_valid = torch.cat([valid[:, :1], valid[:, :-1]], dim=1) & valid
    labels = ids.masked_fill(~from_valid, -100)
    return model(ids, attention_mask=mask, labels=labels, **kw)


@_transformers_test
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", list(MODELS))
def test_logits_and_grads_match_transformers_reference(model, dtype, padding):
    torch.manual_seed(0)
    ours, ref = _pair(model, dtype)
    ids, mask = _batch(padding)
    valid = _valid(mask, ids)
    out, want = _loss(ours, ids, mask), _loss(ref, ids, mask)
    _assert_close("logits (valid tokens)", out.logits[valid], want.logits[valid], dtype)
    _assert_close("loss", out.loss, want.loss, dtype)
    out.loss.backward()
    want.loss.backward()
    ref_params = dict(ref.named_parameters())
    for pname, p in ours.named_parameters():
        if ref_params[pname].grad is None:
            continue
        _assert_close(f"grad of {pname}", p.grad, ref_params[pname].grad, dtype)


@_transformers_test
@pytest.mark.parametrize("model", ["llama-gqa", "gpt2"])
def test_autocast_bf16_matches_sdpa(model):
    """An fp32 model under torch.autocast('cpu', bfloat16): attention runs in bf16 like SDPA."""
    torch.manual_seed(1)
    ours, ref = _pair(model)
    ids, mask = _batch("left")
    valid = _valid(mask, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, want = _loss(ours, ids, mask), _loss(ref, ids, mask)
    _assert_close("logits under autocast", out.logits[valid], want.logits[valid], torch.bfloat16)
    out.loss.backward()
    want.loss.backward()
    for (pname, p), q in zip(ours.named_parameters(), ref.parameters()):
        _assert_close(f"grad of {pname} under autocast", p.grad, q.grad, torch.bfloat16)


@_transformers_test
@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("model", ["llama-gqa", "gemma2-softcap-window"])
def test_padded_mask_path_equals_varlen_path(model, padding):
    """register(padded='varlen') (unpad + flash_attn_varlen_func) and the default key-mask path
    give the same logits and gradients on the valid tokens."""
    torch.manual_seed(2)
    masked, _ = _pair(model)
    varlen, _ = _pair(model, name=VARLEN_NAME)
    varlen.load_state_dict(masked.state_dict())
    ids, mask = _batch(padding)
    valid = _valid(mask, ids)
    a, b = _loss(masked, ids, mask), _loss(varlen, ids, mask)
    _assert_close("logits mask vs varlen", a.logits[valid], b.logits[valid], torch.float32)
    a.loss.backward()
    b.loss.backward()
    for (pname, p), q in zip(masked.named_parameters(), varlen.parameters()):
        _assert_close(f"grad of {pname}", p.grad, q.grad, torch.float32)


@_transformers_test
def test_varlen_padded_path_unpads_once_a_forward(monkeypatch):
    """register(padded='varlen'): the layers of one forward share the padding mask's unpadding
    (its indices and lengths, one host read of the mask), each running the varlen kernel."""
    from flashtile._tensor_cache import TensorCache

    torch.manual_seed(2)
    varlen, _ = _pair("llama-gqa", name=VARLEN_NAME)
    ids, mask = _batch("left")
    cache, made = TensorCache(), []
    real_get = cache.get
    monkeypatch.setattr(cache, "get", lambda key, tensors, make: real_get(
        key, tensors, lambda: made.append(key[0]) or make()))
    monkeypatch.setattr(ft_hf, "_per_mask", cache)
    calls = _count_varlen(monkeypatch)
    with torch.no_grad():
        varlen(ids, attention_mask=mask)
    assert len(calls) == varlen.config.num_hidden_layers == 2
    assert made == ["unpad"]


def _count_varlen(monkeypatch):
    calls = []
    real = ft_hf.flash_attn_varlen_func

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ft_hf, "flash_attn_varlen_func", counting)
    return calls


@_transformers_test
@pytest.mark.parametrize("model", ["llama-gqa", "mistral-window"])
def test_padding_free_packed_batch_equals_padded_batch(model, monkeypatch):
    """Sequences packed into rows (position_ids restarting at 0, no attention_mask, no cache:
    transformers recognises packing only without a cache) give the logits of the same
    sequences in a right-padded batch, through the varlen kernel."""
    torch.manual_seed(3)
    ours, ref = _pair(model)
    lens = [[7, 9, 4], [12, 8]]  # two packed rows of 20 tokens
    seqs = [torch.randint(0, VOCAB, (n,)) for row in lens for n in row]
    longest = max(n for row in lens for n in row)
    padded = torch.zeros(len(seqs), longest, dtype=torch.long)
    pmask = torch.zeros_like(padded)
    for i, s in enumerate(seqs):
        padded[i, :len(s)] = s
        pmask[i, :len(s)] = 1
    want = ours(padded, attention_mask=pmask).logits
    packed = torch.stack([torch.cat(seqs[:3]), torch.cat(seqs[3:])])
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens])
    calls = _count_varlen(monkeypatch)
    got = ours(packed, position_ids=pos, use_cache=False).logits
    assert calls, "the packed batch did not go through flash_attn_varlen_func"
    got_sdpa = ref(packed, position_ids=pos, use_cache=False).logits
    k = 0
    for r, row in enumerate(lens):
        start = 0
        for n in row:
            _assert_close(f"sequence {k} packed vs padded", got[r, start:start + n],
                          want[k, :n], torch.float32)
            start += n
            k += 1
    _assert_close("packed batch vs sdpa's packed mask", got, got_sdpa, torch.float32)


@_transformers_test
def test_flash_varlen_kwargs_are_used(monkeypatch):
    """cu_seq_lens_q/k + max_length_q/k (transformers' padding-free collator output) select the
    varlen kernel, as in transformers' flash path."""
    torch.manual_seed(4)
    ours, ref = _pair("llama-gqa")
    lens = [5, 9, 6]
    ids = torch.randint(0, VOCAB, (1, sum(lens)))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 5, 14, 20], dtype=torch.int32)
    calls = _count_varlen(monkeypatch)
    got = ours(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9,
               max_length_k=9, use_cache=False).logits
    assert calls
    want = ref(ids, position_ids=pos, use_cache=False).logits
    _assert_close("varlen kwargs vs sdpa packed mask", got, want, torch.float32)


@_transformers_test
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("model", ["llama-gqa", "gpt2", "mistral-window", "deepseek-v3-mla"])
def test_greedy_generation_identical_tokens(model, cache):
    torch.manual_seed(5)
    ours, ref = _pair(model)
    ids, mask = _batch("left", seqlen=9)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    got = ours.generate(ids, **kw)
    want = ref.generate(ids, **kw)
    assert torch.equal(got, want), f"{got}\n{want}"


@_transformers_test
def test_compiled_fullgraph_dynamic_forward_and_backward():
    """torch.compile(fullgraph=True, dynamic=True) of a training step (padded batch) matches
    eager, for two sequence lengths (one graph)."""
    torch.manual_seed(6)
    ours, _ = _pair("llama-gqa")
    compiled = torch.compile(ours, fullgraph=True, dynamic=True, backend="aot_eager")
    for seqlen in (12, 17):
        ids, mask = _batch("left", seqlen=seqlen)
        want = _loss(ours, ids, mask)
        got = _loss(compiled, ids, mask)
        _assert_close(f"compiled logits at {seqlen}", got.logits, want.logits, torch.float32)
        g_want = torch.autograd.grad(want.loss, list(ours.parameters()))
        g_got = torch.autograd.grad(got.loss, list(ours.parameters()))
        for a, b in zip(g_got, g_want):
            _assert_close(f"compiled grads at {seqlen}", a, b, torch.float32)


@_transformers_test
def test_generate_static_cache_compiled_decode():
    """Greedy generation with a static cache and the forward compiled (fullgraph, dynamic)
    gives the tokens of the eager SDPA model."""
    torch.manual_seed(7)
    ours, ref = _pair("llama-gqa")
    ids, mask = _batch("left", seqlen=9)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    want = ref.generate(ids, **kw)
    ours.forward = torch.compile(ours.forward, fullgraph=True, dynamic=True, backend="aot_eager")
    got = ours.generate(ids, **kw)
    assert torch.equal(got, want), f"{got}\n{want}"


@_transformers_test
def test_training_with_attention_dropout():
    """attention_dropout is applied in training (repeatable with the seed), not in eval."""
    cfg = _llama()
    cfg.attention_dropout = 0.3
    model = LlamaForCausalLM._from_config(cfg, attn_implementation=NAME)
    ids, mask = _batch("left")
    model.train()
    torch.manual_seed(8)
    a = _loss(model, ids, mask)
    torch.manual_seed(8)
    b = _loss(model, ids, mask)
    torch.manual_seed(9)
    c = _loss(model, ids, mask)
    assert torch.equal(a.logits, b.logits)
    assert not torch.allclose(a.logits, c.logits)
    a.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    e1, e2 = _loss(model, ids, mask), _loss(model, ids, mask)
    assert torch.equal(e1.logits, e2.logits)


@_transformers_test
def test_block_sparse_variant():
    """The block-sparse variant equals dense causal attention when the local window covers
    every block, and block_sparse_attn_func's local+global pattern otherwise."""
    torch.manual_seed(10)
    full = ft_hf.register_block_sparse("tile_block_sparse_full", block_size=16, window_blocks=4)
    ours, ref = _pair("llama-gqa", name=full)
    ids, _ = _batch("none", seqlen=64)
    _assert_close("block-sparse (all blocks) vs sdpa", ours(ids).logits, ref(ids).logits,
                  torch.float32)
    sparse = ft_hf.register_block_sparse("tile_block_sparse_1", block_size=16, window_blocks=1,
                                         global_blocks=1)
    model = LlamaForCausalLM._from_config(_llama(), attn_implementation=sparse).eval()
    dense = LlamaForCausalLM._from_config(_llama(), attn_implementation=NAME).eval()
    dense.load_state_dict(model.state_dict())
    diff = (model(ids).logits - dense(ids).logits).abs()
    assert diff[:, :32].max() < 1e-5  # the first two blocks see everything causal anyway
    assert diff[:, 48:].max() > 1e-4  # later rows miss the middle blocks
    with pytest.raises(NotImplementedError, match="padded"):
        model(ids, attention_mask=_batch("left", seqlen=64)[1])
    assert 0 < ft_hf.block_sparse_density(4096, 128, 2, 1) < 0.25


@_transformers_test
def test_register_rejects_names_transformers_misreads():
    assert ft_hf.register() == "tile_attention"
    for bad in ("flashtile", "my_flash", "tile_sdpa", "org/kernel", "eager"):
        with pytest.raises(ValueError, match="must not"):
            ft_hf.register(bad)
    with pytest.raises(ValueError, match="padded"):
        ft_hf.register(padded="unpad")


@_transformers_test
def test_transformers_refuses_flash_names():
    """Why the name has no "flash": transformers loads such names as hub kernels."""
    transformers.AttentionInterface.register("flashtile_probe", ft_hf.attention_forward)
    with pytest.raises((ValueError, ImportError, OSError)):
        LlamaForCausalLM._from_config(_llama(), attn_implementation="flashtile_probe")


@_transformers_test
def test_set_attn_implementation_switches_model():
    torch.manual_seed(11)
    ours, ref = _pair("gpt2")
    ref.set_attn_implementation(NAME)
    assert ref.config._attn_implementation == NAME
    ids, mask = _batch("right")
    valid = _valid(mask, ids)
    _assert_close("after set_attn_implementation", ref(ids, attention_mask=mask).logits[valid],
                  ours(ids, attention_mask=mask).logits[valid], torch.float32)
    assert flashtile.__version__
