"""The key under which direct launches reuse a compiled kernel (GPU-only path; the key itself is
plain Python).  Two calls may share a compiled kernel only if Triton would specialise them the
same way: same dtypes and 16-byte alignment of every tensor, same value and type of every
scalar, same launch options."""
from __future__ import annotations

import pytest
import torch

from flashtile.backends.triton import fastlaunch


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
    monkeypatch.setattr(fastlaunch, "_raw_stream", lambda device: 1000 + device)
    compiled = FakeCompiled()
    assert fastlaunch.run_direct(compiled, grid, ["a", 2, None], 7)
    assert compiled.calls == [dims + (1007, "fn", "meta", None, None, None, "a", 2, None)]


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


def _backward_tensors(share_qk=False):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 4, 16, generator=g)
    k = q if share_qk else torch.randn(2, 8, 4, 16, generator=g)
    v, do, out = (torch.randn(2, 8, 4, 16, generator=g) for _ in range(3))
    lse = torch.randn(2, 4, 8, generator=g)
    grads = dict(dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v),
                 delta=torch.empty(2, 4, 8))
    return dict(q=q, k=k, v=v, do=do, out=out, lse=lse, **grads)


def _recorded_launches(t):
    """The two launches with the backward's argument layout (tensors, then scalars)."""
    return [((1, 8), ("dq", [t["q"], t["k"], t["v"], t["do"], t["dq"], t["out"], t["lse"],
                             t["delta"], None, 0.25, 128])),
            ((2, 8), ("dkdv", [t["q"], t["k"], t["v"], t["do"], t["dk"], t["dv"], t["lse"],
                               t["delta"], None, 0.25, 64]))]


def test_backward_plan_puts_a_new_calls_tensors_in_the_recorded_places(monkeypatch):
    from flashtile.backends.triton import launch_bwd

    first = _backward_tensors()
    plan = launch_bwd._record(_recorded_launches(first), first)
    assert plan is not None
    calls = []
    monkeypatch.setattr(launch_bwd, "run_direct",
                        lambda compiled, grid, values, device: calls.append((compiled, grid, values)))
    second = _backward_tensors()
    dq, dk, dv = launch_bwd._replay(plan, second["do"], second["q"], second["k"], second["v"],
                                    second["out"], second["lse"])
    want = _recorded_launches(dict(second, dq=dq, dk=dk, dv=dv, delta=calls[0][2][7]))
    assert [c[0] for c in calls] == ["dq", "dkdv"]
    assert [c[1] for c in calls] == [w[0] for w in want]
    for (_, _, got), (_, (_, expected)) in zip(calls, want):
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert a is b if isinstance(b, torch.Tensor) or b is None else a == b
    assert calls[1][2][7] is calls[0][2][7], "delta written by the dQ kernel is read by dK/dV"
    assert dq.shape == second["q"].shape and dk.shape == second["k"].shape


def test_backward_plan_recorded_with_one_tensor_as_two_inputs_serves_distinct_ones(monkeypatch):
    from flashtile.backends.triton import launch_bwd

    shared = _backward_tensors(share_qk=True)
    plan = launch_bwd._record(_recorded_launches(shared), shared)
    assert plan is not None
    calls = []
    monkeypatch.setattr(launch_bwd, "run_direct",
                        lambda compiled, grid, values, device: calls.append(values))
    t = _backward_tensors()
    launch_bwd._replay(plan, t["do"], t["q"], t["k"], t["v"], t["out"], t["lse"])
    assert calls[1][0] is t["q"] and calls[1][1] is t["k"], "q and k each in its own place"


def test_backward_plan_is_not_recorded_with_an_unknown_tensor_argument():
    from flashtile.backends.triton import launch_bwd

    t = _backward_tensors()
    launches = _recorded_launches(t)
    launches[1][1][1][8] = torch.zeros(1)  # e.g. a bias the plan would not know how to fill
    assert launch_bwd._record(launches, t) is None
