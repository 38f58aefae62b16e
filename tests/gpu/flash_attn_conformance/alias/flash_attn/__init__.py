"""An import alias: flash-attn 2.x's public names, backed by flashtile.

Put the folder that holds this package first on ``PYTHONPATH`` and ``import flash_attn`` gets
flashtile's functions.  It exists to run flash-attn's own test file against flashtile
(``tests/gpu/flash_attn_conformance/run.py``); it is not installed with flashtile.
"""
import os

# flash-attn raises a bad kvcache index inside the call (its paged path reads the block table's
# maximum on the host); its tests wrap that single call in pytest.raises
os.environ.setdefault("FLASHTILE_KVCACHE_CHECK", "sync")

from flashtile import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,  # noqa: E402
                       flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

# The flash-attn API level the alias provides (code that checks the version sees 2.x).
__version__ = "2.8.4"

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
