"""CPU tests of the benchmark harness (flashtile.bench); CUDA-only paths run with fakes."""
from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import sys
import types
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flashtile.bench import __main__ as cli
from flashtile.bench import common, memory, report, speed
from flashtile.bench import io as bench_io
from flashtile.bench import variants as bench_variants
from flashtile.reference import algorithms

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")


def _sdpa_stand_in(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, scale=softmax_scale)
    return out.transpose(1, 2)


@pytest.fixture
def stand_in(monkeypatch):
    """Replace flashtile's API inside the harness by SDPA on transposed views."""
    backends_used = []

    @contextlib.contextmanager
    def use_backend(name):
        backends_used.append(name)
        yield

    api = types.SimpleNamespace(flash_attn_func=_sdpa_stand_in, use_backend=use_backend,
                                scaled_dot_product_attention=F.scaled_dot_product_attention)
    monkeypatch.setattr(common, "flashtile_api", lambda: api)
    return backends_used


def _real_flashtile_available() -> bool:
    try:
        common.flashtile_api()
    except ImportError:
        return False
    return True


def _record(impl="flashtile", mode="fwd", causal=False, dtype="bf16", d=64, n=1024, tflops=100.0,
            status="ok", device="NVIDIA H100 80GB HBM3", batch=None, heads=None, peak_bytes=None):
    return common.make_record(
        {"device": device, "torch": "2.11.0", "triton": "3.6.0"}, impl=impl, mode=mode,
        causal=causal, dtype=dtype, d=d, n=n, batch=batch or 16384 // n, heads=heads or 2048 // d,
        tflops=tflops if status == "ok" else None, ms=1.0 if status == "ok" else None,
        status=status, error=None if status == "ok" else "RuntimeError: boom",
        peak_bytes=peak_bytes)


class FakePrepared:
    """A Prepared whose forward counts its calls."""

    def __init__(self, n=8):
        torch.manual_seed(0)
        self.x = torch.randn(2, n, requires_grad=True)
        self.w = torch.randn(n, n, requires_grad=True)
        self.calls = 0

    def fn(self):
        self.calls += 1
        return torch.tanh(self.x @ self.w)

    def prepared(self):
        dout = torch.randn(2, self.w.shape[0])
        return common.Prepared(self.fn, (self.x, self.w), dout)


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "batch,heads,n,d,causal,mode,expected",
    [
        (1, 1, 2, 1, False, "fwd", 16),
        (1, 1, 2, 1, True, "fwd", 8),
        (1, 1, 2, 1, False, "bwd", 40),
        (1, 1, 2, 1, False, "fwd_bwd", 56),
        (1, 1, 2, 1, True, "fwd_bwd", 28),
        (8, 16, 2048, 128, False, "fwd", 4 * 8 * 16 * 2048 ** 2 * 128),
        (4, 32, 4096, 64, True, "bwd", 4 * 4 * 32 * 4096 ** 2 * 64 // 2 * 5 // 2),
    ],
    ids=["fwd", "fwd-causal", "bwd", "fwd_bwd", "fwd_bwd-causal", "fa-shape",
         "fa-shape-bwd-causal"],
)
def test_flops_formula(batch, heads, n, d, causal, mode, expected):
    assert common.flops(batch, heads, n, d, causal, mode) == expected


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flops_mode_ratios(causal):
    fwd = common.flops(2, 16, 4096, 128, causal, "fwd")
    assert common.flops(2, 16, 4096, 128, causal, "bwd") == fwd * 5 // 2
    assert common.flops(2, 16, 4096, 128, causal, "fwd_bwd") == fwd * 7 // 2
    assert {m: common.MODES[m].flops_mult for m in ("fwd", "bwd", "fwd_bwd")} == {
        "fwd": Fraction(1), "bwd": Fraction(5, 2), "fwd_bwd": Fraction(7, 2)}


def test_tflops_of():
    assert common.tflops_of(10 ** 12, 1000.0) == pytest.approx(1.0)
    assert common.tflops_of(3 * 10 ** 12, 2.0) == pytest.approx(1500.0)


# ---------------------------------------------------------------------------------------------
# Argument parsing
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [("512", 512), ("1k", 1024), ("1K", 1024), ("16K", 16384),
                                        (" 2048 ", 2048)], ids=["512", "1k", "1K", "16K", "spaces"])
def test_parse_seqlen(text, value):
    assert common.parse_seqlen(text) == value


@pytest.mark.parametrize("text", ["", "0", "1M", "-4", "1.5K", "abc"],
                         ids=["empty", "zero", "mega", "negative", "fraction", "word"])
def test_parse_seqlen_rejects(text):
    with pytest.raises(Exception, match="bad sequence length"):
        common.parse_seqlen(text)


@pytest.mark.parametrize("text,value", [("bf16", "bf16"), ("bfloat16", "bf16"), ("FP16", "fp16"),
                                        ("half", "fp16"), ("float32", "fp32")],
                         ids=["bf16", "bfloat16", "FP16", "half", "float32"])
def test_parse_dtype(text, value):
    assert common.parse_dtype(text) == value


def test_parse_args_cuda_defaults_are_the_fa_sweep():
    cfg = speed.parse_args(["--device", "cuda"])
    assert cfg.impls == ("flashtile", "sdpa_default", "sdpa_flash", "sdpa_cudnn",
                         "sdpa_efficient", "sdpa_math", "flex")
    assert cfg.modes == ("fwd", "bwd", "fwd_bwd")
    assert cfg.causal == (False, True)
    assert cfg.dtypes == ("bf16", "fp16")
    assert cfg.ds == (64, 128, 256)
    assert cfg.ns == (512, 1024, 2048, 4096, 8192, 16384)
    assert (cfg.tokens, cfg.hidden, cfg.warmup, cfg.rep) == (16384, 2048, 25, 100)
    assert cfg.out is None and cfg.plots == Path("bench_out")  # None: the device's results file
    assert [cfg.batch_for(n) for n in cfg.ns] == [32, 16, 8, 4, 2, 1]
    assert [cfg.heads_for(d) for d in cfg.ds] == [32, 16, 8]


def test_parse_args_cpu_defaults():
    cfg = speed.parse_args(["--device", "cpu"])
    assert cfg.impls == ("flashtile", "sdpa", "sdpa_math")
    assert cfg.dtypes == ("fp32", "bf16") and cfg.ds == (64,)
    assert cfg.ns == (256, 512, 1024, 2048)
    assert all(cfg.batch_for(n) * n == 2048 for n in cfg.ns)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_parse_args_quick_is_smaller(device):
    full = speed.build_plan(speed.parse_args(["--device", device]))
    quick = speed.build_plan(speed.parse_args(["--device", device, "--quick"]))
    assert 0 < len(quick) < len(full)


def test_parse_args_overrides(tmp_path):
    cfg = speed.parse_args([
        "--device", "cuda", "--quick", "--impl", "flashtile,sdpa_math", "flex", "--mode", "bwd",
        "--causal", "1", "--d", "64", "128,256", "--n", "1K", "2k", "512", "--dtype", "bfloat16",
        "fp16", "--warmup", "5", "--rep", "7.5", "--out", str(tmp_path / "all.json"), "--plots",
        str(tmp_path), "--batch", "3", "--hidden", "1024", "--time-limit", "60",
        "--no-plot", "--no-progress", "--seed", "4", "--no-device-ceilings"])
    assert cfg.impls == ("flashtile", "sdpa_math", "flex")
    assert cfg.modes == ("bwd",)
    assert cfg.causal == (True,)
    assert cfg.ds == (64, 128, 256)
    assert cfg.ns == (1024, 2048, 512)
    assert cfg.dtypes == ("bf16", "fp16")
    assert (cfg.warmup, cfg.rep) == (5.0, 7.5)
    assert cfg.out == tmp_path / "all.json" and cfg.plots == tmp_path
    assert cfg.batch_for(512) == 3 and cfg.heads_for(256) == 4
    assert (cfg.time_limit, cfg.plot, cfg.progress, cfg.seed, cfg.ceilings) == (60, False, False,
                                                                                4, False)


@pytest.mark.parametrize("flag,expected", [("0", (False,)), ("1", (True,)),
                                           ("both", (False, True))], ids=["0", "1", "both"])
def test_parse_args_causal(flag, expected):
    assert speed.parse_args(["--device", "cpu", "--causal", flag]).causal == expected


def test_parse_args_all_selects_every_name():
    cfg = speed.parse_args(["--device", "cpu", "--impl", "all", "--mode", "all"])
    assert cfg.impls == tuple(common.IMPLS) and cfg.modes == tuple(common.MODES)


@pytest.mark.parametrize(
    "argv",
    [["--impl", "nope"], ["--mode", "decode"], ["--causal", "2"], ["--dtype", "int8"],
     ["--n", "1M"], ["--d", "0"], ["--impl", "all", "flashtile"]],
    ids=["impl", "mode", "causal", "dtype", "n", "d", "all-mixed"],
)
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit) as info:
        speed.parse_args(["--device", "cpu"] + argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_build_plan_groups_shapes_and_flex_sets():
    cfg = speed.parse_args(["--device", "cuda"])
    plan = speed.build_plan(cfg)
    assert len(plan) == len(speed.GPU_IMPLS) * 3 * 2 * 2 * 3 * 6 == 7 * 3 * 2 * 2 * 3 * 6
    assert len(set(plan)) == len(plan)
    assert all(c.batch * c.n == 16384 and c.heads * c.d == 2048 for c in plan)
    # each shape's cases are contiguous, and so are those of each (shape, causal) set
    for key in (lambda c: c.shape_key, lambda c: c.shape_key + (c.causal,)):
        seen, last = set(), None
        for case in plan:
            k = key(case)
            if k != last:
                assert k not in seen
                seen.add(k)
                last = k


# ---------------------------------------------------------------------------------------------
# Inputs and implementations
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,torch_dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                               ("fp16", torch.float16)],
                         ids=["fp32", "bf16", "fp16"])
def test_make_inputs(dtype, torch_dtype):
    inp = common.make_inputs(2, 16, 3, 8, dtype, "cpu", seed=1)
    tensors = (inp.q, inp.k, inp.v, inp.dout)
    for t in tensors:
        assert t.shape == (2, 16, 3, 8) and t.dtype == torch_dtype and t.is_contiguous()
        assert not t.requires_grad and t.float().abs().sum() > 0 and t.float().std() > 0.5
    assert not torch.equal(inp.q, inp.k) and not torch.equal(inp.k, inp.v)
    assert (inp.batch, inp.n, inp.heads, inp.d) == (2, 16, 3, 8)
    assert inp.nbytes() == 4 * 2 * 16 * 3 * 8 * torch.tensor([], dtype=torch_dtype).element_size()
    again = common.make_inputs(2, 16, 3, 8, dtype, "cpu", seed=1)
    assert torch.equal(inp.q, again.q)


@pytest.mark.parametrize("impl", ["sdpa", "sdpa_math", "sdpa_flash"])
def test_sdpa_peers_use_bhnd_copies_of_the_same_data(impl):
    inp = common.make_inputs(2, 16, 3, 8, "fp32", "cpu")
    prep = common.IMPLS[impl].prepare(inp, False, 8 ** -0.5)
    for leaf, src in zip(prep.leaves, (inp.q, inp.k, inp.v)):
        assert leaf.shape == (2, 3, 16, 8) and leaf.is_contiguous()
        assert leaf.is_leaf and leaf.requires_grad
        assert torch.equal(leaf.detach(), src.transpose(1, 2))
        assert leaf.data_ptr() != src.data_ptr()
    assert torch.equal(prep.dout, inp.dout.transpose(1, 2)) and prep.dout.is_contiguous()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_peers_and_flashtile_agree(stand_in, causal):
    """flashtile (its own layout and the SDPA drop-in on the peers' ``(B, H, N, d)`` copies)
    and the SDPA peers compute the same attention of the same inputs."""
    inp = common.make_inputs(1, 32, 2, 16, "fp32", "cpu")
    outs = {}
    for name in ("flashtile", "flashtile_sdpa", "sdpa", "sdpa_math"):
        with common.IMPLS[name].context(inp.device):
            out = common.IMPLS[name].prepare(inp, causal, 0.25).fn()
        outs[name] = out if name != "flashtile" else out.transpose(1, 2)
    torch.testing.assert_close(outs["flashtile"], outs["sdpa"])
    torch.testing.assert_close(outs["flashtile_sdpa"], outs["sdpa"])
    torch.testing.assert_close(outs["sdpa_math"], outs["sdpa"])
    assert stand_in == ["torch", "torch"]


@pytest.mark.skipif(not _real_flashtile_available(), reason="flashtile not importable")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_flashtile_sdpa_impl_runs_the_drop_in_on_bhnd_copies(causal):
    """``flashtile_sdpa``: flashtile's own ``scaled_dot_product_attention`` (the real API) on
    ``(B, H, N, d)`` copies of the inputs, equal to PyTorch's SDPA on them, forward and
    backward (the bwd mode's gradients)."""
    inp = common.make_inputs(1, 32, 2, 16, "fp32", "cpu")
    with common.IMPLS["flashtile_sdpa"].context(inp.device):
        prep = common.IMPLS["flashtile_sdpa"].prepare(inp, causal, 0.25)
        out = prep.fn()
        grads = common.MODES["bwd"].build(prep)()
    assert all(x.shape == (1, 2, 32, 16) and x.is_contiguous() for x in prep.leaves)
    q, k, v = (x.detach().clone().requires_grad_() for x in prep.leaves)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.25)
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), prep.dout)):
        torch.testing.assert_close(got, want)


def test_flashtile_leaves_share_the_inputs(stand_in):
    inp = common.make_inputs(1, 32, 2, 16, "fp32", "cpu")
    prep = common.IMPLS["flashtile"].prepare(inp, True, 0.25)
    assert [t.data_ptr() for t in prep.leaves] == [inp.q.data_ptr(), inp.k.data_ptr(),
                                                   inp.v.data_ptr()]
    assert all(t.is_leaf and t.requires_grad for t in prep.leaves)
    assert prep.dout is inp.dout


