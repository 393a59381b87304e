"""Aux hidden-state layer ids: the one place that knows the three conventions.

eyas stores and speaks **HF indices**: ``k`` means ``model(..., output_hidden_states=True)
.hidden_states[k]``, the residual stream entering decoder layer ``k`` (= the output of layer
``k-1``; index 0 is the embedding output, index L the final, normed, state).

- EAGLE-3 default: ``[2, L//2, L-3]`` (SGLang ``llama.py`` and vLLM ``llama.py`` capture the
  residual stream at the start of these layers), concatenated in ascending order.
- vLLM reads a top-level ``eagle_aux_hidden_state_layer_ids`` in the drafter config as HF indices.
- SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` as OUTPUT-of-layer ids and
  captures at ``id + 1`` (``set_eagle3_layers_to_capture``): SGLang id = HF index - 1.

With the default layers the exported config carries no ids (every engine assumes the default);
with custom layers it carries both forms: the nested ``eagle_config`` (``sgl-project/sglang:
python/sglang/srt/models/llama.py``) and the top-level key (``vllm-project/vllm:
vllm/v1/worker/gpu_model_runner.py`` ``_get_eagle3_aux_layers_from_config``; speculators
``src/speculators/models/eagle3/config.py``).
"""

from __future__ import annotations


class LayerIdError(ValueError):
    """Aux layer ids are invalid or disagree between two sources."""


def default_hf_indices(num_layers: int) -> list[int]:
    """The EAGLE-3 default for a target with ``num_layers`` decoder layers: [2, L//2, L-3],
    validated like explicit ids (:func:`validate`).

    On a target of fewer than 6 layers the formula gives ids out of range (L = 2: [2, 1, -1]),
    repeated or not ascending (L = 4: [2, 2, 1]; L = 5: [2, 2, 2]). The engines capture by
    membership of a layer in the id set (SGLang ``set_eagle3_layers_to_capture``, vLLM
    ``EagleModelMixin``), so a repeated id yields fewer states than ``fc`` is wide
    (``NVIDIA/Model-Optimizer``: ``modelopt/torch/speculative/plugins/transformers.py``).

    Raises:
        LayerIdError: naming the layer count, the resolved ids and ``extract.aux_layers`` (the key
            to set explicit ids with).
    """
    ids = [2, num_layers // 2, num_layers - 3]
    try:
        return validate(ids, num_layers)
    except LayerIdError as e:
        raise LayerIdError(f"the default aux layers [2, L//2, L-3] of a target with {num_layers} decoder layers "
                           f"are {ids}: {e}. Set extract.aux_layers to unique ascending HF hidden_states "
                           f"indices in [1, {num_layers}]") from None


def validate(ids: list[int], num_layers: int) -> list[int]:
    """Check HF indices: ints in [1, L], unique, ascending. Returns them as a list.

    Raises:
        LayerIdError: naming the offending id.
    """
    ids = list(ids)
    if not ids:
        raise LayerIdError("aux layer ids are empty")
    for k in ids:
        if not isinstance(k, int) or not 1 <= k <= num_layers:
            raise LayerIdError(f"aux layer id {k!r} is not an HF hidden_states index in [1, {num_layers}]")
    if ids != sorted(set(ids)):
        raise LayerIdError(f"aux layer ids {ids} must be unique and ascending (concatenation order)")
    return ids


def normalise(ids: list[int] | None, num_layers: int) -> list[int] | None:
    """``None`` for the default layers (given as ``None`` or spelled out), else validated ids.

    Raises:
        LayerIdError: invalid ids, or ``None`` where the default is invalid for ``num_layers``
            (:func:`default_hf_indices`).
    """
    if ids is None:
        default_hf_indices(num_layers)
        return None
    ids = validate(ids, num_layers)
    try:
        return None if ids == default_hf_indices(num_layers) else ids
    except LayerIdError:  # no valid default on this target: the ids are custom
        return ids


def resolve(ids: list[int] | None, num_layers: int) -> list[int]:
    """The HF indices actually captured: the default when ``ids`` is ``None``.

    Raises:
        LayerIdError: invalid ids, or ``None`` on a target whose default is invalid
            (:func:`default_hf_indices`).
    """
    return default_hf_indices(num_layers) if ids is None else validate(ids, num_layers)


def to_sglang(hf_ids: list[int]) -> list[int]:
    """HF indices -> SGLang ``eagle_aux_hidden_state_layer_ids`` (output-of-layer ids)."""
    return [k - 1 for k in hf_ids]


def from_sglang(sglang_ids: list[int]) -> list[int]:
    """SGLang output-of-layer ids -> HF indices."""
    return [k + 1 for k in sglang_ids]


def config_fields(ids: list[int] | None, num_layers: int) -> dict:
    """Keys to write into a drafter ``config.json``: none for the default layers; otherwise both
    the SGLang form (``eagle_config``) and the vLLM form (top level)."""
    ids = normalise(ids, num_layers)
    if ids is None:
        return {}
    return {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": to_sglang(ids), "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": list(ids),
    }


def from_config(cfg: dict, num_layers: int) -> list[int] | None:
    """Read the aux layers a drafter config declares, as HF indices (``None`` = default).

    Accepts the vLLM/speculators top-level form, the SGLang ``eagle_config`` form, or both.

    Raises:
        LayerIdError: the two forms disagree, or an id is out of range.
    """
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    sg = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top is not None and sg is not None and list(top) != from_sglang(sg):
        raise LayerIdError(
            f"config disagrees with itself: top-level (vLLM, HF indices) {list(top)} vs "
            f"eagle_config (SGLang, output-of-layer ids) {list(sg)} = HF {from_sglang(sg)}")
    ids = list(top) if top is not None else (from_sglang(sg) if sg is not None else None)
    return normalise(ids, num_layers)


def describe(ids: list[int] | None, num_layers: int) -> dict:
    """Human-readable meaning of the layers per convention (for ``eyas inspect``)."""
    hf = resolve(ids, num_layers)
    default = normalise(ids, num_layers) is None
    return {
        "hf_hidden_states_indices": hf,
        "outputs_of_decoder_layers": to_sglang(hf),
        "sglang_eagle_config_ids": to_sglang(hf),
        "vllm_top_level_ids": hf,
        "is_default": default,
        # sgl-project/sglang PR #25454 applies the +1 only when the first id is 1:
        # custom ids whose SGLang form starts elsewhere are read differently across SGLang versions
        "sglang_version_ambiguous": (not default) and to_sglang(hf)[0] != 1,
    }
