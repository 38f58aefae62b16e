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
    monkeypatch.setattr(launch_common, "_arg_names", {})

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
    monkeypatch.setattr(launch_common, "_arg_names", {})
    assert launch_common._direct_key(FakeKernel, dict(X=torch.zeros(4)), {}) is None


def test_interpreter_never_launches_directly():
    # tests run the kernels under TRITON_INTERPRET=1 (conftest): the direct path is off there
    assert launch_common._DIRECT is False
