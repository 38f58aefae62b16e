"""CPU tests of the benchmark harness (flashtile.bench); CUDA-only paths run with fakes."""
from __future__ import annotations

import contextlib
import datetime
import io
import json
import sys
import types
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flashtile.bench import __main__ as cli
from flashtile.bench import common, memory, render, speed
from flashtile.bench import variants as bench_variants

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

    api = types.SimpleNamespace(flash_attn_func=_sdpa_stand_in, use_backend=use_backend)
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
    assert cfg.out == Path("bench_out") and cfg.merge_into is None
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
        "fp16", "--warmup", "5", "--rep", "7.5", "--out", str(tmp_path), "--merge-into",
        str(tmp_path / "all.json"), "--batch", "3", "--hidden", "1024", "--time-limit", "60",
        "--no-plot", "--no-progress", "--seed", "4", "--no-device-ceilings"])
    assert cfg.impls == ("flashtile", "sdpa_math", "flex")
    assert cfg.modes == ("bwd",)
    assert cfg.causal == (True,)
    assert cfg.ds == (64, 128, 256)
    assert cfg.ns == (1024, 2048, 512)
    assert cfg.dtypes == ("bf16", "fp16")
    assert (cfg.warmup, cfg.rep) == (5.0, 7.5)
    assert cfg.out == tmp_path and cfg.merge_into == tmp_path / "all.json"
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
    inp = common.make_inputs(1, 32, 2, 16, "fp32", "cpu")
    outs = {}
    for name in ("flashtile", "sdpa", "sdpa_math"):
        with common.IMPLS[name].context(inp.device):
            out = common.IMPLS[name].prepare(inp, causal, 0.25).fn()
        outs[name] = out if name != "flashtile" else out.transpose(1, 2)
    torch.testing.assert_close(outs["flashtile"], outs["sdpa"])
    torch.testing.assert_close(outs["sdpa_math"], outs["sdpa"])
    assert stand_in == ["torch"]


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
                                   "--n", "128", "--out", str(tmp_path), "--no-plot",
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
    first = [_record(n=1024, tflops=100.0), _record(n=2048, tflops=110.0)]
    common.merge_json(path, first)
    assert common.load_records(path) == first
    rerun = _record(n=2048, tflops=120.0)
    other_mode = _record(mode="bwd", n=2048, tflops=90.0)
    other_device = _record(n=2048, tflops=50.0, device="NVIDIA A100")
    common.merge_json(path, [rerun, other_mode, other_device])
    merged = common.load_records(path)
    assert merged == [first[0], rerun, other_mode, other_device]


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


def test_render_table_cells_and_ratios():
    recs = [
        _record("flashtile", n=1024, tflops=300.0),
        _record("sdpa_flash", n=1024, tflops=200.0),
        _record("sdpa_math", n=1024, status="oom"),
        _record("flashtile", n=2048, tflops=12.345),
        _record("sdpa_flash", n=2048, status="unsupported"),
        _record("flashtile", n=1024, mode="bwd", causal=True, tflops=0.5),
    ]
    rows = _rows(render.render_table(recs))
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
    text = render.render_table(recs)
    assert "device: NVIDIA H100 80GB HBM3" in text and "device: cpu" in text
    rows = _rows("\n".join(ln for ln in text.splitlines() if ln.startswith("|")))
    cells = [row[-1] for row in rows if row[0] == "fwd"]
    assert cells == ["2.00", "3.00"]


def test_render_table_without_flashtile_has_no_ratios():
    rows = _rows(render.render_table([_record("sdpa_flash"), _record("sdpa_math")]))
    assert not any(h.startswith("ft/") for h in rows[0])


def test_render_table_ignores_memory_records():
    assert render.render_table([_record(mode=common.MEMORY_MODE, peak_bytes=1)]) == \
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
    assert render.format_n(n) == text


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
    paths = render.plot(recs, tmp_path / "plots")
    names = sorted(p.name for p in paths)
    assert names == sorted(f"{m}_{c}_bf16_d{d}.png" for m in ("fwd", "bwd")
                           for c in ("full", "causal") for d in (64, 128))
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC


