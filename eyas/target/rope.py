"""RoPE settings of a target or drafter: read them from any config form, and compute the
inverse frequencies the drafter's rotary embedding uses.

Config forms read (the same settings, two spellings):

- transformers v4 / SGLang / most published checkpoints: ``rope_theta`` at the top level and
  ``rope_scaling`` = ``{"rope_type" (or legacy "type"): ..., "factor": ..., ...}`` or null;
- transformers v5: ``rope_parameters`` = ``{"rope_type": ..., "rope_theta": ..., ...}``
  (``rope_type "default"`` = no scaling).

eyas keeps one normal form: ``(theta, scaling)`` where ``scaling`` is ``None`` (plain RoPE) or a
dict with ``rope_type`` and that type's fields, without ``rope_theta``. Exports write it back in
the v4 form (``rope_theta`` + ``rope_scaling``), which transformers v5, SGLang and vLLM all read.

Implemented types (the math, from transformers ``modeling_rope_utils.py``,
``_compute_default_rope_parameters`` / ``_compute_linear_scaling_rope_parameters`` /
``_compute_llama3_parameters``; tests compare with transformers' ``ROPE_INIT_FUNCTIONS``):

- ``default``: ``inv_freq[i] = theta ** (-2i / head_dim)``, i in [0, head_dim/2);
- ``linear``: ``inv_freq / factor``;
- ``llama3`` (Llama-3.1/3.2): wavelengths ``2*pi/inv_freq`` above
  ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those below
  ``original_max_position_embeddings / high_freq_factor`` kept, and the band between interpolated
  with ``smooth = (orig / wavelen - low) / (high - low)``.

Any other type (``dynamic``, ``yarn``, ``longrope``, ...) is refused with :class:`RopeError`:
they change the attention scale or depend on the sequence length, which eyas does not implement.
"""

from __future__ import annotations

import math

import torch

from eyas.target.hf_config import get, rope_theta

SUPPORTED_TYPES = ("default", "linear", "llama3")
_REQUIRED = {"linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


class RopeError(ValueError):
    """RoPE settings eyas cannot honour (an unimplemented ``rope_type`` or missing fields)."""


def normalise(cfg, source: str = "config") -> tuple[float, dict | None]:
    """The RoPE settings of a config, in eyas' normal form.

    Args:
        cfg: a config dict (``config.json``, a speculators ``transformer_layer_config``, a feature
            manifest's ``target_config``) or a transformers config object.
        source: named in errors.
    Returns:
        ``(theta, scaling)``: theta float (:func:`eyas.target.hf_config.rope_theta`); scaling
        ``None`` for plain RoPE, else a dict with ``rope_type`` and that type's fields
        (``rope_theta`` removed, ``type`` renamed ``rope_type``).
    Raises:
        RopeError: an unsupported ``rope_type``, or a supported one without its fields.
    """
    params = get(cfg, "rope_parameters")
    scaling = get(cfg, "rope_scaling")
    if isinstance(params, dict) and params and isinstance(next(iter(params.values())), dict):
        # per-layer-type parameters (Gemma-3 style {"full_attention": {...}, ...}): not a Llama layer
        raise RopeError(f"{source}: per-layer-type rope_parameters {sorted(params)}; eyas implements one "
                        f"RoPE for the drafter's Llama layer")
    theta = rope_theta(cfg)
    raw = dict(scaling) if scaling else dict(params or {})
    raw.pop("rope_theta", None)
    if "type" in raw and "rope_type" not in raw:
        raw["rope_type"] = raw.pop("type")
    raw.pop("type", None)
    rtype = raw.get("rope_type", "default")
    if rtype == "default":
        return float(theta), None
    if rtype not in SUPPORTED_TYPES:
        raise RopeError(f"{source}: rope_scaling rope_type {rtype!r} is not implemented by eyas (it implements "
                        f"{list(SUPPORTED_TYPES)}); SGLang and vLLM would apply it, so a drafter trained without "
                        f"it would see other positions")
    missing = [k for k in _REQUIRED[rtype] if raw.get(k) is None]
    if missing:
        raise RopeError(f"{source}: rope_scaling of type {rtype!r} lacks {missing}")
    keep = ("rope_type",) + _REQUIRED[rtype]
    return float(theta), {k: (raw[k] if k == "rope_type" else float(raw[k]) if k != "original_max_position_embeddings"
                              else int(raw[k])) for k in keep}


def inv_freq(head_dim: int, theta: float, scaling: dict | None = None, device=None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 (radians per position) of RoPE with ``theta``
    and ``scaling`` (the normal form of :func:`normalise`).

    Raises:
        RopeError: an unsupported ``rope_type``.
    """
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return base
    rtype = scaling.get("rope_type")
    if rtype == "linear":
        return base / scaling["factor"]
    if rtype == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        orig = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / base
        out = torch.where(wavelen > low_wavelen, base / factor, base)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out)
    raise RopeError(f"rope_type {rtype!r} is not implemented by eyas (it implements {list(SUPPORTED_TYPES)})")


def describe(theta: float, scaling: dict | None) -> str:
    """One line for reports: ``theta 500000 (llama3: factor 8, ...)``."""
    if scaling is None:
        return f"theta {theta:g} (no scaling)"
    fields = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in scaling.items() if k != "rope_type")
    return f"theta {theta:g} ({scaling['rope_type']}: {fields})"


def config_fields(theta: float, scaling: dict | None) -> dict:
    """The keys an exported ``config.json`` carries: ``rope_theta`` and, when scaled,
    ``rope_scaling`` (v4 form, which transformers v5, SGLang and vLLM read)."""
    return {"rope_theta": theta, **({"rope_scaling": dict(scaling)} if scaling else {})}