def test_flashtile_context_picks_backend_by_device(stand_in):
    with common.IMPLS["flashtile"].context(torch.device("cpu")):
        pass
    with common.IMPLS["flashtile"].context(torch.device("cuda")):
        pass
    assert stand_in == ["torch", "triton"]


# ---------------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------------

def test_fwd_mode_times_the_forward():
    fake = FakePrepared()
    run = common.MODES["fwd"].build(fake.prepared())
    assert fake.calls == 0
    run()
    run()
    assert fake.calls == 2


def test_bwd_mode_times_only_the_backward():
    fake = FakePrepared()
    prep = fake.prepared()
    run = common.MODES["bwd"].build(prep)
    assert fake.calls == 1  # the untimed forward
    grads = [run() for _ in range(3)]
    assert fake.calls == 1
    expected = torch.autograd.grad(fake.fn(), prep.leaves, prep.dout)
    for g in grads:
        for a, b in zip(g, expected):
            torch.testing.assert_close(a, b)
    assert all(t.grad is None for t in prep.leaves)


def test_fwd_bwd_mode_runs_both_each_call():
    fake = FakePrepared()
    prep = fake.prepared()
    run = common.MODES["fwd_bwd"].build(prep)
    assert fake.calls == 0
    g1, g2 = run(), run()
    assert fake.calls == 2
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    assert all(t.grad is None for t in prep.leaves)


def test_a_mode_is_one_function_and_an_entry(monkeypatch, tmp_path):
    def last_query(inp):
        return common.Inputs(inp.q[:, -1:].contiguous(), inp.k, inp.v, inp.dout[:, -1:].contiguous())

    def one_query_flops(batch, heads, n, d, causal):
        return 4 * batch * heads * n * d

    shapes = []

    def build(prep):
        shapes.append(tuple(prep.leaves[0].shape))
        return prep.fn

    monkeypatch.setitem(common.MODES, "last_query", common.Mode(
        build, inputs_fn=last_query, flops_fn=one_query_flops))
    assert common.flops(2, 4, 128, 16, False, "last_query") == 4 * 2 * 4 * 128 * 16
    cfg = speed.parse_args(TINY + ["--impl", "sdpa", "--mode", "last_query", "--causal", "0",
                                   "--n", "128", "--out", str(tmp_path / "r.json"), "--no-plot",
                                   "--no-device-ceilings"])
    (rec,) = speed.run_speed(cfg, timer=lambda fn: (fn(), 0.5)[1], stdout=io.StringIO())
    assert rec["status"] == "ok" and rec["mode"] == "last_query"
    assert rec["tflops"] == pytest.approx(4 * 2 * 2 * 128 * 32 / 0.5e-3 / 1e12)
    assert shapes == [(2, 2, 1, 32)]


@pytest.mark.parametrize("impl", ["sdpa", "sdpa_math"])
def test_bwd_mode_gradients_match_autograd(impl):
    inp = common.make_inputs(1, 24, 2, 8, "fp32", "cpu")
    with common.IMPLS[impl].context(inp.device):
        prep = common.IMPLS[impl].prepare(inp, True, 0.3)
        grads = common.MODES["bwd"].build(prep)()
    q, k, v = (t.transpose(1, 2).clone().requires_grad_() for t in (inp.q, inp.k, inp.v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    expected = torch.autograd.grad(ref, (q, k, v), inp.dout.transpose(1, 2))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------
# Timers
# ---------------------------------------------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.mark.parametrize(
    "durations_ms,warmup,rep,min_reps,expected_median,expected_calls",
    [
        ([1.0] * 200, 0.0, 10.0, 3, 1.0, 10),
        ([50.0, 4.0, 6.0, 5.0, 100.0] + [5.0] * 20, 0.0, 1.0, 5, 6.0, 5),
        ([2.0] * 100, 10.0, 20.0, 3, 2.0, 15),
    ],
    ids=["fills-rep", "min-reps", "warmup"],
)
def test_cpu_bench(durations_ms, warmup, rep, min_reps, expected_median, expected_calls):
    clock = FakeClock()
    durations = iter(durations_ms)
    calls = []

    def fn():
        calls.append(1)
        clock.t += next(durations) * 1e-3

    median = common.cpu_bench(fn, warmup=warmup, rep=rep, min_reps=min_reps, clock=clock)
    assert median == pytest.approx(expected_median)
    assert len(calls) == expected_calls


def test_cpu_bench_real_clock():
    calls = []
    ms = common.cpu_bench(lambda: calls.append(sum(range(1000))), warmup=1, rep=2, min_reps=3,
                         max_reps=50)
    assert 0 < ms < 1000 and 3 <= len(calls)


def test_cuda_timer_is_do_bench_median(monkeypatch):
    testing = pytest.importorskip("triton.testing")
    seen = {}

    def fake_do_bench(fn, **kwargs):
        fn()
        seen.update(kwargs)
        return 1.25

    monkeypatch.setattr(testing, "do_bench", fake_do_bench)
    calls = []
    timer = common.make_timer("cuda", 25, 100)
    assert timer(lambda: calls.append(1)) == 1.25
    assert seen == {"warmup": 25, "rep": 100, "return_mode": "median"} and calls == [1]


def test_cpu_timer_uses_cpu_bench(monkeypatch):
    seen = {}
    monkeypatch.setattr(common, "cpu_bench", lambda fn, **kw: seen.update(kw) or 3.0)
    assert common.make_timer("cpu", 1, 2)(lambda: None) == 3.0
    assert seen == {"warmup": 1, "rep": 2}


# ---------------------------------------------------------------------------------------------
# run_case and records
# ---------------------------------------------------------------------------------------------

CPU_ENV = {"device": "cpu", "torch": torch.__version__, "triton": None}


def _case(impl, mode="fwd", causal=False, n=32, d=16, dtype="fp32", batch=2, heads=2):
    return common.Case(impl, mode, causal, dtype, d, n, batch, heads)


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd_bwd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_run_case_ok_record(mode, causal):
    case = _case("sdpa", mode, causal)
    inp = common.make_inputs(case.batch, case.n, case.heads, case.d, case.dtype, "cpu")
    timed = []
    rec = common.run_case(case, inp, lambda fn: timed.append(fn()) or 2.0, CPU_ENV)
    assert tuple(rec) == common.RECORD_KEYS
    assert rec["status"] == "ok" and rec["error"] is None and rec["peak_bytes"] is None
    assert rec["ms"] == 2.0
    assert rec["tflops"] == pytest.approx(case.flops() / 2e-3 / 1e12)
    assert {k: rec[k] for k in ("impl", "mode", "causal", "dtype", "d", "n", "batch", "heads")} == {
        "impl": "sdpa", "mode": mode, "causal": causal, "dtype": "fp32", "d": 16, "n": 32,
        "batch": 2, "heads": 2}
    assert rec["device"] == "cpu" and rec["torch"] == torch.__version__
    date = datetime.datetime.fromisoformat(rec["date"])
    assert date.utcoffset() == datetime.timedelta(0)
    assert len(timed) == 1


@pytest.mark.parametrize("impl", ["sdpa_cudnn", "sdpa_efficient"])
def test_run_case_unsupported_peer(impl):
    case = _case(impl)
    inp = common.make_inputs(case.batch, case.n, case.heads, case.d, case.dtype, "cpu")
    rec = common.run_case(case, inp, lambda fn: pytest.fail("must not time"), CPU_ENV)
    assert rec["status"] == "unsupported"
    assert rec["tflops"] is None and rec["ms"] is None
    assert rec["error"].startswith("RuntimeError: ") and "\n" not in rec["error"]


def _raising_impl(exc, peer):
    def prepare(inp, causal, scale):
        raise exc
    return common.Impl(prepare, peer=peer)


@pytest.mark.parametrize(
    "exc,peer,status",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"), True, "oom"),
        (RuntimeError("CUDA error: out of memory\nmore"), False, "oom"),
        (RuntimeError("No available kernel. Aborting execution."), True, "unsupported"),
        (NotImplementedError("head dim 512"), False, "unsupported"),
        (ValueError("headdim must be <= 256"), False, "unsupported"),
        (RuntimeError("illegal memory access"), False, "error"),
        (ImportError("flashtile.flash_attn_func is not available"), False, "error"),
    ],
    ids=["oom-type", "oom-text", "peer-refusal", "notimpl", "valueerror", "ft-runtime",
         "ft-import"],
)
def test_run_case_failures(monkeypatch, exc, peer, status):
    monkeypatch.setitem(common.IMPLS, "fake", _raising_impl(exc, peer))
    case = _case("fake")
    inp = common.make_inputs(case.batch, case.n, case.heads, case.d, case.dtype, "cpu")
    rec = common.run_case(case, inp, lambda fn: 1.0, CPU_ENV)
    assert rec["status"] == status
    assert rec["error"].startswith(f"{type(exc).__name__}: ")
    assert "\n" not in rec["error"] and "more" not in rec["error"]
    assert rec["tflops"] is None and rec["ms"] is None


@pytest.mark.parametrize("peer", [True, False], ids=["peer", "flashtile"])
def test_broken_cuda_context_is_an_error(monkeypatch, peer):
    exc = RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors")
    monkeypatch.setitem(common.IMPLS, "fake", _raising_impl(exc, peer))
    case = _case("fake")
    inp = common.make_inputs(case.batch, case.n, case.heads, case.d, case.dtype, "cpu")
    rec = common.run_case(case, inp, lambda fn: 1.0, CPU_ENV)
    assert rec["status"] == "error" and common.is_fatal(rec["error"])


def test_run_case_appends_warnings_to_the_error(monkeypatch):
    def prepare(inp, causal, scale):
        import warnings
        warnings.warn("Flash attention requires something", stacklevel=1)
        raise RuntimeError("No available kernel. Aborting execution.")
    monkeypatch.setitem(common.IMPLS, "fake", common.Impl(prepare))
    case = _case("fake")
    inp = common.make_inputs(case.batch, case.n, case.heads, case.d, case.dtype, "cpu")
    rec = common.run_case(case, inp, lambda fn: 1.0, CPU_ENV)
    assert rec["error"] == ("RuntimeError: No available kernel. Aborting execution. "
                            "[warnings: Flash attention requires something]")


def test_run_case_raise_errors(monkeypatch):
    monkeypatch.setitem(common.IMPLS, "fake", _raising_impl(RuntimeError("boom"), True))
    case = _case("fake")
    inp = common.make_inputs(case.batch, case.n, case.heads, case.d, case.dtype, "cpu")
    with pytest.raises(RuntimeError, match="boom"):
        common.run_case(case, inp, lambda fn: 1.0, CPU_ENV, raise_errors=True)


def test_run_case_timer_failure_is_recorded():
    case = _case("sdpa")
    inp = common.make_inputs(case.batch, case.n, case.heads, case.d, case.dtype, "cpu")

    def timer(fn):
        raise torch.OutOfMemoryError("CUDA out of memory")

    assert common.run_case(case, inp, timer, CPU_ENV)["status"] == "oom"


def test_make_record_rejects_unknown_fields():
    with pytest.raises(KeyError, match="bogus"):
        common.make_record(CPU_ENV, bogus=1)


def test_first_line_truncates():
    assert common.first_line(RuntimeError("")) == "RuntimeError"
    assert common.first_line(ValueError("\n  a\nb")) == "ValueError: a"
    assert len(common.first_line(RuntimeError("x" * 1000), limit=50)) == 50


def test_runtime_env_cpu():
    env = common.runtime_env("cpu")
    assert env["device"] == "cpu" and env["torch"] == torch.__version__
    assert set(env) == {"device", "torch", "triton"}


# ---------------------------------------------------------------------------------------------
# FlexAttention wiring (compile mocked: CPU flex has no backward and compiles for a minute)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def fake_compile(monkeypatch):
    counts = {"compile": 0, "reset": 0, "block_masks": []}

    def compile_(fn, dynamic=None, **kwargs):
        assert dynamic is False
        counts["compile"] += 1

        def compiled(q, k, v, block_mask=None, scale=None):
            counts["block_masks"].append(block_mask)
            return F.scaled_dot_product_attention(q, k, v, is_causal=block_mask is not None,
                                                  scale=scale)
        return compiled

    def reset():
        counts["reset"] += 1

    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(torch._dynamo, "reset", reset)
    common.reset_flex_cache()
    yield counts
    common.reset_flex_cache()


def test_flex_compiles_once_per_shape_set(fake_compile):
    a = common.make_inputs(1, 256, 2, 16, "fp32", "cpu")
    b = common.make_inputs(1, 128, 2, 16, "fp32", "cpu")
    for _ in range(3):
        common.IMPLS["flex"].prepare(a, False, 0.25).fn()
    assert (fake_compile["compile"], fake_compile["reset"]) == (1, 1)
    assert fake_compile["block_masks"] == [None] * 3
    prep = common.IMPLS["flex"].prepare(a, True, 0.25)
    prep.fn()
    common.IMPLS["flex"].prepare(a, True, 0.25).fn()
    assert (fake_compile["compile"], fake_compile["reset"]) == (2, 2)
    masks = fake_compile["block_masks"][3:]
    assert masks[0] is masks[1] and masks[0] is not None
    assert masks[0].shape[-2:] == (256, 256)
    assert prep.leaves[0].shape == (1, 2, 256, 16) and prep.leaves[0].is_contiguous()
    common.IMPLS["flex"].prepare(b, True, 0.25)
    assert (fake_compile["compile"], fake_compile["reset"]) == (3, 3)


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd_bwd"])
def test_flex_run_case_with_mocked_compile(fake_compile, mode):
    case = _case("flex", mode, True, n=128)
    inp = common.make_inputs(case.batch, case.n, case.heads, case.d, case.dtype, "cpu")
    rec = common.run_case(case, inp, lambda fn: (fn(), 1.0)[1], CPU_ENV)
    assert rec["status"] == "ok", rec["error"]


