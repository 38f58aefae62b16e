"""Launching kernels with little host work: output allocation, direct launches of compiled
kernels, and launch plans that later calls of the same signature replay (the forward, the
backward and the decode step record and replay through the one mechanism here).

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
import threading

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
    try:
        from triton.backends.nvidia.driver import make_tensordesc_arg as _make_tensordesc_arg
    except ImportError:  # pragma: no cover - a Triton built without the CUDA backend
        _make_tensordesc_arg = None
else:  # pragma: no cover - another Triton: the plain launch path only
    _knobs = _Heuristics = _JITFunction = _make_tensordesc_arg = None

    class OutOfResources(Exception):
        pass

_poison = False
_tls = threading.local()  # per thread: the recorder of the call running, if any (recording())


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
    """A buffer the kernels write: NaN-filled under :func:`poison_outputs` when it holds floats
    (an integer buffer is always written whole), noted by the call's :func:`recording`."""
    return _new(torch.empty(shape, dtype=dtype, device=device))


def empty_like(x: torch.Tensor, dtype=None) -> torch.Tensor:
    """:func:`empty` with ``x``'s shape and, when ``x`` is dense, its strides."""
    return _new(torch.empty_like(x, dtype=dtype))


# Tensors a kernel is handed in place of a parameter the launched variant never reads (one
# stand-in per tile shape, made once and kept): a plan rebuilds their descriptors as its own
_constants: dict = {}


def constant(t: torch.Tensor) -> torch.Tensor:
    """``t``, kept for good as a stand-in that plans may use (:func:`record_plan`)."""
    _constants[id(t)] = t
    return t


def zeros(shape, dtype, device) -> torch.Tensor:
    """A buffer that must start at zero (a work counter), noted by the call's
    :func:`recording` as one: a plan's replay zeroes its fresh buffer too."""
    out = torch.zeros(shape, dtype=dtype, device=device)
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        rec.zeroed.add(len(rec.allocs))
        rec.allocs.append(out)
    return out


