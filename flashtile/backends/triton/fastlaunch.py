"""Launching kernels with little host work: output allocation, direct launches of compiled
kernels, and launch plans that later calls of the same signature replay.

Every use of Triton's internals (the ``Heuristics`` wrapper's rules, ``JITFunction``'s
parameter names, a compiled kernel's ``run`` / ``packed_metadata``, the launch-hook chain) and of
PyTorch's raw-stream accessor sits in this module, behind :data:`INTERNALS_OK`, a check of the
Triton version these were written against.  With another Triton version every launch takes
Triton's own path, ``kernel[grid](**kwargs)``: slower on the host, same kernels, same results.
"""
from __future__ import annotations

import contextlib
import operator
import os

import torch
import triton

from .configs import interpreting, pinned_configs

# The Triton versions whose internals this module reads (``major.minor``).
_TESTED_TRITON = {(3, 6)}


def _triton_version() -> tuple[int, int]:
    try:
        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


INTERNALS_OK = _triton_version() in _TESTED_TRITON
if INTERNALS_OK:
    from triton import knobs as _knobs
    from triton.runtime.autotuner import Heuristics as _Heuristics
    from triton.runtime.errors import OutOfResources
    from triton.runtime.jit import JITFunction as _JITFunction
else:  # pragma: no cover - another Triton: the plain launch path only
    _knobs = _Heuristics = _JITFunction = None

    class OutOfResources(Exception):
        pass

_poison = False


@contextlib.contextmanager
def poison_outputs():
    """Fill every buffer the kernels write with NaN first, so a test can prove that each
    element was written."""
    global _poison
    old, _poison = _poison, True
    try:
        yield
    finally:
        _poison = old


def poisoning() -> bool:
    """Whether :func:`poison_outputs` is active."""
    return _poison


