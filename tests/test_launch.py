"""The host side of the Triton launches (``fastlaunch``), in plain Python with the GPU-only
parts stubbed.

* The key under which direct launches reuse a compiled kernel: two calls may share one only if
  Triton would specialise them the same way (same dtypes and 16-byte alignment of every tensor,
  same value and type of every scalar, same launch options).
* The ``triton.heuristics`` constexprs a launch derives itself: those Triton's wrapper derives.
* Launch plans (forward, backward, decode step): replaying a plan for new tensors of the same
  signature passes each kernel exactly what a fresh call on those tensors passes.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from flashtile.backends.spec import AttnSpec
from flashtile.backends.triton import fastlaunch, launch_bwd, launch_decode, launch_fwd


class FakeKernel:
    arg_names = ["X", "Y", "n", "scale", "FLAG"]


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fastlaunch, "_layouts", {})

    def make(meta=None, **overrides):
        named = {**dict(X=torch.zeros(64), Y=None, n=48, scale=0.5, FLAG=True), **overrides}
        return fastlaunch._direct_key(FakeKernel, {**named, "num_warps": 4, "num_stages": 3,
                                                   **(meta or {})})
    return make


def test_equal_specialisations_share_a_key(key):
    assert key() == key(X=torch.ones(64)), "same dtype and alignment, other data and shape"
    assert key() == key(X=torch.zeros(128)[16:80]), "a view at a 64-byte offset is still aligned"
    # scalars key by exact value: another float value is another entry (a compile-free miss)
    assert key(scale=0.25) != key() and key(scale=0.25) == key(scale=0.25)


@pytest.mark.parametrize("change", [
    dict(X=torch.zeros(65)[1:]),             # 4-byte offset: not 16-byte aligned
    dict(X=torch.zeros(64, dtype=torch.float16)),
    dict(Y=torch.zeros(8)),                   # None -> tensor changes a constexpr
    dict(n=1),                                # ints equal to 1 are specialised
    dict(n=47),                               # divisibility by 16 is specialised
    dict(scale=1),                            # an int where a float was: another signature
    dict(FLAG=False),
    dict(meta={"num_warps": 8}),
], ids=["misaligned", "dtype", "none-to-tensor", "int-one", "int-not-div16", "int-for-float",
        "constexpr", "num-warps"])
def test_a_different_specialisation_gets_another_key(key, change):
    assert key(**change) != key(), f"{sorted(change)} must change the key"


def test_missing_parameter_falls_back_to_the_plain_launch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fastlaunch, "_layouts", {})
    assert fastlaunch._direct_key(FakeKernel, dict(X=torch.zeros(4))) is None


def test_interpreter_never_launches_directly():
    # tests run the kernels under TRITON_INTERPRET=1 (conftest): the direct path is off there
    assert fastlaunch.direct_enabled() is False
    with fastlaunch.direct_launches(True):
        assert fastlaunch.direct_enabled() is False


class FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


@pytest.mark.parametrize("grid, dims", [((3,), (3, 1, 1)), ((3, 4), (3, 4, 1)),
                                        ((3, 4, 5), (3, 4, 5))], ids=["1d", "2d", "3d"])
def test_run_direct_passes_the_grid_stream_and_every_argument(monkeypatch, grid, dims):
    monkeypatch.setattr(fastlaunch, "raw_stream", lambda device: 1000 + device)
    compiled = FakeCompiled()
    assert fastlaunch.run_direct(compiled, grid, ["a", 2, None], 7)
    assert compiled.calls == [dims + (1007, "fn", "meta", None, None, None, "a", 2, None)]


@pytest.mark.parametrize("entry", ["c-entry", "wrapper"])
def test_bound_launch_passes_what_a_direct_launch_of_the_new_tensors_passes(monkeypatch, entry):
    """``fastlaunch.BoundLaunch`` (a plan's replay of one direct launch, e.g. the Hopper
    backward's prologue): Triton's C launcher gets exactly what a direct launch (``_run``,
    through Triton's own ``CudaLauncher.__call__``) of the replay's tensors gives it, those
    tensors as addresses and every other argument the recorded one; it keeps no tensor of the
    recorded call (one left unnamed is refused).  Where the launcher would allocate scratch memory the replay goes through
    Triton's wrapper instead, with the same arguments."""
    from types import SimpleNamespace

    from triton.backends.nvidia.driver import CudaLauncher

    monkeypatch.setattr(fastlaunch, "raw_stream", lambda device: 1000 + device)
    seen = []
    if entry == "c-entry":  # Triton's launcher around a stub C entry point
        run = CudaLauncher.__new__(CudaLauncher)
        run.launch = lambda *args: seen.append(args)
        run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, True
        run.global_scratch_size = run.profile_scratch_size = 0
        run.global_scratch_align = run.profile_scratch_align = 1
    else:  # a launcher bind cannot look into (no C entry point, no scratch sizes)
        run = lambda *args: seen.append(args)  # noqa: E731
    compiled = SimpleNamespace(run=run, function="fn", packed_metadata="meta")
    kernel = SimpleNamespace(arg_names=["X", "n", "Y", "Z", "FLAG"])
    x, y, z = torch.randn(8), torch.randn(4), torch.randn(2)
    launched = (compiled, [x, 48, y, z, True])
    bound = fastlaunch.BoundLaunch(kernel, launched, (3, 2), ("Y", "X", "Z"))
    assert not any(isinstance(a, torch.Tensor) for a in bound.args)
    assert bound.function is getattr(run, "launch", run)
    x2, y2, z2 = torch.randn(8), torch.randn(4), torch.randn(2)
    fastlaunch._run(compiled, (3, 2), [x2.data_ptr(), 48, y2.data_ptr(), z2.data_ptr(), True], 7)
    bound((y2, x2, z2), 7)
    want, got = seen
    assert got == want and want[:4] == (3, 2, 1, 1007)
    assert want[-5:] == (x2.data_ptr(), 48, y2.data_ptr(), z2.data_ptr(), True)
    with pytest.raises(ValueError, match="not in"):  # Z would be launched again
        fastlaunch.BoundLaunch(kernel, launched, (3, 2), ("Y", "X"))


def test_run_direct_declines_while_a_profiler_hook_is_set(monkeypatch):
    from triton import knobs
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        compiled = FakeCompiled()
        assert not fastlaunch.run_direct(compiled, (1, 1), [], 0)
        assert compiled.calls == []
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not fastlaunch.launch_hooks_set()


def test_named_values_follow_the_signature(key):
    named = dict(FLAG=True, scale=0.5, n=48, Y=None, X=torch.zeros(4))
    assert key() is not None  # fills the kernel's layout
    assert fastlaunch.named_values(FakeKernel, named)[1:] == [None, 48, 0.5, True]


# --------------------------------------------------------------------------------------------
# triton.heuristics constexprs
# --------------------------------------------------------------------------------------------
def _heuristic_kernels():
    from flashtile.backends.triton.kernels import bwd, decode, fwd
    return {"attn_fwd": fwd.attn_fwd_kernel, "attn_bwd_dq": bwd.attn_bwd_dq_kernel,
            "decode_split_kv": decode._split_kv_kernel,
            "decode_rotary_append": decode._rotary_append_kernel}


@pytest.mark.parametrize("name", ["attn_fwd", "attn_bwd_dq", "decode_split_kv",
                                  "decode_rotary_append"])
def test_launch_derives_the_same_constexprs_as_triton(monkeypatch, name):
    """``fastlaunch.launch`` evaluates a kernel's ``triton.heuristics`` itself: the jitted
    function must receive exactly the arguments Triton's own wrapper would pass it."""
    from triton.runtime.autotuner import Heuristics

    kernel = _heuristic_kernels()[name]
    assert isinstance(kernel, Heuristics)
    seen = []
    monkeypatch.setattr(kernel.fn, "run", lambda *a, **kw: seen.append((a, kw)))
    names = [n for n in kernel.arg_names if n not in kernel.values]
    n_ptr = next(i for i, n in enumerate(names) if n.startswith("stride_"))  # tensors first
    marker = torch.zeros(1)
    for variant in range(8):
        named = {}
        for i, n in enumerate(names):
            if i < n_ptr:  # present or None by variant; the query (always read) present
                present = (variant >> (i % 3)) & 1 or i == 0
                named[n] = marker if present else None
            elif n == "softcap":
                named[n] = 2.5 if variant & 1 else 0.0
            elif n in ("window_left", "window_right"):
                named[n] = (-1, 0, 7)[(variant + i) % 3]
            else:
                named[n] = 16 + i + variant
        if "HEAD_DIM" in named:  # EVEN_D: a head dim equal to its block or not
            named["BLOCK_D"], named["HEAD_DIM"] = 32, (32, 24)[variant & 1]
        grid = (3, 1 + variant, 1)
        kernel[grid](*named.values(), num_warps=4)  # Triton's wrapper, positional
        fastlaunch.launch(kernel, grid, **named, num_warps=4)
        (a_ref, kw_ref), (a_new, kw_new) = seen[-2:]
        bound_ref = {**dict(zip(kernel.arg_names, a_ref)), **kw_ref}
        bound_new = {**dict(zip(kernel.arg_names, a_new)), **kw_new}
        assert set(bound_new) == set(bound_ref), set(bound_new) ^ set(bound_ref)
        assert all(bound_new[k] is bound_ref[k] or bound_new[k] == bound_ref[k] for k in bound_ref)
        assert set(kernel.values) <= set(bound_new)


# --------------------------------------------------------------------------------------------
# launch plans
# --------------------------------------------------------------------------------------------
def _seed(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def _fwd_inputs(gen, shared=False):
    q = torch.randn(2, 40, 4, 16, generator=gen)
    k = q if shared else torch.randn(2, 40, 2, 16, generator=gen)
    v = q if shared else torch.randn(2, 40, 2, 16, generator=gen)
    return (q, k, v)


def _bwd_inputs(gen, shared=False):
    q, k, v = _fwd_inputs(gen, shared)
    do, out = torch.randn_like(q), torch.randn_like(q)
    return (do, q, k, v, out, torch.randn(2, 4, 40, generator=gen))


def _decode_inputs(gen, shared=False):
    b, cap, h, hk, d = 2, 1024, 8, 2, 32  # 16 key tiles a row: 4 splits, so a combine
    q = torch.randn(b, 1, h, d, generator=gen)
    kc = torch.randn(b, cap, hk, d, generator=gen)
    vc = kc if shared else torch.randn(b, cap, hk, d, generator=gen)
    k, v = torch.randn(b, 1, hk, d, generator=gen), torch.randn(b, 1, hk, d, generator=gen)
    cos, sin = torch.randn(cap, 8, generator=gen), torch.randn(cap, 8, generator=gen)
    lens = torch.tensor([900, 17], dtype=torch.int32)
    return (q, kc, vc, k, v, cos, sin, lens, None, None, None, None)


SPEC = AttnSpec(0.25, -1, 0)


def _fwd_call(t):
    return launch_fwd._forward(*t, SPEC)


def _bwd_call(t):
    return launch_bwd._backward(*t, SPEC)


def _decode_call(t):
    return launch_decode.decode_forward(
        t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], None, None, None, softmax_scale=0.2,
        window_left=-1, window_right=0, softcap=0.0, rotary_interleaved=True,
        rotary_q_per_token=True, alibi_slopes=None, num_splits=0, tree_mask=None)


def _record(case, t, call=None):
    """``(outputs, plan)`` of one recorded call of ``case`` on the inputs ``t``."""
    if case == "decode":
        return launch_decode.record_plan(t, lambda: (call or _decode_call)(t))
    call, roles = {"forward": (_fwd_call, launch_fwd._ROLES),
                   "backward": (_bwd_call, launch_bwd._ROLES)}[case] if call is None else (
        call, {"forward": launch_fwd._ROLES, "backward": launch_bwd._ROLES}[case])
    with fastlaunch.recording() as rec:
        outs = call(t)
    return outs, fastlaunch.record_plan(rec, t, outs, roles)


INPUTS = {"forward": _fwd_inputs, "backward": _bwd_inputs, "decode": _decode_inputs}
# kernels of one call: the forward; dQ, dK/dV; append, rotate q, split-KV, combine
N_LAUNCHES = {"forward": 1, "backward": 2, "decode": 4}


@pytest.fixture
def stubbed(monkeypatch):
    """Direct launches stubbed (they run on a GPU only): a launch returns a handle per kernel
    and its arguments; replays are noted, not run."""
    handles, seen, ran = {}, [], []

    def fake_launch(kernel, grid, kwargs):
        for name, rule in getattr(kernel, "values", {}).items():
            kwargs[name] = rule(kwargs)
        values = [kwargs[n] for n in kernel.arg_names]  # signature order, as named_values
        seen.append((kernel, grid, values))
        return handles.setdefault(kernel, object()), values

    monkeypatch.setattr(fastlaunch, "_launch", fake_launch)
    monkeypatch.setattr(fastlaunch, "INTERNALS_OK", True)
    monkeypatch.setattr(fastlaunch, "_current", lambda device: True)
    monkeypatch.setattr(fastlaunch, "launch_hooks_set", lambda: False)
    # a replay calls what fastlaunch.bind made of each launch: here a note of its arguments
    monkeypatch.setattr(fastlaunch, "bind", lambda compiled, grid, values: (
        lambda *args: ran.append((compiled, grid, list(args[4:]))), [None] * 4 + list(values)))
    monkeypatch.setattr(fastlaunch, "raw_stream", lambda device: None)
    # replays pass tensors as they are (test_replays_pass_addresses checks the conversion)
    monkeypatch.setattr(fastlaunch, "addresses", list)
    # decode: GPU block shapes and splits; no index check (the stubbed kernels write no error
    # record; tests/test_decode.py replays plans with the check on)
    monkeypatch.setattr(launch_decode, "_on_gpu", lambda x: True)
    monkeypatch.setattr(launch_decode, "num_sms", lambda device: 132)
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "off")
    launch_decode._plan.cache_clear()
    yield handles, seen, ran
    launch_decode._plan.cache_clear()


def test_replays_pass_addresses():
    """``fastlaunch.addresses``: a tensor becomes its ``data_ptr()`` (a view's, with its
    offset), an int (an address already) and None stay as they are."""
    t = torch.randn(4, 8)
    view = t[1:, 2:]
    assert fastlaunch.addresses([t, None, view, 12345]) == [
        t.data_ptr(), None, t.data_ptr() + (8 + 2) * t.element_size(), 12345]


def test_plan_rebuilds_each_descriptor_for_the_new_tensors(stubbed):
    """A Gluon launch is recorded with its TMA descriptors (``launch_sm90._launch``: position
    -> (tensor, build)): the plan keeps none of the recording call's descriptors and, per
    replay, builds each one of the replay's tensor in that place (an input, or the fresh buffer
    of the recorded buffer) with the recorded build; a buffer that started at zero starts at
    zero in every replay."""
    _, _, ran = stubbed
    handle = object()

    def call(inputs):
        out = fastlaunch.empty((4, 8), torch.float32, "cpu")

        def build(t):
            return ("descriptor of", t)
        values = [build(inputs[0]), build(out), 3, inputs[1]]
        fastlaunch.recorder().launches.append(
            ("gluon kernel", (2,), (handle, values, {0: (inputs[0], build), 1: (out, build)})))
        return (out,)

    first = (torch.randn(4, 8), torch.randn(3))
    with fastlaunch.recording() as rec:
        outs = call(first)
    plan = fastlaunch.record_plan(rec, first, outs)
    assert plan is not None
    (_, template, _, _), = plan.launches
    assert not any(isinstance(v, (tuple, torch.Tensor)) for v in template)
    second = (torch.randn(4, 8), torch.randn(3))
    (out,) = plan.run(second)
    (compiled, grid, args), = ran
    assert compiled is handle and grid == (2,)
    assert args[0] == ("descriptor of", second[0]) and args[0][1] is second[0]
    assert args[1][1] is out and out is not outs[0] and out.shape == (4, 8)
    assert args[2] == 3 and args[3] is second[1]
    # a buffer that starts at zero (a work counter: fastlaunch.zeros) is zeroed per replay
    with fastlaunch.recording() as rec:
        counter = fastlaunch.zeros(1, torch.int32, "cpu")
        fastlaunch.recorder().launches.append(("kernel", (1,), (handle, [counter], {})))
        outs = (fastlaunch.empty((2,), torch.float32, "cpu"),)
    plan = fastlaunch.record_plan(rec, first, outs)
    ran.clear()
    real = torch.empty_strided
    with pytest.MonkeyPatch.context() as mp:  # fresh memory that is not zero
        mp.setattr(torch, "empty_strided", lambda *a, **kw: real(*a, **kw).fill_(7))
        plan.run(second)
    (_, _, (fresh,)), = ran
    assert fresh is not counter and fresh.dtype == torch.int32 and fresh.tolist() == [0]
    # a descriptor of a tensor that is neither an input nor a buffer of the call: no plan
    with fastlaunch.recording() as rec:
        fastlaunch.recorder().launches.append(("gluon kernel", (2,), (handle, [None], {
            0: (torch.randn(2), lambda t: t)})))
        outs = (fastlaunch.empty((1,), torch.float32, "cpu"),)
    assert fastlaunch.record_plan(rec, first, outs) is None
    # ... unless it is a stand-in kept for good (fastlaunch.constant): rebuilt per replay
    stand_in = fastlaunch.constant(torch.empty(2))
    with fastlaunch.recording() as rec:
        fastlaunch.recorder().launches.append(("gluon kernel", (2,), (handle, [None], {
            0: (stand_in, lambda t: ("descriptor of", t))})))
        outs = (fastlaunch.empty((1,), torch.float32, "cpu"),)
    plan = fastlaunch.record_plan(rec, first, outs)
    (_, template, _, _), = plan.launches
    assert not any(isinstance(v, (tuple, torch.Tensor)) for v in template)
    ran.clear()
    plan.run(second)
    (_, _, args), = ran
    assert args[0] == ("descriptor of", stand_in) and args[0][1] is stand_in


@pytest.mark.parametrize("case", ["forward", "backward", "decode"])
def test_plan_replays_the_recorded_launches_with_new_tensors(stubbed, case):
    """Replaying a plan for new tensors of the same signature passes each kernel exactly the
    arguments a fresh call on those tensors passes, with fresh buffers in the buffer places."""
    handles, seen, ran = stubbed
    first = INPUTS[case](_seed(case, "a"))
    _, plan = _record(case, first)
    kernels = [s[0] for s in seen]
    assert plan is not None and len(plan.launches) == N_LAUNCHES[case]
    second = INPUTS[case](_seed(case, "b"))
    seen.clear()
    want_outs, _ = _record(case, second)
    outs = plan.run(second)
    assert [r[0] for r in ran] == [handles[kn] for kn in kernels]
    buffers = {}
    for (_, grid, got), (kernel, want_grid, want) in zip(ran, seen):
        assert grid == want_grid and len(got) == len(want)
        for i, (x, y) in enumerate(zip(got, want)):
            if isinstance(y, torch.Tensor) and any(y is t for t in second):
                assert x is y, f"{kernel}: argument {i} is not the caller's tensor"
            elif isinstance(y, torch.Tensor) and case == "decode" and not any(y is w for w in want_outs):
                # a decode buffer it does not return: an address in the stream's scratch
                # region (tests/test_decode.py checks where)
                assert isinstance(x, int)
            elif isinstance(y, torch.Tensor):
                # a buffer of the call: fresh, of the recorded shape, strides and dtype, the
                # same one wherever the fresh call used the same one
                assert isinstance(x, torch.Tensor) and x.shape == y.shape
                assert x.stride() == y.stride() and x.dtype == y.dtype
                assert all(x is not t for t in second + first)
                assert buffers.setdefault(id(y), x) is x
            else:
                assert x == y, f"{kernel}: argument {i}: {x!r} != {y!r}"
    assert len(outs) == len(want_outs)
    for out, want in zip(outs, want_outs):
        assert out is buffers[id(want)] and out.shape == want.shape


@pytest.mark.parametrize("case", ["forward", "backward"])
def test_plan_recorded_with_one_tensor_as_several_inputs_serves_distinct_ones(stubbed, case):
    """``flash_attn_func(x, x, x)``: the kernel parameters place q, k and v, so the plan also
    serves a later call with three distinct tensors."""
    _, _, ran = stubbed
    shared = INPUTS[case](_seed(case, "shared"), shared=True)
    _, plan = _record(case, shared)
    assert plan is not None
    t = INPUTS[case](_seed(case, "distinct"))
    plan.run(t)
    for _, _, values in ran:
        placed = [i for i, x in enumerate(t) if any(x is v for v in values)]
        # each launch gets q, k and v (and do, out, lse in the backward), each in its own place
        assert {1, 2, 3} <= set(placed) if case == "backward" else placed == [0, 1, 2]


def test_decode_plan_is_not_recorded_with_one_tensor_as_two_inputs(stubbed):
    """No parameter tells which input a tensor passed twice is (a later call of the same
    signature may pass two), so no plan."""
    shared = _decode_inputs(_seed("decode", "shared"), shared=True)
    assert _record("decode", shared)[1] is None


@pytest.mark.parametrize("case", ["forward", "decode"])
def test_no_plan_with_a_tensor_that_is_neither_an_input_nor_a_buffer(stubbed, case):
    t = INPUTS[case](_seed(case, "copy"))
    k_copy = t[1].clone() if case == "forward" else t[3].clone()  # e.g. a converted copy
    if case == "forward":
        call = lambda t: _fwd_call((t[0], k_copy, t[2]))  # noqa: E731
    else:
        call = lambda t: _decode_call(t[:3] + (k_copy,) + t[4:])  # noqa: E731
    assert _record(case, t, call)[1] is None


@pytest.mark.parametrize("case", ["forward", "backward", "decode"])
def test_no_plan_when_a_launch_was_not_direct(stubbed, monkeypatch, case):
    monkeypatch.setattr(fastlaunch, "_launch", lambda kernel, grid, kwargs: None)
    assert _record(case, INPUTS[case](_seed(case, "plain")))[1] is None


def test_no_plan_of_a_call_that_works_besides_its_launches(stubbed):
    """``fastlaunch.unplannable``: a call that does work a plan would skip (a PyTorch copy of a
    buffer into an output: ``launch_sm90.padded_backward``'s crops) records no plan, though
    every launch was direct; the same call without the mark records one."""
    t = INPUTS["backward"](_seed("backward", "unplannable"))

    def call(t):
        outs = _bwd_call(t)
        fastlaunch.unplannable()
        return outs
    assert _record("backward", t)[1] is not None
    assert _record("backward", t, call)[1] is None


@pytest.mark.parametrize("case", ["forward", "backward"])
def test_launcher_records_a_plan_once_then_replays_it(stubbed, monkeypatch, case):
    """The public launchers: the first plain call of a signature records a plan, the next ones
    replay it (one launch per kernel, no argument rebuilt) and return its fresh buffers."""
    _, seen, ran = stubbed
    module = launch_fwd if case == "forward" else launch_bwd
    monkeypatch.setattr(module, "plans_enabled", lambda: True)
    monkeypatch.setattr(module, "_plans", fastlaunch.PlanCache())
    call = ((lambda t: launch_fwd.forward(*t, SPEC)) if case == "forward"
            else (lambda t: launch_bwd.backward(*t, SPEC)))
    first = call(INPUTS[case](_seed(case, "public-a")))
    assert len(seen) == N_LAUNCHES[case] and ran == []
    second = call(INPUTS[case](_seed(case, "public-b")))
    assert len(seen) == N_LAUNCHES[case] and len(ran) == N_LAUNCHES[case]
    assert all(x.shape == y.shape and x is not y for x, y in zip(first, second))


def test_launch_plans_switch():
    with fastlaunch.launch_plans(False):
        assert not fastlaunch.plans_enabled()
    # under the interpreter direct launches, and so plans, are off anyway
    assert fastlaunch.plans_enabled() is False


def test_tma_launch_passes_the_c_launcher_what_tritons_wrapper_passes(monkeypatch):
    """``fastlaunch.TmaLaunch``: a plan's launch of a kernel with TMA descriptors hands
    Triton's C launcher exactly the arguments Triton's own descriptor wrapper
    (``wrap_handle_tensordesc``, run here on a stub launcher) hands it for the same call,
    pointers as their addresses; each descriptor is encoded once per address of its tensor
    (a later call on the same tensors encodes nothing, a new tensor is encoded); a kernel
    whose descriptors the plan does not all name gets no TmaLaunch."""
    from types import SimpleNamespace

    from triton.backends.nvidia import driver

    encodes = []

    def fake_encode(desc, meta):  # stands in for cuTensorMapEncodeTiled (GPU only)
        encodes.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr(), meta["swizzle"]), *desc.shape, *desc.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", fake_encode)
    monkeypatch.setattr(fastlaunch, "_make_tensordesc_arg", fake_encode)
    signature = {"desc_a": "tensordesc<fp16[64, 32]>", "X": "*fp32", "n": "i32",
                 "desc_b": "tensordesc<fp16[64, 32]>", "Y": "*fp16", "FLAG": "constexpr"}
    metas = [{"swizzle": 64}, {"swizzle": 128}]
    seen = []
    wrapped = driver.wrap_handle_tensordesc(lambda *a: seen.append(a), signature, metas)
    run = SimpleNamespace(launch=wrapped, launch_cooperative_grid=False, launch_pdl=True,
                          global_scratch_size=0, profile_scratch_size=0)
    compiled = SimpleNamespace(run=run, src=SimpleNamespace(signature=signature),
                               function=77, packed_metadata=("packed",))

    def build(shape, strides):
        return lambda t: SimpleNamespace(base=t, shape=shape, strides=strides)
    builds = ((0, 1, build([128, 32], [32, 1])), (3, 0, build([256, 32], [32, 1])))
    fast = fastlaunch.TmaLaunch.of(compiled, (5, 2), builds)
    assert fast is not None

    def call(a, b, x, y):
        values = [None, x, 40, None, y, True]
        head = (5, 2, 1, 999, 77, False, True, None, None, ("packed",), None, None, None)
        wrapped(*head, *[build([128, 32], [32, 1])(b), *values[1:3],
                         build([256, 32], [32, 1])(a), *values[4:]])
        fast(values, (a, b), 999)
        want, got = seen[-2:]
        assert got == tuple(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in want)

    a, b = torch.randn(256, 32, dtype=torch.float16), torch.randn(128, 32, dtype=torch.float16)
    x, y = torch.randn(8), torch.randn(8, dtype=torch.float16)
    call(a, b, x, y)
    assert encodes == [b.data_ptr(), a.data_ptr()] * 2   # Triton's wrapper, then the first call
    call(a, b, torch.randn(8), y)
    assert len(encodes) == 6                             # the wrapper's 2; TmaLaunch's none
    b2 = torch.randn(128, 32, dtype=torch.float16)
    call(a, b2, x, y)
    assert encodes[-1] == b2.data_ptr() and len(encodes) == 9
    # every descriptor parameter needs a build: else Triton's own launch path
    assert fastlaunch.TmaLaunch.of(compiled, (5, 2), builds[:1]) is None
    assert fastlaunch.TmaLaunch.of(SimpleNamespace(), (5, 2), builds) is None


