"""Every config key SGLang, vLLM or llama.cpp reads for an EAGLE-3 (Llama) drafter, where each reads
it, and what eyas does with it: the one table every load path checks a checkpoint through.

Load paths that go through :func:`refusals`: :func:`eyas.export.eagle.config_from_hf` (eyas / EAGLE
/ SpecForge layout and, via :func:`eyas.export.speculators.config_to_eagle`, the speculators
layout), hence ``load_drafter`` (train-finetune's warm start, the remap source, eval) and
``eyas inspect`` (which reports every refusal, with or without the target's layer count). Each row
also gives the JSON type of the key's value, which :func:`type_problems` checks when
:func:`eyas.export.engine_keys.read_config` reads a drafter's ``config.json`` (every load path, the GGUF
check included).

``eyas`` column: ``honours`` (read and implemented), ``writes`` (eyas sets it; its value is
fixed), ``refuses`` (a value other than ``default`` changes the math in an engine and eyas does
not implement it: loading stops with a message naming the key and the engines that honour it),
``ignores`` (no effect on the drafter's function). Sources are files of the engines' repositories
(``sgl-project/sglang`` under ``python/sglang/srt/``, ``vllm-project/vllm`` under ``vllm/``,
``vllm-project/speculators`` 0.9.0 under ``src/speculators/``), as read for this table (SGLang
``models/llama_eagle3.py`` at 03d5a77, vLLM ``model_executor/models/llama_eagle3.py`` at 00bd149
and later versions where a row says so). llama.cpp (``ggml-org/llama.cpp`` as vendored in
``llama-cpp-python`` 0.3.36, the sources ``scripts/build_llama_server.sh`` builds from) reads the
config only through its HF -> GGUF converter (``conversion/llama.py`` ``LlamaModel``,
``conversion/base.py`` ``TextModel``), which writes GGUF keys that ``src/models/eagle3.cpp`` and
``src/llama-model.cpp`` load; its column names both ends (eyas/export/gguf.py reads the result).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eyas.io import read_json
from eyas.target import rope

# the JSON types a config value may have, as the errors name them (a JSON true is not an integer,
# though Python's bool is an int)
POS_INT = "an integer > 0"
POS_NUMBER = "a number > 0"
NUMBER = "a number"
BOOL = "true or false"
STRING = "a string"
OBJECT = "a JSON object"
INT_LIST = "a list of integers"
STR_LIST = "a list of strings"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_IS = {
    POS_INT: lambda v: _is_int(v) and v > 0,
    POS_NUMBER: lambda v: _is_number(v) and v > 0,
    NUMBER: _is_number,
    BOOL: lambda v: isinstance(v, bool),
    STRING: lambda v: isinstance(v, str),
    OBJECT: lambda v: isinstance(v, dict),
    INT_LIST: lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
    STR_LIST: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
}


def has_type(value, kind: str) -> bool:
    """Whether ``value`` (parsed JSON) is of ``kind`` (one of the constants above)."""
    return _IS[kind](value)


@dataclass(frozen=True)
class EngineKey:
    """One row: ``key`` (dotted for nested dicts), who reads it, what eyas does, the default
    value that eyas' math equals (for ``refuses`` rows), why, where llama.cpp reads it (its
    converter and the GGUF key it becomes; ``not read ...`` when it does not), the type its value
    must have (``kind``, one of :data:`_IS`'s keys) and whether ``null`` is refused (``required``:
    a drafter cannot be built without the key; for every other key ``null`` means absent, as
    transformers reads a config)."""

    key: str
    sglang: str
    vllm: str
    eyas: str
    default: object = None
    note: str = ""
    llamacpp: str = "not read"
    kind: str = ""
    required: bool = False


_SGL_EAGLE3 = "models/llama_eagle3.py"
_SGL_LLAMA = "models/llama.py (LlamaAttention/LlamaMLP)"
_VLLM_EAGLE3 = "model_executor/models/llama_eagle3.py"
_VLLM_ALGOS = "transformers_utils/configs/speculators/algos.py (update_eagle3)"
_SPEC = "speculators 0.9.0 models/eagle3/core.py"
_LC_CONV = "conversion/llama.py (LlamaModel)"
_LC_BASE = "conversion/base.py (TextModel.set_gguf_parameters)"
_LC_E3 = "src/models/eagle3.cpp"

ENGINE_KEYS: tuple[EngineKey, ...] = (
    EngineKey("architectures", f"model registry: {_SGL_EAGLE3} EntryClass LlamaForCausalLMEagle3",
              f"model registry; {_VLLM_ALGOS} sets Eagle3LlamaForCausalLM for Eagle3Speculator",
              "writes", None, "LlamaForCausalLMEagle3 (eagle layout) / Eagle3Speculator (speculators layout)",
              llamacpp=f"{_LC_CONV}: every listed name picks LlamaModel; EAGLE-3 is detected by draft_vocab_size "
                       f"with num_hidden_layers 1 -> general.architecture eagle3", kind=STR_LIST),
    EngineKey("model_type", f"{_SGL_EAGLE3} (llama4_text reads intermediate_size_mlp)",
              f"{_VLLM_ALGOS} (llama -> Eagle3LlamaForCausalLM, qwen3 -> Eagle3Qwen3ForCausalLM)",
              "refuses", "llama", "eyas' layer is a Llama layer (Qwen3 adds q_norm/k_norm)",
              llamacpp="not read (the converter class is picked by architectures[0]: conversion/base.py "
                       "get_model_architecture)", kind=STRING),
    EngineKey("hidden_size", _SGL_EAGLE3, _VLLM_EAGLE3, "honours",
              llamacpp=f"{_LC_BASE} -> eagle3.embedding_length ({_LC_E3} n_embd)", kind=POS_INT, required=True),
    EngineKey("intermediate_size", _SGL_EAGLE3, _VLLM_EAGLE3, "honours",
              llamacpp=f"{_LC_BASE} -> eagle3.feed_forward_length ({_LC_E3} ffn_gate/up/down)",
              kind=POS_INT, required=True),
    EngineKey("num_attention_heads", _SGL_LLAMA, "model_executor/models/llama.py (LlamaAttention)", "honours",
              llamacpp=f"{_LC_BASE} -> eagle3.attention.head_count; also the q_proj row permutation "
                       "(conversion/llama.py LlamaModel.permute)", kind=POS_INT, required=True),
    EngineKey("num_key_value_heads", _SGL_LLAMA, _VLLM_EAGLE3, "honours",
              llamacpp=f"{_LC_BASE} -> eagle3.attention.head_count_kv; also the k_proj row permutation", kind=POS_INT),
    EngineKey("head_dim", _SGL_LLAMA, "model_executor/models/llama.py (LlamaAttention)", "honours",
              llamacpp=f"{_LC_BASE} -> eagle3.attention.key_length/value_length; {_LC_CONV} -> "
                       f"eagle3.rope.dimension_count (absent: hidden_size / num_attention_heads)", kind=POS_INT),
    EngineKey("rms_norm_eps", _SGL_EAGLE3, _VLLM_EAGLE3, "honours",
              llamacpp=f"{_LC_BASE} -> eagle3.attention.layer_norm_rms_epsilon ({_LC_E3} load_arch_hparams)",
              kind=POS_NUMBER),
    EngineKey("hidden_act", _SGL_EAGLE3 + " (LlamaMLP)", _VLLM_EAGLE3 + " (LlamaMLP)", "refuses", "silu",
              "eyas' MLP is SwiGLU", llamacpp=f"not read ({_LC_E3}: SwiGLU fixed, LLM_FFN_SILU)", kind=STRING),
    EngineKey("vocab_size", _SGL_EAGLE3 + " (embed_tokens)", _VLLM_EAGLE3 + " (embed_tokens, logits scatter)",
              "honours", None, "the TARGET vocab",
              llamacpp=f"{_LC_CONV} -> eagle3.vocab_size, and the number of tokenizer entries written from "
                       f"--target-model-dir's tokenizer (conversion/base.py get_vocab_base pads to it): the width "
                       f"{_LC_E3} scatters draft logits into; d2t ids are checked against the target config's",
              kind=POS_INT, required=True),
    EngineKey("draft_vocab_size", _SGL_EAGLE3 + " (absent: vocab_size and the target's lm_head)",
              _VLLM_EAGLE3 + " (absent: vocab_size)", "honours",
              llamacpp=f"{_LC_CONV}: its presence (with num_hidden_layers 1) marks the drafter EAGLE-3; d2t is "
                       f"written as absolute target ids (d2t + arange, int64), t2d dropped; {_LC_E3} takes the "
                       f"draft vocab from d2t's length", kind=POS_INT),
    EngineKey("target_hidden_size", _SGL_EAGLE3 + " (fc input width / 3)", _VLLM_EAGLE3 + " (fc input width)",
              "honours", llamacpp=f"{_LC_CONV} (absent: the target config's hidden_size) -> eagle3.target_hidden_size "
                                  f"({_LC_E3}: fc input width = 3 x it)", kind=POS_INT),
    EngineKey("num_hidden_layers",
              _SGL_EAGLE3 + " (midlayer + additional_layers.{i-1} BasicDecoderLayer for i >= 1)",
              _VLLM_EAGLE3 + " (layers.{i}; i >= 1 take H-wide input, no embedding)",
              "refuses", 1, "eyas trains and serves one decoder layer",
              llamacpp=f"{_LC_CONV}: 1 (with draft_vocab_size) is the EAGLE-3 detection, else converted as a plain "
                       f"Llama; -> eagle3.block_count, {_LC_E3} asserts 1", kind=POS_INT),
    EngineKey("tie_word_embeddings", _SGL_EAGLE3 + " (true: lm_head = embed_tokens)", "not read by the EAGLE-3 "
              "class (own lm_head)", "refuses", False, "eyas' lm_head is its own [draft_vocab, H]",
              llamacpp=f"not read ({_LC_CONV}: an lm_head.weight becomes output.weight; without one {_LC_E3} "
                       f"uses the target's output)", kind=BOOL),
    EngineKey("rope_theta", _SGL_LLAMA + " (get_rope)", "model_executor/models/llama.py (get_rope)", "honours",
              llamacpp=f"{_LC_BASE} -> eagle3.rope.freq_base", kind=POS_NUMBER),
    EngineKey("rope_scaling", _SGL_LLAMA + " (get_rope)", "model_executor/models/llama.py (get_rope; "
              "newer versions via rope_parameters)", "honours", None,
              f"types {list(rope.SUPPORTED_TYPES)} honoured (eyas/target/rope.py); any other type refused",
              llamacpp=f"{_LC_BASE}: linear and yarn -> eagle3.rope.scaling.*; llama3 -> the rope_freqs.weight "
                       "tensor (conversion/llama.py LlamaModel.generate_extra_tensors)", kind=OBJECT),
    EngineKey("rope_parameters", "transformers v5 form of rope_theta + rope_scaling",
              "transformers v5 form of rope_theta + rope_scaling", "honours", None, "read as rope_scaling",
              llamacpp=f"{_LC_BASE} (read before rope_scaling)", kind=OBJECT),
    EngineKey("max_position_embeddings", _SGL_LLAMA + " (rotary table)", _VLLM_EAGLE3 + " (LlamaAttention)",
              "honours", None, "carried from the target; eval warns and records decoding past it; remap "
              "takes the target's", llamacpp=f"{_LC_BASE} -> eagle3.context_length", kind=POS_INT),
    EngineKey("attention_bias", _SGL_LLAMA, _VLLM_EAGLE3 + " (qkv/o bias)", "refuses", False,
              llamacpp=f"not read (bias tensors in the file are converted; {_LC_E3} creates none, so the load "
                       f"fails on the tensor count)", kind=BOOL),
    EngineKey("qkv_bias", "not read", _VLLM_EAGLE3, "refuses", False, kind=BOOL),
    EngineKey("mlp_bias", "not read", _VLLM_EAGLE3, "refuses", False, kind=BOOL),
    EngineKey("bias", _SGL_EAGLE3 + " (fc bias)", _VLLM_EAGLE3 + " (attention bias)", "refuses", False, kind=BOOL),
    EngineKey("logit_scale", "not read", _VLLM_EAGLE3 + " (LogitsProcessor scale)", "refuses", 1.0, kind=NUMBER),
    EngineKey("is_causal", "not read", _VLLM_EAGLE3 + " (false: encoder-only attention)", "refuses", True,
              llamacpp=f"{_LC_BASE} (false -> eagle3.attention.causal, read by src/llama-model.cpp load_hparams)",
              kind=BOOL),
    EngineKey("norm_before_residual", "not read (residual is always the un-normed hidden state)",
              _VLLM_EAGLE3 + f" (residual = hidden_norm(h)); {_VLLM_ALGOS} defaults it to TRUE when a "
              f"speculators config lacks it", "refuses", False, f"also {_SPEC}",
              llamacpp=f"{_LC_CONV} (absent: false) -> eagle3.norm_before_residual ({_LC_E3}: residual = "
                       f"hidden_norm(h))", kind=BOOL),
    EngineKey("norm_before_fc", "not read",
              _VLLM_EAGLE3 + " in newer versions (input_norm.weight: RMSNorm over the concatenated aux "
              "states; not in the version at 00bd149)", "refuses", False, f"also {_SPEC} (input_norm)",
              llamacpp=f"{_LC_CONV} (absent: false) -> eagle3.norm_before_fc ({_LC_E3}: RMSNorm input_norm.weight "
                       f"over the concatenated aux states)", kind=BOOL),
    EngineKey("fc_norm", "not read",
              _VLLM_EAGLE3 + " in newer versions (one RMSNorm per aux state, fc_norm.{i}.weight)",
              "refuses", False, f"also {_SPEC}", kind=BOOL),
    EngineKey("norm_output", "not read by models/llama_eagle3.py (read by some newer SGLang EAGLE-3 models)",
              f"passed through by {_VLLM_ALGOS} in newer versions",
              "refuses", False, f"EAGLE 3.1: the post-norm hidden state is fed back ({_SPEC} forward)",
              llamacpp=f"not read ({_LC_E3} feeds back the pre-norm state)", kind=BOOL),
    EngineKey("eagle_config.eagle_aux_hidden_state_layer_ids",
              "model_executor/model_runner.py via the target's set_eagle3_layers_to_capture (models/llama.py): "
              "output-of-layer ids, captured at id + 1 (eyas/target/layers.py)",
              "not read (reads the top-level key)", "honours",
              llamacpp=f"not read ({_LC_CONV} reads the top-level key only: with only this form the GGUF gets the "
                       f"default [2, L//2, L-3])", kind=INT_LIST),
    EngineKey("eagle_aux_hidden_state_layer_ids", "not read (reads eagle_config)",
              f"the target's aux capture (model_executor/models/llama.py, HF hidden_states indices) set by the "
              f"v1 model runner; {_VLLM_ALGOS} copies it", "honours",
              llamacpp=f"{_LC_CONV} -> eagle3.target_layers verbatim (absent or empty: [2, L//2, L-3] of "
                       f"--target-model-dir's num_hidden_layers); common/speculative.cpp: id < L captures the input "
                       f"of target layer id (= HF hidden_states[id]), id == L the target graph's t_h_nextn "
                       f"buffer (the pre-norm state only on gpt-oss, mimo2, step35; never filled on Llama, "
                       f"Qwen3: eyas/export/llamacpp_nextn.py), id > L aborts; exactly 3", kind=INT_LIST),
    EngineKey("eagle_config.use_aux_hidden_state", "not read",
              _VLLM_EAGLE3 + " (false: no fc, the target's last hidden state is the input)", "refuses", True,
              kind=BOOL),
    EngineKey("speculators_config.verifier.name_or_path", "not read",
              "not read for weights (speculators: from_pretrained resolves aux ids and "
              "load_verifier_weights reads AutoConfig of it)", "writes", None,
              "the target's hub id or path (eyas/export/verifier.py)",
              llamacpp="not read (the converter takes the target from --target-model-dir)", kind=STRING),
    EngineKey("torch_dtype", "model config (dtype when --dtype auto)", "model config (dtype when auto)",
              "ignores", None, "recorded; the engines cast to the serving dtype",
              llamacpp="not read (conversion/base.py: the converter's --outtype sets the tensor types)", kind=STRING),
    EngineKey("layer_types", "not read (models/llama.py LlamaAttention: RadixAttention without a window)",
              "model_executor/models/llama.py (LlamaAttention: a 'sliding_attention' entry gives the layer "
              "config.sliding_window; an EAGLE-3 draft indexes it from 0 through target_layer_count)", "refuses",
              default="full_attention",
              note=f"every entry must be full_attention; also {_SPEC} (sliding_window_indices: the layer's "
                   f"attention mask gets the window); eyas' attention has no window", kind=STR_LIST),
    EngineKey("sliding_window", "not read (models/llama.py)",
              "model_executor/models/llama.py (LlamaAttention, for the layers layer_types marks sliding)",
              "refuses", default=None,
              note=f"also {_SPEC}; refused whatever its size (even one past max_position_embeddings: an engine "
                   f"may serve longer contexts); allowed only beside use_sliding_window false and no sliding "
                   f"layer_types (transformers' Qwen2 config then drops it)", kind=POS_INT),
    EngineKey("use_sliding_window", "not read (models/llama.py)", "not read (model_executor/models/llama.py)",
              "refuses", default=False,
              note="transformers' Qwen2/Qwen3 configs (configuration_qwen2.py): true turns sliding_window on, "
                   "making layer_types sliding", kind=BOOL),
)

BY_KEY = {k.key: k for k in ENGINE_KEYS}

# keys no engine reads that eyas reads from a drafter config: its own record, and the speculators
# layout's nested layer config (whose keys are checked as the table's rows)
OWN_KEYS = {"eyas.num_target_layers": POS_INT, "speculators_model_type": STRING, "transformer_layer_config": OBJECT}


def _lookup(cfg: dict, dotted: str):
    cur = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None, False
        cur = cur[part]
    return cur, True


def _json(v) -> str:
    """A config value as config.json spells it (``true``, ``null``, ``"silu"``, ``2``)."""
    import json

    try:
        return json.dumps(v)
    except TypeError:
        return repr(v)


def _json_type(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number"}.get(type(v), type(v).__name__)


def type_problems(cfg: dict) -> list[str]:
    """Every value of ``cfg`` (a drafter ``config.json`` dict, either layout) whose JSON type is not
    the one its key's row gives (``kind``; :data:`OWN_KEYS` for eyas' own keys), at the top level
    and, for the speculators layout, inside ``transformer_layer_config``; a dotted key's containers
    must be objects. ``null`` passes (absent) except for ``required`` keys.

    Returns:
        One message per wrong value, naming the key (dotted), the value as config.json spells it,
        its type and the type expected; empty when every value has its type.
    """
    rules = [(k.key, k.kind, k.required) for k in ENGINE_KEYS] + [(k, kind, False) for k, kind in OWN_KEYS.items()]
    scopes = [("", cfg)]
    if isinstance(cfg.get("transformer_layer_config"), dict):
        scopes.append(("transformer_layer_config.", cfg["transformer_layer_config"]))
    out: dict[str, str] = {}  # dotted key -> message (a container shared by two rows is named once)
    for prefix, scope in scopes:
        for dotted, kind, required in rules:
            parts = dotted.split(".")
            cur = scope
            for depth, part in enumerate(parts):
                if not isinstance(cur, dict) or part not in cur:
                    break
                cur = cur[part]
                name = prefix + ".".join(parts[:depth + 1])
                last = depth == len(parts) - 1
                want = kind if last else OBJECT
                if cur is None and not (last and required):
                    break
                if not has_type(cur, want):
                    found = _json(cur) + ("" if cur is None else f" ({_json_type(cur)})")
                    out.setdefault(name, f"{name} is {found}, expected {want}")
                    break
    return list(out.values())


def honoured_by(key: str) -> str:
    """'SGLang: <file>; vLLM: <file>; llama.cpp: <file>' for the engines that read ``key`` (for
    refusal messages)."""
    k = BY_KEY[key]
    return "; ".join(f"{eng}: {src}" for eng, src in (("SGLang", k.sglang), ("vLLM", k.vllm), ("llama.cpp", k.llamacpp))
                     if not src.startswith("not read"))


def departs(k: EngineKey, value, cfg: dict) -> bool:
    """Whether ``value`` (not None) of the ``refuses`` row ``k`` makes an engine compute something
    other than eyas' drafter, in the flat config ``cfg`` (for the keys read together: a
    ``sliding_window`` is inert only beside ``use_sliding_window: false`` and no sliding layer)."""
    if k.key == "num_hidden_layers":
        return value != 1
    if k.key == "model_type":
        return value != "llama"
    if k.key == "logit_scale":
        return float(value) != 1.0
    if k.key == "layer_types":
        return any(t != "full_attention" for t in (value if isinstance(value, list) else [value]))
    if k.key == "sliding_window":
        return not (cfg.get("use_sliding_window") is False
                    and all(t == "full_attention" for t in cfg.get("layer_types") or []))
    return value != k.default


def refusals(cfg: dict) -> list[str]:
    """Every key of ``cfg`` (a flat EAGLE-layout config dict, as :func:`eyas.export.eagle.config_from_hf`
    reads it) whose value changes an engine's math away from what eyas implements.

    Returns:
        One message per refused key, naming the key, its value, eyas' value and the engines that
        honour it; empty when eyas computes what the engines would.
    """
    out = []
    for k in ENGINE_KEYS:
        if k.eyas != "refuses":
            continue
        value, present = _lookup(cfg, k.key)
        if present and value is not None and departs(k, value, cfg):
            by = honoured_by(k.key) or "no engine's EAGLE-3 model directly"
            out.append(f"{k.key}: {_json(value)} (eyas implements {_json(k.default)}; honoured by {by}"
                       + (f"; {k.note}" if k.note else "") + ")")
    try:
        rope.normalise(cfg, source="config")
    except rope.RopeError as e:
        out.append(f"rope_scaling: {e} (honoured by {honoured_by('rope_scaling')})")
    return out


def table_markdown() -> str:
    """The table as Markdown (key | type | SGLang | vLLM | llama.cpp | eyas | note)."""
    rows = ["| key | type | SGLang reads it in | vLLM reads it in | llama.cpp reads it in | eyas | note |",
            "|---|---|---|---|---|---|---|"]
    for k in ENGINE_KEYS:
        what = k.eyas + (f" (default {k.default!r})" if k.eyas == "refuses" else "")
        kind = k.kind + (", not null" if k.required else "")
        rows.append(f"| `{k.key}` | {kind} | {k.sglang} | {k.vllm} | {k.llamacpp} | {what} | {k.note} |")
    return "\n".join(rows) + "\n"


class ExportError(ValueError):
    """A drafter checkpoint does not have the keys, shapes or mapping the engines need."""


def read_config(path: str | Path) -> dict:
    """A drafter's ``config.json`` (either layout), every value of the type its key's row in
    eyas/export/engine_keys.py gives (:func:`eyas.export.engine_keys.type_problems`): the one
    reader every load path (``load_drafter``, ``eyas inspect``, the GGUF check) reads it with.

    Raises:
        FileNotFoundError / ValueError: no such file, not JSON, or not a JSON object (naming it).
        ExportError: naming the file and, for every wrong value, the key, the value and the type
            expected.
    """
    cfg = read_json(path)
    bad = type_problems(cfg)
    if bad:
        raise ExportError(f"{path}: " + "; ".join(bad))
    return cfg