def test_flex_context_disables_donated_buffers():
    import torch._functorch.config as cfg

    if not hasattr(cfg, "donated_buffer"):
        pytest.skip("this torch has no donated buffers")
    before = cfg.donated_buffer
    with common.IMPLS["flex"].context(torch.device("cpu")):
        assert cfg.donated_buffer is False
    assert cfg.donated_buffer == before


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------

def test_write_json_roundtrip(tmp_path):
    recs = [_record(), _record(impl="sdpa_math", status="oom")]
    path = common.write_json(tmp_path / "sub" / "results.json", recs)
    assert json.loads(path.read_text()) == recs
    assert common.load_records(path) == recs
    assert not list(path.parent.glob("*.tmp"))


def test_merge_json_appends_and_replaces(tmp_path):
    path = tmp_path / "h100.json"
    common.write_result(path, "decode", [{"impl": "flashtile", "ms": 0.1}])
    first = [_record(n=1024, tflops=100.0), _record(n=2048, tflops=110.0)]
    common.merge_result(path, "speed", first)
    assert common.load_records(path, "speed") == first
    rerun = _record(n=2048, tflops=120.0)
    other_mode = _record(mode="bwd", n=2048, tflops=90.0)
    other_device = _record(n=2048, tflops=50.0, device="NVIDIA A100")
    common.merge_result(path, "speed", [rerun, other_mode, other_device])
    merged = common.load_records(path, "speed")
    assert merged == [first[0], rerun, other_mode, other_device]
    # the other entries of the file are kept, in their order
    assert list(common.read_results(path)) == ["decode", "speed"]
    assert common.read_result(path, "decode") == [{"impl": "flashtile", "ms": 0.1}]


def test_write_result_replaces_one_entry_atomically(tmp_path):
    path = tmp_path / "results" / "cpu.json"
    assert common.read_results(path) == {} and common.load_records(path, "speed") == []
    common.write_result(path, "device", {"copy_bandwidth_GBps": 10.0})
    common.write_result(path, "cpu_b1h8n4096", {"threads": 2})
    common.write_result(path, "device", {"copy_bandwidth_GBps": 12.0})
    assert common.read_results(path) == {"device": {"copy_bandwidth_GBps": 12.0},
                                         "cpu_b1h8n4096": {"threads": 2}}
    assert sorted(p.name for p in path.parent.iterdir()) == ["cpu.json"]  # no temporary left
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="one entry per benchmark"):
        common.write_result(path, "device", {})


def test_results_path_names_the_device(monkeypatch):
    assert common.results_path("cpu") == Path("benchmarks/results/cpu.json")
    assert common.results_path("cpu", "x.json") == Path("x.json")
    for name, tag in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"),
                      ("NVIDIA GeForce RTX 4090", "rtx4090"), ("AMD Instinct MI300X", "mi300x")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert common.device_tag("cuda") == tag, name


def test_merge_replaces_max_seqlen_whatever_its_n():
    old = _record(mode=common.MAX_SEQLEN_MODE, n=65536, impl="flashtile", batch=1, heads=16)
    new = _record(mode=common.MAX_SEQLEN_MODE, n=131072, impl="flashtile", batch=1, heads=16)
    assert common.merge_records([old], [new]) == [new]


@pytest.mark.parametrize("content", ['{"a": 1}', "[1, 2]"], ids=["dict", "ints"])
def test_load_records_rejects_non_lists(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="expected a JSON list"):
        common.load_records(path)


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------

def _rows(table: str) -> list[list[str]]:
    """The Markdown rows of ``table`` (the line above them says the unit)."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("|")]


def test_speed_rounds_keep_each_cases_median_and_rotate_the_order(tmp_path):
    """--rounds 3: every case of a shape is timed three times, the cases interleaved and their
    order rotated each round; each record keeps the median round's time and lists all three."""
    cfg = speed.parse_args(TINY + ["--impl", "sdpa", "flashtile", "--mode", "fwd", "--causal", "0",
                                   "--n", "128", "--rounds", "3", "--out", str(tmp_path / "r.json"),
                                   "--no-plot", "--no-device-ceilings"])
    order, script = [], iter([4.0, 1.0, 2.0, 8.0, 3.0, 6.0])

    def timer(fn):
        fn()
        order.append(len(order))
        return next(script)

    recs = speed.run_speed(cfg, timer=timer, stdout=io.StringIO())
    assert len(order) == 6 and [r["impl"] for r in recs] == ["sdpa", "flashtile"]
    # round 0: sdpa 4, flashtile 1; round 1 (rotated): flashtile 2, sdpa 8; round 2: sdpa 3,
    # flashtile 6
    assert recs[0]["ms_rounds"] == [4.0, 8.0, 3.0] and recs[0]["ms"] == 4.0
    assert recs[1]["ms_rounds"] == [1.0, 2.0, 6.0] and recs[1]["ms"] == 2.0
    assert all(r["status"] == "ok" for r in recs)


def test_io_l2reuse_sweep_keeps_l2_between_kernels():
    """The l2reuse sweep (flashtile's default backward, the deterministic one and the chunked
    one) runs under ncu with --cache-control none, the other sweeps with ncu's default (caches
    emptied per kernel)."""
    cases = bench_io.build_cases(["fig2", "l2reuse"], quick=True)
    reuse = [c for c in cases if c.sweep == "l2reuse"]
    assert [c.impl for c in reuse] == ["flashtile", "flashtile_deterministic", "flashtile_chunked"]
    assert (reuse[0].n, reuse[0].d, reuse[0].heads, reuse[0].batch) == (1024, 64, 16, 64)
    modes = {bench_io.CACHE_CONTROL.get(c.sweep, "all") for c in cases}
    assert modes == {"all", "none"}
    cmd = bench_io.ncu_command("ncu", "plan.json", "log.jsonl", False, "none")
    assert cmd[cmd.index("--cache-control") + 1] == "none"


def test_io_pinned_tiles_select_the_portable_kernels(monkeypatch):
    """A blocks-sweep case pins Triton tiles: its runs switch the Hopper kernels off (they have
    tiles of their own) and its records carry the pinned tiles; an unpinned case leaves the
    switch alone and, off sm_90, records the tuned Triton tiles."""
    monkeypatch.delenv("FLASHTILE_SM90", raising=False)
    case = bench_io.Case("blocks", "flashtile", n=128, d=64, heads=2, batch=1, dtype="float32",
                         fwd=(64, 32, 4, 2))
    run = bench_io.Runner(case.impl, case.n, case.d, case.heads, case.batch, case.dtype,
                          configs={"fwd": case.fwd}, device="cpu")
    with run._context():
        assert os.environ["FLASHTILE_SM90"] == "0"
    assert "FLASHTILE_SM90" not in os.environ
    assert bench_io.used_configs(case, "cpu", run)["fwd"] == [64, 32, 4, 2]
    plain = bench_io.Case("fig2", "flashtile", n=128, d=64, heads=2, batch=1, dtype="float32")
    run = bench_io.Runner(plain.impl, plain.n, plain.d, plain.heads, plain.batch, plain.dtype,
                          device="cpu")
    with run._context():
        assert "FLASHTILE_SM90" not in os.environ
    assert bench_io.used_configs(plain, "cpu", run) == bench_io.used_configs(plain, "cpu")


def test_io_kernel_rows_sum_the_launches_of_a_chunked_pass():
    """A chunked backward launches each kernel once per chunk: the per-kernel rows of the io
    report sum them (bytes and time), count the launches, and keep the model's numbers once."""
    def k(name, read, ms):
        return dict(name=name, dram_read_bytes=read, dram_write_bytes=1, l2_bytes=None, ms=ms,
                    model_dram_bytes=500)

    rows = bench_io._by_kernel([k("dq", 10, 0.5), k("dkdv", 3, 1.0), k("dq", 20, 0.25),
                                k("dkdv", 4, 1.0)])
    assert [(r["name"], r["launches"]) for r in rows] == [("dq", 2), ("dkdv", 2)]
    assert (rows[0]["dram_read_bytes"], rows[0]["dram_write_bytes"], rows[0]["ms"]) == (30, 2, 0.75)
    assert rows[1]["l2_bytes"] is None and rows[1]["model_dram_bytes"] == 500


def test_render_table_cells_and_ratios():
    recs = [
        _record("flashtile", n=1024, tflops=300.0),
        _record("sdpa_flash", n=1024, tflops=200.0),
        _record("sdpa_math", n=1024, status="oom"),
        _record("flashtile", n=2048, tflops=12.345),
        _record("sdpa_flash", n=2048, status="unsupported"),
        _record("flashtile", n=1024, mode="bwd", causal=True, tflops=0.5),
    ]
    rows = _rows(report.render_table(recs))
    header, body = rows[0], rows[2:]
    assert header == ["mode", "causal", "dtype", "d", "n", "B", "H", "flashtile", "sdpa_flash",
                      "sdpa_math", "ft/sdpa_flash", "ft/sdpa_math"]
    assert set(rows[1][0]) <= {"-", ":"}
    assert body == [
        ["fwd", "0", "bf16", "64", "1K", "16", "32", "300", "200", "oom", "1.50", "-"],
        ["fwd", "0", "bf16", "64", "2K", "8", "32", "12.3", "unsup", "-", "-", "-"],
        ["bwd", "1", "bf16", "64", "1K", "16", "32", "0.5", "-", "-", "-", "-"],
    ]


def test_render_table_later_record_wins_and_devices_split():
    recs = [_record(tflops=1.0), _record(tflops=2.0), _record(tflops=3.0, device="cpu")]
    text = report.render_table(recs)
    assert "device: NVIDIA H100 80GB HBM3" in text and "device: cpu" in text
    rows = _rows("\n".join(ln for ln in text.splitlines() if ln.startswith("|")))
    cells = [row[-1] for row in rows if row[0] == "fwd"]
    assert cells == ["2.00", "3.00"]


def test_render_table_without_flashtile_has_no_ratios():
    rows = _rows(report.render_table([_record("sdpa_flash"), _record("sdpa_math")]))
    assert not any(h.startswith("ft/") for h in rows[0])


def test_render_table_ignores_memory_records():
    assert report.render_table([_record(mode=common.MEMORY_MODE, peak_bytes=1)]) == \
        "(no speed records)"


def test_render_memory_table():
    recs = [
        _record("flashtile", mode="memory", n=1024, peak_bytes=2 ** 29, batch=1, heads=16),
        _record("sdpa_math", mode="memory", n=1024, peak_bytes=2 ** 31, batch=1, heads=16),
        _record("flashtile", mode="memory", n=2048, peak_bytes=2 ** 30, batch=1, heads=16),
        _record("sdpa_math", mode="memory", n=2048, status="oom", batch=1, heads=16),
        _record("flashtile", mode="max_seqlen", n=2048, peak_bytes=2 ** 30, batch=1, heads=16),
        _record("sdpa_math", mode="max_seqlen", n=1024, peak_bytes=2 ** 31, batch=1, heads=16),
    ]
    rows = _rows(memory.render_memory_table(recs))
    assert rows[0] == ["n", "flashtile GiB", "sdpa_math GiB"]
    assert rows[2:] == [["1K", "0.500", "2.000"], ["2K", "1.000", "oom"], ["longest", "2K", "1K"]]


@pytest.mark.parametrize("n,text", [(512, "512"), (1024, "1K"), (16384, "16K"), (1536, "1536"),
                                    (None, "-")], ids=["512", "1K", "16K", "odd", "none"])
def test_format_n(n, text):
    assert report.format_n(n) == text


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_one_png_per_mode_causal_dtype_d(tmp_path):
    pytest.importorskip("matplotlib")
    recs = [_record(impl, mode, causal, "bf16", d, n, tflops=float(n) / 100)
            for impl in ("flashtile", "sdpa_flash") for mode in ("fwd", "bwd")
            for causal in (False, True) for d in (64, 128) for n in (512, 1024, 2048)]
    recs.append(_record("sdpa_math", "fwd", False, "bf16", 64, 2048, status="oom"))
    paths = report.plot(recs, tmp_path / "plots")
    names = sorted(p.name for p in paths)
    assert names == sorted(f"{m}_{c}_bf16_d{d}.png" for m in ("fwd", "bwd")
                           for c in ("full", "causal") for d in (64, 128))
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC


def test_plot_prefixes_device_when_several(tmp_path):
    pytest.importorskip("matplotlib")
    paths = report.plot([_record(), _record(device="cpu")], tmp_path)
    assert sorted(p.name for p in paths) == ["cpu_fwd_full_bf16_d64.png",
                                             "nvidia_h100_80gb_hbm3_fwd_full_bf16_d64.png"]


