"""flashtile: exact FlashAttention (forward and backward) as Triton kernels, with a tiled
PyTorch engine for CPUs.  See ``flashtile.interface`` for the functions' documentation."""
from .backends import use_backend
from .decode import build_tree_mask, merge_attention_states
from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_with_kvcache,
                        scaled_dot_product_attention)

__version__ = "0.1.0"

__all__ = [
    "build_tree_mask",
    "flash_attn_with_kvcache",
    "merge_attention_states",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "scaled_dot_product_attention",
    "use_backend",
]