def test_plot_prefixes_device_when_several(tmp_path):
    pytest.importorskip("matplotlib")
    paths = render.plot([_record(), _record(device="cpu")], tmp_path)
    assert sorted(p.name for p in paths) == ["cpu_fwd_full_bf16_d64.png",
                                             "nvidia_h100_80gb_hbm3_fwd_full_bf16_d64.png"]


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
    assert render.plot([_record()], tmp_path) == []
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
                             batch=1, heads=2, d=8, dtype="fp32", out=tmp_path,
                             merge_into=tmp_path / "all.json", progress=False, plot=False)
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
    assert json.loads((tmp_path / "memory.json").read_text()) == records
    assert not (tmp_path / "results.json").exists()
    assert common.load_records(tmp_path / "all.json") == records
    out = capsys.readouterr().out
    assert "longest" in out and "linear GiB" in out


def test_run_memory_stops_after_a_broken_context(monkeypatch, tmp_path):
    mem = FakeMemory()

    def broken(inp, causal, scale):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setitem(common.IMPLS, "broken", common.Impl(broken, peer=False))
    monkeypatch.setitem(common.IMPLS, "linear", _memory_impl(mem, 10, 1 << 30))
    cfg = memory.MemoryConfig(device="cpu", impls=("broken", "linear"), n_min=64, n_max=256,
                             batch=1, heads=2, d=8, dtype="fp32", out=tmp_path, progress=False,
                             plot=False)
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
                             heads=2, d=8, dtype="fp32", out=tmp_path, progress=False, plot=False)
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
    out = tmp_path / "out"
    merged = tmp_path / "merged.json"
    argv = TINY + ["--impl", "flashtile", "sdpa", "sdpa_math", "sdpa_cudnn", "--out", str(out),
                   "--merge-into", str(merged)]
    assert cli.main(argv) == 0
    records = json.loads((out / "results.json").read_text())
    assert len(records) == 4 * 3 * 2 * 2
    assert all(tuple(r) == common.RECORD_KEYS and r["device"] == "cpu" for r in records)
    assert {r["status"] for r in records if r["impl"] != "sdpa_cudnn"} == {"ok"}
    assert {r["status"] for r in records if r["impl"] == "sdpa_cudnn"} == {"unsupported"}
    assert all(r["tflops"] > 0 and r["ms"] > 0 for r in records if r["status"] == "ok")
    assert all(r["batch"] * r["n"] == 256 and r["heads"] == 2 for r in records)
    assert common.load_records(merged) == records
    device = json.loads((out / "device.json").read_text())
    assert device["copy_bandwidth_GBps"] > 0 and device["matmul_tflops"] > 0
    assert len(list(out.glob("*.png"))) == 3 * 2
    table = capsys.readouterr().out
    rows = _rows(table)
    assert rows[0][7:] == ["flashtile", "sdpa", "sdpa_cudnn", "sdpa_math", "ft/sdpa",
                           "ft/sdpa_cudnn", "ft/sdpa_math"]
    assert len(rows) == 2 + 3 * 2 * 2

    assert cli.main(argv[:-4] + ["--impl", "sdpa", "--n", "64", "--out", str(tmp_path / "o2"),
                                   "--merge-into", str(merged), "--no-plot"]) == 0
    assert len(common.load_records(merged)) == len(records)  # re-run replaced its records
    capsys.readouterr()

    assert cli.main(["report", str(merged), "--out", str(tmp_path / "rep")]) == 0
    report = capsys.readouterr().out
    assert len(_rows(report)) == len(rows)
    assert len(list((tmp_path / "rep").glob("*.png"))) == 6


