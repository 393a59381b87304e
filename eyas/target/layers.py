"""Aux hidden-state layer ids: the one place that knows the three conventions.

eyas stores and speaks **HF indices**: ``k`` means ``model(..., output_hidden_states=True)
.hidden_states[k]``, the residual stream entering decoder layer ``k`` (= the output of layer
``k-1``; index 0 is the embedding output), for ``1 <= k < L``.

Id ``L`` (the layer count; some published drafters use it, e.g. GPT-OSS ``[24, 30, 36]`` of 36)
is where HF and the engines part: HF ``hidden_states[L]`` is the state AFTER the final norm, while
vLLM (``vllm-project/vllm`` PR #46788) and SGLang after ``sgl-project/sglang`` PR #32334 serve the
residual stream BEFORE it (the last decoder layer's output; before that PR SGLang's layer loop
captures "before layer i" for i < L only and never captures id L). llama.cpp
(``ggml-org/llama.cpp`` ``common/speculative.cpp``, draft-eagle3) reads id L from the target
graph's ``t_h_nextn`` buffer (``llama_get_embeddings_nextn``), which most graphs never fill (Llama
and Qwen3 among them) and some fill after the final norm (eyas.export.llamacpp_nextn; an id above
L aborts). eyas captures id L pre-norm
(:func:`capture_aux`), records it in the feature manifest (``eyas.features.AUX_AT_L``) and says
per engine what the id means (:func:`describe`).

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

import contextlib

# the final norm of a decoder, by the attribute names transformers models give it
# (Llama/Qwen/Mistral ``norm``, Phi ``final_layernorm``, GPT-NeoX ``final_layer_norm``, GPT-2 ``ln_f``)
FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")


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


def final_norm(model):
    """The final norm module of a transformers causal LM (``model.get_decoder()``'s
    :data:`FINAL_NORM_NAMES` attribute).

    Raises:
        LayerIdError: no such module, naming the model class (id L cannot be captured pre-norm).
    """
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model
    for name in FINAL_NORM_NAMES:
        m = getattr(dec, name, None)
        if hasattr(m, "register_forward_pre_hook"):
            return m
    raise LayerIdError(f"{type(model).__name__}: no final norm ({' / '.join(FINAL_NORM_NAMES)}) found: aux layer "
                       f"id {model.config.num_hidden_layers} (L, the pre-norm residual) cannot be captured; "
                       f"use ids below L")


@contextlib.contextmanager
def capture_aux(model, ids: list[int] | None):
    """Capture the aux hidden states at HF indices ``ids`` from the next forward of ``model``.

    Usage: ``with capture_aux(model, ids) as aux_of: out = model(..., output_hidden_states=True)``
    then ``aux_of(out.hidden_states)`` -> [B, T, len(ids)*H], ids concatenated in the given
    (ascending) order, in the model's dtype. An id below L is ``hidden_states[id]``; id L is the
    residual stream before the final norm (the input of :func:`final_norm`, taken by a forward
    pre-hook, removed on exit), as the engines serve it (module docstring), not HF's post-norm
    ``hidden_states[L]``. ``ids`` empty or None: ``aux_of`` is not to be called.

    Raises (from ``aux_of``):
        LayerIdError: the forward returned other than L+1 hidden states, or (id L) the final norm
            ran other than once.
    """
    import torch

    ids, L = list(ids or []), model.config.num_hidden_layers
    seen: list = []
    handle = final_norm(model).register_forward_pre_hook(lambda _m, args: seen.append(args[0])) \
        if L in ids else None

    def aux_of(hidden_states) -> "torch.Tensor":
        if len(hidden_states) != L + 1:
            raise LayerIdError(f"target returned {len(hidden_states)} hidden states, expected L+1 = {L + 1}")
        if handle is not None and len(seen) != 1:
            raise LayerIdError(f"{type(model).__name__}: the final norm ran {len(seen)} times in one forward; "
                               f"the pre-norm state at aux layer id {L} is ambiguous")
        return torch.cat([seen[0] if k == L else hidden_states[k] for k in ids], dim=-1)

    try:
        yield aux_of
    finally:
        if handle is not None:
            handle.remove()


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
    """Human-readable meaning of the layers per convention (for ``eyas inspect``); with id L,
    ``id_L`` says per engine what it captures there (module docstring)."""
    hf = resolve(ids, num_layers)
    default = normalise(ids, num_layers) is None
    out = {
        "hf_hidden_states_indices": hf,
        "outputs_of_decoder_layers": to_sglang(hf),
        "sglang_eagle_config_ids": to_sglang(hf),
        "vllm_top_level_ids": hf,
        "is_default": default,
        # sgl-project/sglang PR #25454 applies the +1 only when the first id is 1:
        # custom ids whose SGLang form starts elsewhere are read differently across SGLang versions
        "sglang_version_ambiguous": (not default) and to_sglang(hf)[0] != 1,
    }
    if num_layers in hf:
        out["id_L"] = {
            "id": num_layers,
            "eyas": "the residual before the final norm (the last decoder layer's output), not HF's "
                    "post-norm hidden_states[L]",
            "vllm": "the residual before the final norm (vllm-project/vllm PR #46788)",
            "sglang": ("the residual before the final norm with sgl-project/sglang PR #32334; without it "
                       "never captured (its layer loop captures before layer i < L): fewer states than fc expects"),
            "llama.cpp": "the target graph's t_h_nextn buffer (llama_get_embeddings_nextn): the residual "
                         "before the final norm only on a few architectures (gpt-oss, mimo2, step35), after it "
                         "on others, never filled on most, Llama and Qwen3 among them: eyas.export.llamacpp_nextn "
                         "refuses the others; an id above L aborts",
        }
    return out
