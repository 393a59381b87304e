"""Which targets llama.cpp feeds an EAGLE-3 drafter's target layer id L (the target's layer count)
with the state eyas trains it on: the last hidden state before the final norm.

In the llama.cpp that eyas builds (``ggml-org/llama.cpp`` as vendored in ``llama-cpp-python``
0.3.36, the sources ``scripts/build_llama_server.sh`` builds from), ``common/speculative.cpp``
(``common_speculative_impl_draft_eagle3``) captures an id below L as the input of that target
layer (``llama_set_embeddings_layer_inp``), and reads id L through ``llama_get_embeddings_nextn``:
the buffer the target's graph fills only where it sets ``res->t_h_nextn``. Each architecture's
graph is one file under ``src/models/`` (``src/llama-model.cpp`` ``llama_model_mapping`` picks
the class; ``src/llama-arch.cpp`` names the architecture):

- :data:`PRE_NORM`: the graph sets ``t_h_nextn`` to the residual stream BEFORE ``output_norm``:
  what eyas captures for id L (eyas.target.layers.capture_aux).
- :data:`AFTER_NORM`: the graph sets it AFTER ``build_norm(..., model.output_norm, ...)``: HF's
  ``hidden_states[L]``, another state than eyas trains on.
- Every other architecture, ``llama`` (``src/models/llama.cpp``: SmolLM2, Llama) and ``qwen3``
  (``src/models/qwen3.cpp``) among them, never sets it: the drafter reads a buffer nothing
  wrote, with no error.

So id L is served as trained only on a :data:`PRE_NORM` target; :func:`id_l_problem` says why
for any other. The target is named by its HF class (``config.json`` ``architectures[0]``; the
converter's ``conversion/*.py`` ``ModelBase.register`` picks the GGUF architecture from it), its
llama.cpp architecture (a GGUF's ``general.architecture``) or its HF ``model_type``.
"""

from __future__ import annotations

_SRC = "src/models/"

PRE_NORM: dict[str, tuple[str, tuple[str, ...]]] = {
    # llama.cpp architecture: (its graph, the HF classes the converter maps to it)
    "gpt-oss": (_SRC + "openai-moe.cpp", ("GptOssForCausalLM", "gpt_oss")),   # conversion/gpt_oss.py
    "mimo2": (_SRC + "mimo2.cpp", ("MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM")),  # conversion/mimo.py
    "step35": (_SRC + "step35.cpp", ("Step3p5ForCausalLM", "Step3p7ForConditionalGeneration")),  # conversion/step3.py
}
"""Architectures whose main graph sets ``t_h_nextn`` before the final norm."""

AFTER_NORM: dict[str, tuple[str, tuple[str, ...]]] = {
    "qwen35": (_SRC + "qwen35.cpp", ("Qwen3_5ForCausalLM",)),
    "qwen35moe": (_SRC + "qwen35moe.cpp", ("Qwen3_5MoeForCausalLM",)),
    "qwen3next": (_SRC + "qwen3next.cpp", ("Qwen3NextForCausalLM", "qwen3_next")),
    "gemma4": (_SRC + "gemma4.cpp", ()),
    "deepseek2": (_SRC + "deepseek2.cpp", ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")),
    "deepseek32": (_SRC + "deepseek32.cpp", ()),
    "glm4moe": (_SRC + "glm4-moe.cpp", ("Glm4MoeForCausalLM",)),
    "glm-dsa": (_SRC + "glm-dsa.cpp", ()),
    "glm5-next": (_SRC + "glm5-next.cpp", ()),
    "cohere2moe": (_SRC + "cohere2moe.cpp", ()),
    "bailingmoe3": (_SRC + "bailingmoe3.cpp", ()),
    "hy_v3": (_SRC + "hy-v3.cpp", ()),
    "nemotron_h": (_SRC + "nemotron-h.cpp", ()),
}
"""Architectures whose main graph sets ``t_h_nextn`` after the final norm (HF ``hidden_states[L]``)."""

NEVER: dict[str, tuple[str, tuple[str, ...]]] = {
    "llama": (_SRC + "llama.cpp", ("LlamaForCausalLM", "MistralForCausalLM", "llama", "mistral")),
    "qwen3": (_SRC + "qwen3.cpp", ("Qwen3ForCausalLM", "qwen3")),
    "qwen3moe": (_SRC + "qwen3moe.cpp", ("Qwen3MoeForCausalLM", "qwen3_moe")),
    "qwen2": (_SRC + "qwen2.cpp", ("Qwen2ForCausalLM", "qwen2")),
    "phi3": (_SRC + "phi3.cpp", ("Phi3ForCausalLM", "phi3")),
    "gemma3": (_SRC + "gemma3.cpp", ("Gemma3ForCausalLM", "gemma3_text")),
    "smollm3": (_SRC + "smollm3.cpp", ("SmolLM3ForCausalLM", "smollm3")),
    "granite": (_SRC + "granite.cpp", ("GraniteForCausalLM", "granite")),
}
"""Common target architectures whose graph never sets ``t_h_nextn`` (named in messages; every
architecture outside :data:`PRE_NORM` and :data:`AFTER_NORM` is treated the same)."""


def llamacpp_arch(target: str | None) -> str | None:
    """The llama.cpp architecture of ``target`` (an HF class, an HF ``model_type`` or a llama.cpp
    architecture name), ``None`` when it is not in this module's tables or not given."""
    if not target:
        return None
    for table in (PRE_NORM, AFTER_NORM, NEVER):
        for arch, (_, names) in table.items():
            if target == arch or target in names:
                return arch
    return None


def id_l_problem(ids: list[int], num_target_layers: int | None, target: str | None) -> str | None:
    """Why llama.cpp would not feed a drafter with ``eagle3.target_layers`` ``ids`` the pre-norm
    state at id L on ``target`` (see the module docstring), or ``None`` (no id L, L unknown, or a
    :data:`PRE_NORM` target).

    Args:
        ids: llama.cpp target layer ids (= eyas' HF ``hidden_states`` indices, L the pre-norm state).
        num_target_layers: the target's decoder-layer count L.
        target: the target's HF class, HF ``model_type`` or llama.cpp architecture; ``None``
            unknown (refused: only :data:`PRE_NORM` architectures serve id L as trained).
    """
    L = num_target_layers
    if L is None or L not in ids:
        return None
    arch = llamacpp_arch(target)
    if arch in PRE_NORM:
        return None
    fill = ", ".join(f"{a}: {f}" for a, (f, _) in PRE_NORM.items())
    why = ("llama.cpp reads id L through llama_get_embeddings_nextn (common/speculative.cpp), which only the graphs "
           f"that set t_h_nextn before the final norm fill ({fill})")
    if arch in AFTER_NORM:
        what = (f"the target's architecture {arch} ({AFTER_NORM[arch][0]}) fills it AFTER the final norm (HF "
                f"hidden_states[{L}]), not with the pre-norm state eyas trained on")
    elif target is None:
        what = "the target's architecture is unknown here (give the target), and most llama.cpp graphs never fill it"
    else:
        src = NEVER[arch][0] if arch in NEVER else "its graph under src/models/"
        what = (f"the target's architecture {arch or target} ({src}) never sets t_h_nextn: the drafter would read a "
                f"buffer nothing wrote, with no error")
    return (f"target layer id {L} (= L, the state before the final norm in eyas): {what}; {why}. Train with aux "
            f"layers below {L} (e.g. {L - 1}) to serve it with llama.cpp")
