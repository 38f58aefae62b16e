"""The key under which direct launches reuse a compiled kernel (GPU-only path; the key itself is
plain Python).  Two calls may share a compiled kernel only if Triton would specialise them the
same way: same dtypes and 16-byte alignment of every tensor, same value and type of every
scalar, same launch options."""
from __future__ import annotations

import pytest
import torch

from flashtile.backends.triton import launch_common


class FakeKernel:
    arg_names = ["X", "Y", "n", "scale", "FLAG"]


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch_common, "_layouts", {})

    def make(meta=None, **overrides):
        named = {**dict(X=torch.zeros(64), Y=None, n=48, scale=0.5, FLAG=True), **overrides}
        return launch_common._direct_key(FakeKernel, named,
                                         {"num_warps": 4, "num_stages": 3, **(meta or {})})
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
    monkeypatch.setattr(launch_common, "_layouts", {})
    assert launch_common._direct_key(FakeKernel, dict(X=torch.zeros(4)), {}) is None


def test_interpreter_never_launches_directly():
    # tests run the kernels under TRITON_INTERPRET=1 (conftest): the direct path is off there
    assert launch_common._DIRECT is False


class FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


@pytest.mark.parametrize("grid, dims", [((3,), (3, 1, 1)), ((3, 4), (3, 4, 1)),
                                        ((3, 4, 5), (3, 4, 5))], ids=["1d", "2d", "3d"])
def test_run_direct_passes_the_grid_stream_and_every_argument(monkeypatch, grid, dims):
    monkeypatch.setattr(launch_common, "_raw_stream", lambda device: 1000 + device)
    compiled = FakeCompiled()
    assert launch_common.run_direct(compiled, grid, ["a", 2, None], 7)
    assert compiled.calls == [dims + (1007, "fn", "meta", None, None, None, "a", 2, None)]


def test_run_direct_declines_while_a_profiler_hook_is_set(monkeypatch):
    from triton import knobs
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        compiled = FakeCompiled()
        assert not launch_common.run_direct(compiled, (1, 1), [], 0)
        assert compiled.calls == []
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert launch_common._no_launch_hooks()


def test_named_values_follow_the_signature(key):
    named = dict(FLAG=True, scale=0.5, n=48, Y=None, X=torch.zeros(4))
    assert key() is not None  # fills the kernel's layout
    assert launch_common.named_values(FakeKernel, named)[1:] == [None, 48, 0.5, True]
