"""The functional Flax decoder."""

from lcx.model.decoder import Decoder, abstract_params, attention_inputs, init_params, param_axes

__all__ = ["Decoder", "abstract_params", "attention_inputs", "init_params", "param_axes"]
