"""What SGLang, vLLM, speculators and llama.cpp would do with a drafter checkpoint: the per-engine
sections of ``eyas inspect``'s report (:func:`engine_report`, called by
:func:`eyas.export.inspector.inspect_checkpoint`).

Per engine: the tensors it would skip or not know, the defaults it would assume, whether it would
discard the checkpoint's embedding, the keys set away from eyas' math it honours, and how it
builds a drafter of several layers. The behaviours encoded here are the ones read in
``sgl-project/sglang``: ``python/sglang/srt/models/llama_eagle3.py`` /
``python/sglang/srt/speculative/eagle_worker.py``, ``vllm-project/vllm``:
``vllm/model_executor/models/llama_eagle3.py`` / ``vllm/transformers_utils/configs/speculators/algos.py``,
``vllm-project/speculators`` 0.9.0 and ``ggml-org/llama.cpp``: ``conversion/llama.py`` /
``src/models/eagle3.cpp`` / ``common/speculative.cpp``; they are a model of the engines, not the engines.
"""

from __future__ import annotations

import json

import torch

from eyas.export import gguf
from eyas.export.eagle import SERVED_KEYS
from eyas.export.engine_keys import ENGINE_KEYS, departs
from eyas.export.llamacpp_nextn import id_l_problem, llamacpp_arch
from eyas.target import layers
from eyas.vocab.mapping import target_id_order

# what SGLang's LlamaForCausalLMEagle3 has a parameter for (t2d is accepted and ignored)
_SGLANG_KNOWN = set(SERVED_KEYS) | {"embed_tokens.weight", "fc.bias"}
# what vLLM's Eagle3LlamaForCausalLM has a parameter for, in eyas names (midlayer = layers.0)
_VLLM_KNOWN = (set(SERVED_KEYS) - {"t2d"}) | {"embed_tokens.weight", "fc.bias", "mask_hidden"}

_LAYER_PARAMS = ("input_layernorm.weight", "hidden_norm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight")

# how each engine builds a drafter with num_hidden_layers > 1 (sources: eyas/export/engine_keys.py)
MULTI_LAYER = {
    "sglang": ("builds {n} layers (models/llama_eagle3.py: midlayer + additional_layers.0..{n}-2, "
               "BasicDecoderLayer: H-wide input, no embedding); loads tensors named midlayer.* and "
               "additional_layers.<i-1>.* (layers.<i>.* names match nothing and are skipped); eyas refuses it"),
    "vllm": ("builds {n} layers (model_executor/models/llama_eagle3.py: layers.0..{n}-1, layers >= 1 take the "
             "H-wide hidden state and no embedding); loads layers.<i>.* (midlayer.* renamed layers.0.*); "
             "speculators 0.9.0 builds the same layers.<i>; eyas refuses it"),
}


def _num_layers(raw_cfg: dict, layout: str) -> int:
    """The drafter's decoder-layer count (``transformer_layer_config``'s in the speculators layout; 1 when unset)."""
    src = raw_cfg.get("transformer_layer_config") if layout == "speculators" else raw_cfg
    return int((src or {}).get("num_hidden_layers", 1) or 1)


def _engine_known(engine: str, raw_cfg: dict, layout: str) -> set:
    """Tensor names (eyas names: layer 0 = midlayer.*) the engine's EAGLE-3 class has a parameter for,
    given the config: extra decoder layers, norm_before_fc's input_norm, fc_norm's per-aux norms."""
    base = _SGLANG_KNOWN if engine == "sglang" else _VLLM_KNOWN
    known = set(base)
    n = _num_layers(raw_cfg, layout)
    for i in range(1, n):
        if engine == "sglang":
            known |= {f"additional_layers.{i - 1}.{p}" for p in _LAYER_PARAMS if p != "input_layernorm.weight"}
        else:
            known |= {f"layers.{i}.{p}" for p in _LAYER_PARAMS}
    if engine == "vllm":  # newer vLLM llama_eagle3.py (eyas/export/engine_keys.py rows norm_before_fc, fc_norm)
        if raw_cfg.get("norm_before_fc") is True:
            known.add("input_norm.weight")
        if raw_cfg.get("fc_norm") is True:
            aux = raw_cfg.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0]
            known |= {f"fc_norm.{i}.weight" for i in range(len(aux))}
    return known


