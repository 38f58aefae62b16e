"""``flash_attn.layers``: only ``rotary.apply_rotary_emb`` (used by flash-attn's tests)."""