def test_plan_replays_gluon_launches_through_tma_launch(monkeypatch):
    """A plan (``fastlaunch.record_plan``) of a launch recorded with TMA descriptors replays it
    through ``TmaLaunch``: the C launcher gets what Triton's own descriptor wrapper gives it for
    the replay's tensors (a new input, the replay's fresh output buffer), pointers as
    addresses."""
    from types import SimpleNamespace

    from triton.backends.nvidia import driver

    def fake_encode(desc, meta):  # stands in for cuTensorMapEncodeTiled (GPU only)
        return [("map", desc.base.data_ptr(), meta["swizzle"]), *desc.shape, *desc.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", fake_encode)
    monkeypatch.setattr(fastlaunch, "_make_tensordesc_arg", fake_encode)
    monkeypatch.setattr(fastlaunch, "_current", lambda device: True)
    monkeypatch.setattr(fastlaunch, "launch_hooks_set", lambda: False)
    monkeypatch.setattr(fastlaunch, "raw_stream", lambda device: 999)
    signature = {"desc_a": "tensordesc<fp16[64, 32]>", "X": "*fp32", "n": "i32",
                 "desc_b": "tensordesc<fp16[64, 32]>", "FLAG": "constexpr"}
    seen = []
    wrapped = driver.wrap_handle_tensordesc(lambda *a: seen.append(a), signature,
                                            [{"swizzle": 64}, {"swizzle": 128}])
    run = SimpleNamespace(launch=wrapped, launch_cooperative_grid=False, launch_pdl=False,
                          global_scratch_size=0, profile_scratch_size=0)
    compiled = SimpleNamespace(run=run, src=SimpleNamespace(signature=signature),
                               function=77, packed_metadata=("packed",))

    def build(t):
        return SimpleNamespace(base=t, shape=[t.shape[0], 32], strides=[32, 1])

    def call(inputs):
        out = fastlaunch.empty((128, 32), torch.float16, "cpu")
        values = [build(inputs[0]), inputs[1], 40, build(out), True]
        fastlaunch.recorder().launches.append(
            ("kernel", (5,), (compiled, values, {0: (inputs[0], build), 3: (out, build)})))
        return (out,)

    def inputs():
        return torch.randn(256, 32, dtype=torch.float16), torch.randn(8)
    first = inputs()
    with fastlaunch.recording() as rec:
        outs = call(first)
    plan = fastlaunch.record_plan(rec, first, outs)
    (fast, template, _, tma), = plan.launches
    assert tma and isinstance(fast, fastlaunch.TmaLaunch)
    assert not any(isinstance(v, torch.Tensor) or hasattr(v, "base") for v in template)
    second = inputs()
    (out,) = plan.run(second)
    assert out is not outs[0] and out.shape == (128, 32)
    wrapped(5, 1, 1, 999, 77, False, False, None, None, ("packed",), None, None, None,
            build(second[0]), second[1], 40, build(out), True)
    got, want = seen
    assert got == tuple(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in want)
