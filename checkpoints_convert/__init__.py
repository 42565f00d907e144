"""Converters from HF safetensors and llama.cpp GGUF checkpoints to clusterkv checkpoints.

A clusterkv checkpoint is a directory holding `config.json` (the HF config, plus a "clusterkv" entry
recording the dtype and source), `tokenizer.json`, `tokenizer_config.json` and `params/`, an orbax
checkpoint of the pytree laid out by `clusterkv_jax.model.param_shapes`.

Each converter checks the config and the tensor names and shapes before reading any weights, builds the
whole output in a temporary sibling directory and renames it into place last, so a failed conversion
leaves nothing behind.
"""

# Imported first: for `python -m checkpoints_convert`, Ctrl-C while the rest imports and compiles ends the process
# with the converter's one line, not a traceback (clusterkv_jax._exit_on_interrupt_until_running).
import clusterkv_jax  # noqa: F401  isort: skip
from checkpoints_convert.common import DTYPES, params_to_hf_state_dict
from checkpoints_convert.gguf import convert_gguf
from checkpoints_convert.hf import convert_hf, hf_state_dict_to_params

__all__ = ["convert_hf", "convert_gguf", "hf_state_dict_to_params", "params_to_hf_state_dict", "DTYPES"]
