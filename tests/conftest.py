"""Test configuration: the Triton kernels run under the interpreter on this CPU-only machine.

TRITON_INTERPRET must be set before ``triton.jit`` decorates the kernels (at import), so it is
set here, before any test module imports flashtile.  Tests that exercise the torch backend
select it explicitly with ``flashtile.use_backend("torch")``.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("FLASHTILE_BACKEND", None)
