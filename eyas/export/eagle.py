"""The eagle layout: the drafter checkpoint format SGLang and vLLM load (written by eyas, EAGLE, SpecForge).

Written format (as ``sgl-project/SpecForge: specforge/modeling/draft/llama3_eagle.py`` writes it and
``configs/llama3-8B-eagle3.json`` shows it; SGLang ``python/sglang/srt/models/llama_eagle3.py`` and
vLLM ``vllm/model_executor/models/llama_eagle3.py`` load it): ``config.json`` with ``architectures:
["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``, the TARGET ``vocab_size``,
``draft_vocab_size``, ``target_hidden_size`` when it differs from ``hidden_size``,
``tie_word_embeddings: false``, ``rope_theta`` and, for a scaled RoPE, ``rope_scaling``
(eyas/target/rope.py); aux layer ids only when they are not the default
(eyas/target/layers.py). ``model.safetensors`` holds exactly :data:`SERVED_KEYS` (``fc``, ``midlayer.*``,
``norm``, ``lm_head`` [draft_vocab, H], ``d2t`` int64, ``t2d`` bool); no embedding: both engines
take the target's. SGLang silently skips tensor names it does not know, so an unknown or missing
key is an error here, not a warning.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.drafter.model import DrafterConfig, Eagle3Drafter
from eyas.export.engine_keys import ExportError
from eyas.io import atomic_dir, load_safetensors, save_safetensors, write_json
from eyas.target import hf_config, layers, rope
from eyas.vocab.mapping import validate_mapping

ARCHITECTURE = "LlamaForCausalLMEagle3"
SERVED_KEYS = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


def llama_layer_fields(c: DrafterConfig) -> dict:
    """The one-layer LlamaConfig fields both checkpoint formats write (the TARGET vocab size)."""
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        **rope.config_fields(c.rope_theta, c.rope_scaling),
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
    }


def to_hf_config(c: DrafterConfig) -> dict:
    """The ``config.json`` SGLang/vLLM read for an eyas drafter."""
    cfg = {
        "architectures": [ARCHITECTURE],
        **llama_layer_fields(c),
        "draft_vocab_size": c.draft_vocab_size,
        "torch_dtype": c.torch_dtype,
        # eyas' own record; engines ignore unknown config keys
        "eyas": {"num_target_layers": c.num_target_layers, "format_version": 1},
    }
    if c.target_hidden_size != c.hidden_size:
        cfg["target_hidden_size"] = c.target_hidden_size
    cfg.update(layers.config_fields(c.aux_layer_ids, c.num_target_layers))
    return cfg


def expected_shapes(c: DrafterConfig) -> dict[str, tuple]:
    H, I = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        "fc.weight": (H, c.num_aux * c.target_hidden_size),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (c.draft_vocab_size, H),
        "d2t": (c.draft_vocab_size,),
        "t2d": (c.vocab_size,),
    }


def check_served_tensors(tensors: dict[str, torch.Tensor], c: DrafterConfig, source: str) -> None:
    """Exactly the served keys, with the shapes the config implies, and a valid vocab mapping.

    Raises:
        ExportError: naming ``source`` and the missing / unknown / mis-shaped key.
    """
    fc = tensors.get("fc.weight")
    if fc is not None and fc.dim() == 2 and fc.shape[1] != c.num_aux * c.target_hidden_size:
        # the most common silent mismatch (wrong layer count / wrong target): say it in those terms
        raise ExportError(
            f"{source}: fc.weight input width {fc.shape[1]} != n_aux ({c.num_aux}, HF layers "
            f"{c.resolved_aux_layers()}) x target_hidden_size ({c.target_hidden_size}) = "
            f"{c.num_aux * c.target_hidden_size}; the config's aux layers or target_hidden_size do not "
            f"match the weights")
    missing = [k for k in SERVED_KEYS if k not in tensors]
    unknown = sorted(set(tensors) - set(SERVED_KEYS))
    if missing:
        raise ExportError(f"{source}: missing tensor(s) {missing} (engines would zero-fill or skip them)")
    if unknown:
        raise ExportError(f"{source}: unknown tensor(s) {unknown} (SGLang silently skips unknown names)")
    for k, shape in expected_shapes(c).items():
        if tuple(tensors[k].shape) != shape:
            raise ExportError(f"{source}: {k} has shape {tuple(tensors[k].shape)}, config implies {shape}")
    if tensors["d2t"].dtype != torch.int64 or tensors["t2d"].dtype != torch.bool:
        raise ExportError(f"{source}: d2t must be int64 and t2d bool, "
                          f"got {tensors['d2t'].dtype}/{tensors['t2d'].dtype}")
    validate_mapping(tensors["d2t"], tensors["t2d"], c.vocab_size, c.draft_vocab_size, source=source)


def save_drafter(drafter: Eagle3Drafter, out_dir: str | Path, extra_files: dict | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` atomically (a temp dir renamed into place),
    then re-read the tensors and require them bit-identical to the trained ones.

    Raises:
        ExportError: a served key is missing/unknown/mis-shaped, or the re-read differs.
    """
    c = drafter.config
    tensors = {k: v.detach().cpu() for k, v in drafter.state_dict_for_export().items()}
    check_served_tensors(tensors, c, source=f"export to {out_dir}")
    with atomic_dir(out_dir) as tmp:
        write_json(tmp / "config.json", to_hf_config(c))
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        for name, obj in (extra_files or {}).items():
            write_json(tmp / name, obj)
        back = load_safetensors(tmp / "model.safetensors")
        for k, v in tensors.items():
            if not torch.equal(back[k], v):
                raise ExportError(f"export to {out_dir}: tensor {k} differs after writing")


