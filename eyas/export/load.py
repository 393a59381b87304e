"""Load a drafter checkpoint in either layout: eagle (eyas, EAGLE, SpecForge) or speculators."""

from __future__ import annotations

from pathlib import Path

from eyas.drafter.model import Eagle3Drafter
from eyas.export.eagle import check_served_tensors, config_from_hf
from eyas.export.engine_keys import read_config
from eyas.export.speculators import ARCHITECTURE as SPECULATORS_ARCHITECTURE
from eyas.export.speculators import EAGLE_LAYER_PREFIX, LAYER_PREFIX, read_speculators
from eyas.io import load_safetensors


def detect_layout(cfg: dict, tensor_names) -> str:
    """``"speculators"`` (``Eagle3Speculator``, ``layers.0.*``) or ``"eagle"`` (eyas / EAGLE /
    SpecForge: ``LlamaForCausalLMEagle3``, ``midlayer.*``). The config's ``architectures`` decides;
    without one, the tensor names do."""
    archs = cfg.get("architectures") or []
    if SPECULATORS_ARCHITECTURE in archs or cfg.get("speculators_model_type"):
        return "speculators"
    names = list(tensor_names)
    if not archs and any(n.startswith(LAYER_PREFIX) for n in names) and \
            not any(n.startswith(EAGLE_LAYER_PREFIX) for n in names):
        return "speculators"
    return "eagle"


def load_drafter(path: str | Path, num_target_layers: int | None = None) -> Eagle3Drafter:
    """Load a drafter from a directory: the eyas / EAGLE / SpecForge layout (``midlayer.*``,
    ``LlamaForCausalLMEagle3``) or the speculators layout (``layers.0.*``, ``Eagle3Speculator``;
    converted by :func:`eyas.export.speculators.read_speculators`).

    The embedding is NOT loaded (set it from the target with ``set_embedding``); an
    ``embed_tokens.weight`` in the file is ignored, and so are speculators' ``verifier_*`` copies
    of the target's head.

    Raises:
        FileNotFoundError: no config.json / model.safetensors.
        ValueError: config.json is not a JSON object, or model.safetensors is not safetensors
            (naming the file).
        eyas.export.eagle.ExportError: a config value of the wrong type
            (:func:`eyas.export.engine_keys.read_config`), wrong keys, shapes or vocab mapping; an
            unsupported variant (``norm_before_residual: true`` ...).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"drafter {str(path)!r}: no such directory (expected a local drafter dir "
                                f"with config.json and model.safetensors)")
    cfg = read_config(path / "config.json")
    tensors = load_safetensors(path / "model.safetensors")
    if detect_layout(cfg, tensors) == "speculators":
        cfg, tensors = read_speculators(path)
    c = config_from_hf(cfg, num_target_layers, str(path / "config.json"))
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()
               if "embed_tokens" not in k and not k.startswith("verifier_")}
    check_served_tensors(tensors, c, source=str(path / "model.safetensors"))
    drafter = Eagle3Drafter(c)
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) == {"embed_tokens.weight"}, (missing, unexpected)
    return drafter