def test_main_returns_1_on_flashtile_error(monkeypatch, tmp_path):
    def broken():
        raise ImportError("flashtile.flash_attn_func is not available")
    monkeypatch.setattr(common, "flashtile_api", broken)
    argv = TINY + ["--impl", "flashtile", "--mode", "fwd", "--n", "64", "--out", str(tmp_path),
                   "--no-plot", "--no-device-ceilings"]
    assert cli.main(argv) == 1
    records = common.load_records(tmp_path / "results.json")
    assert {r["status"] for r in records} == {"error"}


def test_fatal_error_stops_the_run(stand_in, monkeypatch, tmp_path, capsys):
    calls = []

    def prepare(inp, causal, scale):
        calls.append(inp.n)
        raise RuntimeError("CUDA error: device-side assert triggered")
    monkeypatch.setitem(common.IMPLS, "fake", common.Impl(prepare))
    cfg = speed.parse_args(TINY + ["--impl", "fake", "sdpa", "--out", str(tmp_path), "--no-plot",
                                   "--no-device-ceilings"])
    records = speed.run_speed(cfg)
    assert len(records) == 1 and records[0]["status"] == "error" and calls == [64]
    assert common.load_records(tmp_path / "results.json") == records
    assert "unrecoverable CUDA error" in capsys.readouterr().err


def test_input_failure_is_recorded_for_the_shape(stand_in, monkeypatch, tmp_path):
    real = common.make_inputs

    def make_inputs(batch, n, *args, **kwargs):
        if n == 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return real(batch, n, *args, **kwargs)
    monkeypatch.setattr(common, "make_inputs", make_inputs)
    cfg = speed.parse_args(TINY + ["--impl", "sdpa", "--mode", "fwd", "--out", str(tmp_path),
                                   "--no-plot", "--no-device-ceilings"])
    records = speed.run_speed(cfg, stdout=io.StringIO())
    assert [(r["n"], r["causal"], r["status"]) for r in records] == [
        (64, False, "ok"), (64, True, "ok"), (128, False, "oom"), (128, True, "oom")]
    assert records[-1]["error"].startswith("making the inputs: OutOfMemoryError: CUDA out of")
    assert all(tuple(r) == common.RECORD_KEYS for r in records)


def test_resume_skips_finished_cases(stand_in, tmp_path, capsys):
    merged = tmp_path / "merged.json"
    flags = TINY + ["--impl", "sdpa", "sdpa_math", "--mode", "fwd", "--causal", "0", "--no-plot",
                     "--no-device-ceilings", "--merge-into", str(merged)]
    first = speed.run_speed(speed.parse_args(flags + ["--n", "64", "--out", str(tmp_path / "a")]))
    assert len(first) == 2
    failed = dict(first[1], status="error", tflops=None, ms=None, error="RuntimeError: x")
    common.write_json(merged, [first[0], failed])
    capsys.readouterr()
    cfg = speed.parse_args(flags + ["--out", str(tmp_path / "b"), "--resume"])
    second = speed.run_speed(cfg)
    assert [(r["impl"], r["n"]) for r in second] == [("sdpa_math", 64), ("sdpa", 128),
                                                     ("sdpa_math", 128)]
    out = capsys.readouterr()
    assert "--resume: 1 of 4 cases" in out.err
    assert len(_rows(out.out)) == 2 + 2  # the table shows the resumed case too
    merged_records = common.load_records(merged)
    assert len(merged_records) == 4 and {r["status"] for r in merged_records} == {"ok"}


def test_resume_needs_merge_into(capsys):
    with pytest.raises(SystemExit):
        speed.parse_args(["--device", "cpu", "--resume"])
    assert "--merge-into" in capsys.readouterr().err


def test_case_key_matches_record_key():
    case = _case("sdpa", "bwd", True)
    inp = common.make_inputs(case.batch, case.n, case.heads, case.d, case.dtype, "cpu")
    rec = json.loads(json.dumps(common.run_case(case, inp, lambda fn: 1.0, CPU_ENV)))
    assert speed.case_key(case, "cpu") == common.record_key(rec)


