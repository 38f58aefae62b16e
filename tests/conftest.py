"""Test configuration: the Triton kernels run under the interpreter on this CPU-only machine.

TRITON_INTERPRET must be set before ``triton.jit`` decorates the kernels (at import), so it is
set here, before any test module imports flashtile.  Tests that exercise the torch backend
select it explicitly with ``flashtile.use_backend("torch")``.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("FLASHTILE_BACKEND", None)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_kvcache_error_carried_over():
    """A bad index found by the Triton decode path is raised at a later call (see
    ``flashtile.check_kvcache_errors``): one test's bad call must not fail the next test."""
    yield
    import sys

    if "flashtile.backends.triton.launch_decode" in sys.modules:
        import flashtile

        try:
            flashtile.check_kvcache_errors()
        except flashtile.FlashtileInputError:
            pass