def test_plot_ratio_one_png_of_shapes_with_both_impls(tmp_path, monkeypatch):
    """--ratio-png: one figure of flashtile's TFLOP/s over the peer's, over the shapes where
    both ran (in one device); nothing when no shape has both."""
    pytest.importorskip("matplotlib")
    recs = [_record("flashtile", "fwd", c, "bf16", 128, n, tflops=300.0) for c in (False, True)
            for n in (1024, 8192)]
    recs += [_record("sdpa_default", "fwd", c, "bf16", 128, n, tflops=400.0) for c in (False, True)
             for n in (1024,)]
    ratios = {}
    real_bar = __import__("matplotlib.axes", fromlist=["Axes"]).Axes.bar

    def bar(self, xs, ys, *args, **kwargs):
        ratios.setdefault(self.get_title() or "untitled", []).extend(ys)
        return real_bar(self, xs, ys, *args, **kwargs)

    monkeypatch.setattr("matplotlib.axes.Axes.bar", bar)
    path = report.plot_ratio(recs, "sdpa_default", tmp_path / "ratio.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert sorted(sum(ratios.values(), [])) == [0.75, 0.75]  # N=8K has no peer: not drawn
    assert report.plot_ratio(recs, "flex", tmp_path / "none.png") is None


def test_plot_memory(tmp_path):
    pytest.importorskip("matplotlib")
    recs = [_record(impl, mode="memory", n=n, peak_bytes=n * 1000, batch=1, heads=16)
            for impl in ("flashtile", "sdpa_math") for n in (1024, 2048)]
    recs.append(_record("flashtile", mode="max_seqlen", n=2048, batch=1, heads=16))
    paths = memory.plot_memory(recs, tmp_path)
    assert [p.name for p in paths] == ["memory.png"]
    assert paths[0].read_bytes()[:8] == PNG_MAGIC


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert report.plot([_record()], tmp_path) == []
    assert memory.plot_memory([_record(mode="memory", peak_bytes=1)], tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Device ceilings
# ---------------------------------------------------------------------------------------------

def test_device_ceilings_cpu_formula():
    info = speed.measure_device_ceilings("cpu", lambda fn: (fn(), 2.0)[1],
                                         copy_bytes=1 << 20, matmul_n=64)
    assert info["copy_bytes"] == 1 << 20
    assert info["copy_bandwidth_GBps"] == pytest.approx(2 * (1 << 20) / 2e-3 / 1e9)
    assert info["matmul_tflops"] == pytest.approx(2 * 64 ** 3 / 2e-3 / 1e12)
    assert info["matmul_shape"] == [64, 64, 64] and info["matmul_dtype"] == "fp32"
    assert info["device"] == "cpu" and "date" in info
    json.dumps(info)


# ---------------------------------------------------------------------------------------------
# Memory sweep (CUDA allocator replaced by a fake)
# ---------------------------------------------------------------------------------------------

class FakeMemory:
    def __init__(self):
        self.base, self.current, self.peak_value = 1000, 1000, 1000
        self.resets = 0

    def reset_peak(self):
        self.resets += 1
        self.peak_value = self.current

    def allocated(self):
        return self.current

    def peak(self):
        return self.peak_value

    def synchronize(self):
        pass

    def empty_cache(self):
        pass


def _memory_impl(mem, bytes_per_n, oom_above, peer=True):
    def prepare(inp, causal, scale):
        q = inp.q.detach().requires_grad_()

        def fn():
            if inp.n > oom_above:
                raise torch.OutOfMemoryError("CUDA out of memory")
            mem.peak_value = max(mem.peak_value, mem.current + bytes_per_n * inp.n)
            return q * 2
        return common.Prepared(fn, (q,), inp.dout)
    return common.Impl(prepare, peer=peer)


def test_run_memory_sweep_and_longest(monkeypatch, tmp_path, capsys):
    mem = FakeMemory()
    monkeypatch.setitem(common.IMPLS, "linear", _memory_impl(mem, 10, 1 << 30, peer=False))
    monkeypatch.setitem(common.IMPLS, "quadratic", _memory_impl(mem, 1000, 256))
    cfg = memory.MemoryConfig(device="cpu", impls=("linear", "quadratic"), n_min=64, n_max=1024,
                             batch=1, heads=2, d=8, dtype="fp32", out=tmp_path / "all.json",
                             progress=False, plot=False)
    records = memory.run_memory(cfg, mem=mem)
    sweep = [r for r in records if r["mode"] == "memory"]
    assert [(r["impl"], r["n"], r["status"]) for r in sweep] == [
        ("linear", 64, "ok"), ("quadratic", 64, "ok"), ("linear", 128, "ok"),
        ("quadratic", 128, "ok"), ("linear", 256, "ok"), ("quadratic", 256, "ok"),
        ("linear", 512, "ok"), ("quadratic", 512, "oom"), ("linear", 1024, "ok")]
    assert [r["peak_bytes"] for r in sweep if r["impl"] == "linear"] == [640, 1280, 2560, 5120,
                                                                         10240]
    assert all(tuple(r) == common.RECORD_KEYS for r in records)
    longest = {r["impl"]: r for r in records if r["mode"] == "max_seqlen"}
    assert longest["linear"]["n"] == 1024 and longest["linear"]["error"] is None
    assert longest["quadratic"]["n"] == 256 and longest["quadratic"]["status"] == "ok"
    assert longest["quadratic"]["error"].startswith("oom at n=512")
    assert common.read_results(tmp_path / "all.json") == {"memory": records}  # no speed entry
    assert common.load_records(tmp_path / "all.json", "memory") == records
    out = capsys.readouterr().out
    assert "longest" in out and "linear GiB" in out


def test_run_memory_stops_after_a_broken_context(monkeypatch, tmp_path):
    mem = FakeMemory()

    def broken(inp, causal, scale):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setitem(common.IMPLS, "broken", common.Impl(broken, peer=False))
    monkeypatch.setitem(common.IMPLS, "linear", _memory_impl(mem, 10, 1 << 30))
    cfg = memory.MemoryConfig(device="cpu", impls=("broken", "linear"), n_min=64, n_max=256,
                             batch=1, heads=2, d=8, dtype="fp32", out=tmp_path / "r.json",
                             progress=False, plot=False)
    records = memory.run_memory(cfg, mem=mem, stdout=io.StringIO())
    assert [(r["impl"], r["mode"], r["status"]) for r in records] == [
        ("broken", "memory", "error"), ("broken", "max_seqlen", "error"),
        ("linear", "max_seqlen", "error")]
    assert records[2]["error"] == "not run after the CUDA error at n=64"


def test_run_memory_input_failure_stops_everyone(monkeypatch, tmp_path):
    mem = FakeMemory()
    real = common.make_inputs

    def make_inputs(batch, n, *args, **kwargs):
        if n >= 256:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(batch, n, *args, **kwargs)
    monkeypatch.setattr(common, "make_inputs", make_inputs)
    monkeypatch.setitem(common.IMPLS, "linear", _memory_impl(mem, 10, 1 << 30))
    cfg = memory.MemoryConfig(device="cpu", impls=("linear",), n_min=64, n_max=1024, batch=1,
                             heads=2, d=8, dtype="fp32", out=tmp_path / "r.json", progress=False,
                             plot=False)
    records = memory.run_memory(cfg, mem=mem, stdout=io.StringIO())
    assert [(r["mode"], r["n"], r["status"]) for r in records] == [
        ("memory", 64, "ok"), ("memory", 128, "ok"), ("memory", 256, "oom"),
        ("max_seqlen", 128, "ok")]
    assert records[-1]["error"].startswith("oom at n=256: making the inputs")


def test_memory_config_seqlens():
    assert memory.MemoryConfig(device="cuda").seqlens() == [1024 * 2 ** i for i in range(9)]


def test_parse_memory_args():
    cfg = memory.parse_memory_args(["--device", "cuda", "--impl", "flashtile", "sdpa_math",
                                   "--n-max", "128K", "--dtype", "fp16", "--causal", "1"])
    assert cfg.impls == ("flashtile", "sdpa_math") and cfg.n_max == 131072
    assert (cfg.batch, cfg.heads, cfg.d, cfg.dtype, cfg.causal) == (1, 16, 128, "fp16", True)
    default = memory.parse_memory_args(["--device", "cuda"])
    assert default.impls == ("flashtile", "sdpa_flash", "sdpa_math")
    assert (default.n_min, default.n_max) == (1024, 262144)


@needs_cpu_only
def test_main_memory_needs_cuda(capsys):
    assert cli.main(["memory"]) == 2
    assert "CUDA" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# End to end on CPU
# ---------------------------------------------------------------------------------------------

TINY = ["--device", "cpu", "--mode", "fwd", "bwd", "fwd_bwd", "--causal", "both", "--n", "64",
        "128", "--d", "32", "--dtype", "fp32", "--tokens", "256", "--hidden", "64", "--warmup",
        "0", "--rep", "1", "--no-progress"]


def test_main_cpu_end_to_end(stand_in, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, plots = tmp_path / "cpu.json", tmp_path / "plots"
    argv = TINY + ["--impl", "flashtile", "sdpa", "sdpa_math", "sdpa_cudnn", "--out", str(out),
                   "--plots", str(plots)]
    assert cli.main(argv) == 0
    records = common.load_records(out, "speed")
    assert len(records) == 4 * 3 * 2 * 2
    assert all(tuple(r) == common.RECORD_KEYS and r["device"] == "cpu" for r in records)
    assert {r["status"] for r in records if r["impl"] != "sdpa_cudnn"} == {"ok"}
    assert {r["status"] for r in records if r["impl"] == "sdpa_cudnn"} == {"unsupported"}
    assert all(r["tflops"] > 0 and r["ms"] > 0 for r in records if r["status"] == "ok")
    assert all(r["batch"] * r["n"] == 256 and r["heads"] == 2 for r in records)
    assert list(common.read_results(out)) == ["speed", "device"]
    device = common.read_result(out, "device")
    assert device["copy_bandwidth_GBps"] > 0 and device["matmul_tflops"] > 0
    assert len(list(plots.glob("*.png"))) == 3 * 2
    table = capsys.readouterr().out
    rows = _rows(table)
    assert rows[0][7:] == ["flashtile", "sdpa", "sdpa_cudnn", "sdpa_math", "ft/sdpa",
                           "ft/sdpa_cudnn", "ft/sdpa_math"]
    assert len(rows) == 2 + 3 * 2 * 2

    assert cli.main(argv[:-4] + ["--impl", "sdpa", "--n", "64", "--out", str(out),
                                   "--no-plot"]) == 0
    assert len(common.load_records(out, "speed")) == len(records)  # re-run replaced its records
    capsys.readouterr()

    assert cli.main(["report", str(out), "--plots", str(tmp_path / "rep")]) == 0
    report = capsys.readouterr().out
    assert len(_rows(report)) == len(rows)
    assert len(list((tmp_path / "rep").glob("*.png"))) == 6


def test_main_returns_1_on_flashtile_error(monkeypatch, tmp_path):
    def broken():
        raise ImportError("flashtile.flash_attn_func is not available")
    monkeypatch.setattr(common, "flashtile_api", broken)
    argv = TINY + ["--impl", "flashtile", "--mode", "fwd", "--n", "64", "--out",
                   str(tmp_path / "r.json"), "--no-plot", "--no-device-ceilings"]
    assert cli.main(argv) == 1
    records = common.load_records(tmp_path / "r.json", "speed")
    assert {r["status"] for r in records} == {"error"}


def test_fatal_error_stops_the_run(stand_in, monkeypatch, tmp_path, capsys):
    calls = []

    def prepare(inp, causal, scale):
        calls.append(inp.n)
        raise RuntimeError("CUDA error: device-side assert triggered")
    monkeypatch.setitem(common.IMPLS, "fake", common.Impl(prepare))
    cfg = speed.parse_args(TINY + ["--impl", "fake", "sdpa", "--out", str(tmp_path / "r.json"),
                                   "--no-plot", "--no-device-ceilings"])
    records = speed.run_speed(cfg)
    assert len(records) == 1 and records[0]["status"] == "error" and calls == [64]
    assert common.load_records(tmp_path / "r.json", "speed") == records
    assert "unrecoverable CUDA error" in capsys.readouterr().err


def test_input_failure_is_recorded_for_the_shape(stand_in, monkeypatch, tmp_path):
    real = common.make_inputs

    def make_inputs(batch, n, *args, **kwargs):
        if n == 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return real(batch, n, *args, **kwargs)
    monkeypatch.setattr(common, "make_inputs", make_inputs)
    cfg = speed.parse_args(TINY + ["--impl", "sdpa", "--mode", "fwd", "--out",
                                   str(tmp_path / "r.json"), "--no-plot", "--no-device-ceilings"])
    records = speed.run_speed(cfg, stdout=io.StringIO())
    assert [(r["n"], r["causal"], r["status"]) for r in records] == [
        (64, False, "ok"), (64, True, "ok"), (128, False, "oom"), (128, True, "oom")]
    assert records[-1]["error"].startswith("making the inputs: OutOfMemoryError: CUDA out of")
    assert all(tuple(r) == common.RECORD_KEYS for r in records)


def test_resume_skips_finished_cases(stand_in, tmp_path, capsys):
    merged = tmp_path / "merged.json"
    flags = TINY + ["--impl", "sdpa", "sdpa_math", "--mode", "fwd", "--causal", "0", "--no-plot",
                     "--no-device-ceilings", "--out", str(merged)]
    first = speed.run_speed(speed.parse_args(flags + ["--n", "64"]))
    assert len(first) == 2
    failed = dict(first[1], status="error", tflops=None, ms=None, error="RuntimeError: x")
    common.write_result(merged, "speed", [first[0], failed])
    capsys.readouterr()
    cfg = speed.parse_args(flags + ["--resume"])
    second = speed.run_speed(cfg)
    assert [(r["impl"], r["n"]) for r in second] == [("sdpa_math", 64), ("sdpa", 128),
                                                     ("sdpa_math", 128)]
    out = capsys.readouterr()
    assert "--resume: 1 of 4 cases" in out.err
    assert len(_rows(out.out)) == 2 + 2  # the table shows the resumed case too
    merged_records = common.load_records(merged, "speed")
    assert len(merged_records) == 4 and {r["status"] for r in merged_records} == {"ok"}


def test_resume_without_results_runs_everything(stand_in, tmp_path, capsys):
    cfg = speed.parse_args(TINY + ["--impl", "sdpa", "--mode", "fwd", "--causal", "0",
                                   "--no-plot", "--no-device-ceilings", "--resume",
                                   "--out", str(tmp_path / "none_yet.json")])
    assert [(r["impl"], r["n"]) for r in speed.run_speed(cfg)] == [("sdpa", 64), ("sdpa", 128)]
    assert "--resume" not in capsys.readouterr().err


def test_case_key_matches_record_key():
    case = _case("sdpa", "bwd", True)
    inp = common.make_inputs(case.batch, case.n, case.heads, case.d, case.dtype, "cpu")
    rec = json.loads(json.dumps(common.run_case(case, inp, lambda fn: 1.0, CPU_ENV)))
    assert speed.case_key(case, "cpu") == common.record_key(rec)


def test_time_limit_stops_between_shapes(stand_in, tmp_path, capsys):
    cfg = speed.parse_args(TINY + ["--impl", "sdpa", "--out", str(tmp_path / "r.json"),
                                   "--no-plot", "--no-device-ceilings", "--time-limit", "0"])
    assert speed.run_speed(cfg) == []
    assert common.read_results(tmp_path / "r.json") == {"speed": []}
    assert "--time-limit" in capsys.readouterr().err


@pytest.mark.skipif(not _real_flashtile_available(), reason="flashtile.flash_attn_func missing")
def test_real_flashtile_cpu_run(tmp_path):
    cfg = speed.parse_args(TINY + ["--impl", "flashtile", "--out", str(tmp_path / "r.json"),
                                   "--no-plot", "--no-device-ceilings"])
    records = speed.run_speed(cfg, stdout=io.StringIO())
    assert len(records) == 3 * 2 * 2
    assert {r["status"] for r in records} == {"ok"}, [r["error"] for r in records]


def test_counter_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    progress = common.make_progress(2)
    assert isinstance(progress, common._Counter)
    progress.set_description("case a")
    progress.update()
    progress.set_description("case b")
    progress.close()
    assert capsys.readouterr().err.splitlines() == ["[1/2] case a", "[2/2] case b"]


def test_tqdm_progress(capsys):
    pytest.importorskip("tqdm")
    progress = common.make_progress(2)
    assert isinstance(progress, common._Tqdm)
    progress.set_description("case a")
    progress.update()
    progress.write("a message")
    progress.update()
    progress.close()
    err = capsys.readouterr().err
    assert "a message" in err and "2/2" in err


def test_silent_progress(capsys):
    progress = common.make_progress(3, enabled=False)
    progress.set_description("x")
    progress.write("y")
    progress.update()
    assert capsys.readouterr().err == ""


def test_cpu_engine_benchmark_writes_its_entry(tmp_path, capsys, monkeypatch):
    """`python -m flashtile.bench cpu`: op counts, one child process per implementation, the
    result under cpu_b1h8n<N> of the results file, and its plot."""
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU engine, as a CPU user runs it
    out, png = tmp_path / "cpu.json", tmp_path / "cpu.png"
    assert cli.main(["cpu", "--out", str(out), "--png", str(png), "--n", "64", "--reps", "1",
                     "--threads", "1", "--conditions", "quiet", "--impls", "flashtile,sdpa"]) == 0
    result = common.read_result(out, "cpu_b1h8n64")
    assert list(common.read_results(out)) == ["cpu_b1h8n64"] and png.stat().st_size > 1000
    assert result["shape"] == dict(B=1, H=8, N=64, D=64, dtype="float32", causal=True)
    assert set(result["aten_ops_fwd_bwd"]) == {"64", "1024"}
    runs = result["conditions"]["quiet"]["results"]
    assert set(runs) == {"flashtile", "sdpa"} and runs["sdpa"]["ratio_to_sdpa"] == 1.0
    assert all(r["median_s"] > 0 and len(r["times_s"]) == 1 for r in runs.values()), runs
    assert "wrote" in capsys.readouterr().out


def test_decode_subcommand_routes_to_the_decode_benchmark(monkeypatch, tmp_path):
    """`python -m flashtile.bench decode ...` runs flashtile.bench.decode with the remaining flags."""
    from flashtile.bench import decode as bench_decode
    seen = {}
    monkeypatch.setattr(bench_decode, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert cli.main(["decode", "--quick", "--out", str(tmp_path / "d.json")]) == 0
    assert seen["argv"] == ["--quick", "--out", str(tmp_path / "d.json")]


def test_decode_records_merge_by_case(tmp_path):
    """A decode run replaces only the cases it measured in the results file's decode entry."""
    from flashtile.bench import decode as bench_decode
    base = dict(device="GPU", impl="flashtile_graph", batch=1, cache_len=4096, mode="graph",
                dtype="bf16", nheads=32, nheads_k=8, headdim=128, l2_flush="read", ms=0.03)
    old = [base, dict(base, cache_len=16384, ms=0.05), dict(base, impl="device_copy", batch=None,
                                                           cache_len=None, mode=None, GBps=3000.0)]
    path = common.merge_result(tmp_path / "h100.json", bench_decode.KEY, old,
                               bench_decode.record_key)
    quick = [dict(base, ms=0.02), dict(base, impl="device_copy", batch=None, cache_len=None,
                                       mode=None, GBps=3010.0)]
    common.merge_result(path, bench_decode.KEY, quick, bench_decode.record_key)
    assert common.load_records(path, "decode") == [quick[0], old[1], quick[1]]


def test_overhead_subcommand_routes_to_speed_overhead_main(monkeypatch, tmp_path):
    """`python -m flashtile.bench overhead ...` runs speed.overhead_main with the remaining
    flags; without CUDA it says so in one line and exits 2."""
    seen = {}
    monkeypatch.setattr(speed, "overhead_main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert cli.main(["overhead", "--out", str(tmp_path / "o.json")]) == 0
    assert seen["argv"] == ["--out", str(tmp_path / "o.json")]
    monkeypatch.undo()
    if not torch.cuda.is_available():
        assert cli.main(["overhead", "--out", str(tmp_path / "o.json")]) == 2
        assert not (tmp_path / "o.json").exists()


def test_host_cost_block_reports_wall_and_cpu_time(monkeypatch):
    """``speed._per_call_us``: per call, the wall time and the process's CPU time of a block of
    calls; a call that waits without running (a sleep, as a host descheduled by other work)
    adds wall time only, a call that computes adds both."""
    import time as _time
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    wall, used = speed._per_call_us(lambda: _time.sleep(0.002), n=20)
    assert wall >= 2000 and used < 0.5 * wall
    x = torch.randn(200, 200)
    wall, used = speed._per_call_us(lambda: (x @ x).sum(), n=20)
    assert used > 0 and wall > 0


# ---------------------------------------------------------------------------------------------
# Variants subcommand (flashtile.bench.variants)
# ---------------------------------------------------------------------------------------------

VARIANTS_TINY = ["--device", "cpu", "--n", "128", "--batch", "1", "--heads", "2", "--d", "16",
                 "--block-size", "32", "--warmup", "0", "--rep", "1", "--no-progress"]


def test_variants_subcommand_routes_to_bench_variants(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(bench_variants, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert cli.main(["variants", "--sweeps", "window", "--out", str(tmp_path)]) == 0
    assert seen["argv"] == ["--sweeps", "window", "--out", str(tmp_path)]


@pytest.mark.skipif(not _real_flashtile_available(), reason="flashtile.flash_attn_func missing")
def test_variants_cpu_end_to_end(tmp_path, capsys):
    out, merged = tmp_path / "out", tmp_path / "merged.json"
    assert cli.main(["variants"] + VARIANTS_TINY + ["--out", str(merged), "--plots",
                                                      str(out)]) == 0
    records = common.load_records(merged, "variants")
    assert all(tuple(r) == bench_variants.RECORD_KEYS and r["device"] == "cpu" for r in records)
    assert {r["status"] for r in records} == {"ok"}, [r["error"] for r in records]
    assert all(r["ms"] > 0 and r["tflops"] > 0 and r["ratio_vs_dense"] > 0 for r in records)
    assert all((r["dtype"], r["d"], r["n"], r["batch"], r["heads"]) == ("fp32", 16, 128, 1, 2)
               for r in records)
    by = {}
    for r in records:
        by.setdefault((r["sweep"], r["impl"], r["variant"]), []).append(r)
    assert set(by) == {("sparse", "flashtile", "dense"), ("sparse", "flashtile", "block_sparse"),
                       ("window", "flashtile", "dense"), ("window", "flashtile", "window"),
                       ("window", "sdpa", "dense"), ("window", "sdpa", "window"),
                       ("varlen", "flashtile", "padded"), ("varlen", "flashtile", "varlen"),
                       ("varlen", "flashtile", "varlen_paged"), ("padding", "flashtile", "dense"),
                       ("padding", "flashtile", "key_mask"), ("padding", "sdpa", "dense"),
                       ("padding", "sdpa", "key_mask")}
    assert {r["mode"] for r in records} == {"fwd", "fwd_bwd"}

    sparse = by[("sparse", "flashtile", "block_sparse")]
    assert sorted({r["detail"]["target"] for r in sparse}) == [1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0]
    assert all(r["detail"]["target"] <= r["param"] <= 1 and not r["causal"] for r in sparse)
    assert all(r["param"] == 1.0 for r in sparse if r["detail"]["target"] == 1.0)
    assert all(r["detail"]["blocks"] == 16 for r in sparse)
    windows = by[("window", "flashtile", "window")]
    assert sorted({r["param"] for r in windows}) == [4, 16, 64, 128]
    assert all(r["causal"] for r in windows + by[("window", "sdpa", "window")])
    references = [r for k, rs in by.items() if k[2] in ("dense", "padded") for r in rs]
    assert all(r["ratio_vs_dense"] == 1.0 for r in references)
    assert [r["causal"] for r in by[("sparse", "flashtile", "dense")]] == [False, False]
    varlen = by[("varlen", "flashtile", "varlen")]
    assert {r["causal"] for r in varlen} == {False, True}
    assert all(r["detail"]["tokens"] <= 128 and r["detail"]["longest"] <= 28 for r in varlen)
    assert all(r["param"] == pytest.approx(r["detail"]["tokens"] / r["detail"]["sequences"])
               for r in varlen)
    paged = by[("varlen", "flashtile", "varlen_paged")]
    assert {r["causal"] for r in paged} == {False, True} and all(r["status"] == "ok" for r in paged)
    assert all(r["detail"]["page_size"] == bench_variants.PAGE_SIZE for r in paged)
    padding = by[("padding", "flashtile", "key_mask")] + by[("padding", "sdpa", "key_mask")]
    assert sorted({r["param"] for r in padding}) == [1 / 8, 1 / 4, 1 / 2]
    assert all(r["detail"]["padded_keys"] == [int(r["param"] * 128)] for r in padding)
    assert {r["causal"] for r in padding} == {False, True}
    assert list(common.read_results(merged)) == ["variants"]

    title, *table = capsys.readouterr().out.splitlines()
    assert title.startswith("variants, fp32, d=16, N=128, B=1, H=2")
    rows = _rows("\n".join(table))
    assert rows[0] == ["sweep", "variant", "param", "causal", "mode", "flashtile ms",
                       "flashtile /ref", "sdpa ms", "sdpa /ref"]
    assert len(rows) == 2 + len({(r["sweep"], *bench_variants.variant_key(r)[3:7])
                                 for r in records})
    if report.have_matplotlib():
        assert sorted(p.name for p in out.glob("*.png")) == ["padding.png", "sparse.png",
                                                            "varlen.png", "window.png"]

    assert cli.main(["variants"] + VARIANTS_TINY + [
        "--sweeps", "window", "--impl", "sdpa", "--windows", "16", "--mode", "fwd", "--no-plot",
        "--out", str(merged)]) == 0
    assert len(common.load_records(merged, "variants")) == len(records)  # re-run replaced its own
    capsys.readouterr()
    assert cli.main(["report", str(merged)]) == 0
    assert "block_sparse" in capsys.readouterr().out


def test_variants_parse_args_defaults():
    gpu = bench_variants.parse_args(["--device", "cuda"])
    assert (gpu.n, gpu.batch, gpu.heads, gpu.d, gpu.dtype, gpu.block_size) == (
        8192, 2, 16, 128, "bf16", 128)
    assert gpu.sweeps == ("sparse", "window", "varlen", "padding")
    assert gpu.impls == ("flashtile", "sdpa")
    assert gpu.modes == ("fwd", "fwd_bwd") and (gpu.warmup, gpu.rep) == (25, 100)
    assert [float(x) for x in gpu.densities] == [1, 0.5, 0.25, 0.125, 0.0625]
    assert gpu.window_sizes() == (256, 1024, 4096, 8192)
    assert (gpu.mean_length(), gpu.total_tokens()) == (1024, 16384)
    cpu = bench_variants.parse_args(["--device", "cpu"])
    assert cpu.n < gpu.n and cpu.heads < gpu.heads and cpu.dtype == "fp32"
    quick = bench_variants.parse_args(["--device", "cpu", "--quick"])
    assert len(bench_variants.build_plan(quick)) == len(bench_variants.build_plan(cpu))
    assert quick.n < cpu.n


def test_variants_parse_args_overrides(tmp_path):
    cfg = bench_variants.parse_args([
        "--device", "cuda", "--sweeps", "sparse,window", "--flex", "--mode", "fwd", "--n", "2K",
        "--densities", "1", "0.5", "1/8", "--windows", "128", "1K", "--varlen-mean", "256",
        "--varlen-tokens", "4K", "--block-size", "64", "--out", str(tmp_path / "r.json"),
        "--plots", str(tmp_path), "--no-plot"])
    assert cfg.sweeps == ("sparse", "window") and cfg.impls == ("flashtile", "sdpa", "flex")
    assert cfg.modes == ("fwd",) and cfg.n == 2048 and cfg.block_size == 64
    assert cfg.densities == (Fraction(1), Fraction(1, 2), Fraction(1, 8))
    assert cfg.window_sizes() == (128, 1024)
    assert (cfg.mean_length(), cfg.total_tokens()) == (256, 4096)
    assert cfg.out == tmp_path / "r.json" and cfg.plots == tmp_path and not cfg.plot


@pytest.mark.parametrize(
    "argv,flag",
    [(["--sweeps", "dense"], "--sweeps"), (["--impl", "sdpa_flash"], "--impl"),
     (["--mode", "decode"], "--mode"), (["--densities", "0"], "--densities"),
     (["--densities", "1.5"], "--densities"), (["--densities", "half"], "--densities"),
     (["--block-size", "24"], "--block-size"), (["--block-size", "1K"], "--block-size"),
     (["--windows", "0"], "--windows"), (["--windows", "1K"], "--windows"),
     (["--varlen-mean", "2"], "--varlen-mean"), (["--varlen-tokens", "8"], "--varlen-tokens"),
     (["--n", "1M"], "--n"), (["--dtype", "int8"], "--dtype")],
    ids=["sweep", "impl", "mode", "density-zero", "density-above-one", "density-word",
         "block-not-16", "block-above-n", "window-zero", "window-above-n", "mean-small",
         "tokens-below-mean", "n", "dtype"],
)
def test_variants_parse_args_rejects(argv, flag, capsys):
    with pytest.raises(SystemExit) as info:
        bench_variants.parse_args(VARIANTS_TINY + argv)
    assert info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "fields,name",
    [({"sweeps": ()}, "sweeps"), ({"impls": ("fa2",)}, "impls"), ({"device": "mps"}, "device"),
     ({"n": 0}, "n"), ({"densities": (Fraction(2),)}, "densities"), ({"windows": (4096,)},
                                                                      "windows"),
     ({"varlen_tokens": 16}, "varlen_tokens"), ({"rep": -1}, "rep")],
    ids=["no-sweeps", "impl", "device", "n", "density", "window", "tokens", "rep"],
)
def test_variants_config_names_the_bad_field(fields, name):
    with pytest.raises(ValueError, match=f"^{name}: "):
        bench_variants.VariantsConfig(**{"device": "cpu", "n": 1024, **fields})


@pytest.mark.parametrize("n", [128, 100, 1000], ids=["128", "100", "1000"])
def test_variants_useful_pairs(n):
    V = bench_variants
    assert V.window_pairs(n, n) == V.window_pairs(n, n - 1) == V.dense_pairs(n, True) == n * n / 2
    assert V.window_pairs(n, 0) == n / 2  # the diagonal, at half weight
    assert V.window_pairs(n, 4) == sum(min(i, 4) + 1 for i in range(n)) - Fraction(n, 2)
    full = torch.ones(-(-n // 32), -(-n // 32), dtype=torch.bool)
    assert V.block_pairs(full, n, 32) == n * n
    diagonal = torch.eye(full.shape[0], dtype=torch.bool)
    last = n - 32 * (full.shape[0] - 1)
    assert V.block_pairs(diagonal, n, 32) == 32 * 32 * (full.shape[0] - 1) + last * last
    assert V.varlen_pairs([3, 5], False) == 34 and V.varlen_pairs([3, 5], True) == 17


def test_variants_padding_masks_hide_each_rows_first_keys():
    """The padding sweep's rows: row r of B padded by f * N * (r + 1) / B keys on the left, the
    bool key mask hiding exactly those."""
    V = bench_variants
    assert V.pad_lengths(128, 4, Fraction(1, 2)) == [16, 32, 48, 64]
    mask = V.key_padding_mask(8, [0, 3], "cpu")
    assert mask.shape == (2, 1, 1, 8) and mask.dtype == torch.bool
    assert mask[:, 0, 0].tolist() == [[True] * 8, [False] * 3 + [True] * 5]


def test_variants_useful_flops_scale_with_the_mode():
    pairs = bench_variants.dense_pairs(1024, False)
    fwd = bench_variants._useful_flops(pairs, 16, 128, "fwd")
    assert fwd == common.flops(1, 16, 1024, 128, False, "fwd")
    assert bench_variants._useful_flops(pairs, 16, 128, "fwd_bwd") == fwd * 7 // 2


def test_variants_random_blocks_keep_the_diagonal():
    blocks = bench_variants.random_blocks(1000, 64, Fraction(1, 16), seed=3)
    assert blocks.shape == (16, 16) and blocks.diagonal().all()
    assert torch.equal(blocks, bench_variants.random_blocks(1000, 64, Fraction(1, 16), seed=3))
    assert bench_variants.random_blocks(256, 32, Fraction(1), seed=0).all()


def test_variants_varlen_lengths_match_the_committed_h100_batch():
    lengths = bench_variants.varlen_lengths(16384, 1024, seed=0)
    assert (len(lengths), sum(lengths), max(lengths)) == (17, 15966, 1673)
    assert all(256 <= s < 1792 for s in lengths)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_variants_plan_flex_only_on_cuda_and_references_first(device):
    cfg = bench_variants.VariantsConfig(device=device, impls=bench_variants.IMPLS, n=1024)
    plan = bench_variants.build_plan(cfg)
    flex = {c.sweep for c in plan if c.impl == "flex"}
    assert flex == (set() if device == "cpu" else {"sparse", "window"})
    assert {c.sweep for c in plan if c.impl == "sdpa"} == {"window", "padding"}
    for sweep, reference in (("sparse", "dense"), ("window", "dense"), ("varlen", "padded"),
                             ("padding", "dense")):
        for impl in {c.impl for c in plan if c.sweep == sweep}:
            for causal in {c.causal for c in plan if c.sweep == sweep and c.impl == impl}:
                cases = [c for c in plan if (c.sweep, c.impl, c.causal) == (sweep, impl, causal)]
                assert cases[0].variant == reference
    assert len(plan) == len({(c.sweep, c.impl, c.variant, c.param, c.causal, c.mode)
                             for c in plan})


def test_variants_ratios_use_the_sweeps_reference():
    env = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0"}

    def r(sweep, variant, ms, causal=False, status="ok", mode="fwd"):
        fields = {"sweep": sweep, "impl": "flashtile", "mode": mode, "variant": variant,
                  "causal": causal, "dtype": "bf16", "d": 128, "n": 8192, "batch": 2,
                  "heads": 16, "ms": ms, "status": status}
        return common.fill_record(bench_variants.RECORD_KEYS, env, fields)
    records = bench_variants.fill_ratios([
        r("sparse", "dense", 4.0), r("sparse", "block_sparse", 1.0),
        r("sparse", "block_sparse", 2.0, mode="fwd_bwd"), r("window", "dense", 2.0, True),
        r("window", "window", 0.5, True), r("varlen", "padded", None, status="oom"),
        r("varlen", "varlen", 1.0)])
    assert [x["ratio_vs_dense"] for x in records] == [1.0, 0.25, None, 1.0, 0.25, None, None]


def test_report_reads_the_speed_memory_and_variants_entries(tmp_path, capsys):
    path = common.write_result(tmp_path / "h100.json", "speed", [_record(), _record(impl="sdpa")])
    common.write_result(path, "memory", [_record(mode="memory", n=4096, peak_bytes=2**30)])
    common.write_result(path, "decode", [{"impl": "flashtile", "mode": "graph", "ms": 0.03}])
    common.write_result(path, "device", {"copy_bandwidth_GBps": 3000.0})
    assert cli.main(["report", str(path)]) == 0
    out = capsys.readouterr()
    assert out.err == ""  # the decode and device entries are not read
    rows = _rows(out.out)
    assert rows[2][7:] == ["100", "100", "1.00"]  # the speed table: flashtile, sdpa, ft/sdpa
    assert rows[3] == ["n", "flashtile GiB"] and rows[5] == ["4K", "1.000"]  # the memory table


def test_report_skips_records_of_another_format(tmp_path, capsys):
    path = common.write_json(tmp_path / "old.json", [{"kind": "window", "window": 256,
                                                      "fwd_ms": 0.25, "device": "cpu"}])
    assert cli.main(["report", str(path)]) == 0
    out = capsys.readouterr()
    assert "skipped 1 records without impl/mode" in out.err
    assert out.out.strip() == "(no speed records)"


def test_paged_pools_hold_each_sequence_in_its_pages():
    lengths = [5, 40, 17, 1]
    data = bench_variants.make_varlen_data(lengths, 2, 8, "fp32", "cpu", seed=3)
    k_pool, v_pool, table = bench_variants.paged_pools(data, 16, seed=3)
    assert k_pool.shape == (1 + 3 + 2 + 1, 16, 2, 8) and table.dtype == torch.int32
    used = [p for b, n in enumerate(lengths) for p in table[b, :-(-n // 16)].tolist()]
    assert sorted(used) == list(range(7)), "every page belongs to exactly one sequence"
    start = 0
    for b, n in enumerate(lengths):
        slots = [(table[b, j // 16].item(), j % 16) for j in range(n)]
        got_k = torch.stack([k_pool[p, s] for p, s in slots])
        got_v = torch.stack([v_pool[p, s] for p, s in slots])
        assert torch.equal(got_k, data.packed.k[start:start + n]), f"keys of sequence {b}"
        assert torch.equal(got_v, data.packed.v[start:start + n]), f"values of sequence {b}"
        start += n


# ---------------------------------------------------------------------------------------------
# The flashtile command line (python -m flashtile)
# ---------------------------------------------------------------------------------------------

def test_flashtile_help_is_argparse_and_lists_subcommands(capsys):
    from flashtile import __main__ as ft_cli
    with pytest.raises(SystemExit) as exc:
        ft_cli.cli(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flashtile") and "``" not in out
    assert all(name in out for name in ("check", "bench", "tune", "explain"))


def test_flashtile_rejects_unknown_flags(capsys):
    from flashtile import __main__ as ft_cli
    with pytest.raises(SystemExit) as exc:
        ft_cli.cli(["--bogus-flag"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --bogus-flag" in capsys.readouterr().err


def test_flashtile_subcommand_routes_argv(monkeypatch):
    from flashtile import __main__ as ft_cli
    seen = {}
    fake = types.SimpleNamespace(main=lambda argv: seen.setdefault("argv", argv) and 0)
    monkeypatch.setitem(sys.modules, "flashtile.explain", fake)
    assert ft_cli.cli(["explain", "--out", "x.html"]) == 0
    assert seen["argv"] == ["--out", "x.html"]


def test_flashtile_missing_subcommand_module_is_one_line(monkeypatch, capsys):
    from flashtile import __main__ as ft_cli
    monkeypatch.setitem(ft_cli.SUBCOMMANDS, "explain", ("flashtile._no_such_module", "x"))
    assert ft_cli.cli(["explain"]) == 2
    assert capsys.readouterr().err.strip() == \
        "flashtile explain: flashtile._no_such_module is not part of this installation"


def test_bench_missing_subcommand_module_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "train", ("flashtile.bench._no_such_module", "x"))
    assert cli.main(["train"]) == 2
    assert "not part of this installation" in capsys.readouterr().err


@needs_cpu_only
def test_tune_and_memory_on_cpu_give_one_line(capsys):
    from flashtile import __main__ as ft_cli
    assert ft_cli.cli(["tune"]) == 2
    assert ft_cli.cli(["bench", "memory", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "CUDA" in err[0] and "CUDA" in err[1]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_cpu_peak_in_child_sees_the_score_matrix():
    """Standard attention at N=1024, 2 heads materialises 2 x 1024 x 1024 fp32 scores (8 MiB)
    and more for softmax and its gradient; measured in a fresh process it shows at least that."""
    from flashtile import __main__ as ft_cli
    mib = ft_cli.cpu_peak_in_child("standard", 1024, 16, 2)
    assert mib is not None and mib >= 8


# ----------------------------------------------------------------------------------------------
# io: the reading of Nsight Compute output, the records and the report (on CPU)

# What `ncu --csv` prints for one forward and one backward between the markers, plus a kernel
# with a templated name (commas inside a field), with the units ncu chooses per value.
SAMPLE = """\
==PROF== Connected to process 4242 (/usr/bin/python3.11)
==PROF== Profiling "io_begin_marker_kernel" - 0: 0%....50%....100% - 1 pass
==PROF== Profiling "attn_fwd_kernel" - 1: 0%....50%....100% - 1 pass
==PROF== Profiling "io_end_marker_kernel" - 2: 0%....50%....100% - 1 pass
==PROF== Profiling "io_begin_marker_kernel" - 3: 0%....50%....100% - 1 pass
==PROF== Profiling "attn_bwd_dq_kernel" - 4: 0%....50%....100% - 1 pass
==PROF== Profiling "attn_bwd_dkdv_kernel" - 5: 0%....50%....100% - 1 pass
==PROF== Profiling "io_end_marker_kernel" - 6: 0%....50%....100% - 1 pass
==PROF== Profiling "at::native::vectorized_elementwise_kernel" - 7: 0%....50%....100% - 1 pass
==PROF== Disconnected from process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3.11","127.0.0.1","io_begin_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","0"
"0","4242","python3.11","127.0.0.1","io_begin_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"0","4242","python3.11","127.0.0.1","io_begin_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","lts__t_bytes.sum","byte","1,024"
"0","4242","python3.11","127.0.0.1","io_begin_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","2,304"
"1","4242","python3.11","127.0.0.1","attn_fwd_kernel","1","7","(128, 1, 1)","(16, 1024, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","402,915,328"
"1","4242","python3.11","127.0.0.1","attn_fwd_kernel","1","7","(128, 1, 1)","(16, 1024, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","138,461,184"
"1","4242","python3.11","127.0.0.1","attn_fwd_kernel","1","7","(128, 1, 1)","(16, 1024, 1)","0","9.0","Command line profiler metrics","lts__t_bytes.sum","byte","4,730,112,000"
"1","4242","python3.11","127.0.0.1","attn_fwd_kernel","1","7","(128, 1, 1)","(16, 1024, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","612,544"
"2","4242","python3.11","127.0.0.1","io_end_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","0"
"2","4242","python3.11","127.0.0.1","io_end_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","32"
"2","4242","python3.11","127.0.0.1","io_end_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","lts__t_bytes.sum","byte","1,024"
"2","4242","python3.11","127.0.0.1","io_end_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","2,272"
"3","4242","python3.11","127.0.0.1","io_begin_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","0"
"3","4242","python3.11","127.0.0.1","io_begin_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"3","4242","python3.11","127.0.0.1","io_begin_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","lts__t_bytes.sum","byte","1,024"
"3","4242","python3.11","127.0.0.1","io_begin_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","2,240"
"4","4242","python3.11","127.0.0.1","attn_bwd_dq_kernel","1","7","(256, 1, 1)","(8, 1024, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","675.41"
"4","4242","python3.11","127.0.0.1","attn_bwd_dq_kernel","1","7","(256, 1, 1)","(8, 1024, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Mbyte","138.52"
"4","4242","python3.11","127.0.0.1","attn_bwd_dq_kernel","1","7","(256, 1, 1)","(8, 1024, 1)","0","9.0","Command line profiler metrics","lts__t_bytes.sum","Gbyte","2.81"
"4","4242","python3.11","127.0.0.1","attn_bwd_dq_kernel","1","7","(256, 1, 1)","(8, 1024, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","702.18"
"5","4242","python3.11","127.0.0.1","attn_bwd_dkdv_kernel","1","7","(128, 1, 1)","(16, 1024, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","545,390,592"
"5","4242","python3.11","127.0.0.1","attn_bwd_dkdv_kernel","1","7","(128, 1, 1)","(16, 1024, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","268,500,992"
"5","4242","python3.11","127.0.0.1","attn_bwd_dkdv_kernel","1","7","(128, 1, 1)","(16, 1024, 1)","0","9.0","Command line profiler metrics","lts__t_bytes.sum","byte","5,310,001,152"
"5","4242","python3.11","127.0.0.1","attn_bwd_dkdv_kernel","1","7","(128, 1, 1)","(16, 1024, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,104,864"
"6","4242","python3.11","127.0.0.1","io_end_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","0"
"6","4242","python3.11","127.0.0.1","io_end_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","32"
"6","4242","python3.11","127.0.0.1","io_end_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","lts__t_bytes.sum","byte","1,024"
"6","4242","python3.11","127.0.0.1","io_end_marker_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","2,208"
"7","4242","python3.11","127.0.0.1","void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char *, 1ul>>(int, at::native::FillFunctor<float>, std::array<char *, 1ul>)","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","0"
"7","4242","python3.11","127.0.0.1","void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char *, 1ul>>(int, at::native::FillFunctor<float>, std::array<char *, 1ul>)","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","4,194,304"
"7","4242","python3.11","127.0.0.1","void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char *, 1ul>>(int, at::native::FillFunctor<float>, std::array<char *, 1ul>)","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","lts__t_bytes.sum","byte","4,210,688"
"7","4242","python3.11","127.0.0.1","void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char *, 1ul>>(int, at::native::FillFunctor<float>, std::array<char *, 1ul>)","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","3,968"
"""


def test_ncu_csv_parses_every_kernel_in_launch_order_with_units_converted():
    kernels = bench_io.parse_ncu_csv(SAMPLE)
    assert [k.id for k in kernels] == list(range(8))
    assert [bench_io.short_name(k.name) for k in kernels[:7]] == [
        "io_begin_marker_kernel", "attn_fwd_kernel", "io_end_marker_kernel",
        "io_begin_marker_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel",
        "io_end_marker_kernel"]
    # a templated name with commas inside stays one field
    assert kernels[7].name.startswith("void at::native::vectorized_elementwise_kernel<4, ")
    assert bench_io.short_name(kernels[7].name) == "vectorized_elementwise_kernel"
    fwd, dq = kernels[1].metrics, kernels[4].metrics
    assert fwd["dram__bytes_read.sum"] == 402_915_328  # thousands separators dropped
    assert fwd["gpu__time_duration.sum"] == pytest.approx(0.612544)  # ns -> ms
    assert dq["dram__bytes_read.sum"] == pytest.approx(675.41e6)  # Mbyte -> bytes
    assert dq["lts__t_bytes.sum"] == pytest.approx(2.81e9)  # Gbyte -> bytes
    assert dq["gpu__time_duration.sum"] == pytest.approx(0.70218)  # us -> ms


def test_ncu_raw_page_parses_like_the_details_page():
    raw = ('==PROF== Disconnected from process 1\n'
           '"ID","Kernel Name","dram__bytes_read.sum","gpu__time_duration.sum"\n'
           '"","","Mbyte","usecond"\n'
           '"0","attn_fwd_kernel","1.5","250"\n')
    (k,) = bench_io.parse_ncu_csv(raw)
    assert k.metrics == {"dram__bytes_read.sum": 1.5e6, "gpu__time_duration.sum": 0.25}


def test_markers_split_kernels_into_passes_and_drop_the_rest():
    groups = bench_io.split_by_markers(bench_io.parse_ncu_csv(SAMPLE))
    assert [[bench_io.short_name(k.name) for k in g] for g in groups] == [
        ["attn_fwd_kernel"], ["attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"]]


def _sample_records():
    case = bench_io.Case("fig2", "flashtile")
    configs = {"fwd": [64, 64, 4, 3], "dkdv": [64, 64, 4, 3], "dq": [128, 64, 8, 5]}
    entries = [dict(index=0, pass_="fwd", configs=configs),
               dict(index=0, pass_="bwd", configs=configs),
               dict(index=1, error="RuntimeError: no kernel")]
    groups = bench_io.split_by_markers(bench_io.parse_ncu_csv(SAMPLE))
    cases = [case, bench_io.Case("fig2", "cudnn")]
    return bench_io.build_records(cases, entries, groups, {"device": "test"})


def test_fused_backward_records_use_the_one_kernel_model():
    """A backward pass that ran the Hopper one-kernel backward (``configs["fused"]``) is set
    against ``flashtile_backward_fused``: the record's model is its three kernels' sum, and the
    prologue and the kernel carry their own model values (the conversion is PyTorch's copy)."""
    def kernel(i, name, mb):
        return bench_io.KernelRecord(i, name, {"dram__bytes_read.sum": mb * 1e6,
                                               "dram__bytes_write.sum": mb * 1e6,
                                               "lts__t_bytes.sum": 4 * mb * 1e6,
                                               "gpu__time_duration.sum": 0.1})
    configs = {"fwd": [128, 128, 12, 2], "dkdv": [64, 128, 12, 2], "dq": [128, 64, 8, 5],
               "fused": True}
    groups = [[kernel(1, "attn_bwd_delta_kernel", 260),
               kernel(2, "attn_bwd_sm90_kernel", 660),
               kernel(3, "void at::native::vectorized_elementwise_kernel<4>(int)", 190)]]
    (rec,) = bench_io.build_records([bench_io.Case("fig2", "flashtile")],
                                    [dict(index=0, pass_="bwd", configs=configs)], groups,
                                    {"device": "test"})
    p = algorithms.figure2_problem()
    delta, bwd, dq = algorithms.flashtile_backward_fused(p, 64, 128)
    assert rec["model_dram_bytes"] == algorithms.dram_bytes(p, [delta, bwd, dq])
    assert rec["model_l2_bytes"] == delta.tile + bwd.tile + dq.tile
    assert rec["dram_read_bytes"] == pytest.approx((260 + 660 + 190) * 1e6)
    by_name = {k["name"]: k for k in rec["kernels"]}
    assert by_name["attn_bwd_delta_kernel"]["model_dram_bytes"] == delta.dram
    assert by_name["attn_bwd_sm90_kernel"]["model_l2_bytes"] == bwd.tile
    assert "model_dram_bytes" not in by_name["vectorized_elementwise_kernel"]


def test_records_carry_the_measured_sums_the_model_and_the_compulsory_bytes():
    fwd, bwd, failed = _sample_records()
    p = algorithms.figure2_problem()
    assert (fwd["impl"], fwd["pass"], fwd["n"], fwd["d"], fwd["heads"], fwd["batch"]) == (
        "flashtile", "fwd", 1024, 64, 16, 64)
    assert (fwd["block_m"], fwd["block_n"]) == (64, 64)
    assert fwd["dram_read_bytes"] == 402_915_328 and fwd["dram_write_bytes"] == 138_461_184
    assert fwd["compulsory_bytes"] == algorithms.compulsory(p, "fwd")
    assert fwd["model_dram_bytes"] == algorithms.flashtile_forward(p, 64, 64)[0].dram
    assert bwd["dram_read_bytes"] == pytest.approx(675.41e6 + 545_390_592)
    assert bwd["ms"] == pytest.approx(0.70218 + 1.104864)
    assert [k["name"] for k in bwd["kernels"]] == ["attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"]
    assert bwd["kernels"][1]["model_l2_bytes"] == algorithms.flashtile_backward(p, (64, 64), (128, 64))[1].tile
    assert failed["impl"] == "cudnn" and failed["error"].startswith("RuntimeError")
    for field in ("impl", "pass", "n", "d", "heads", "batch", "block_m", "block_n",
                  "dram_read_bytes", "dram_write_bytes", "l2_bytes", "ms", "compulsory_bytes"):
        assert field in fwd


def test_report_tables_plots_and_doc_section(tmp_path):
    records = _sample_records()
    records.append(dict(sweep="fig3", impl="flashtile", n=1024, batch=16, heads=16, d=64,
                        ms=1.5, peak_extra_bytes=2e8, **{"pass": "fwd_bwd"}))
    md = bench_io.render_markdown(records)
    assert "| flashtile | 2.17 | 1.34 |" in md  # fwd+bwd DRAM GB of the sample, x compulsory
    assert "| flashtile | 1.50 |" in md  # Figure 3 time
    pngs = bench_io.plot(records, tmp_path)
    assert {p.name for p in pngs} == {"fig2.png", "fig3.png"}
    assert all(p.stat().st_size > 1000 for p in pngs)
    doc = tmp_path / "io.md"
    doc.write_text(f"intro\n{bench_io.DOC_BEGIN}\nold\n{bench_io.DOC_END}\nend\n")
    bench_io.update_doc(doc, md)
    text = doc.read_text()
    assert "old" not in text and md in text and text.startswith("intro") and text.endswith("end\n")


def test_io_records_come_from_the_results_entry(tmp_path):
    records = _sample_records()
    results = common.write_result(tmp_path / "h100.json", "io", records)
    common.write_result(results, "speed", [_record()])
    assert bench_io.load_io_records(results) == (results, records)
    plain = common.write_json(tmp_path / "io_records.json", records)
    assert bench_io.load_io_records(plain) == (plain, records)


def test_sweeps_pin_the_tile_they_vary():
    cases = bench_io.build_cases(["blocks"], quick=True)
    for c in cases:
        kernel, tile = c.knob.split(".")
        pinned = getattr(c, kernel)
        assert pinned is not None and len(pinned) == 4
    sizes = [c.fwd[0] for c in cases if c.knob == "fwd.block_m"]
    assert sizes == sorted(sizes) and len(sizes) >= 3
    assert {c.impl for c in bench_io.build_cases(["fig2"], quick=True)} == set(bench_io.IMPLS)


def test_worker_runs_each_pass_between_markers_and_logs_configs(tmp_path, monkeypatch):
    # the worker's flow on CPU (kernels under the interpreter): which passes it logs, in
    # marker order, with the tile configs flashtile used; a failing case is logged, not fatal
    import json

    markers = []
    real = bench_io._markers

    def counting(device):
        begin, end = real(device)
        return (lambda: (markers.append("begin"), begin())), (lambda: (markers.append("end"), end()))

    monkeypatch.setattr(bench_io, "_markers", counting)
    tiny = dict(n=16, d=16, heads=1, batch=1, dtype="float32")
    cases = [bench_io.Case("fig2", "flashtile", **tiny),
             bench_io.Case("fig2", "standard", **tiny),
             bench_io.Case("fig2", "cudnn", **tiny),  # SDPA's cudnn backend: no CPU kernel
             bench_io.Case("blocks", "flashtile", passes=("bwd",), knob="dkdv.block_n",
                           dkdv=(16, 16, 1, 1), dq=(16, 16, 1, 1), **tiny),
             bench_io.Case("sparse", "flashtile_sparse", density=0.5, sparse_block=16,
                           **dict(tiny, n=32))]
    plan, log = tmp_path / "plan.json", tmp_path / "log.jsonl"
    plan.write_text(json.dumps([c.to_json() for c in cases]))
    bench_io.run_worker(str(plan), str(log), device="cpu")
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["index"], e.get("pass_")) for e in entries] == [
        (0, "fwd"), (0, "bwd"), (1, "fwd"), (1, "bwd"), (2, None), (3, "bwd"), (4, "fwd"),
        (4, "bwd")], entries
    assert "error" in entries[4] and not entries[4].get("marked")
    assert entries[5]["configs"]["dkdv"] == [16, 16, 1, 1]
    assert entries[0]["configs"]["fwd"][:2] == [16, 16]  # the interpreter's tiles
    assert entries[2]["configs"] == {}
    assert markers == ["begin", "end"] * 7


FAKE_NCU = '''#!{python}
"""Stands in for ncu: runs the profiled command (on the CPU) and prints the CSV sample."""
import os, subprocess, sys
args = sys.argv[1:]
assert args[:5] == ["--clock-control", "none", "--cache-control", "all", "--metrics"], args
cmd = args[args.index({python!r}):]
subprocess.run(cmd + ["--device", "cpu"], check=True, env=dict(os.environ, TRITON_INTERPRET="1"))
sys.stdout.write(open({sample!r}).read())
'''


def test_ncu_run_end_to_end_with_a_stand_in_profiler(tmp_path):
    # the plumbing of run_ncu_sweeps: the ncu command line, the worker subprocess, its log,
    # the CSV on stdout, and the records (the stand-in prints the committed sample)
    import sys

    fake = tmp_path / "ncu"
    sample = tmp_path / "ncu_sample.csv"
    sample.write_text(SAMPLE)
    fake.write_text(FAKE_NCU.format(python=sys.executable, sample=str(sample)))
    fake.chmod(0o755)
    case = bench_io.Case("fig2", "flashtile", n=16, d=16, heads=1, batch=1, dtype="float32")
    records = bench_io.run_ncu_sweeps([case], str(fake), True, tmp_path, timeout=600)
    assert [(r["impl"], r["pass"]) for r in records] == [("flashtile", "fwd"), ("flashtile", "bwd")]
    assert records[1]["dram_write_bytes"] == pytest.approx(138.52e6 + 268_500_992)
    assert records[0]["block_m"] == 16  # the interpreter's tiles, logged by the worker


def test_train_run_times_each_step_and_reports_the_median(monkeypatch):
    """bench train: every timed step gets its own wall time (from one loss read to the next,
    each read made once the next step is queued); ``step_s`` is their median and
    ``tokens_per_s`` a step's tokens over it, so one slow step does not move the result; every
    step's loss is read."""
    pytest.importorskip("transformers")
    from flashtile.bench import train
    clock = iter([0.0, 1.0, 1.5, 2.0, 10.0, 10.5] + [11.0] * 50)  # step times 0.5, 0.5, 8, 0.5
    monkeypatch.setattr(train.time, "perf_counter", lambda: next(clock))
    rec = train.run_one("tiny", "sdpa", 64, steps=6, warmup=1, tokens_per_step=128,
                        device=torch.device("cpu"))
    monkeypatch.undo()
    assert rec["status"] == "ok" and rec["steps"] == 6 and rec["batch"] == 2
    assert rec["step_times_s"] == [1.0, 0.5, 0.5, 8.0, 0.5]
    assert rec["step_s"] == 0.5
    assert rec["tokens_per_s"] == 2 * 64 / 0.5
    assert len(rec["losses"]) == 6 and all(x == x for x in rec["losses"])


@pytest.mark.parametrize("kernel, kind", [
    ("attn_fwd_sm90_kernel", "fwd"), ("attn_fwd_kernel", "fwd"), ("key_mask_ranges_kernel", "fwd"),
    ("attn_bwd_delta_kernel", "bwd"), ("attn_bwd_sm90_kernel", "bwd"),
    ("attn_bwd_dq_split_sm90_kernel", "bwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x", "fwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64", "bwd"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*", "bwd"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "fwd"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "bwd"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "fwd"), ("fmha_cutlassB_bf16_aligned", "bwd"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", None),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float>", None),
    ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", None),
], ids=["ft-fwd-sm90", "ft-fwd", "ft-keymask", "ft-delta", "ft-bwd-sm90", "ft-dq-split",
        "cudnn-fprop", "cudnn-bprop", "cudnn-dot-do-o", "fa2-fwd", "fa2-bwd", "efficient-fwd",
        "efficient-bwd", "gemm", "softmax", "copy"])
def test_train_kernel_names_sort_into_attention_passes(kernel, kind):
    """bench train --kernels: each implementation's attention kernels count as the attention
    forward or backward; matrix products, softmax and copies (an eager model's attention,
    flashtile's dQ conversion) as other kernels."""
    from flashtile.bench import train
    assert train.attention_pass(kernel) == kind


def test_train_kernel_split_sums_per_step_and_compares_with_sdpa():
    """bench train --kernels: kernel time per step by pass (µs of all profiled steps over
    their count), and the summary's ratio of sdpa's time over each other implementation's."""
    from flashtile.bench import train
    split = train.kernel_split([("attn_fwd_sm90_kernel", 3000.0), ("gemm_a", 30000.0),
                                ("attn_bwd_sm90_kernel", 6300.0), ("attn_bwd_delta_kernel", 600.0),
                                ("attn_fwd_sm90_kernel", 3000.0)], steps=3)
    assert split["total_ms"] == pytest.approx(14.3)
    assert split["attention_fwd_ms"] == pytest.approx(2.0)
    assert split["attention_bwd_ms"] == pytest.approx(2.3)
    assert split["other_ms"] == pytest.approx(10.0)
    assert list(split["attention"]) == ["attn_bwd_sm90_kernel", "attn_fwd_sm90_kernel",
                                        "attn_bwd_delta_kernel"]
    ref = dict(split, total_ms=14.9, attention_fwd_ms=1.9, attention_bwd_ms=3.0)
    runs = [dict(model="small", impl=impl, context=1024, kind="timed", tokens_per_s=None,
                 losses=[], kernels=k) for impl, k in (("sdpa", ref), ("flashtile", split))]
    ratios = train.summarize(dict(runs=runs))["kernels_vs_sdpa"]["small/1024/flashtile"]
    assert ratios == pytest.approx(dict(total_ms=14.9 / 14.3, attention_fwd_ms=0.95,
                                        attention_bwd_ms=3.0 / 2.3))


def _train_result(gpu, date, runs, preset="gpu-a"):
    env = dict(device="cuda", gpu=gpu, date=date, torch="2.11.0", transformers="5.17.0",
               flashtile="0.1.0")
    return dict(env=env, preset=preset, params={}, skipped=[], wall_s=1.0,
                runs=[dict(model="small", impl=impl, context=ctx, batch=16, kind=kind,
                           steps=18, status="ok", tokens_per_s=tok, peak_mem_gib=23.4,
                           losses=[])
                      for impl, ctx, kind, tok in runs])


def test_train_report_has_a_section_per_device_with_ratios_to_sdpa(tmp_path):
    """bench train --report: each GPU's results in their own section (the newest first), the
    ad-hoc ``train`` entry left out by default, every row's tokens/s over ``sdpa``'s of the
    same device, the profiled runs' kernel time against ``sdpa``'s, and plots named by
    device."""
    from flashtile.bench import train
    from flashtile.bench.common import write_result
    old, new = tmp_path / "h100.json", tmp_path / "h200.json"
    write_result(old, "train_gpu-a", _train_result("NVIDIA H100 80GB HBM3", "2026-11-27T08:00:00",
                                                   [("sdpa", 1024, "timed", 100.0),
                                                    ("flashtile", 1024, "timed", 99.0)]))
    h200_b = _train_result(
        "NVIDIA H200", "2026-11-29T04:00:00",
        [("sdpa", 1024, "timed", 200.0), ("flashtile", 1024, "timed", 202.0),
         ("sdpa", 16384, "long", 50.0), ("flashtile", 16384, "long", 55.0),
         ("sdpa", 1024, "curve", 200.0), ("flashtile", 1024, "curve", 204.0)], preset="gpu-b")
    for run, ms in zip(h200_b["runs"], ((10.0, 1.0, 2.0), (8.0, 1.0, 1.6))):
        run["kernels"] = dict(zip(("total_ms", "attention_fwd_ms", "attention_bwd_ms"), ms))
    write_result(new, "train_gpu-b", h200_b)
    write_result(new, "train", _train_result("NVIDIA H200", "2026-11-29T05:00:00",
                                             [("flashtile", 1024, "timed", 1.0)], preset=None))
    groups = train.by_device(train.load_results([str(old), str(new)], adhoc=False))
    assert [d for d, _ in groups] == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    h200 = groups[0][1]
    assert len(h200["runs"]) == 6
    assert h200["summary"]["vs_sdpa"]["curve/small/1024/flashtile"] == pytest.approx(1.02)
    assert h200["summary"]["vs_sdpa"]["timed/small/1024/flashtile"] == pytest.approx(1.01)
    assert h200["summary"]["vs_sdpa"]["long/small/16384/flashtile"] == pytest.approx(1.1)
    assert groups[1][1]["summary"]["vs_sdpa"]["timed/small/1024/flashtile"] == pytest.approx(0.99)
    images = {d: [str(tmp_path / f"end-to-end-loss-{train._slug(d)}.png")] for d, _ in groups}
    text = train.report(groups, [], images, str(tmp_path / "doc.md"))
    h200_at, h100_at = text.index("### NVIDIA H200"), text.index("### NVIDIA H100 80GB HBM3")
    assert h200_at < h100_at
    assert "| small | 1024 | 16 | 18 | flashtile | 202 | - | 1.010x | 23.4 |" in text[h200_at:h100_at]
    assert "| flashtile | 16384 | ok | 55 | 1.100x | 23.4 |" in text[h200_at:h100_at]
    assert "| small | 1024 | 16 | 18 | flashtile | 204 | - | 1.020x | 23.4 |" in text[h200_at:]
    assert "| small | 1024 | 16 | 18 | flashtile | 99 | - | 0.990x | 23.4 |" in text[h100_at:]
    assert "| small | 1024 | flashtile | 8.0 | 1.00 | 1.60 | 1.250x | 1.000x | 1.250x |" in text
    assert "(end-to-end-loss-h200.png)" in text and "(end-to-end-loss-h100.png)" in text
    assert len(train.load_results([str(new)])) == 2  # named files: every train* entry


def test_train_preset_gpu_c_runs_its_model_context_pairs_as_curves(monkeypatch):
    """bench train --preset gpu-c: 200-step curve runs of each (model, context) pair of the
    preset, every compared implementation, in the preset's order."""
    from flashtile.bench import train
    calls = []

    def fake_run_one(model, impl, ctx, steps, warmup, tokens, device, **kw):
        calls.append((model, ctx, impl, steps))
        return dict(model=model, impl=impl, context=ctx, batch=tokens // ctx, steps=steps,
                    status="ok", tokens_per_s=1.0, peak_mem_gib=None, losses=[1.0] * steps)

    monkeypatch.setattr(train, "run_one", fake_run_one)
    res = train.run(train.build_parser().parse_args(["--preset", "gpu-c", "--device", "cpu"]))
    impls = ["sdpa", "sdpa_fa2", "flashtile"]
    assert calls == [(m, c, i, 200) for m, c in (("medium", 1024), ("small", 4096),
                                                  ("small", 8192), ("medium", 8192))
                     for i in impls]
    assert {r["kind"] for r in res["runs"]} == {"curve"} and not res["skipped"]
    assert res["summary"]["curves"]["small/8192/flashtile-vs-sdpa"]["max_abs_diff"] == 0.0


def test_train_stream_keeps_one_token_mapping_so_unigrams_are_learnable():
    """bench train's synthetic batches draw Zipf ranks per batch but map ranks to tokens once
    per seed: the most frequent token (rank 1, ~15% of draws at this vocabulary) is the same
    token in every batch, so a model can learn the unigram statistics across steps."""
    pytest.importorskip("transformers")
    from flashtile.bench import train
    common_tokens = set()
    for step in range(4):
        ids = train._batch(step, 4, 512, 512, torch.device("cpu"), seed=3)
        assert ids.shape == (4, 512) and ids.dtype == torch.int64
        common_tokens.add(int(torch.bincount(ids.flatten(), minlength=512).argmax()))
    assert len(common_tokens) == 1
    other = train._batch(0, 4, 512, 512, torch.device("cpu"), seed=4)
    assert int(torch.bincount(other.flatten(), minlength=512).argmax()) not in common_tokens


def test_variants_plan_runs_the_portable_kernels_where_flashtile_runs():
    """``flashtile_portable`` (an A/B of the Hopper and the portable kernels in one process)
    gets every case flashtile gets, under ``FLASHTILE_SM90=0``."""
    cfg = bench_variants.VariantsConfig(device="cuda", n=1024,
                                        impls=("flashtile", "flashtile_portable"))
    plan = bench_variants.build_plan(cfg)

    def cases(impl):
        return [(c.sweep, c.variant, c.param, c.causal, c.mode) for c in plan if c.impl == impl]
    assert cases("flashtile") == cases("flashtile_portable") and cases("flashtile")
    with bench_variants._context("flashtile_portable")(torch.device("cpu")):
        assert os.environ["FLASHTILE_SM90"] == "0"
    assert "flashtile_portable" in common.IMPLS


def test_cp_scale_writes_efficiencies_flash_rule_ratios_and_a_report(tmp_path):
    """``python -m flashtile.bench.cp scale`` at world size 1 on gloo (the torch engine): every
    mode and layout timed with an efficiency, the correctness rows hold flash-attn's rule
    against float64 (out <= 2, gradients <= 3), and ``report`` turns the entry into a table
    and a PNG."""
    import subprocess
    out, png = tmp_path / "cp.json", tmp_path / "cp.png"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    args = ["--device", "cpu", "--dtype", "fp32", "--tokens-per-gpu", "64",
            "--strong-seqlen", "0", "--check-seqlen", "64", "--heads", "2", "--headdim", "16",
            "--warmup", "0", "--iters", "1", "--no-peer", "--out", str(out)]
    subprocess.run([sys.executable, "-m", "flashtile.bench.cp", "scale"] + args, check=True,
                   env=env, capture_output=True, timeout=600)
    entry = json.loads(out.read_text())["cp_world1"]
    assert entry["world"] == 1 and entry["device"] == "cpu" and entry["date"]
    timed = [r for r in entry["rows"] if "efficiency" in r]
    assert {(r["mode"], r["layout"]) for r in timed} == {
        (m, lay) for m in ("ring", "allgather", "ulysses") for lay in ("zigzag", "contiguous")}
    assert all(r["efficiency"] > 0 for r in timed)
    rules = [r["flash_rule_ratio"] for r in entry["correctness"]]
    assert len(rules) == 7  # one device and the six paths
    for rule in rules:
        assert rule["out"] <= 2 and max(rule["dq"], rule["dk"], rule["dv"]) <= 3, rule
    subprocess.run([sys.executable, "-m", "flashtile.bench.cp", "report", "--out", str(out),
                    "--png", str(png)], check=True, env=env, capture_output=True, timeout=300)
    assert png.stat().st_size > 0
    from flashtile.bench import cp
    table = cp.report(json.loads(out.read_text()))
    assert table.splitlines()[2].startswith("| weak | 1 | 64 |")
    assert len(table.splitlines()) == 3
