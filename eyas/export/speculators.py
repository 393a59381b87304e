"""The speculators (vLLM) drafter layout: read it into eyas names, write it for export.

Layout (``vllm-project/speculators: src/speculators/models/eagle3/config.py``,
``.../eagle3/core.py``, ``src/speculators/convert/eagle/eagle3_converter.py``):

- ``config.json``: ``architectures ["Eagle3Speculator"]``, ``speculators_model_type "eagle3"``,
  ``transformer_layer_config`` (a nested LlamaConfig: TARGET ``vocab_size``, ``num_hidden_layers``
  1, the layer's shapes), ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` at the TOP level (HF ``hidden_states`` indices, as vLLM reads
  them), ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``,
  ``speculators_config``.
- ``model.safetensors``: ``layers.0.*`` instead of ``midlayer.*``; ``fc``, ``norm``, ``lm_head``,
  ``d2t``, ``t2d``; usually ``embed_tokens.weight`` (a frozen copy of the target's); sometimes
  ``verifier_lm_head`` / ``verifier_norm`` (copies of the target's head).

vLLM translates such a config with ``norm_before_residual`` defaulting to **True** when the key is
missing (``vllm-project/vllm: vllm/transformers_utils/configs/speculators/algos.py:
update_eagle3``); eyas' drafter keeps the un-normed residual (SGLang's ``llama_eagle3.py``), so
``true`` is refused on load.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eyas.export.eagle import llama_layer_fields
from eyas.export.engine_keys import BY_KEY, read_config
from eyas.io import atomic_dir, load_safetensors, save_safetensors, write_json
from eyas.target import hf_config, layers
from eyas.vocab.mapping import target_id_order

log = logging.getLogger(__name__)

ARCHITECTURE = "Eagle3Speculator"
LAYER_PREFIX = "layers.0."
EAGLE_LAYER_PREFIX = "midlayer."

# keys of the nested config that this module sets itself, after checking them: the layer's HF
# class (not the drafter's), and the dtype (read below, engines cast to theirs)
_WRITTEN = ("architectures", "torch_dtype")
# keys of the nested LlamaConfig that describe the one decoder layer
_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
               "max_position_embeddings", "vocab_size", "hidden_act", "num_hidden_layers", "attention_bias",
               "mlp_bias")


class SpeculatorsFormatError(ValueError):
    """A speculators-layout checkpoint cannot be read as an eyas drafter."""


def to_eyas_name(name: str) -> str:
    """``layers.0.x`` -> ``midlayer.x`` (other names unchanged; ``model.`` prefix stripped)."""
    name = name.removeprefix("model.")
    return EAGLE_LAYER_PREFIX + name[len(LAYER_PREFIX):] if name.startswith(LAYER_PREFIX) else name


def to_speculators_name(name: str) -> str:
    """``midlayer.x`` -> ``layers.0.x`` (the speculators converter's rename)."""
    return LAYER_PREFIX + name[len(EAGLE_LAYER_PREFIX):] if name.startswith(EAGLE_LAYER_PREFIX) else name


def config_to_eagle(cfg: dict, source: str = "config.json") -> dict:
    """A speculators ``config.json`` dict -> the flat ``LlamaForCausalLMEagle3``-style dict that
    :func:`eyas.export.eagle.config_from_hf` reads.

    The speculators flags (``norm_before_residual`` etc.) are carried over verbatim so the loader
    can refuse unsupported variants; a missing ``norm_before_residual`` is recorded under
    ``speculators_norm_before_residual_missing`` (vLLM would assume True, speculators' own model
    config False). So is every key of ``transformer_layer_config`` that an engine reads (the rows of
    eyas/export/engine_keys.py: ``tie_word_embeddings``, ``layer_types``, ``sliding_window``, biases, ...):
    vLLM builds the draft's config from that nested config
    (``vllm/transformers_utils/configs/speculators/algos.py``), so nothing an engine reads is dropped
    or overwritten here before :func:`eyas.export.engine_keys.refusals` has seen it. Only
    ``architectures`` (the layer's HF class) and ``torch_dtype`` are set here; ``model_type`` and
    ``num_hidden_layers`` are checked first.

    Raises:
        SpeculatorsFormatError: no ``transformer_layer_config``, more than one layer, or a layer
            config that is not Llama (``model_type`` absent means Qwen3 to speculators).
    """
    tlc = cfg.get("transformer_layer_config")
    if not isinstance(tlc, dict):
        raise SpeculatorsFormatError(f"{source}: speculators config without a transformer_layer_config")
    if tlc.get("num_hidden_layers", 1) != 1:
        raise SpeculatorsFormatError(f"{source}: transformer_layer_config.num_hidden_layers "
                                     f"{tlc['num_hidden_layers']}; eyas drafters have one layer")
    mt = tlc.get("model_type")
    if mt != "llama":
        # speculators builds the layer config with Qwen3Config when model_type is absent; Qwen3
        # layers carry q_norm/k_norm, which eyas' Llama midlayer does not have
        raise SpeculatorsFormatError(
            f"{source}: transformer_layer_config.model_type {mt!r}" +
            (" (speculators then assumes Qwen3Config)" if mt is None else "") +
            "; eyas drafters use a Llama decoder layer")
    # every key of the layer config that an engine reads (the table of eyas/export/engine_keys.py) is
    # carried, so that check_supported_variant refuses what eyas does not implement (tie_word_embeddings,
    # layer_types / sliding_window, biases, ...) instead of it being dropped or overwritten here
    out = {k: v for k, v in tlc.items() if k in _LAYER_KEYS or (k in BY_KEY and k not in _WRITTEN)}
    # speculators writes the layer config with to_diff_dict(): keys equal to LlamaConfig's defaults
    # are ABSENT and mean LlamaConfig's defaults (rms_norm_eps 1e-6, not eyas' 1e-5)
    full = _llama_defaults(tlc)
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "max_position_embeddings", "vocab_size"):
        out.setdefault(k, full[k])
    if "rope_theta" not in out and not (out.get("rope_parameters") or {}).get("rope_theta"):
        out["rope_theta"] = full["rope_theta"]
    out["architectures"] = ["LlamaForCausalLMEagle3"]
    out["model_type"] = "llama"
    out["num_hidden_layers"] = 1
    out.setdefault("tie_word_embeddings", False)  # LlamaConfig's default, omitted by to_diff_dict()
    for k in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
              "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "eyas"):
        if cfg.get(k) is not None:
            out[k] = cfg[k]
    out["torch_dtype"] = cfg.get("torch_dtype") or tlc.get("torch_dtype") or tlc.get("dtype") or "float32"
    if "norm_before_residual" not in cfg:
        out["speculators_norm_before_residual_missing"] = True
    out["source_format"] = "speculators"
    return out