def _new(out: torch.Tensor) -> torch.Tensor:
    if _poison and out.dtype.is_floating_point:
        out.fill_(float("nan"))
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        rec.allocs.append(out)
    return out


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
    H100 host costs ~18 us a launch (``python -m flashtile.bench overhead --profile``).  Same
    rules, same order, same values.

    After the first launch of a variant its compiled kernel is called directly (see
    :func:`_direct_key`).  Returns ``(compiled kernel, every argument in signature order)``
    when the launch was direct, else None; a :func:`recording` notes it either way.
    """
    if INTERNALS_OK:
        launched = _launch(kernel, grid, kwargs)
    else:
        kernel[grid](**kwargs)
        launched = None
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        rec.launches.append((kernel, grid, launched))
    return launched


def _launch(kernel, grid, kwargs: dict) -> tuple | None:
    """:func:`launch` with Triton's internals known; ``kwargs`` maps every argument and launch
    option to its value (the heuristics add theirs)."""
    if isinstance(kernel, _Heuristics):
        for name, rule in kernel.values.items():
            kwargs[name] = rule(kwargs)
        kernel = kernel.fn
    direct = _DIRECT and grid[0] and kernel.__class__ is _JITFunction
    key = None
    if direct:
        key = _direct_key(kernel, kwargs)
        try:
            compiled = _compiled.get(key) if key is not None else None
        except TypeError:  # an unhashable scalar argument
            compiled = key = None
        if compiled is not None:
            values = named_values(kernel, kwargs)
            if run_direct(compiled, grid, values, key[1]):
                return compiled, values
    # Per variant (its constexprs and options), the pipeline depth that fits in shared memory.
    params = _params(kernel)
    fit_key = (kernel, tuple(sorted((k, v) for k, v in kwargs.items()
                                    if k != "num_stages" and (k not in params or params[k])
                                    and isinstance(v, (int, float, str, bool, type(None))))))
    stages = _fitted_stages.get(fit_key)
    if stages is not None:
        kwargs["num_stages"] = stages
    while True:
        try:
            compiled = kernel[grid](**kwargs)
            break
        except OutOfResources:
            # Optional features (bias tiles, dropout state) add shared memory to a config tuned
            # without them: fewer pipeline stages always fit in less.  Remembered per variant.
            if kwargs.get("num_stages", 1) <= 1:
                raise
            kwargs["num_stages"] = _fitted_stages[fit_key] = kwargs["num_stages"] - 1
    if direct and key is not None and compiled is not None:
        if len(_compiled) >= _MAX_COMPILED:
            _compiled.clear()
        # under the key of the requested options: a retry that lowered num_stages is remembered
        # by the next lookup too
        _compiled[key] = compiled
        return compiled, named_values(kernel, kwargs)
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


def raw_stream(device: int) -> int:
    """The current CUDA stream of ``device`` as a raw handle (what compiled launches take)."""
    return torch._C._cuda_getCurrentRawStream(device)


def run_direct(compiled, grid: tuple, values: list, device: int) -> bool:
    """Launch ``compiled`` with ``values`` (every argument, signature order) on the current
    stream; False (nothing launched) when a profiler hook asks for the full path."""
    if launch_hooks_set():
        return False
    _run(compiled, grid, values, device)
    return True


def _run(compiled, grid: tuple, values: list, device: int) -> None:
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 raw_stream(device), compiled.function, compiled.packed_metadata, None, None,
                 None, *values)


def bind(compiled, grid: tuple, values: list) -> tuple:
    """A launch of ``compiled`` made ready for replays: ``(function, arguments)``, where
    ``function(*arguments)`` launches ``compiled`` with ``values`` as :func:`_run` does once
    ``arguments[STREAM_ARG]`` holds the raw stream; the values sit at the end of
    ``arguments``, from position ``len(arguments) - len(values)``.

    Where Triton's launcher needs no scratch memory of its own allocators for the kernel (every
    kernel here), the function is the launcher's C entry point: the Python frame in front of it
    only passes the arguments on and asks for scratch sizes of zero (~2 us a launch on the H100
    machine)."""
    run = compiled.run  # loads the kernel on first use, which sets compiled.function
    launch = getattr(run, "launch", None)
    g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, None)
    if (launch is not None and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0):
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                compiled.packed_metadata, None, None, None)
        return launch, [*g, *head, *values]
    return run, [*g, compiled.function, compiled.packed_metadata, None, None, None, *values]


STREAM_ARG = 3  # where bind's arguments hold the stream


# Launches with TMA descriptors.  Triton's launcher turns each descriptor argument into its
# encoded form (``make_tensordesc_arg``: a ``cuTensorMapEncodeTiled`` call and the Python
# around it) on every launch, and a Hopper forward + backward passes 13 of them.  The encoding
# is a function of the tensor's address and the geometry only, and a plan's geometry is fixed
# by its key, so :class:`TmaLaunch` keeps each encoding per address and hands the launcher's C
# entry point the encoded arguments directly.
_MAX_ENCODED = 256  # encodings kept per descriptor of a plan (a model's layers, each its own)


class TmaLaunch:
    """Repeated launches of one compiled kernel, whose TMA descriptor arguments are given as
    tensors, straight through Triton's C launcher (``launch`` of the kernel's ``run``):
    ``launch(values, tensors, stream)`` with ``values`` every argument in signature order
    (what sits at a descriptor's position is ignored) and ``tensors`` the tensors the
    descriptors describe, by ``role``.  Each descriptor is encoded by Triton's own
    ``make_tensordesc_arg`` once per address of its tensor and kept; pointer arguments go as
    addresses.  Build one with :meth:`of`."""

    __slots__ = ("raw", "head", "slots", "ptr_at")

    def __init__(self, raw, head: list, slots: tuple, ptr_at: tuple):
        self.raw, self.head, self.slots, self.ptr_at = raw, head, slots, ptr_at

    @classmethod
    def of(cls, compiled, grid: tuple, descs: tuple) -> "TmaLaunch | None":
        """The launch of ``compiled`` on ``grid`` whose descriptors are ``descs``, tuples
        ``(position, role, build)`` with ``build(tensor)`` the descriptor object of a tensor
        (every descriptor parameter of the kernel once); None where Triton's launcher is not
        the one this was written against (the caller then launches as before)."""
        if not INTERNALS_OK or _make_tensordesc_arg is None:
            return None
        # (loads the kernel on first use, which sets compiled.function)
        run, src = getattr(compiled, "run", None), getattr(compiled, "src", None)
        wrapped = getattr(run, "launch", None)
        code, cells = getattr(wrapped, "__code__", None), getattr(wrapped, "__closure__", None)
        if (code is None or not cells or getattr(run, "global_scratch_size", 1) != 0
                or getattr(run, "profile_scratch_size", 1) != 0
                or not isinstance(getattr(src, "signature", None), dict)):
            return None
        free = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
        raw, metas = free.get("launcher"), free.get("tensordesc_meta")
        types = list(src.signature.values())
        at = [i for i, t in enumerate(types) if isinstance(t, str) and t.startswith("tensordesc")]
        if (raw is None or not metas or len(metas) != len(at) or any(m is None for m in metas)
                or sorted(d[0] for d in descs) != at):
            return None
        slots = tuple((pos, role, metas[at.index(pos)], build, {})
                      for pos, role, build in sorted(descs, key=operator.itemgetter(0)))
        ptr_at = tuple(i for i, t in enumerate(types) if isinstance(t, str) and t[:1] == "*")
        g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        head = [*g, None, compiled.function, run.launch_cooperative_grid, run.launch_pdl, None,
                None, compiled.packed_metadata, None, None, None]
        return cls(raw, head, slots, ptr_at)

    def __call__(self, values: list, tensors: tuple, stream: int) -> None:
        for i in self.ptr_at:  # (the launcher would ask the driver about each tensor)
            v = values[i]
            if isinstance(v, torch.Tensor):
                values[i] = v.data_ptr()
        args = self.head.copy()
        args[STREAM_ARG] = stream
        prev = 0
        for pos, role, meta, build, encoded in self.slots:
            x = tensors[role]
            address = x.data_ptr()
            enc = encoded.get(address)
            if enc is None:
                if len(encoded) >= _MAX_ENCODED:
                    encoded.clear()
                # [encoded map, *shape, *strides]: ints and the map, no tensor kept alive
                enc = encoded[address] = _make_tensordesc_arg(build(x), meta)
            args += values[prev:pos]
            args += enc
            prev = pos + 1
        args += values[prev:]
        self.raw(*args)


class BoundLaunch:
    """One direct launch (:func:`launch`'s result ``(compiled, values)`` on ``grid``) kept for
    replays whose arguments differ only in the tensors passed as the pointer parameters
    ``names`` of ``kernel``: ``bound(tensors, device)`` launches the compiled kernel through
    :func:`bind`'s function on ``device``'s current stream with the recorded arguments and
    ``tensors`` (as addresses, in the order of ``names``).  Every other argument (the scalars
    derived from shapes and strides, the constexprs) is the recorded one, so the caller's key
    must fix them; ``names`` must hold every tensor argument (ValueError otherwise), so no
    tensor of the recorded call is kept or launched again."""

    __slots__ = ("function", "args", "at")

    def __init__(self, kernel, launched: tuple, grid: tuple, names: tuple):
        compiled, values = launched
        params = list(kernel.arg_names)
        self.function, self.args, slots = bind_slots(compiled, grid, values,
                                                     tuple((params.index(n),) for n in names))
        self.at = tuple(slot[0] for slot in slots)
        for i in self.at:
            self.args[i] = None
        if any(isinstance(a, torch.Tensor) for a in self.args):
            raise ValueError(f"BoundLaunch: a tensor argument of {kernel} is not in {names}")

    def __call__(self, tensors: tuple, device: int) -> None:
        args = self.args.copy()
        args[STREAM_ARG] = raw_stream(device)
        for i, t in zip(self.at, tensors):
            args[i] = t.data_ptr()
        self.function(*args)


def bind_slots(compiled, grid: tuple, template: list, slots) -> tuple:
    """:func:`bind` of ``template``, with ``slots`` (tuples whose first item is a position in
    ``template``) moved to the same argument's position in the bound arguments:
    ``(function, arguments, slots)``."""
    function, args = bind(compiled, grid, template)
    shift = len(args) - len(template)  # bind puts the grid and the launch options first
    return function, args, tuple((pos + shift, *rest) for pos, *rest in slots)


def addresses(items) -> list:
    """Each tensor's address; ints (addresses already) and None stay as they are.  Replays pass
    addresses, not tensors: for a tensor the launcher calls ``data_ptr()`` and then asks the
    driver whether the address is device memory (``cuPointerGetAttribute``), ~1 us a pointer
    argument on the H100 machine, for tensors whose device the plan key has already fixed."""
    return [t if t is None or t.__class__ is int else t.data_ptr() for t in items]


# Launch plans.  A short-sequence forward, a backward or an eager decode step costs as much
# host time as GPU time, and most of that host time rebuilds the same ~50-60 kernel arguments
# per launch from the same shapes.  While a call runs inside :func:`recording`, every buffer it
# allocates (:func:`empty`, :func:`empty_like`) and every launch is noted; :func:`record_plan`
# turns that into a :class:`Plan` that replays the call for new tensors of the same signature:
# allocate the same buffers, put the call's tensors and the buffers in their argument places,
# launch the same compiled kernels.  A Gluon launch (``launch_sm90._launch``) is noted with its
# TMA descriptors, which a replay rebuilds around its own tensors.  Callers keep their plans in
# a :class:`PlanCache` under a key of everything the launches depend on (:func:`signature` of
# the tensors, dtype, device, the call's other arguments).
_PLANS = True


@contextlib.contextmanager
def launch_plans(enabled: bool):
    """Turn launch plans on or off inside the block (benchmarks compare the two paths)."""
    global _PLANS
    old, _PLANS = _PLANS, bool(enabled)
    try:
        yield
    finally:
        _PLANS = old


def plans_enabled() -> bool:
    """Plans replay direct launches, and are not used while outputs are poisoned (every buffer
    must come from :func:`empty`), configs are pinned (``configs.override``) or
    :func:`launch_plans` turned them off."""
    return _DIRECT and _PLANS and not _poison and not pinned_configs()


class PlanCache:
    """Plans by key; emptied when it reaches ``limit`` entries."""

    def __init__(self, limit: int = 1024):
        self._plans: dict = {}
        self._limit = limit

    def get(self, key):
        return self._plans.get(key)

    def put(self, key, plan) -> None:
        if len(self._plans) >= self._limit:
            self._plans.clear()
        self._plans[key] = plan


def signature(*tensors: torch.Tensor) -> tuple:
    """Shape, strides and 16-byte alignment of each tensor: with the dtype, device and spec,
    everything a plan's launches depend on."""
    return tuple([(t.shape, t.stride(), t.data_ptr() & 15) for t in tensors])


class Recorder:
    """What a call did inside :func:`recording`: ``allocs``, the buffers it allocated
    (``zeroed``: the indices of those that started at zero, :func:`zeros`); ``launches``,
    ``(kernel, grid, launch's result)`` per launch (:func:`launch`); ``note``, whatever the
    caller wants to keep with the plan."""

    __slots__ = ("allocs", "zeroed", "launches", "note")

    def __init__(self):
        self.allocs: list = []
        self.zeroed: set = set()
        self.launches: list = []
        self.note = None


@contextlib.contextmanager
def recording():
    """Record the buffers and launches of the call run inside the block (this thread only);
    yields the :class:`Recorder`."""
    rec, old = Recorder(), getattr(_tls, "rec", None)
    _tls.rec = rec
    try:
        yield rec
    finally:
        _tls.rec = old


def recorder() -> Recorder | None:
    """The :class:`Recorder` of the call running on this thread, or None."""
    return getattr(_tls, "rec", None)


def unplannable() -> None:
    """Mark the call :func:`recording` records as one no :class:`Plan` may repeat: it does
    work other than launches (a PyTorch operation, such as a copy of a buffer into an output),
    which a plan would skip."""
    rec = recorder()
    if rec is not None:
        rec.launches.append((None, None, None))  # (record_plan: a launch it cannot repeat)


class Plan:
    """A recorded call: buffers to allocate (shape, strides, dtype, whether zeroed), then
    launches ``(function, argument template, slots, tma)`` (:func:`bind`), each slot ``(position,
    kind, index)`` with kind 0 the address of input ``index`` and 1 that of buffer ``index``, or
    ``(position, kind, index, build)`` with kind 2 (an input), 3 (a buffer) or 4 (one of
    ``constants``, :func:`constant` stand-ins) a TMA descriptor ``build(tensor)`` of that
    tensor; with ``tma`` the function is a :class:`TmaLaunch` of the kernel's arguments (the
    template in signature order), handed the descriptors' tensors by position; ``outputs`` are
    buffer indices."""

    __slots__ = ("allocs", "launches", "outputs", "device", "constants")

    def __init__(self, allocs: list, launches: list, outputs: tuple, device: torch.device,
                 constants: tuple = ()):
        self.allocs, self.launches, self.outputs, self.device = allocs, launches, outputs, device
        self.constants = constants

    def run(self, inputs: tuple, after_first=None) -> tuple | None:
        """The outputs of the recorded call replayed for ``inputs`` (same signature as the
        recorded call); ``after_first(outputs)`` runs once the first kernel is launched.  None,
        with nothing launched, when a profiler hook asks for Triton's own launch path."""
        if launch_hooks_set():
            return None
        device = self.device
        bufs = []
        for shape, stride, dtype, zero in self.allocs:
            buf = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            bufs.append(buf.zero_() if zero else buf)
        outs = tuple([bufs[i] for i in self.outputs])
        pools = (addresses(inputs), addresses(bufs), inputs, bufs, self.constants)
        stream = raw_stream(device.index)
        for function, template, slots, tma in self.launches:
            args, tensors = template.copy(), {}
            for slot in slots:
                pos, kind, i = slot[0], slot[1], slot[2]
                if kind < 2:
                    args[pos] = pools[kind][i]
                elif tma:  # a TmaLaunch takes the descriptors' tensors by position
                    tensors[pos] = pools[kind][i]
                else:
                    args[pos] = slot[3](pools[kind][i])
            if tma:
                function(args, tensors, stream)
            else:
                args[STREAM_ARG] = stream
                function(*args)
            if after_first is not None:
                after_first(outs)
                after_first = None
        return outs


def _current(device: torch.device) -> bool:
    """Whether ``device`` is the current CUDA device, whose stream launches go to."""
    return device.type == "cuda" and device.index == torch.cuda.current_device()


def plan_roles(kernel, **params: int) -> dict:
    """``{position of parameter: input index}`` for ``kernel`` (a jitted kernel or its
    ``triton.heuristics`` wrapper) from ``{parameter name: input index}``: where
    :func:`record_plan` puts those inputs.  Empty where plans are never recorded (a Triton
    version whose internals are not known)."""
    if not INTERNALS_OK:
        return {}
    names = list(kernel.arg_names)
    return {names.index(p): i for p, i in params.items()}


def record_plan(rec: Recorder, inputs: tuple, outputs: tuple, roles: dict | None = None):
    """The :class:`Plan` of the call ``rec`` recorded, which took ``inputs`` (tensors or None)
    and returned ``outputs`` (buffers it allocated); None when it cannot be replayed: a launch
    was not direct, a kernel got a tensor that is neither one of ``inputs`` nor a buffer of the
    call (a converted copy), an output is not a buffer of the call, or the call's tensors are
    not on the current CUDA device (whose stream the launches went to).

    Tensors are placed by identity; a descriptor may also be of a :func:`constant` stand-in.
    One tensor passed as several inputs (``flash_attn_func(x, x, x)``) is placed by ``roles``,
    ``{kernel: plan_roles(kernel, ...)}``, so that the plan also serves a later call with
    distinct tensors; where no role places such a tensor, no plan (a later call of the same
    signature may pass distinct ones).
    """
    if not rec.launches or not outputs:
        return None
    device = outputs[0].device
    if not _current(device):
        return None
    where, shared = {}, set()
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor):
            if id(t) in where:
                shared.add(id(t))
            else:
                where[id(t)] = (0, i)
    for j, t in enumerate(rec.allocs):
        where[id(t)] = (1, j)  # fresh buffers: never an input
    launches, constants = [], []
    for kernel, grid, launched in rec.launches:
        if launched is None:
            return None
        # a Gluon launch adds its TMA descriptors: {position: (tensor, build)}
        compiled, values, descs = launched if len(launched) == 3 else (*launched, {})
        fixed = roles.get(kernel, {}) if roles else {}
        template, slots = list(values), []
        for pos, v in enumerate(values):
            if pos in descs:
                t, build = descs[pos]
                slot = where.get(id(t))
                if slot is None and _constants.get(id(t)) is t:
                    constants.append(t)
                    slot = (2, len(constants) - 1)   # (kind 4: a stand-in)
                if slot is None or id(t) in shared:
                    return None
                template[pos] = None
                slots.append((pos, slot[0] + 2, slot[1], build))
                continue
            if not isinstance(v, torch.Tensor):
                continue
            if pos in fixed:
                if inputs[fixed[pos]] is not v:
                    return None
                slot = (0, fixed[pos])
            else:
                slot = where.get(id(v))
                if slot is None or id(v) in shared:
                    return None
            template[pos] = None
            slots.append((pos, *slot))
        fast = TmaLaunch.of(compiled, grid, tuple(
            (slot[0], slot[0], slot[3]) for slot in slots if len(slot) == 4)) if descs else None
        if fast is not None:  # (descriptors encoded once per address: TmaLaunch)
            launches.append((fast, template, tuple(slots), True))
        else:
            launches.append((*bind_slots(compiled, grid, template, slots), False))
    out_index = []
    for t in outputs:
        slot = where.get(id(t))
        if slot is None or slot[0] != 1:
            return None
        out_index.append(slot[1])
    allocs = [(tuple(t.shape), t.stride(), t.dtype, j in rec.zeroed)
              for j, t in enumerate(rec.allocs)]
    return Plan(allocs, launches, tuple(out_index), device, tuple(constants))
