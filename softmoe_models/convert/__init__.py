"""Converters from vmoe checkpoints to model packages: pure functions, torch + numpy only."""

from .convert import convert_checkpoint, params_to_state_dict, state_dict_to_params
from .errors import ConversionError

__all__ = ["ConversionError", "convert_checkpoint", "params_to_state_dict", "state_dict_to_params"]