# transformers' LlamaConfig defaults (``models/llama/configuration_llama.py``): what a key omitted
# by speculators' ``to_diff_dict()`` means. Hard-coded so reading a checkpoint needs no transformers.
LLAMA_DEFAULTS = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
                  "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "vocab_size": 32000,
                  "rope_theta": 10000.0}


def _llama_defaults(tlc: dict) -> dict:
    """The values transformers' LlamaConfig gives the layer config (as speculators builds it):
    LLAMA_DEFAULTS, ``num_key_value_heads`` = heads, ``head_dim`` = hidden // heads."""
    out = {k: tlc.get(k, v) for k, v in LLAMA_DEFAULTS.items()}
    out["num_key_value_heads"] = hf_config.num_key_value_heads(out | tlc)
    out["head_dim"] = hf_config.head_dim(out | tlc)
    out["rope_theta"] = hf_config.rope_theta(tlc)  # LLAMA_DEFAULTS' 10000.0 when absent
    return out


def read_speculators(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a speculators-layout drafter directory.

    Args:
        path: directory with ``config.json`` and ``model.safetensors``.
    Returns:
        (config dict in the flat eyas/EAGLE form (see :func:`config_to_eagle`), tensors with eyas
        names: ``layers.0.*`` renamed to ``midlayer.*``; ``embed_tokens.weight`` and any
        ``verifier_*`` tensors are kept under their own names for the caller to use or drop).
    Raises:
        FileNotFoundError: a file is missing.
        SpeculatorsFormatError: the config is not a one-layer EAGLE-3 speculator, or the tensors
            hold more than one decoder layer (``layers.1.*``).
    """
    path = Path(path)
    cfg = read_config(path / "config.json")
    mtype = cfg.get("speculators_model_type")
    if mtype is not None and mtype != "eagle3":
        raise SpeculatorsFormatError(f"{path / 'config.json'}: speculators_model_type {mtype!r}, not 'eagle3'")
    out_cfg = config_to_eagle(cfg, str(path / "config.json"))
    raw = load_safetensors(path / "model.safetensors")
    extra_layers = sorted({k.split(".")[1] for k in raw if k.startswith("layers.") and not k.startswith(LAYER_PREFIX)})
    if extra_layers:
        raise SpeculatorsFormatError(f"{path}: tensors for decoder layers {extra_layers} besides layer 0; "
                                     f"eyas drafters have one layer")
    return out_cfg, {to_eyas_name(k): v for k, v in raw.items()}


def speculators_config(drafter, verifier: dict | None = None) -> dict:
    """The speculators ``config.json`` for an eyas drafter (``Eagle3Speculator``).

    Args:
        drafter: an :class:`eyas.drafter.model.Eagle3Drafter`.
        verifier: :func:`eyas.export.verifier.verifier_identity`'s dict; None writes
            ``verifier.name_or_path: null``, which speculators 0.9.0 cannot load (its
            ``from_pretrained`` calls ``AutoConfig.from_pretrained(None)``); ``eyas inspect`` says so.
    """
    c = drafter.config
    ident = verifier or {"verifier": {"name_or_path": None, "architectures": []}, "eyas": None}
    # embed_tokens.weight in the file is the target's, frozen (eyas trains over it): the engines that read
    # it and the ones that swap in the target's serve the same function (eyas.export.own_tensors.disagreements)
    record = {"num_target_layers": c.num_target_layers, "format_version": 1, "embedding": "target"}
    if ident.get("eyas"):
        record["verifier"] = ident["eyas"]
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **llama_layer_fields(c)},
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        # speculators always writes the ids, as HF indices at the top level (vLLM's form)
        "eagle_aux_hidden_state_layer_ids": layers.resolve(c.aux_layer_ids, c.num_target_layers),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "torch_dtype": c.torch_dtype,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": dict(ident["verifier"]),
        },
        "eyas": record,
    }


class UnsafeExportError(ValueError):
    """An export speculators 0.9.0 would load wrongly (e.g. without ``embed_tokens.weight``)."""


def write_speculators(drafter, path: str | Path, include_embedding: bool = True,
                      verifier: dict | None = None) -> None:
    """Write ``drafter`` in the speculators layout (atomically): ``config.json`` from
    :func:`speculators_config` (``verifier``: :func:`eyas.export.verifier.verifier_identity`'s dict),
    ``model.safetensors`` with ``layers.0.*`` names, ``fc``, ``norm``, ``lm_head``, ``d2t`` int64,
    ``t2d`` bool and ``embed_tokens.weight`` (the target's, frozen), as the speculators converter
    and trainer save them.

    Draft ids are written in ascending target-id order (``lm_head`` rows and ``d2t`` permuted by
    :func:`eyas.vocab.mapping.target_id_order`; every target id keeps its logit, so the file computes the
    drafter's distribution exactly): speculators 0.9.0 builds ``verifier_lm_head`` (the target
    distribution its trainer distils from) as the target's lm_head rows selected by ``t2d``, i.e.
    in ascending target id (``src/speculators/model.py``, ``DraftVocabMixin._load_verifier_weights``:
    ``lm_head_weight[t2d]``), whatever ``d2t`` says.

    Raises:
        UnsafeExportError: ``include_embedding=False``. speculators 0.9.0 lists
            ``embed_tokens.weight`` in ``_keys_to_ignore_on_load_missing``
            (``models/eagle3/core.py``) and leaves the embedding UNINITIALISED when the file has
            none (seen in 5 to 9 of 12 loads, logits off by up to 2.06); vLLM and SGLang take the
            target's embedding either way, so the embedding-less form buys nothing for serving.
    """
    if not include_embedding:
        raise UnsafeExportError(
            f"{path}: a speculators-layout export without embed_tokens.weight loads in speculators 0.9.0 with an "
            f"uninitialised embedding (models/eagle3/core.py ignores it as missing); keep the embedding, or "
            f"export the eagle layout (eyas.export.eagle.save_drafter) for SGLang/vLLM, which take the target's")
    tensors = {to_speculators_name(k): v.detach().cpu() for k, v in drafter.state_dict_for_export().items()}
    tensors["embed_tokens.weight"] = drafter.embed_tokens.weight.detach().cpu()
    perm = target_id_order(tensors["d2t"])
    n = perm.numel()
    if not torch.equal(perm, torch.arange(n)):
        log.info("%s: draft ids reordered to ascending target id (speculators' verifier_lm_head assumes it)", path)
        tids = (torch.arange(n) + tensors["d2t"])[perm]
        tensors["d2t"] = tids - torch.arange(n)
        tensors["lm_head.weight"] = tensors["lm_head.weight"][perm].contiguous()
    if verifier is None:
        log.warning("%s: no verifier identity given: speculators_config.verifier.name_or_path is null and "
                    "speculators' Eagle3DraftModel.from_pretrained will fail "
                    "(pass eyas.export.verifier.verifier_identity)",
                    path)
    with atomic_dir(path) as tmp:
        write_json(tmp / "config.json", speculators_config(drafter, verifier))
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
