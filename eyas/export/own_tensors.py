"""Tensors a published drafter may carry that eyas takes from the target instead, and what each
engine does with them.

eyas trains and exports a drafter over the TARGET's token embedding, frozen and not saved
(eyas/drafter/model.py), and takes rows for new draft tokens from the target's lm_head
(eyas/vocab/remap.py). A published drafter may have trained its own: "Some EAGLE3 drafters might have
their own lm_head and/or embed_tokens" (vllm-project/vllm PR #28549). The engines then disagree
(:data:`ENGINES`), so a drafter fine-tuned over the target's embedding computes another function
than its source, and a source served as published reads its own embedding in some engines and the
target's in others.

:func:`check_source` is what remap runs on its source before the target's embedding replaces
anything: it refuses a source whose ``embed_tokens.weight`` is not the target's, and one whose
hidden size is not the target's (its embedding cannot be the target's; the EAGLE-3 drafter of
Llama-3.3-70B kind), each naming the tensor and the engines that read it. :func:`disagreements`
is what ``eyas inspect`` warns with.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.export.engine_keys import ExportError
from eyas.io import open_safetensors

EMBED = "embed_tokens.weight"

ENGINES = {
    EMBED: {
        "SGLang": "discarded: the worker's set_embed swaps in the target's unless target_hidden_size != hidden_size "
                  "(speculative/eagle_worker.py, models/llama.py set_embed)",
        "vLLM": "used unless torch.equal to the target's (v1/spec_decode/eagle.py, PR #28549)",
        "llama.cpp": "used: written as token_embd.weight (conversion/llama.py), read by src/models/eagle3.cpp "
                     "load_arch_tensors",
        "speculators": "loaded from the file (models/eagle3/core.py)",
    },
    "lm_head.weight": {
        "SGLang": "replaced by the target's lm_head when draft_vocab_size is absent (models/llama_eagle3.py "
                  "load_lm_head_from_target)",
        "vLLM": "used (model_executor/models/llama_eagle3.py), the target's only when torch.equal to it",
        "llama.cpp": "used: written as output.weight (src/models/eagle3.cpp)",
    },
}
"""Per tensor, what each engine does with a drafter's own copy (sources: sgl-project/sglang under
``python/sglang/srt/``, vllm-project/vllm under ``vllm/``, ggml-org/llama.cpp, vllm-project/speculators)."""


class OwnTensorError(ExportError):
    """A source drafter carries a tensor of its own that eyas would replace with the target's; the
    message names the file, the tensor and the engines that read it."""


def _engines(name: str) -> str:
    return "; ".join(f"{eng}: {what}" for eng, what in ENGINES[name].items())


def _embedding(path: Path) -> tuple[str, torch.Tensor] | None:
    """(name as written, tensor) of the drafter's own token embedding, if its file has one."""
    with open_safetensors(path) as h:
        for k in h.keys():
            if k.removeprefix("model.") == EMBED:
                return k, h.get_tensor(k)
    return None


def check_source(drafter_dir: str | Path, hidden_size: int, target_embed: torch.Tensor) -> None:
    """Refuse a source drafter that would lose a tensor of its own to the target's.

    Args:
        drafter_dir: the source checkpoint directory (``model.safetensors``, either layout).
        hidden_size: the source drafter's hidden size H (its config).
        target_embed: [vocab, H_target] the target's input embedding (any float dtype).
    Raises:
        OwnTensorError: H != H_target (the target's embedding cannot feed the drafter: it was
            trained over an embedding of its own width), or the file's ``embed_tokens.weight``
            differs from ``target_embed`` at the file's dtype (how many rows differ, the largest
            relative row difference); each names the file, the tensor and the engines that read it.
        FileNotFoundError / ValueError: no ``model.safetensors`` or not safetensors (naming it).
    """
    w_path = Path(drafter_dir) / "model.safetensors"
    own = _embedding(w_path)
    V, Ht = target_embed.shape
    if hidden_size != Ht:
        has = f"its own {own[0]} {list(own[1].shape)}" if own else f"no {EMBED} (its embedding is elsewhere)"
        raise OwnTensorError(
            f"{w_path}: the source drafter's hidden_size {hidden_size} != the target's hidden size {Ht}: it embeds "
            f"tokens with an embedding of its own width, not the target's; the file holds {has}. eyas fine-tunes "
            f"and exports drafters over the target's embedding (eyas/drafter/model.py), so it cannot fine-tune this "
            f"one. Engines that read {EMBED}: {_engines(EMBED)}. Serve it as published, or train from scratch")
    if own is None:
        return
    name, e = own
    if tuple(e.shape) != (V, Ht):
        raise OwnTensorError(f"{w_path}: {name} has shape {list(e.shape)}, the target's embedding is [{V}, {Ht}]: "
                             f"the source was trained for another target")
    t = target_embed.to(e.dtype)
    if torch.equal(e, t):
        return
    rows = (e != t).any(dim=1)
    rel = ((e.float() - t.float()).norm(dim=1) / t.float().norm(dim=1).clamp(min=1e-12)).max()
    raise OwnTensorError(
        f"{w_path}: {name} is not the target's embedding ({int(rows.sum()):,} of {V:,} rows differ at {e.dtype}, up "
        f"to {float(rel):.3g} relative): the source was trained with an embedding of its own. eyas fine-tunes over "
        f"the target's embedding and exports none, so the fine-tuned drafter would compute another function than "
        f"its source. Engines that read {EMBED}: {_engines(EMBED)}. Serve the source as published; or, to fine-tune "
        f"it over the target's embedding anyway, write its model.safetensors without {name}")


def disagreements(cfg: dict, tensor_names) -> list[str]:
    """Where the engines would serve a checkpoint's tensors differently from each other (the
    table :data:`ENGINES`): its own ``embed_tokens.weight`` (unless its hidden size differs from
    ``target_hidden_size``, where SGLang keeps it too, or eyas' own export records it as the target's: its
    config's ``eyas`` record says ``"embedding": "target"``, eyas.export.speculators.speculators_config), and its
    ``lm_head.weight`` without ``draft_vocab_size``.

    Args:
        cfg: the flat config (eagle layout, or the speculators layout converted).
        tensor_names: the checkpoint's tensor names in eyas' naming (``midlayer.*``).
    Returns:
        One warning per tensor, naming it and what each engine does.
    """
    names = set(tensor_names)
    out = []
    H, th = cfg.get("hidden_size"), cfg.get("target_hidden_size")
    targets = (cfg.get("eyas") or {}).get("embedding") == "target"
    if EMBED in names and th in (None, H) and not targets:
        out.append(f"engines disagree about {EMBED}: {_engines(EMBED)}; the same file serves two different functions "
                   f"unless it equals the target's embedding (eyas trains over the target's)")
    if "lm_head.weight" in names and cfg.get("draft_vocab_size") is None:
        out.append(f"engines disagree about lm_head.weight (no draft_vocab_size): {_engines('lm_head.weight')}")
    return out
