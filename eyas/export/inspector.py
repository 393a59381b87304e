"""``eyas inspect``: what a drafter checkpoint is, and what SGLang, vLLM and llama.cpp would do with it.

Reads a checkpoint directory (``config.json`` + ``model.safetensors``) in either layout:

- eyas / EAGLE / SpecForge: ``LlamaForCausalLMEagle3``, ``midlayer.*``
  (``sgl-project/SpecForge: specforge/modeling/draft/llama3_eagle.py``);
- speculators: ``Eagle3Speculator``, ``layers.0.*``, nested ``transformer_layer_config``,
  top-level ``eagle_aux_hidden_state_layer_ids``
  (``vllm-project/speculators: src/speculators/models/eagle3/config.py``).

and reports architecture and sizes, the aux layers and their meaning per engine
(:func:`eyas.target.layers.describe`), vocab-mapping health (:func:`eyas.vocab.mapping.validate_mapping`, draft-id
order), and, per engine (:func:`eyas.export.engine_report.engine_report`), the keys it would skip, the
defaults it would assume and whether the embedding would be discarded. The engine behaviours encoded
there are the ones read in ``sgl-project/sglang``: ``python/sglang/srt/models/llama_eagle3.py`` /
``python/sglang/srt/speculative/eagle_worker.py`` and ``vllm-project/vllm``:
``vllm/model_executor/models/llama_eagle3.py`` /
``vllm/transformers_utils/configs/speculators/algos.py``, and ``ggml-org/llama.cpp``:
``conversion/llama.py`` (the HF -> GGUF converter) / ``src/models/eagle3.cpp`` /
``common/speculative.cpp``; they are a model of the engines, not the engines.

A llama.cpp drafter GGUF (``.gguf``, :func:`inspect_gguf`) is read as llama.cpp will load it
(eyas/export/gguf.py) and, given what the drafter was trained on (its checkpoint directory, the
features manifest, the vocab), checked against it: target layers and d2t that differ are errors.

One module past 500 lines: it is ``eyas inspect`` whole, the checkpoint report and the GGUF report
side by side with the target summary both compare against (:func:`target_summary`) and the text
each renders to; the per-engine sections live in eyas/export/engine_report.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.export import gguf, gguf_fields, own_tensors
from eyas.export.eagle import SERVED_KEYS, ExportError, check_served_tensors, config_from_hf
from eyas.export.engine_keys import read_config, refusals
from eyas.export.engine_report import engine_report
from eyas.export.load import detect_layout
from eyas.io import load_safetensors, read_json
from eyas.target import layers, rope
from eyas.vocab.mapping import (
    VocabError,
    VocabMapping,
    compare_mappings,
    load_mapping,
    validate_mapping,
)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    f = path / "model.safetensors"
    if not f.is_file():
        raise FileNotFoundError(f"{f}: no such file (eyas inspect reads config.json + model.safetensors)")
    return load_safetensors(f)


def inspect_checkpoint(path: str | Path, vocab_dir: str | Path | None = None,
                       num_target_layers: int | None = None, target: dict | None = None,
                       features: str | Path | None = None) -> dict:
    """Inspect a drafter checkpoint directory.

    Args:
        path: directory with ``config.json`` and ``model.safetensors``.
        vocab_dir: optional ``models/vocab``-style directory (``vocab.safetensors``) to compare the
            checkpoint's mapping with (through target ids).
        num_target_layers: the target's decoder-layer count L, needed to interpret default layers
            when the config carries no ``eyas`` record.
        target: the target's summary (:func:`target_summary`: sizes, layer count, vocab, context,
            RoPE); its layer count stands in for ``num_target_layers``, and ``against_target``
            compares context length, RoPE, vocab size, hidden size and aux layers with it.
        features: a features manifest (``manifest.json`` or its directory) the drafter was
            trained on: target layers llama.cpp's converter would write other than its
            ``aux_layers`` are an error; its ``num_layers`` is the last source of L.
    Returns:
        A JSON-able dict: ``layout``, ``architectures``, ``config`` (sizes), ``tensors``
        (name -> [shape, dtype]), ``num_params``, ``aux_layers``, ``vocab``, ``engines``
        (``sglang`` / ``vllm``: ``skipped_keys``, ``ignored_keys``, ``assumes``,
        ``embedding``, ``non_default_keys`` (keys set away from eyas' math, each "honoured (where)" or
        "not read" by that engine), ``multi_layer``; ``speculators``: what
        speculators 0.9.0 does with the file, or what ``speculators convert`` would change;
        ``llamacpp``: what llama.cpp's converter writes from it, the target layers it derives and
        what llama.cpp then captures),
        ``against_target`` (with ``target``), ``compare_vocab`` (with ``vocab_dir``), ``errors`` (the checkpoint is
        wrong for serving, or ``vocab_dir`` maps a target vocab of another size) and ``warnings``.
    Raises:
        FileNotFoundError: config.json or model.safetensors (or ``vocab_dir``'s
            vocab.safetensors, or ``features``' manifest) is missing.
        ValueError: ``features`` is not an eyas features manifest, a JSON file is not a JSON
            object, or model.safetensors is not safetensors (truncated: naming the file).
        eyas.export.eagle.ExportError: a config.json value of the wrong type
            (:func:`eyas.export.engine_keys.read_config`: naming the file, the key and the type expected).
        VocabError: ``vocab_dir``'s mapping is invalid in itself.
    """
    path = Path(path)
    errors: list[str] = []
    warnings: list[str] = []
    raw_cfg, raw, layout, cfg, names = _read_checkpoint(path, errors)
    t = {eyas_name: raw[orig] for eyas_name, orig in names.items()}

    manifest = None if features is None else gguf.features_manifest(features)
    L = (cfg.get("eyas") or {}).get("num_target_layers") or num_target_layers or \
        (target or {}).get("num_hidden_layers") or (manifest[1].get("num_layers") if manifest else None)
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
    report["config"] = _config_section(raw_cfg, cfg, t)
    _eyas_refusals(path, cfg, t, L, errors, warnings)
    report["aux_layers"] = _aux_layers(raw_cfg, cfg, layout, L, report["config"]["fc_n_aux"], errors, warnings)
    report["vocab"], mapping = _vocab(t, cfg, errors, warnings)
    report["engines"] = engine_report(raw_cfg, cfg, layout, names, t, report["aux_layers"], L, manifest,
                                      _target_arch(target, manifest), errors, warnings)
    warnings += own_tensors.disagreements(cfg, t)  # a tensor the engines serve differently from each other
    if target is not None:
        report["against_target"] = _against_target(cfg, L, target, errors, warnings)
    if vocab_dir is not None:
        report["compare_vocab"] = _compare_vocab(vocab_dir, mapping, errors, warnings)
    report["errors"] = errors
    report["warnings"] = warnings
    return report


def _read_checkpoint(path: Path, errors: list[str]) -> tuple[dict, dict, str, dict, dict]:
    """A checkpoint directory read in either layout.

    Returns:
        ``(raw_cfg, raw, layout, cfg, names)``: ``config.json`` as written; the tensors as named in
        ``model.safetensors``; ``"eagle"`` or ``"speculators"``; the config in the eagle layout's keys
        (a speculators config converted; when it cannot be, its ``transformer_layer_config`` and
        the reason appended to ``errors``); eyas tensor name (``model.`` prefix dropped, layer 0 =
        ``midlayer.*``) -> the name in the file.
    Raises:
        FileNotFoundError / ValueError / eyas.export.eagle.ExportError: as :func:`inspect_checkpoint`.
    """
    raw_cfg = read_config(path / "config.json")
    raw = _read_tensors(path)
    layout = detect_layout(raw_cfg, raw)
    if layout == "speculators":
        from eyas.export.speculators import SpeculatorsFormatError, config_to_eagle, to_eyas_name
        try:
            cfg = config_to_eagle(raw_cfg, str(path / "config.json"))
        except SpeculatorsFormatError as e:
            errors.append(str(e))
            cfg = dict(raw_cfg.get("transformer_layer_config") or {})
        names = {to_eyas_name(k): k for k in raw}
    else:
        cfg = raw_cfg
        names = {k.removeprefix("model."): k for k in raw}
    return raw_cfg, raw, layout, cfg, names


def _config_section(raw_cfg: dict, cfg: dict, t: dict) -> dict:
    """The report's ``config`` section: the drafter's sizes, RoPE and norm flags, ``fc_input_width``
    (``fc.weight``'s columns) and ``fc_n_aux`` (those columns over the target hidden size: how many
    target hidden states fc takes; a float when they do not divide)."""
    H = cfg.get("hidden_size")
    th = cfg.get("target_hidden_size") or H
    fc = t.get("fc.weight")
    return {
        "hidden_size": H,
        "intermediate_size": cfg.get("intermediate_size"),
        "num_attention_heads": cfg.get("num_attention_heads"),
        "num_key_value_heads": cfg.get("num_key_value_heads"),
        "head_dim": cfg.get("head_dim"),
        "num_hidden_layers": cfg.get("num_hidden_layers", 1),
        "vocab_size": cfg.get("vocab_size"),
        "draft_vocab_size": cfg.get("draft_vocab_size"),
        "target_hidden_size": cfg.get("target_hidden_size"),
        "rope": _rope_line(cfg),
        "max_position_embeddings": cfg.get("max_position_embeddings"),
        "torch_dtype": cfg.get("torch_dtype"),
        **{f: raw_cfg.get(f) for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")},
        "fc_input_width": None if fc is None else int(fc.shape[1]),
        "fc_n_aux": None if fc is None or not th else
        (fc.shape[1] // th if fc.shape[1] % th == 0 else fc.shape[1] / th),
    }


def _eyas_refusals(path: Path, cfg: dict, t: dict, L: int | None, errors: list[str], warnings: list[str]) -> None:
    """The drafter as eyas reads it, appended to ``errors`` as ``"eyas would refuse it: ..."``: the
    refused keys (always: they do not depend on the target), then, given the target's layer count
    ``L``, the config, the served tensors' names and shapes and the mapping
    (:func:`eyas.export.eagle.check_served_tensors`); without ``L`` a warning says what is unchecked."""
    refused = refusals(cfg)
    if cfg.get("num_hidden_layers", 1) != 1 and not any(r.startswith("num_hidden_layers") for r in refused):
        refused.insert(0, f"num_hidden_layers: {cfg.get('num_hidden_layers')!r} (eyas implements 1)")
    errors += [f"eyas would refuse it: {r}" for r in refused]
    if L is not None and not refused:
        try:
            c = config_from_hf(cfg, L, str(path / "config.json"))
            served = {k: v for k, v in t.items() if "embed_tokens" not in k and not k.startswith("verifier_")}
            check_served_tensors(served, c, str(path / "model.safetensors"))
        except (ExportError, VocabError, layers.LayerIdError) as e:
            errors.append(f"eyas would refuse it: {e}")
    elif L is None:
        warnings.append("target layer count unknown (no 'eyas' record in config.json): pass "
                        "--num-target-layers or --target to check shapes and interpret default aux layers")


def _compare_vocab(vocab_dir: str | Path, mapping: VocabMapping | None, errors: list[str],
                   warnings: list[str]) -> dict:
    """The report's ``compare_vocab`` section: the checkpoint's mapping against ``vocab_dir``'s,
    through target ids (:func:`eyas.vocab.mapping.compare_mappings`). Another target vocab size is
    an error (remap cannot bridge it); draft positions that differ are a warning.

    Raises:
        FileNotFoundError: ``vocab_dir`` has no vocab.safetensors.
        VocabError: ``vocab_dir``'s mapping is invalid in itself.
    """
    other, _ = load_mapping(vocab_dir)
    if mapping is None:
        return {"vocab_dir": str(vocab_dir), "error": "the checkpoint has no usable d2t"}
    if other.vocab_size != mapping.vocab_size:
        # different tokenizers: overlaps "through target ids" would compare unrelated tokens
        msg = (f"target vocab mismatch: {vocab_dir} maps a target vocab of {other.vocab_size} tokens, "
               f"the checkpoint's target has {mapping.vocab_size}: they are for different targets "
               f"(remap cannot bridge them)")
        errors.append(msg)
        return {"vocab_dir": str(vocab_dir), "vocab_size_checkpoint": mapping.vocab_size,
                "vocab_size_vocab_dir": other.vocab_size, "error": msg}
    cmp = compare_mappings(mapping, other)
    cmp["vocab_dir"] = str(vocab_dir)
    if cmp["positions_agree"] < cmp["draft_vocab_size_a"]:
        warnings.append(
            f"the checkpoint's mapping and {vocab_dir} agree on {cmp['positions_agree']}/"
            f"{cmp['draft_vocab_size_a']} draft positions ({cmp['shared_tokens']} shared tokens): "
            f"fine-tuning it under that mapping needs `remap` (lm_head rows go through target ids)")
    return cmp


def _target_arch(target: dict | None, manifest) -> str | None:
    """The target's class: ``target``'s ``architecture`` (:func:`target_summary`), else the
    features manifest's ``target.class``."""
    return (target or {}).get("architecture") or ((manifest[1].get("target") or {}).get("class") if manifest else None)


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
    try:
        d = layers.default_hf_indices(L) if L is not None else "[2, L//2, L-3]"
    except layers.LayerIdError as e:  # a small target: the engines' default is no valid id set
        d = f"none valid ({e})"
    out["sglang_captures_hf"] = layers.from_sglang(nested) if nested is not None else d
    out["vllm_captures_hf"] = list(top) if top is not None else d
    if top is None and nested is not None:
        warnings.append("aux ids only in eagle_config (SGLang form): some vLLM versions read only the "
                        "top-level key and fall back to the default layers; others may read the nested "
                        "ids verbatim (off by one)")
    if top is not None and nested is None and layout != "speculators":
        warnings.append("aux ids only at the top level (vLLM form): SGLang reads eagle_config only and "
                        "would capture its default layers")
    if "id_L" in out:
        warnings.append(f"aux layer id {L} = L: served as the residual before the final norm by vLLM and SGLang with "
                        f"PR #32334; SGLang without PR #32334 never captures it (fewer states than fc expects); "
                        f"llama.cpp: see its section")
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


def _rope_line(cfg: dict) -> str:
    try:
        return rope.describe(*rope.normalise(cfg))
    except rope.RopeError as e:
        return f"unsupported: {e}"


def inspect_gguf(path: str | Path, drafter_dir: str | Path | None = None, vocab_dir: str | Path | None = None,
                 features: str | Path | None = None, num_target_layers: int | None = None,
                 target: dict | None = None) -> dict:
    """Inspect a llama.cpp EAGLE-3 drafter GGUF: what llama.cpp will load (eyas/export/gguf.py
    :func:`~eyas.export.gguf.read_drafter`) and, with the pipeline context, every way it differs
    from what the drafter was trained on (:func:`~eyas.export.gguf.check_against`).

    Args:
        path: the ``.gguf`` file.
        drafter_dir: the checkpoint directory it was converted from.
        vocab_dir: a ``models/vocab``-style directory whose d2t the GGUF's must equal.
        features: the features manifest the drafter was trained on (its ``aux_layers``).
        num_target_layers: the target's decoder-layer count L (else the target's, the manifest's,
            or the drafter config's ``eyas.num_target_layers``).
        target: the target's summary (:func:`target_summary`).
    Returns:
        A JSON-able dict: ``path``, ``layout`` (``"gguf"``), ``architecture``, ``config`` (what
        llama.cpp loads), ``target_layers`` (ids, L, the meaning of each id), ``vocab`` (token
        count, draft vocab, first d2t target ids, embedding / lm_head source), ``metadata``
        (every ``eagle3.*`` key), ``tensors`` (name -> [shape, type]), ``context`` (the sources
        checked against), ``errors`` (each names the file, the key and llama.cpp) and ``warnings``.
    Raises:
        FileNotFoundError: ``path`` (or a given source file) is missing.
        eyas.export.gguf.GGUFReadError: ``path`` is not a GGUF or not an EAGLE-3 drafter.
        ValueError: a given source is unreadable (not JSON, not an eyas features manifest).
    """
    info = gguf.read_drafter(path)
    L = _gguf_target_layer_count(num_target_layers, target, features, drafter_dir)
    errors = gguf.check_against(info, drafter_dir=drafter_dir, features=features, vocab_dir=vocab_dir,
                                num_target_layers=L, target=target)
    warnings: list[str] = []
    if gguf_fields.digest_path(path).is_file():  # an eyas export: its bytes as they were written
        errors += [p for p in [gguf_fields.digest_problem(path)] if p]
    else:
        warnings.append(f"no digest beside it ({gguf_fields.digest_path(path).name}): not a file eyas exported, or "
                        f"its digest was lost; eyas' eval refuses to serve it")
    context = {k: str(v) for k, v in (("drafter_dir", drafter_dir), ("features", features),
                                      ("vocab_dir", vocab_dir)) if v is not None}
    if not context:
        warnings.append("no pipeline context: pass --drafter DIR, --features MANIFEST and/or --vocab DIR to check "
                        "the target layers and d2t against what the drafter was trained on")
    if L is None:
        warnings.append("target layer count unknown: pass --num-target-layers or --target to check the ids")
    V = (target or {}).get("vocab_size")
    if V is not None and info["n_tokens"] != V:
        warnings.append(f"the GGUF embeds {info['n_tokens']} tokens, the target has a vocab of {V}: llama.cpp "
                        f"scatters draft logits into the GGUF's {info['n_tokens']}")
    return {
        "path": info["path"],
        "layout": "gguf",
        "architecture": info["architecture"],
        "config": {**{k: info[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                                           "rope_freq_base", "context_length", "target_hidden_size",
                                           "norm_before_residual", "norm_before_fc")},
                   "rope": gguf_fields.served_inv_freq(info)[1]},
        "target_layers": {"ids": info["target_layers"], "num_target_layers": L,
                          "meaning": gguf.describe_target_layers(info["target_layers"], L)},
        "vocab": _gguf_vocab(info),
        "metadata": info["metadata"],
        "tensors": {k: [v["shape"], v["type"]] for k, v in info["tensors"].items()},
        "context": context,
        "errors": errors,
        "warnings": warnings,
    }


def _gguf_target_layer_count(num_target_layers: int | None, target: dict | None, features: str | Path | None,
                             drafter_dir: str | Path | None) -> int | None:
    """The target's decoder-layer count L for :func:`inspect_gguf`: ``num_target_layers``, else
    ``target``'s, else the features manifest's ``num_layers``, else the drafter config's
    ``eyas.num_target_layers``; None when none gives it.

    Raises:
        FileNotFoundError / ValueError: the manifest or the drafter's config.json is missing or unreadable.
    """
    L = num_target_layers or (target or {}).get("num_hidden_layers")
    if L is None and features is not None:
        L = gguf.features_manifest(features)[1].get("num_layers")
    if L is None and drafter_dir is not None:
        L = (read_config(Path(drafter_dir) / "config.json").get("eyas") or {}).get("num_target_layers")
    return L


def _gguf_vocab(info: dict) -> dict:
    """The ``vocab`` section of :func:`inspect_gguf`'s report from :func:`eyas.export.gguf.read_drafter`'s
    dict (its ``d2t``: [draft_vocab] int64 absolute target ids, or None)."""
    d2t = info["d2t"]
    return {
        "vocab_size": info["vocab_size"], "n_tokens": info["n_tokens"], "tokenizer": info["tokenizer"],
        "draft_vocab_size": info["draft_vocab_size"],
        "d2t": "absent: draft id i = target id i" if d2t is None else "absolute target ids (int64)",
        "first_target_ids": None if d2t is None else d2t[:8].tolist(),
        "order": None if d2t is None else
        ("target_id" if bool((d2t[1:] > d2t[:-1]).all()) else "other (e.g. frequency)"),
        "embedding": "token_embd.weight (its own)" if info["own_embedding"] else "the target's token_embd",
        "lm_head": "output.weight (its own)" if info["own_lm_head"] else "the target's output (full vocab)",
    }


def render_gguf(report: dict) -> str:
    """The text ``eyas inspect`` prints for a report from :func:`inspect_gguf`."""
    lines = [f"{report['path']}  [GGUF, general.architecture {report['architecture']}: what llama.cpp loads]", ""]
    lines.append("architecture")
    lines += [f"  {k:<22} {v}" for k, v in report["config"].items()]
    tl = report["target_layers"]
    lines += ["", f"target layers (eagle3.target_layers, target layers L = {tl['num_target_layers']}; "
                  f"common/speculative.cpp)", f"  ids                    {tl['ids']}"]
    lines += [f"  {m}" for m in tl["meaning"]]
    lines += ["", "vocab"]
    lines += [f"  {k:<22} {v}" for k, v in report["vocab"].items()]
    lines += ["", "tensors"]
    lines += [f"  {k:<44} {str(shape):<16} {dtype}" for k, (shape, dtype) in sorted(report["tensors"].items())]
    lines += ["", "checked against" + ("" if report["context"] else ": nothing")]
    lines += [f"  {k:<22} {v}" for k, v in report["context"].items()]
    return _with_verdict(lines, report)


def _with_verdict(lines: list[str], report: dict) -> str:
    """A rendered report: ``lines``, then its errors and warnings, or the OK line when it has none."""
    lines = [*lines, "", *[f"ERROR   {e}" for e in report["errors"]], *[f"WARNING {w}" for w in report["warnings"]]]
    if not report["errors"] and not report["warnings"]:
        lines.append("OK: no problems found")
    return "\n".join(lines) + "\n"


def target_summary(path: str, gguf_file: str | None = None) -> dict:
    """The target summary ``--target`` compares with (eyas.target.model.summarise_config's keys, and
    ``architecture``: its HF class, else its ``model_type``; a manifest's ``target.class``).

    Args:
        path: a feature manifest (``data/features/<split>/manifest.json`` or its directory: its
            ``target_config``), ``"embedded"`` (the default GGUF target), a ``.gguf`` file, a local
            HF directory or a hub id (read with transformers' AutoConfig; no weights load).
        gguf_file: the GGUF file inside ``path``.
    Raises:
        FileNotFoundError: ``path`` is neither on disk nor a hub id (``a/b/c``, ``./x``: checked by
            ``huggingface_hub.utils.validate_repo_id``), a directory with neither ``config.json``
            nor ``manifest.json``, or ``gguf_file`` is not in it; each names the path.
        ValueError: a ``manifest.json`` without ``target_config``, a file that is none of these, or a
            GGUF file transformers cannot parse (truncated, not GGUF).
        OSError: transformers cannot read it (a hub id offline or not found).
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from eyas.target.model import embedded_target, summarise_config

    p = Path(path)
    manifest = p / "manifest.json" if p.is_dir() else p
    if manifest.name == "manifest.json" and manifest.is_file():
        m = read_json(manifest)
        summary = m.get("target_config")
        if not isinstance(summary, dict):
            raise ValueError(f"{manifest}: no target_config mapping (not an eyas feature manifest)")
        return {**summary, "architecture": (m.get("target") or {}).get("class")}
    if path == "embedded":
        path, gguf_file = embedded_target()
    elif p.suffix == ".gguf" and p.is_file():
        path, gguf_file = str(p.parent), p.name
    elif p.is_dir():
        if gguf_file is not None and not (p / gguf_file).is_file():
            raise FileNotFoundError(f"{p / gguf_file}: no such GGUF file in the target directory")
        if gguf_file is None and not (p / "config.json").is_file():
            raise FileNotFoundError(f"{path}: a directory with neither config.json (an HF target) nor "
                                    "manifest.json (a feature manifest); for a GGUF give the .gguf file")
    elif p.exists() and p.suffix != ".json":  # transformers reads a config .json file itself
        raise ValueError(f"{path}: not a target: give an HF directory, a .gguf file, a feature manifest "
                         "(manifest.json or its directory), 'embedded' or a hub id")
    else:
        try:
            validate_repo_id(path)
        except HFValidationError:
            raise FileNotFoundError(f"{path}: no such file or directory (nor a hub id, org/name)") from None
    from transformers import AutoConfig

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        cfg = AutoConfig.from_pretrained(path, **kw)
    except Exception as e:  # noqa: BLE001 -- transformers' GGUF reader raises struct.error on a truncated file
        if not gguf_file or isinstance(e, OSError):
            raise
        raise ValueError(f"{Path(path) / gguf_file}: not a GGUF file transformers can read "
                         f"({type(e).__name__}: {e})") from None
    arch = (getattr(cfg, "architectures", None) or [getattr(cfg, "model_type", None)])[0]
    cfg = getattr(cfg, "text_config", None) or cfg
    return {**summarise_config(cfg), "architecture": arch}


def _against_target(cfg, L, target: dict, errors, warnings) -> dict:
    """Context length, RoPE, vocab size, hidden size and aux layers of the drafter against the
    target's summary. Mismatched vocab / hidden size / layer count are errors (the drafter cannot
    run on it); context and RoPE differences are warnings (served as configured, but not what the
    target uses)."""
    rows: dict = {}

    def row(name, drafter_v, target_v, severity):
        ok = drafter_v == target_v
        rows[name] = {"drafter": drafter_v, "target": target_v, "ok": ok}
        if not ok:
            msg = f"against the target: {name} {drafter_v!r} (drafter) != {target_v!r} (target)"
            (errors if severity == "error" else warnings).append(msg)

    row("vocab_size", cfg.get("vocab_size"), target.get("vocab_size"), "error")
    row("hidden_size (target_hidden_size)", cfg.get("target_hidden_size") or cfg.get("hidden_size"),
        target.get("hidden_size"), "error")
    recorded = (cfg.get("eyas") or {}).get("num_target_layers")
    if recorded is not None:
        row("num_target_layers", recorded, target.get("num_hidden_layers"), "error")
    tl = target.get("num_hidden_layers")
    try:
        rows["aux_layers (HF hidden_states)"] = {"drafter": layers.resolve(layers.from_config(cfg, L or tl), L or tl),
                                                 "target_layers": tl,
                                                 "ok": all(0 < i <= tl for i in layers.resolve(
                                                     layers.from_config(cfg, L or tl), L or tl))}
    except layers.LayerIdError as e:
        rows["aux_layers (HF hidden_states)"] = {"error": str(e), "ok": False}
        errors.append(f"against the target: {e}")
    mpe_d, mpe_t = cfg.get("max_position_embeddings"), target.get("max_position_embeddings")
    rows["max_position_embeddings"] = {"drafter": mpe_d, "target": mpe_t, "ok": mpe_d == mpe_t}
    if mpe_d is not None and mpe_t is not None and mpe_d < mpe_t:
        warnings.append(f"against the target: the drafter's max_position_embeddings {mpe_d} < the target's {mpe_t}: "
                        f"past position {mpe_d - 1} the engines serve it beyond its rotary table")
    elif mpe_d != mpe_t:
        warnings.append(f"against the target: max_position_embeddings {mpe_d!r} (drafter) != {mpe_t!r} (target)")
    try:
        d_rope = rope.normalise(cfg)
    except rope.RopeError as e:
        d_rope = str(e)
    try:
        t_rope = rope.normalise(target)
    except rope.RopeError as e:
        t_rope = str(e)
    rows["rope"] = {"drafter": rope.describe(*d_rope) if isinstance(d_rope, tuple) else d_rope,
                    "target": rope.describe(*t_rope) if isinstance(t_rope, tuple) else t_rope,
                    "ok": d_rope == t_rope}
    if d_rope != t_rope:
        warnings.append(f"against the target: RoPE {rows['rope']['drafter']} (drafter) != {rows['rope']['target']} "
                        f"(target): the drafter's attention sees positions differently from the target's")
    return rows


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
    if "against_target" in report:
        lines += ["", "against the target"]
        for k, v in report["against_target"].items():
            lines.append(f"  {k:<34} {v}")
    for eng, d in report["engines"].items():
        lines += ["", f"{eng}"]
        for k, v in d.items():
            if isinstance(v, list) and v and all(isinstance(x, int) for x in v):
                lines.append(f"  {k}: {v}")
            elif isinstance(v, list):
                lines.append(f"  {k}:" + ("" if v else " none"))
                lines += [f"    - {x}" for x in v]
            else:
                lines.append(f"  {k}: {v}")
    return _with_verdict(lines, report)
