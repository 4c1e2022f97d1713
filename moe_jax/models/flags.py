"""absl flags of the example decoder's shape, shared by the examples."""

from __future__ import annotations

from absl import flags


def define_model_flags() -> None:
    """--vocab, --d_model, --heads, --layers, --experts, --top_k, --ffn."""
    flags.DEFINE_integer("vocab", 256, "Vocabulary size.")
    flags.DEFINE_integer("d_model", 64, "Model width.")
    flags.DEFINE_integer("heads", 4, "Attention heads.")
    flags.DEFINE_integer("layers", 2, "Decoder blocks.")
    flags.DEFINE_integer("experts", 8, "Experts per MoE layer (a multiple of --ep).")
    flags.DEFINE_integer("top_k", 2, "Experts per token.")
    flags.DEFINE_integer("ffn", 128, "Width of each expert.")