def _honoured_flags(cfg: dict, engine: str) -> list[str]:
    """The table's refused keys that ``cfg`` sets to a non-default value, with whether ``engine``
    honours each (and where)."""
    out = []
    for k in ENGINE_KEYS:
        if k.eyas != "refuses" or "." in k.key or cfg.get(k.key) is None or not departs(k, cfg[k.key], cfg):
            continue
        src = getattr(k, engine)
        out.append(f"{k.key} = {cfg[k.key]!r}: " + (src if src.startswith("not read") else f"honoured ({src})"))
    return out


def _unknown(names: dict, known: set) -> list[str]:
    """The file's names (sorted) of the tensors whose eyas name is not in ``known``."""
    return sorted(orig for eyas_name, orig in names.items() if eyas_name not in known)

def _sglang(raw_cfg, cfg, layout, names, t, aux, errors, warnings) -> dict:
    """What SGLang's ``LlamaForCausalLMEagle3`` (``models/llama_eagle3.py``) does with the checkpoint:
    ``architecture``, ``skipped_keys`` (names as written it has no parameter for), ``ignored_keys``,
    ``assumes``, ``embedding``; warns when it would skip a tensor."""
    archs = raw_cfg.get("architectures") or []
    out: dict = {"architecture": "LlamaForCausalLMEagle3" if "LlamaForCausalLMEagle3" in archs else
                 f"{archs}: not LlamaForCausalLMEagle3, the class SGLang's llama_eagle3.py registers"}
    # SGLang matches the names AS WRITTEN (X, then model.X): speculators' layers.0.* match nothing
    written = {orig.removeprefix("model."): orig for orig in names.values()}
    skipped = _unknown(written, _engine_known("sglang", raw_cfg, layout))
    out["skipped_keys"] = skipped
    out["ignored_keys"] = [k for k in ("t2d",) if k in t]
    if skipped:
        msg = f"SGLang would silently skip {len(skipped)} tensor(s) it has no parameter for: {skipped[:6]}"
        if any(k.startswith("layers.0.") for k in skipped):
            msg += " -- the decoder layer would keep its RANDOM init (low acceptance, no error)"
        warnings.append(msg)
    assumes = []
    if cfg.get("draft_vocab_size") is None:
        assumes.append("no draft_vocab_size: full vocab, and the TARGET's lm_head replaces the checkpoint's")
    assumes.append("aux layers: " + ("eagle_config ids + 1 (HF indices " + str(aux["sglang_captures_hf"]) + ")"
                                     if (raw_cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                                     is not None else f"default HF {aux['sglang_captures_hf']}"))
    if raw_cfg.get("norm_before_residual") is True:
        assumes.append("norm_before_residual is not an option in the llama_eagle3.py read: SGLang keeps the "
                       "un-normed residual, a different function from the one trained")
    out["assumes"] = assumes
    differs = cfg.get("target_hidden_size") not in (None, cfg.get("hidden_size"))
    has_embed = "embed_tokens.weight" in t
    out["embedding"] = ("the checkpoint's embed_tokens is DISCARDED: set_embed swaps in the target's"
                        if has_embed and not differs else
                        "checkpoint embedding kept (target_hidden_size != hidden_size)" if has_embed else
                        "the target's embedding")
    return out


def _vllm(raw_cfg, cfg, layout, names, t, aux, errors, warnings) -> dict:
    """What vLLM's ``Eagle3LlamaForCausalLM`` (``model_executor/models/llama_eagle3.py``; a speculators
    config through ``transformers_utils/configs/speculators/algos.py``) does with the checkpoint:
    ``architecture``, ``skipped_keys``, ``unknown_keys``, ``assumes``, ``embedding``; warns when a
    speculators config leaves ``norm_before_residual`` to vLLM's default."""
    archs = raw_cfg.get("architectures") or []
    if layout == "speculators":
        arch = "Eagle3Speculator -> Eagle3LlamaForCausalLM via speculators/algos.py update_eagle3"
    elif any(a.startswith("Eagle3") or a.endswith("Eagle3") for a in archs):
        arch = f"{archs} -> Eagle3LlamaForCausalLM (midlayer. renamed layers.0.)"
    else:
        arch = f"{archs} -> prefixed 'Eagle3' by EAGLEConfig"
    out: dict = {"architecture": arch}
    out["skipped_keys"] = [names[k] for k in ("t2d",) if k in names]
    unknown = _unknown({k: v for k, v in names.items() if not k.startswith("verifier_") and k != "t2d"},
                       _engine_known("vllm", raw_cfg, layout))
    out["unknown_keys"] = unknown + sorted(v for k, v in names.items() if k.startswith("verifier_"))
    assumes = []
    if cfg.get("draft_vocab_size") is None:
        assumes.append("no draft_vocab_size: draft_vocab_size = vocab_size")
    if "d2t" not in t:
        assumes.append("no d2t: draft_id_to_target_id stays zero = identity map (wrong for a reduced vocab)")
    if "lm_head.weight" not in t:
        assumes.append("no lm_head: shares the target's")
    if layout == "speculators":
        nbr = raw_cfg.get("norm_before_residual")
        if nbr is None:
            assumes.append("no norm_before_residual in a speculators config: vLLM assumes TRUE (residual = "
                           "hidden_norm(h)); eyas and SGLang compute the un-normed residual")
            warnings.append("speculators config without norm_before_residual: vLLM serves it with True, "
                            "speculators' own model config defaults to False; the two disagree")
        else:
            assumes.append(f"norm_before_residual = {nbr}")
    else:
        assumes.append(f"norm_before_residual = {bool(raw_cfg.get('norm_before_residual', False))}"
                       + ("" if "norm_before_residual" in raw_cfg else " (model default)"))
    assumes.append("aux layers: " + (f"top-level ids verbatim (HF {aux['vllm_captures_hf']})"
                                     if raw_cfg.get("eagle_aux_hidden_state_layer_ids") is not None
                                     else f"default HF {aux['vllm_captures_hf']}"))
    out["assumes"] = assumes
    out["embedding"] = ("the checkpoint's embed_tokens is used unless torch.equal to the target's"
                        if "embed_tokens.weight" in t else "the target's embedding (none in the checkpoint)")
    return out


def _speculators(raw_cfg, cfg, layout, t, L, warnings) -> dict:
    """What speculators 0.9.0 (``vllm-project/speculators``) does with the file: for the speculators
    layout, ``Eagle3DraftModel.from_pretrained`` (``models/eagle3/core.py``); for the eagle layout,
    what ``speculators convert --algorithm eagle3`` (``convert/eagle/eagle3_converter.py``) changes."""
    out: dict = {}
    d2t = t.get("d2t")
    if d2t is not None and d2t.dim() == 1 and not torch.equal(target_id_order(d2t), torch.arange(d2t.numel())):
        out["draft_id_order"] = (
            "NOT ascending by target id: speculators 0.9.0 builds verifier_lm_head (its trainer's target "
            "distribution, and the lm_head it initialises from the verifier) as the target's lm_head rows "
            "selected by t2d, in ascending target id (src/speculators/model.py, "
            "DraftVocabMixin._load_verifier_weights: lm_head_weight[t2d]), so draft id i gets the row of the "
            "i-th smallest target id, not of i + d2t[i]")
        warnings.append("speculators 0.9.0 would train this drafter against the wrong target rows: its draft ids "
                        "are not in ascending target-id order, which src/speculators/model.py "
                        "(DraftVocabMixin._load_verifier_weights) assumes; re-export with eyas "
                        "(eyas.export.speculators.write_speculators sorts them, exactly)")
    if layout == "speculators":
        out.update(_speculators_load(raw_cfg, t, warnings))
    else:
        out.update(_speculators_convert(raw_cfg, cfg, t, L))
    return out


def _speculators_load(raw_cfg, t, warnings) -> dict:
    """What speculators 0.9.0's ``Eagle3DraftModel.from_pretrained`` (``models/eagle3/core.py``) does with a
    speculators-layout checkpoint: ``verifier``, ``from_pretrained``, ``embedding``, ``flags``; warns where it
    fails or loads an uninitialised embedding."""
    out: dict = {}
    ver = ((raw_cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    out["verifier"] = ver
    if ver is None:
        out["from_pretrained"] = ("FAILS after loading the weights: verifier.name_or_path is null and "
                                  "from_pretrained calls AutoConfig.from_pretrained(None)")
        warnings.append("speculators_config.verifier.name_or_path is null: speculators 0.9.0's "
                        "Eagle3DraftModel.from_pretrained fails (OSError); write the target's hub id or path "
                        "(eyas.export.verifier.verifier_identity)")
    else:
        out["from_pretrained"] = (f"reads AutoConfig of {ver!r} (it must resolve: a hub id, cached or online, or "
                                  f"a directory relative to where the client runs) to check the aux ids")
    if "embed_tokens.weight" in t:
        out["embedding"] = "embed_tokens.weight loaded from the file"
    else:
        out["embedding"] = ("UNSAFE: no embed_tokens.weight; speculators 0.9.0 ignores it as missing and leaves "
                            "the embedding uninitialised (logits off by up to 2 in tests)")
        warnings.append("speculators-layout checkpoint without embed_tokens.weight: unsafe to load in "
                        "speculators 0.9.0 (uninitialised embedding); vLLM/SGLang take the target's")
    out["flags"] = {f: raw_cfg.get(f, False) for f in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                                        "norm_output")}
    return out


def _speculators_convert(raw_cfg, cfg, t, L) -> dict:
    """What ``speculators convert --algorithm eagle3`` (``convert/eagle/eagle3_converter.py``) would change
    in an eagle-layout checkpoint: ``convert_command`` (with the aux layer ids when they are not the
    default of an ``L``-layer target) and ``convert_changes``."""
    ids = raw_cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and L is not None:
        try:
            ids = layers.resolve(layers.from_config(cfg, L), L)
            default = layers.default_hf_indices(L)
        except layers.LayerIdError:
            ids, default = None, None
    else:
        try:
            default = layers.default_hf_indices(L) if L is not None else None
        except layers.LayerIdError:  # no valid default on this target: explicit ids must be passed
            default = []
    custom = ids is not None and default is not None and list(ids) != list(default)
    kwargs = {"eagle_aux_hidden_state_layer_ids": list(ids)} if custom else {}
    cmd = "speculators convert <this dir> --algorithm eagle3 --verifier <target hub id or path>"
    if kwargs:
        cmd += f" --algorithm-kwargs '{json.dumps(kwargs)}'"
    changes = ["midlayer.* renamed layers.0.*; config nested under transformer_layer_config",
               "norm_before_residual written False (the converter's default; eyas' math)"]
    if custom:
        changes.append(f"aux layer ids {list(ids)} are NOT carried unless passed: without --algorithm-kwargs the "
                       f"converter writes the default {default} (only a UserWarning)")
    elif ids is None:
        changes.append("aux layer ids: the converter's default [2, L//2, L-3] of the verifier")
    if "embed_tokens.weight" not in t:
        changes.append("no embed_tokens.weight: the converted file has none either, which speculators 0.9.0 "
                       "loads with an uninitialised embedding; eyas.export.speculators.write_speculators writes "
                       "the embedding instead")
    return {"convert_command": cmd, "convert_changes": changes}


def _llamacpp(raw_cfg, t, L, aux, manifest, arch, errors, warnings) -> dict:
    """What llama.cpp's converter (``conversion/llama.py`` ``LlamaModel``) writes from the
    checkpoint and what llama.cpp then serves (``src/models/eagle3.cpp``; target layer ids as
    ``common/speculative.cpp`` reads them: eyas/export/gguf.py)."""
    cfg = {**raw_cfg, **(raw_cfg.get("transformer_layer_config") or {})}  # the converter merges it so
    if "draft_vocab_size" not in cfg or cfg.get("num_hidden_layers") != 1:
        warnings.append("llama.cpp: the converter detects an EAGLE-3 drafter by draft_vocab_size with "
                        "num_hidden_layers 1 (conversion/llama.py); without them it writes a plain llama GGUF, "
                        "which --spec-type draft-eagle3 does not serve")
        return {"architecture": "not detected as EAGLE-3: converted as a plain llama model"}
    out: dict = {"architecture": "eagle3 (conversion/llama.py: draft_vocab_size with num_hidden_layers 1)"}
    ids = gguf.converter_target_layers(raw_cfg, L)
    if ids is None:
        out["target_layers"] = "[2, L//2, L-3] of --target-model-dir's num_hidden_layers (L unknown here)"
    else:
        out["target_layers"] = ids
        out["target_layers_meaning"] = gguf.describe_target_layers(ids, L)
    trained = aux.get("hf_hidden_states_indices")
    if ids is not None and (p := id_l_problem(ids, L, arch)) is not None:
        (errors if llamacpp_arch(arch) else warnings).append(f"llama.cpp: eagle3.target_layers {ids}: {p}")
    if ids is not None and trained is not None:
        if ids != trained:
            warnings.append(f"llama.cpp: the converter would write eagle3.target_layers {ids} (it reads only the "
                            f"top-level eagle_aux_hidden_state_layer_ids), the drafter's aux layers are HF "
                            f"{trained}: llama.cpp would feed it other hidden states than it was trained on")
    if manifest is not None and ids is not None and list(manifest[1]["aux_layers"]) != ids:
        errors.append(f"llama.cpp: the converter would write eagle3.target_layers {ids}, the features the "
                      f"drafter was trained on ({manifest[0]} aux_layers) are HF {manifest[1]['aux_layers']}")
    out["target_hidden_size"] = raw_cfg.get("target_hidden_size") or "the target's hidden_size (--target-model-dir)"
    for f in ("norm_before_residual", "norm_before_fc"):
        out[f] = bool(raw_cfg.get(f, False))
    out["d2t"] = ("written as absolute target ids (d2t + arange, int64); t2d dropped" if "d2t" in t else
                  "none: llama.cpp serves draft id i as target id i (the full vocab)")
    out["embedding"] = ("embed_tokens.weight -> token_embd.weight: llama.cpp uses it, not the target's"
                        if "embed_tokens.weight" in t else "none in the file: llama.cpp uses the target's")
    out["lm_head"] = ("lm_head.weight -> output.weight" if "lm_head.weight" in t else
                      "none in the file: llama.cpp uses the target's output (the full vocab)")
    out["convert"] = ("eyas.export.gguf.convert(<this dir>, <out>.gguf, target_model_dir=<the target's "
                      "config.json + tokenizer>) runs llama.cpp's convert_hf_to_gguf.py --target-model-dir")
    return out


def engine_report(raw_cfg: dict, cfg: dict, layout: str, names: dict, t: dict, aux: dict, L: int | None,
                  manifest: tuple | None, target_arch: str | None, errors: list[str], warnings: list[str]) -> dict:
    """The ``engines`` section of :func:`eyas.export.inspector.inspect_checkpoint`'s report.

    Args:
        raw_cfg: the checkpoint's ``config.json`` as written.
        cfg: the same in the eagle layout's keys (a speculators config converted).
        layout: ``"eagle"`` or ``"speculators"`` (:func:`eyas.export.load.detect_layout`).
        names: eyas tensor name (layer 0 = ``midlayer.*``) -> the name in the file.
        t: eyas tensor name -> tensor (``d2t``: [draft_vocab] int64 offsets).
        aux: the report's ``aux_layers`` section (which HF indices each engine captures).
        L: the target's decoder-layer count, or None when unknown.
        manifest: ``(path, dict)`` of the features manifest the drafter was trained on
            (:func:`eyas.export.gguf.features_manifest`), or None.
        target_arch: the target's HF class (decides whether llama.cpp fills aux layer id L), or None.
        errors, warnings: the report's lists, appended to in engine order.
    Returns:
        ``{"sglang", "vllm", "speculators", "llamacpp"}``, each a dict (module docstring); SGLang's,
        vLLM's and llama.cpp's carry ``non_default_keys``, and ``multi_layer`` when the config has
        more than one decoder layer.
    """
    engines = {
        "sglang": _sglang(raw_cfg, cfg, layout, names, t, aux, errors, warnings),
        "vllm": _vllm(raw_cfg, cfg, layout, names, t, aux, errors, warnings),
        "speculators": _speculators(raw_cfg, cfg, layout, t, L, warnings),
        "llamacpp": _llamacpp(raw_cfg, t, L, aux, manifest, target_arch, errors, warnings),
    }
    nl = _num_layers(raw_cfg, layout)
    for eng in ("sglang", "vllm", "llamacpp"):
        engines[eng]["non_default_keys"] = _honoured_flags(cfg, eng)
        if nl > 1 and eng in MULTI_LAYER:
            engines[eng]["multi_layer"] = MULTI_LAYER[eng].format(n=nl)
    return engines
