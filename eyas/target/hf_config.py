"""The one reader of the Hugging Face config fields a drafter's shape depends on.

A config here is a dict (``config.json``, a speculators ``transformer_layer_config``, a feature
manifest's ``target_config``) or a transformers config object (attributes); a missing key or
attribute, or a ``None`` value, takes transformers' LlamaConfig default
(``huggingface/transformers: src/transformers/models/llama/configuration_llama.py``). RoPE scaling
is read by :func:`eyas.target.rope.normalise`, with the base from :func:`rope_theta`. No torch and no eyas
imports here: every other module may use it.
"""

from __future__ import annotations


def get(cfg, key: str, default=None):
    """``cfg[key]`` for a dict, ``cfg.key`` for an object; ``default`` when absent or ``None``."""
    v = cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)
    return default if v is None else v


def head_dim(cfg) -> int:
    """``head_dim``, else ``hidden_size // num_attention_heads`` (LlamaConfig's rule).

    Raises:
        KeyError: the config has neither ``head_dim`` nor ``hidden_size`` and ``num_attention_heads``.
    """
    hd = get(cfg, "head_dim")
    if hd:
        return int(hd)
    hidden, heads = get(cfg, "hidden_size"), get(cfg, "num_attention_heads")
    if hidden is None or heads is None:
        raise KeyError("hidden_size" if hidden is None else "num_attention_heads")
    return int(hidden) // int(heads)


def num_key_value_heads(cfg) -> int:
    """``num_key_value_heads``, else ``num_attention_heads`` (no grouped-query attention).

    Raises:
        KeyError: neither is set.
    """
    kv = get(cfg, "num_key_value_heads") or get(cfg, "num_attention_heads")
    if kv is None:
        raise KeyError("num_attention_heads")
    return int(kv)


def rope_theta(cfg) -> float:
    """The RoPE base: ``rope_parameters.rope_theta`` (transformers v5), else ``rope_theta``, else
    ``rope_scaling.rope_theta``, else 10000.0 (LlamaConfig's default)."""
    params = get(cfg, "rope_parameters") or {}
    scaling = get(cfg, "rope_scaling") or {}
    return float((params.get("rope_theta") if isinstance(params, dict) else None) or get(cfg, "rope_theta")
                 or (scaling.get("rope_theta") if isinstance(scaling, dict) else None) or 10000.0)