def test_time_limit_stops_between_shapes(stand_in, tmp_path, capsys):
    cfg = speed.parse_args(TINY + ["--impl", "sdpa", "--out", str(tmp_path), "--no-plot",
                                   "--no-device-ceilings", "--time-limit", "0"])
    assert speed.run_speed(cfg) == []
    assert common.load_records(tmp_path / "results.json") == []
    assert "--time-limit" in capsys.readouterr().err


@pytest.mark.skipif(not _real_flashtile_available(), reason="flashtile.flash_attn_func missing")
def test_real_flashtile_cpu_run(tmp_path):
    cfg = speed.parse_args(TINY + ["--impl", "flashtile", "--out", str(tmp_path), "--no-plot",
                                   "--no-device-ceilings"])
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


def test_decode_subcommand_routes_to_the_decode_benchmark(monkeypatch, tmp_path):
    """`python -m flashtile.bench decode ...` runs flashtile.bench.decode with the remaining flags."""
    from flashtile.bench import decode as bench_decode
    seen = {}
    monkeypatch.setattr(bench_decode, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert cli.main(["decode", "--quick", "--out", str(tmp_path / "d.json")]) == 0
    assert seen["argv"] == ["--quick", "--out", str(tmp_path / "d.json")]


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
    assert cli.main(["variants"] + VARIANTS_TINY + ["--out", str(out), "--merge-into",
                                                      str(merged)]) == 0
    records = common.load_records(out / "variants.json")
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
                       ("varlen", "flashtile", "varlen_paged")}
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
    assert common.load_records(merged) == records

    title, *table = capsys.readouterr().out.splitlines()
    assert title.startswith("variants, fp32, d=16, N=128, B=1, H=2")
    rows = _rows("\n".join(table))
    assert rows[0] == ["sweep", "variant", "param", "causal", "mode", "flashtile ms",
                       "flashtile /ref", "sdpa ms", "sdpa /ref"]
    assert len(rows) == 2 + len({bench_variants.variant_key(r)[3:7] for r in records})
    if render.have_matplotlib():
        assert sorted(p.name for p in out.glob("*.png")) == ["sparse.png", "varlen.png",
                                                            "window.png"]

    assert cli.main(["variants"] + VARIANTS_TINY + [
        "--sweeps", "window", "--impl", "sdpa", "--windows", "16", "--mode", "fwd", "--no-plot",
        "--out", str(tmp_path / "o2"), "--merge-into", str(merged)]) == 0
    assert len(common.load_records(merged)) == len(records)  # the re-run replaced its records
    capsys.readouterr()
    assert cli.main(["report", str(merged)]) == 0
    assert "block_sparse" in capsys.readouterr().out


def test_variants_parse_args_defaults():
    gpu = bench_variants.parse_args(["--device", "cuda"])
    assert (gpu.n, gpu.batch, gpu.heads, gpu.d, gpu.dtype, gpu.block_size) == (
        8192, 2, 16, 128, "bf16", 128)
    assert gpu.sweeps == ("sparse", "window", "varlen") and gpu.impls == ("flashtile", "sdpa")
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
        "--varlen-tokens", "4K", "--block-size", "64", "--out", str(tmp_path), "--no-plot"])
    assert cfg.sweeps == ("sparse", "window") and cfg.impls == ("flashtile", "sdpa", "flex")
    assert cfg.modes == ("fwd",) and cfg.n == 2048 and cfg.block_size == 64
    assert cfg.densities == (Fraction(1), Fraction(1, 2), Fraction(1, 8))
    assert cfg.window_sizes() == (128, 1024)
    assert (cfg.mean_length(), cfg.total_tokens()) == (256, 4096)
    assert cfg.out == tmp_path and not cfg.plot


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
    assert {c.sweep for c in plan if c.impl == "sdpa"} == {"window"}
    for sweep, reference in (("sparse", "dense"), ("window", "dense"), ("varlen", "padded")):
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
