"""Backend registry: ``"triton"`` (GPU kernels, or the Triton interpreter) and ``"torch"`` (a
tiled PyTorch engine for any device).  Every backend implements the same four functions
(:func:`get`): attention forward/backward, decode against a KV cache and the merge of two
partial results.

Selection, first match wins: ``use_backend(name)`` context, ``FLASHTILE_BACKEND`` environment
variable, then by device: CUDA tensors -> triton; CPU tensors -> triton only when
``TRITON_INTERPRET=1`` (tests run the kernels that way), else torch.

Where the masking rules live (causal and sliding window, both written as one window rule,
``AttnSpec.window_left/right`` and ``AttnSpec.shift`` in :mod:`.spec`):

- GPU: ``triton/kernels/common.py``: ``key_range`` / ``query_range`` pick the key (query) tiles a
  query (key) tile can see, so invisible tiles are never loaded; ``visible`` masks the elements
  of the boundary tiles. The forward and both backward kernels call all three; the decode
  kernel (``triton/kernels/decode.py``) calls ``visible``.
- CPU: ``torch/attention.py``'s ``_Band`` does the same for the tiled engine (plain causal calls
  without a window go to PyTorch's fused CPU kernel instead).
- Reference: ``flashtile.masks.visible_mask`` builds the dense mask the tests compare against.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import threading

import torch

BACKENDS = ("triton", "torch")


class _Choice(threading.local):
    # per thread: the use_backend choice; a class default, because looking up a missing
    # thread-local attribute raises inside getattr (~1 us on every call)
    name = None


_local = _Choice()


def _check_name(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}={name!r} is not a flashtile backend; expected one of "
                         f"{', '.join(map(repr, BACKENDS))}")
    return name


@contextlib.contextmanager
def use_backend(name: str):
    """Run the enclosed calls on backend ``name`` ("triton" or "torch")."""
    _check_name(name, "use_backend")
    old = _local.name
    _local.name = name
    try:
        yield
    finally:
        _local.name = old


def env_reader(name: str):
    """A function returning environment variable ``name`` now (None when unset), as
    ``os.environ.get(name)`` does.  The variables read on every call (backend, check mode,
    interpreter) are read from ``os.environ``'s own mapping under a key encoded once: on the H100
    machine ``os.environ.get`` costs ~2-3 us a read (the key is encoded each time and a missing
    one raises inside), a lookup here ~0.1 us.  Writes through ``os.environ`` (``monkeypatch``,
    ``os.environ[...] = ...``) are seen at once."""
    data = getattr(os.environ, "_data", None)
    if os.name == "posix" and isinstance(data, dict):
        key, decode = os.environ.encodekey(name), os.environ.decodevalue

        def read():
            value = data.get(key)
            return None if value is None else decode(value)
        return read
    return lambda: os.environ.get(name)  # pragma: no cover - other platforms


_interpret_env = env_reader("TRITON_INTERPRET")
_backend_env = env_reader("FLASHTILE_BACKEND")


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the Triton interpreter."""
    return _interpret_env() not in (None, "", "0")



@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    # once per process: every call asks, and a module search costs microseconds
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def _cuda_reason(index: int | None) -> str | None:
    # Cached per device: the capability query costs microseconds on every call otherwise.
    if torch.version.hip is None:
        major, _ = torch.cuda.get_device_capability(index)
        if major < 8:
            return (f"{torch.cuda.get_device_name(index)} (sm_{major}x) is older than "
                    "Ampere; the kernels need sm_80 or newer")
    return None


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device`` (None when it can)."""
    if not _triton_importable():
        return "the 'triton' package is not installed (pip install triton)"
    if device.type == "cuda":
        return _cuda_reason(device.index)
    if interpreting():
        return None
    return (f"Triton cannot compile for {device.type} tensors; set TRITON_INTERPRET=1 to emulate "
            "the kernels (slow) or use the 'torch' backend")


def select(device: torch.device) -> str:
    """The backend name for tensors on ``device``; raises if an explicit choice is impossible."""
    name = _local.name
    source = "use_backend"
    if name is None:
        env = (_backend_env() or "").strip()
        if env:
            name, source = _check_name(env, "FLASHTILE_BACKEND"), "FLASHTILE_BACKEND"
    if name is None:
        kind = device.type  # a new string per read
        if kind == "cuda" or (kind == "cpu" and interpreting()):
            return "triton" if triton_unavailable_reason(device) is None else "torch"
        return "torch"
    if name == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"{source} asks for the triton backend, but {reason}")
    return name


def get(name: str):
    """The module implementing backend ``name``: ``forward`` / ``backward`` (dense, varlen and
    paged attention, see ``spec.py``), ``decode(spec: KVCacheSpec, k_cache, v_cache, rotary_cos,
    rotary_sin, alibi_slopes, rotary_interleaved) -> (out, lse)`` (``flash_attn_with_kvcache``)
    and ``merge_states(out_a, lse_a, out_b, lse_b) -> (out, lse)``."""
    module = _MODULES.get(name)
    if module is None:  # imported on first use (the triton backend imports triton)
        module = _MODULES[name] = importlib.import_module(
            ".triton" if name == "triton" else ".torch", __name__)
    return module


_MODULES: dict = {}