def empty(shape, dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if _poison else out


# Direct launches.  ``JITFunction.run`` binds every argument, derives its specialisation
# (dtype, 16-byte alignment, ints equal to 1 or divisible by 16), hashes that into a cache key
# and builds launch metadata on every call, although a training step repeats the same few
# variants.  Here the compiled kernel of a variant is remembered under a key that determines
# that specialisation: the exact value and type of every non-tensor argument (ints, floats,
# bools, None, constexprs) and the launch options, and each tensor's dtype and 16-byte
# alignment.  Equal keys imply equal Triton cache keys, so the kernel called is the one
# ``kernel[grid]`` would call (``tests/gpu/test_direct_launch.py`` compares the two
# bitwise on the GPU).  ``FLASHTILE_DIRECT_LAUNCH=0`` turns them off.
_DIRECT = (os.environ.get("FLASHTILE_DIRECT_LAUNCH", "1") != "0" and not interpreting()
           and INTERNALS_OK)
_MAX_COMPILED = 4096
_compiled: dict = {}
_layouts: dict = {}  # kernel -> getters of its tensor / scalar / all arguments, parameter names
_fitted_stages: dict = {}


def direct_enabled() -> bool:
    """Whether launches go directly to compiled kernels (see :func:`direct_launches`)."""
    return _DIRECT


@contextlib.contextmanager
def direct_launches(enabled: bool):
    """Turn direct launches on or off inside the block (benchmarks compare the two paths; the
    GPU tests compare their results bitwise).  On only where they may be: compiled kernels and
    a Triton version whose internals this module knows."""
    global _DIRECT
    old = _DIRECT
    _DIRECT = bool(enabled) and not interpreting() and INTERNALS_OK
    try:
        yield
    finally:
        _DIRECT = old


def launch_hooks_set() -> bool:
    """Whether a profiler asked Triton to be called on every launch (a launch-enter hook): then
    every launch takes Triton's own path, which calls it."""
    if not INTERNALS_OK:
        return True
    hook = _knobs.runtime.launch_enter_hook  # a HookChain; profilers add calls to it
    return not (hook is None or not getattr(hook, "calls", True))


def launch(kernel, grid, **kwargs) -> tuple | None:
    """``kernel[grid](**kwargs)`` (every kernel argument and launch option by name), through a
    cheaper host path once a variant is compiled.

    For a ``triton.heuristics`` kernel the derived constexprs are computed here, from the one
    name -> value mapping the call already is, and the wrapped jitted function is launched with
    them: the wrapper rebuilds that mapping of every argument once per heuristic, which on an
    H100 host costs ~18 us a launch (benchmarks/overhead.py --profile).  Same rules, same
    order, same values.

    After the first launch of a variant its compiled kernel is called directly (see
    :func:`_direct_key`).  Returns ``(compiled kernel, every argument in signature order)``
    when launches are direct (for :func:`run_direct` and :func:`record_plan`), else None.
    """
    if not INTERNALS_OK:
        kernel[grid](**kwargs)
        return None
    return _launch(kernel, grid, (), kwargs, kwargs)


def launch_args(kernel, grid, args: tuple, meta: dict) -> tuple | None:
    """:func:`launch` for a caller holding the leading arguments in signature order and the
    rest by name: the jitted function gets them as ``kernel[grid](*args, **meta)`` passes
    them."""
    if not INTERNALS_OK:
        kernel[grid](*args, **meta)
        return None
    named = dict(zip(kernel.arg_names, args))
    named.update(meta)
    return _launch(kernel, grid, args, meta, named)


def _launch(kernel, grid, args: tuple, meta: dict, named: dict) -> tuple | None:
    """:func:`launch` of ``kernel[grid](*args, **meta)``; ``named`` maps every argument and
    launch option to its value (``meta`` itself when ``args`` is empty)."""
    if isinstance(kernel, _Heuristics):
        for name, rule in kernel.values.items():
            named[name] = meta[name] = rule(named)
        kernel = kernel.fn
    direct = _DIRECT and grid[0] and kernel.__class__ is _JITFunction
    key = None
    if direct:
        key = _direct_key(kernel, named)
        try:
            compiled = _compiled.get(key) if key is not None else None
        except TypeError:  # an unhashable scalar argument
            compiled = key = None
        if compiled is not None:
            values = named_values(kernel, named)
            if run_direct(compiled, grid, values, key[1]):
                return compiled, values
    # Per variant (its constexprs and options), the pipeline depth that fits in shared memory.
    params = _params(kernel)
    fit_key = (kernel, tuple(sorted((k, v) for k, v in meta.items()
                                    if k != "num_stages" and (k not in params or params[k])
                                    and isinstance(v, (int, float, str, bool, type(None))))))
    stages = _fitted_stages.get(fit_key)
    if stages is not None:
        meta["num_stages"] = stages
    while True:
        try:
            compiled = kernel[grid](*args, **meta)
            break
        except OutOfResources:
            # Optional features (bias tiles, dropout state) add shared memory to a config tuned
            # without them: fewer pipeline stages always fit in less.  Remembered per variant.
            if meta.get("num_stages", 1) <= 1:
                raise
            meta["num_stages"] = _fitted_stages[fit_key] = meta["num_stages"] - 1
    if direct and key is not None and compiled is not None:
        if len(_compiled) >= _MAX_COMPILED:
            _compiled.clear()
        # under the key of the requested options: a retry that lowered num_stages is remembered
        # by the next lookup too
        _compiled[key] = compiled
        return compiled, named_values(kernel, named)
    return None


_param_kinds: dict = {}


def _params(kernel) -> dict:
    """``{parameter name: is constexpr}`` of a jitted kernel (under the interpreter, which
    keeps no parameter kinds and never runs out of shared memory: every one)."""
    kinds = _param_kinds.get(kernel)
    if kinds is None:
        params = getattr(kernel, "params", None)
        kinds = ({n: True for n in kernel.arg_names} if params is None
                 else {p.name: bool(p.is_constexpr) for p in params})
        _param_kinds[kernel] = kinds
    return kinds


def _direct_key(kernel, named: dict):
    """``(kernel, device, scalars, their types, tensors, options)``, or None when the plain path
    must run (a parameter left at its default, or a tensor where the first call had a scalar).
    ``named`` holds every argument and launch option by name."""
    lay = _layouts.get(kernel)
    if lay is None:
        names = tuple(kernel.arg_names)
        if any(n not in named for n in names):
            return None
        ptr = tuple(n for n in names if named[n] is None or isinstance(named[n], torch.Tensor))
        scalar = tuple(n for n in names if n not in ptr)
        lay = _layouts[kernel] = (_tuple_getter(ptr), _tuple_getter(scalar), _tuple_getter(names),
                                  frozenset(names))
    get_ptr, get_scalar, _, params = lay
    try:
        scalars = get_scalar(named)
        tensors = tuple([None if a is None else (a.dtype, a.data_ptr() & 15 == 0)
                         for a in get_ptr(named)])
    except (KeyError, AttributeError):
        return None
    # the launch options: the names that are not parameters (a set difference at C speed)
    options = tuple([(k, named[k]) for k in sorted(named.keys() - params)])
    return kernel, torch.cuda.current_device(), scalars, tuple(map(type, scalars)), tensors, options


def _tuple_getter(names: tuple):
    """``d -> tuple(d[n] for n in names)`` at C speed (``itemgetter`` of one name is not a
    tuple)."""
    if len(names) >= 2:
        return operator.itemgetter(*names)
    return (lambda d: (d[names[0]],)) if names else (lambda d: ())


def named_values(kernel, named: dict) -> list:
    """Every argument of ``kernel`` in signature order (after :func:`_direct_key` saw it)."""
    return list(_layouts[kernel][2](named))


def _raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def run_direct(compiled, grid: tuple, values: list, device: int) -> bool:
    """Launch ``compiled`` with ``values`` (every argument, signature order) on the current
    stream; False (nothing launched) when a profiler hook asks for the full path."""
    if launch_hooks_set():
        return False
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 _raw_stream(device), compiled.function, compiled.packed_metadata, None, None,
                 None, *values)
    return True


