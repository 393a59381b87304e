"""A tiny randomly initialised Llama target and features extracted from it, for fast CPU tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.features import FeatureStore, ShardWriter
from eyas.target import Target

VOCAB = 128
LAYERS = 8  # default aux layers [2, 4, 5]


def tiny_target(seed: int = 0) -> Target:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    # a sharper output distribution than random init gives, so drafters have something to learn
    model.lm_head.weight.data *= 40.0
    return Target(model, tokenizer=None, identity={"path": "tiny", "num_layers": LAYERS})


def manifest_fields(target: Target, aux_layers: list[int]) -> dict:
    c = target.model.config
    return {
        "aux_layers": aux_layers, "num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size, "target": target.identity, "max_length": 64,
        "target_config": {
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.hidden_size // c.num_attention_heads, "num_hidden_layers": c.num_hidden_layers,
            "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": 10000.0,
            "max_position_embeddings": c.max_position_embeddings,
        },
    }


def write_features(target: Target, out: Path, n_samples: int, seed: int, length: int = 48,
                   token_range: tuple[int, int] = (0, VOCAB), aux_layers=None) -> FeatureStore:
    """Random token sequences from ``token_range`` (first quarter unsupervised, like a prompt),
    run through ``target`` and stored with :class:`ShardWriter` in float32."""
    from eyas import layers

    ids_all = layers.resolve(aux_layers, LAYERS)
    g = torch.Generator().manual_seed(seed)
    w = ShardWriter(out, shard_samples=8, dtype=torch.float32)
    for _ in range(n_samples):
        ids = torch.randint(token_range[0], token_range[1], (length,), generator=g)
        mask = torch.zeros(length, dtype=torch.uint8)
        mask[length // 4:] = 1
        cap = target.capture(ids[None], torch.ones(1, length, dtype=torch.int64), ids_all)
        w.add(ids, mask, cap["aux_hidden"][0], cap["final_hidden"][0], cap["target_argmax"][0])
    w.finish(**manifest_fields(target, ids_all))
    return FeatureStore.open(out)
