"""flashtile inside HuggingFace transformers models (tiny random configs, CPU).

Every comparison builds both models from their own config object (``_from_config`` writes
the implementation into the config it is given) with the same weights, and compares
flashtile's implementation with transformers' own (``sdpa``; ``eager`` for Gemma 2, whose
softcap SDPA refuses) within the tolerances transformers' test-suite uses for eager vs SDPA
(fp32: atol 1e-6, rtol 1e-4; bf16: atol 1e-2, rtol 1e-2).
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM)

import flashtile  # noqa: E402
from flashtile.integrations import transformers as ft_hf  # noqa: E402

NAME = ft_hf.register()
VARLEN_NAME = ft_hf.register("tile_attention_varlen", padded="varlen")
TOL = {torch.float32: (1e-6, 1e-4), torch.bfloat16: (1e-2, 1e-2)}
VOCAB = 96


@pytest.fixture(autouse=True)
def _torch_backend():
    """The CPU engine (what a CPU user gets; the Triton interpreter set up by conftest.py
    cannot read bf16)."""
    with flashtile.use_backend("torch"):
        yield


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


MODELS = {
    "llama-gqa": (LlamaForCausalLM, _llama, "sdpa"),
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


def _count_varlen(monkeypatch):
    calls = []
    real = ft_hf.flash_attn_varlen_func

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ft_hf, "flash_attn_varlen_func", counting)
    return calls


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


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("model", ["llama-gqa", "gpt2", "mistral-window"])
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


def test_register_rejects_names_transformers_misreads():
    assert ft_hf.register() == "tile_attention"
    for bad in ("flashtile", "my_flash", "tile_sdpa", "org/kernel", "eager"):
        with pytest.raises(ValueError, match="must not"):
            ft_hf.register(bad)
    with pytest.raises(ValueError, match="padded"):
        ft_hf.register(padded="unpad")


def test_transformers_refuses_flash_names():
    """Why the name has no "flash": transformers loads such names as hub kernels."""
    transformers.AttentionInterface.register("flashtile_probe", ft_hf.attention_forward)
    with pytest.raises((ValueError, ImportError, OSError)):
        LlamaForCausalLM._from_config(_llama(), attn_implementation="flashtile_probe")


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