# Launch plans of plain calls (launch_fwd, launch_bwd): per call signature, the grids, compiled
# kernels and arguments of a first call, which later calls of that signature replay with their
# own tensors instead of rebuilding ~60 kernel arguments per launch.
class PlanCache:
    """Plans by signature; emptied when it reaches ``limit`` entries."""

    def __init__(self, limit: int = 1024):
        self._plans: dict = {}
        self._limit = limit

    def get(self, key):
        return self._plans.get(key)

    def put(self, key, plan) -> None:
        if len(self._plans) >= self._limit:
            self._plans.clear()
        self._plans[key] = plan


def plans_enabled() -> bool:
    """Plans replay direct launches, and are not used while outputs are poisoned (every buffer
    must come from :func:`empty`) or configs are pinned (``configs.override``)."""
    return _DIRECT and not _poison and not pinned_configs()


def signature(*tensors: torch.Tensor) -> tuple:
    """Shape, strides and 16-byte alignment of each tensor: with the dtype, device and spec,
    everything a plan's launches depend on."""
    return tuple([(t.shape, t.stride(), t.data_ptr() & 15) for t in tensors])


def record_plan(launched: list, roles: list, tensors: dict):
    """The plan of a call from its direct launches, or None if an argument is not where
    ``roles`` says (another tensor among the arguments, or a role holding another tensor).

    ``launched``: ``(grid, (compiled, values))`` per launch, as :func:`launch` returned them;
    ``roles``: per launch, ``(kernel parameter names, call tensor names)`` of the tensors a
    later call replaces; ``tensors``: the call's tensors by name.  Places are known by role,
    not found by identity, so ``flash_attn_func(x, x, x)`` records a plan that also serves a
    later call with three distinct tensors.  A plan is a list of ``(grid, compiled, argument
    template, [(position, tensor name)])``.
    """
    plan = []
    for (grid, (compiled, values)), (params, names) in zip(launched, roles):
        slots = list(zip(params, names))
        if any(values[i] is not tensors[name] for i, name in slots):
            return None
        taken = {i for i, _ in slots}
        if any(isinstance(a, torch.Tensor) for i, a in enumerate(values) if i not in taken):
            return None
        template = list(values)
        for i in taken:
            template[i] = None
        plan.append((grid, compiled, template, slots))
    return plan


def plan_roles(kernel, roles: dict) -> tuple:
    """``(parameter positions, call tensor names)`` of ``roles`` (``{parameter: tensor name}``)
    in the signature of ``kernel`` (a jitted kernel or its ``triton.heuristics`` wrapper).
    Empty where plans are never recorded (a Triton version whose internals are not known)."""
    if not INTERNALS_OK:
        return (), ()
    names = list(kernel.arg_names)
    return tuple(names.index(p) for p in roles), tuple(roles.values())


def fill(template: list, slots: list, tensors: dict) -> list:
    """A plan's argument list for a new call: the template with the call's tensors in place."""
    values = template.copy()
    for i, name in slots:
        values[i] = tensors[name]
    return values
