"""``flash_attn.bert_padding`` backed by ``flashtile.padding``."""
from flashtile.padding import (index_first_axis, index_first_axis_residual, index_put_first_axis,
                               pad_input, unpad_input, unpad_input_for_concatenated_sequences)

__all__ = ["index_first_axis", "index_first_axis_residual", "index_put_first_axis",
           "pad_input", "unpad_input", "unpad_input_for_concatenated_sequences"]