def config_from_hf(cfg: dict, num_target_layers: int | None, source: str) -> DrafterConfig:
    """Build a :class:`DrafterConfig` from an EAGLE/SpecForge/eyas ``config.json`` dict.

    ``num_target_layers`` is needed to interpret default aux layers when the config has no
    ``eyas`` record (foreign checkpoints). ``cfg`` is read with :func:`read_config`, which has
    checked the type of every value (the layouts' loaders call it before this).

    Raises:
        ExportError: a required key is missing, or the config asks for an architecture variant the
            eyas drafter does not implement (:func:`check_supported_variant`, through the table of
            eyas/export/engine_keys.py): ``num_hidden_layers`` != 1, ``norm_before_residual: true``
            (speculators/vLLM: the residual is the hidden_norm'ed h; eyas and SGLang keep the
            un-normed h; ``vllm-project/speculators: src/speculators/models/eagle3/core.py``),
            ``norm_before_fc``, ``fc_norm`` or ``norm_output``
            true, a RoPE scaling type other than default/linear/llama3, ...
    """
    check_supported_variant(cfg, source)
    theta, scaling = rope.normalise(cfg, source)  # refusals() has already refused what this raises
    try:
        H = cfg["hidden_size"]
        recorded = (cfg.get("eyas") or {}).get("num_target_layers")
        if recorded and num_target_layers and recorded != num_target_layers:
            raise ExportError(f"{source}: drafter built for a target with {recorded} layers, this target has "
                              f"{num_target_layers}: its aux layer ids would point at other layers")
        L = recorded or num_target_layers
        if L is None:
            raise ExportError(f"{source}: cannot tell the target's layer count; pass num_target_layers")
        return DrafterConfig(
            hidden_size=H,
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=hf_config.num_key_value_heads(cfg),
            head_dim=hf_config.head_dim(cfg),
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size") or H,
            num_target_layers=L,
            aux_layer_ids=layers.from_config(cfg, L),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            torch_dtype=cfg.get("torch_dtype", "float32"),
        )
    except KeyError as e:
        raise ExportError(f"{source}: config.json lacks key {e.args[0]!r}") from None


def check_supported_variant(cfg: dict, source: str) -> None:
    """Refuse every config key whose value makes an engine compute something other than eyas'
    drafter (the table of eyas/export/engine_keys.py: ``num_hidden_layers`` != 1,
    ``norm_before_residual`` / ``norm_before_fc`` / ``fc_norm`` / ``norm_output`` true, an
    unimplemented ``rope_scaling`` type, biases, ``tie_word_embeddings``, ...).

    Raises:
        ExportError: naming ``source``, every refused key, and the engines that honour it.
    """
    from eyas.export.engine_keys import refusals

    if cfg.get("num_hidden_layers", 1) != 1:
        raise ExportError(f"{source}: num_hidden_layers {cfg['num_hidden_layers']}; eyas drafters have "
                          f"exactly one decoder layer (midlayer)")
    if cfg.get("norm_before_residual") is True:
        raise ExportError(
            f"{source}: norm_before_residual: true (the speculators training default: the residual is "
            f"hidden_norm(h)). eyas' drafter keeps the UN-normed residual, as SGLang's llama_eagle3.py "
            f"does; loading these weights would silently compute a different function")
    bad = refusals(cfg)
    if bad:
        raise ExportError(f"{source}: config key(s) eyas does not implement, which change the drafter's "
                          f"function in the engines that honour them: " + "; ".join(bad))
