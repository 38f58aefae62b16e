"""``flash_attn.flash_attn_interface`` backed by flashtile.

The private entry points of flash-attn's compiled extension (``flash_attn_gpu``,
``_flash_attn_forward``, ``_flash_attn_varlen_forward``, ...) have no counterpart: flashtile
has no such extension, and the conformance runner leaves out the tests that call them.
"""
from flashtile import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

# flash-attn's switch for its ROCm Triton build; flashtile's kernels are the same everywhere.
USE_TRITON_ROCM = False


def maybe_contiguous(x):
    """``x`` with a unit-stride last dimension (copied only when it has another stride)."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """Width of the key blocks in which flash-attn's kernels store ``S_dmask`` unnormalised.

    flashtile's ``S_dmask`` is normalised over the whole row (see ``flash_attn_func``), so
    there is no block structure to undo; one block spans every key of the tests' rows."""
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim must be in [1, 256], got {head_dim}")
    return 1 << 30


__all__ = [
    "USE_TRITON_ROCM",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "maybe_contiguous",
]
