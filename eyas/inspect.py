"""``eyas inspect``: what a drafter checkpoint is, and what SGLang and vLLM would do with it.

Reads a checkpoint directory (``config.json`` + ``model.safetensors``) in either layout:

- eyas / EAGLE / SpecForge: ``LlamaForCausalLMEagle3``, ``midlayer.*`` (eagle3-facts.md §1.1);
- speculators: ``Eagle3Speculator``, ``layers.0.*``, nested ``transformer_layer_config``,
  top-level ``eagle_aux_hidden_state_layer_ids`` (§1.4).

and reports architecture and sizes, the aux layers and their meaning per engine
(:func:`eyas.layers.describe`), vocab-mapping health (:func:`eyas.vocab.validate_mapping`, draft-id
order), and, per engine, the keys it would skip, the defaults it would assume and whether the
embedding would be discarded. The engine behaviours encoded here are the ones read in SGLang
``models/llama_eagle3.py`` / ``speculative/eagle_worker.py`` and vLLM ``models/llama_eagle3.py`` /
``transformers_utils/configs/speculators/algos.py`` (§1.2-1.4); they are a model of the engines,
not the engines.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from eyas import layers
from eyas.export import SERVED_KEYS, ExportError, check_served_tensors, config_from_hf, detect_layout
from eyas.io import read_json
from eyas.vocab import VocabError, VocabMapping, compare_mappings, load_mapping, validate_mapping

# what SGLang's LlamaForCausalLMEagle3 has a parameter for (t2d is accepted and ignored)
_SGLANG_KNOWN = set(SERVED_KEYS) | {"embed_tokens.weight", "fc.bias"}
# what vLLM's Eagle3LlamaForCausalLM has a parameter for, in eyas names (midlayer = layers.0)
_VLLM_KNOWN = (set(SERVED_KEYS) - {"t2d"}) | {"embed_tokens.weight", "fc.bias", "mask_hidden"}


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    f = path / "model.safetensors"
    if not f.is_file():
        raise FileNotFoundError(f"{f}: no such file (eyas inspect reads config.json + model.safetensors)")
    out = {}
    with safe_open(str(f), framework="pt") as h:
        for k in h.keys():
            out[k] = h.get_tensor(k)
    return out


def inspect_checkpoint(path: str | Path, vocab_dir: str | Path | None = None,
                       num_target_layers: int | None = None) -> dict:
    """Inspect a drafter checkpoint directory.

    Args:
        path: directory with ``config.json`` and ``model.safetensors``.
        vocab_dir: optional ``models/vocab``-style directory (``vocab.safetensors``) to compare the
            checkpoint's mapping with (through target ids).
        num_target_layers: the target's decoder-layer count L, needed to interpret default layers
            when the config carries no ``eyas`` record.
    Returns:
        A JSON-able dict: ``layout``, ``architectures``, ``config`` (sizes), ``tensors``
        (name -> [shape, dtype]), ``num_params``, ``aux_layers``, ``vocab``, ``engines``
        (``sglang`` / ``vllm``: ``skipped_keys``, ``ignored_keys``, ``assumes``,
        ``embedding``), ``compare_vocab`` (with ``vocab_dir``), ``errors`` (the checkpoint is
        wrong for serving, or ``vocab_dir`` maps a target vocab of another size) and ``warnings``.
    Raises:
        FileNotFoundError: config.json or model.safetensors (or ``vocab_dir``'s
            vocab.safetensors) is missing.
        VocabError: ``vocab_dir``'s mapping is invalid in itself.
    """
    path = Path(path)
    raw_cfg = read_json(path / "config.json")
    raw = _read_tensors(path)
    layout = detect_layout(raw_cfg, raw)
    errors: list[str] = []
    warnings: list[str] = []

    if layout == "speculators":
        from eyas.speculators_format import SpeculatorsFormatError, config_to_eagle, to_eyas_name
        try:
            cfg = config_to_eagle(raw_cfg, str(path / "config.json"))
        except SpeculatorsFormatError as e:
            errors.append(str(e))
            cfg = dict(raw_cfg.get("transformer_layer_config") or {})
        names = {to_eyas_name(k): k for k in raw}
    else:
        cfg = raw_cfg
        names = {k.removeprefix("model."): k for k in raw}
    t = {eyas_name: raw[orig] for eyas_name, orig in names.items()}

    L = (cfg.get("eyas") or {}).get("num_target_layers") or num_target_layers
    report: dict = {
        "path": str(path),
        "layout": layout,
        "architectures": raw_cfg.get("architectures"),
        "tensors": {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in raw.items()},
        "num_params": {
            "total": sum(v.numel() for v in raw.values()),
            "served": sum(v.numel() for k, v in t.items() if k in SERVED_KEYS),
            "embedding": sum(v.numel() for k, v in t.items() if "embed_tokens" in k),
        },
        "num_target_layers": L,
    }
    H = cfg.get("hidden_size")
    th = cfg.get("target_hidden_size") or H
    fc = t.get("fc.weight")
    report["config"] = {
        "hidden_size": H,
        "intermediate_size": cfg.get("intermediate_size"),
        "num_attention_heads": cfg.get("num_attention_heads"),
        "num_key_value_heads": cfg.get("num_key_value_heads"),
        "head_dim": cfg.get("head_dim"),
        "num_hidden_layers": cfg.get("num_hidden_layers", 1),
        "vocab_size": cfg.get("vocab_size"),
        "draft_vocab_size": cfg.get("draft_vocab_size"),
        "target_hidden_size": cfg.get("target_hidden_size"),
        "rope_theta": (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta"),
        "torch_dtype": cfg.get("torch_dtype"),
        "norm_before_residual": raw_cfg.get("norm_before_residual"),
        "fc_input_width": None if fc is None else int(fc.shape[1]),
        "fc_n_aux": None if fc is None or not th else
        (fc.shape[1] // th if fc.shape[1] % th == 0 else fc.shape[1] / th),
    }

    # --- the drafter as eyas reads it (keys, shapes, mapping) ---
    if L is not None:
        try:
            c = config_from_hf(cfg, L, str(path / "config.json"))
            served = {k: v for k, v in t.items() if "embed_tokens" not in k and not k.startswith("verifier_")}
            check_served_tensors(served, c, str(path / "model.safetensors"))
        except (ExportError, VocabError, layers.LayerIdError) as e:
            errors.append(f"eyas would refuse it: {e}")
    else:
        warnings.append("target layer count unknown (no 'eyas' record in config.json): pass "
                        "--num-target-layers to check shapes and interpret default aux layers")

    report["aux_layers"] = _aux_layers(raw_cfg, cfg, layout, L, report["config"]["fc_n_aux"], errors, warnings)
    report["vocab"], mapping = _vocab(t, cfg, errors, warnings)
    report["engines"] = {
        "sglang": _sglang(raw_cfg, cfg, layout, names, t, report["aux_layers"], errors, warnings),
        "vllm": _vllm(raw_cfg, cfg, layout, names, t, report["aux_layers"], errors, warnings),
    }
    if vocab_dir is not None:
        other, _ = load_mapping(vocab_dir)
        if mapping is None:
            report["compare_vocab"] = {"vocab_dir": str(vocab_dir), "error": "the checkpoint has no usable d2t"}
        elif other.vocab_size != mapping.vocab_size:
            # different tokenizers: overlaps "through target ids" would compare unrelated tokens
            msg = (f"target vocab mismatch: {vocab_dir} maps a target vocab of {other.vocab_size} tokens, "
                   f"the checkpoint's target has {mapping.vocab_size}: they are for different targets "
                   f"(remap cannot bridge them)")
            report["compare_vocab"] = {"vocab_dir": str(vocab_dir), "vocab_size_checkpoint": mapping.vocab_size,
                                       "vocab_size_vocab_dir": other.vocab_size, "error": msg}
            errors.append(msg)
        else:
            cmp = compare_mappings(mapping, other)
            cmp["vocab_dir"] = str(vocab_dir)
            report["compare_vocab"] = cmp
            if cmp["positions_agree"] < cmp["draft_vocab_size_a"]:
                warnings.append(
                    f"the checkpoint's mapping and {vocab_dir} agree on {cmp['positions_agree']}/"
                    f"{cmp['draft_vocab_size_a']} draft positions ({cmp['shared_tokens']} shared tokens): "
                    f"fine-tuning it under that mapping needs `remap` (lm_head rows go through target ids)")
    report["errors"] = errors
    report["warnings"] = warnings
    return report


def _aux_layers(raw_cfg, cfg, layout, L, fc_n_aux, errors, warnings) -> dict:
    top = raw_cfg.get("eagle_aux_hidden_state_layer_ids")
    nested = (raw_cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    out: dict = {"top_level_ids (vLLM, HF indices)": top, "eagle_config_ids (SGLang, output-of-layer ids)": nested}
    if L is not None:
        try:
            ids = layers.from_config(cfg, L)
            out.update(layers.describe(ids, L))
            if fc_n_aux is not None and fc_n_aux != len(out["hf_hidden_states_indices"]):
                errors.append(f"fc width holds {fc_n_aux:g} target hidden states, the config's aux layers "
                              f"{out['hf_hidden_states_indices']} are {len(out['hf_hidden_states_indices'])}")
        except layers.LayerIdError as e:
            errors.append(str(e))
    else:
        out["default_meaning"] = "no ids = HF hidden_states [2, L//2, L-3] of an L-layer target (every engine)"
    # per engine: which HF indices each would capture
    d = layers.default_hf_indices(L) if L is not None else "[2, L//2, L-3]"
    out["sglang_captures_hf"] = layers.from_sglang(nested) if nested is not None else d
    out["vllm_captures_hf"] = list(top) if top is not None else d
    if top is None and nested is not None:
        warnings.append("aux ids only in eagle_config (SGLang form): some vLLM versions read only the "
                        "top-level key and fall back to the default layers; others may read the nested "
                        "ids verbatim (off by one)")
    if top is not None and nested is None and layout != "speculators":
        warnings.append("aux ids only at the top level (vLLM form): SGLang reads eagle_config only and "
                        "would capture its default layers")
    if nested is not None and out.get("sglang_version_ambiguous"):
        warnings.append(f"SGLang eagle_config ids {out['sglang_eagle_config_ids']} do not start at 1: "
                        f"SGLang after PR #25454 reads them as capture-before indices (one layer off)")
    return out


def _vocab(t, cfg, errors, warnings) -> tuple[dict, VocabMapping | None]:
    V = cfg.get("vocab_size")
    d2t, t2d = t.get("d2t"), t.get("t2d")
    out: dict = {"has_d2t": d2t is not None, "has_t2d": t2d is not None,
                 "draft_vocab_size": cfg.get("draft_vocab_size"), "vocab_size": V}
    lm = t.get("lm_head.weight")
    reduced = (cfg.get("draft_vocab_size") or V) != V or (lm is not None and V is not None and lm.shape[0] != V)
    out["reduced"] = bool(reduced)
    if d2t is None:
        out["valid"] = not reduced
        if reduced:
            errors.append("reduced draft vocab without d2t in the weights: vLLM would map draft id i to "
                          "target id i (identity), which is wrong")
        return out, None
    try:
        validate_mapping(d2t, t2d, V, cfg.get("draft_vocab_size"), source="checkpoint")
        out["valid"], out["error"] = True, None
    except VocabError as e:
        out["valid"], out["error"] = False, str(e)
        errors.append(str(e))
        return out, None
    tids = torch.arange(d2t.numel()) + d2t.to(torch.int64)
    ordered = bool((tids[1:] > tids[:-1]).all())
    out["order"] = "target_id" if ordered else "other (e.g. frequency, as ModelOpt writes)"
    out["first_target_ids"] = tids[:8].tolist()
    if not ordered:
        warnings.append("draft ids are not ordered by target id: convert through target ids "
                        "(i + d2t[i]), never by draft index")
    if t2d is None:
        warnings.append("no t2d: engines do not read it, but eyas training and remap need it")
    return out, VocabMapping(d2t.to(torch.int64), t2d if t2d is not None else _t2d_from(tids, V))


def _t2d_from(tids, V) -> torch.Tensor:
    m = torch.zeros(V, dtype=torch.bool)
    m[tids] = True
    return m


def _unknown(names: dict, known: set) -> list[str]:
    return sorted(orig for eyas_name, orig in names.items() if eyas_name not in known)


def _sglang(raw_cfg, cfg, layout, names, t, aux, errors, warnings) -> dict:
    archs = raw_cfg.get("architectures") or []
    out: dict = {"architecture": "LlamaForCausalLMEagle3" if "LlamaForCausalLMEagle3" in archs else
                 f"{archs}: not LlamaForCausalLMEagle3, the class SGLang's llama_eagle3.py registers"}
    # SGLang matches the names AS WRITTEN (X, then model.X): speculators' layers.0.* match nothing
    written = {orig.removeprefix("model."): orig for orig in names.values()}
    skipped = _unknown(written, _SGLANG_KNOWN)
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
                       _VLLM_KNOWN)
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


def render(report: dict) -> str:
    """The text ``eyas inspect`` prints for a report from :func:`inspect_checkpoint`."""
    c = report["config"]
    lines = [f"{report['path']}  [{report['layout']} layout, architectures {report['architectures']}]", ""]
    lines.append("architecture")
    for k, v in c.items():
        lines.append(f"  {k:<22} {v}")
    n = report["num_params"]
    lines.append(f"  parameters             {n['served']:,} served, {n['embedding']:,} embedding, "
                 f"{n['total']:,} in the file")
    lines += ["", "tensors"]
    for k, (shape, dtype) in sorted(report["tensors"].items()):
        lines.append(f"  {k:<44} {str(shape):<16} {dtype}")
    lines += ["", f"aux hidden-state layers (target layers L = {report['num_target_layers']})"]
    for k, v in report["aux_layers"].items():
        lines.append(f"  {k:<46} {v}")
    lines += ["", "vocab mapping"]
    for k, v in report["vocab"].items():
        lines.append(f"  {k:<22} {v}")
    if "compare_vocab" in report:
        lines += ["", "against " + str(report["compare_vocab"].get("vocab_dir"))]
        for k, v in report["compare_vocab"].items():
            if k != "vocab_dir":
                lines.append(f"  {k:<22} {v}")
    for eng, d in report["engines"].items():
        lines += ["", f"{eng}"]
        for k, v in d.items():
            if isinstance(v, list):
                lines.append(f"  {k}:" + ("" if v else " none"))
                lines += [f"    - {x}" for x in v]
            else:
                lines.append(f"  {k}: {v}")
    lines += [""]
    lines += [f"ERROR   {e}" for e in report["errors"]]
    lines += [f"WARNING {w}" for w in report["warnings"]]
    if not report["errors"] and not report["warnings"]:
        lines.append("OK: no problems found")
    return "\n".join(lines) + "\n"
