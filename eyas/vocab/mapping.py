"""The draft vocabulary: build, validate and compare d2t / t2d mappings.

Convention (all engines agree): ``d2t[i] = target_id - i`` (int64 offsets), so
``target_id = i + d2t[i]``. Built so by EAGLE (``SafeAILab/EAGLE: eagle/traineagle3/cnets.py``
``Model.scandata``), SpecForge (``sgl-project/SpecForge: specforge/data/preprocessing.py``
``process_token_dict_to_mappings``) and speculators (``vllm-project/speculators:
src/speculators/train/vocab_mapping.py``); read so by SGLang
(``python/sglang/srt/models/llama_eagle3.py``: ``hot_token_id = d2t + arange``) and vLLM
(``vllm/model_executor/models/llama_eagle3.py`` writes draft logits at
``arange(draft_vocab) + d2t``). ``t2d`` is a bool mask over the target vocab with exactly
``draft_vocab_size`` true entries. Always convert through target ids, never draft indices: some
published drafters order draft ids by frequency, others by target id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.io import load_safetensors, save_safetensors, write_json

log = logging.getLogger(__name__)


class VocabError(ValueError):
    """A vocab mapping is malformed; the message names the source and the first bad index."""


@dataclass
class VocabMapping:
    d2t: torch.Tensor  # [draft_vocab] int64 offsets
    t2d: torch.Tensor  # [vocab] bool

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    @property
    def vocab_size(self) -> int:
        return self.t2d.numel()

    def target_ids(self) -> torch.Tensor:
        """[draft_vocab] int64: the target id of each draft id (``i + d2t[i]``)."""
        return torch.arange(self.draft_vocab_size, dtype=torch.int64) + self.d2t


def target_id_order(d2t: torch.Tensor) -> torch.Tensor:
    """The permutation that puts draft ids in ascending target-id order.

    Args:
        d2t: [draft_vocab] integer offsets (``target_id = i + d2t[i]``).
    Returns:
        ``perm`` [draft_vocab] int64: new draft id j is old draft id ``perm[j]``; the reordered
        lm_head is ``lm_head[perm]`` and the reordered d2t is ``(i + d2t)[perm] - arange``, which
        give the same logit to every target id. The identity when the ids already ascend.
    """
    return torch.argsort(torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64), stable=True)


def count_tokens(input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counts of supervised (assistant) tokens: ``input_ids``/``loss_mask`` [N] -> [vocab] int64."""
    ids = input_ids[loss_mask.bool()].to(torch.int64)
    return torch.bincount(ids, minlength=vocab_size)[:vocab_size]


def build_mapping(counts: torch.Tensor, draft_vocab_size: int, order: str = "target_id",
                  fill_counts: torch.Tensor | None = None):
    """Take the ``draft_vocab_size`` most frequent target ids.

    Args:
        counts: [vocab] int64 counts of assistant tokens.
        draft_vocab_size: number of draft ids.
        order: ``"target_id"`` (draft ids ascend with target id, eyas' default) or ``"frequency"``
            (draft id 0 = most frequent, as some published drafters are ordered).
        fill_counts: optional [vocab] int64 counts of every token of the same data (prompt tokens
            included): it ranks the ids no assistant token uses, so it decides only when the
            assistant tokens hold fewer distinct ids than ``draft_vocab_size``: the rest of the
            draft vocab is then the tokens the data uses most, not arbitrary ids.
    Returns:
        (VocabMapping, info) where info has ``coverage`` (share of assistant tokens whose target id
        is in the draft vocab), ``distinct_tokens``, ``filled`` (ids taken for their
        ``fill_counts`` alone) and ``padded`` (ids added with zero count in both). Remaining ties
        are broken by lower target id: ids unseen in both are the lowest ones (deterministic), and
        a warning says how many.
    Raises:
        VocabError: ``draft_vocab_size`` exceeds the vocab, ``order`` is unknown,
            ``fill_counts`` has another shape than ``counts``, or either is not non-negative
            integer counts (a float would be truncated, a negative count ranked as seen).
    """
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise VocabError(f"draft_vocab_size {draft_vocab_size} must be in [1, vocab size {vocab_size}]")
    if order not in ("target_id", "frequency"):
        raise VocabError(f"vocab order {order!r}: use 'target_id' or 'frequency'")
    if fill_counts is not None and fill_counts.shape != counts.shape:
        raise VocabError(f"fill_counts has shape {tuple(fill_counts.shape)}, counts {tuple(counts.shape)}")
    for what, c in (("counts", counts), ("fill_counts", fill_counts)):
        if c is not None and (c.is_floating_point() or c.is_complex() or c.dtype == torch.bool or bool((c < 0).any())):
            raise VocabError(f"{what} must be non-negative integer counts, got dtype {c.dtype}"
                             + (f" with min {int(c.min())}" if not c.is_floating_point() and c.numel() else ""))
    # a stable sort by descending count keeps lower target ids first among equal counts
    ranked = torch.sort(counts.to(torch.int64), descending=True, stable=True).indices
    distinct = int((counts > 0).sum())
    if fill_counts is not None:  # the ids no assistant token uses, by fill count (ties: lower id)
        unseen = ranked[distinct:]
        by_fill = torch.sort(fill_counts.to(torch.int64)[unseen], descending=True, stable=True).indices
        ranked = torch.cat([ranked[:distinct], unseen[by_fill]])
    chosen = ranked[:draft_vocab_size]
    seen = counts > 0 if fill_counts is None else (counts > 0) | (fill_counts > 0)
    filled = int((seen[chosen] & (counts[chosen] == 0)).sum())
    padded = int((~seen[chosen]).sum())
    if filled:
        log.info("only %d distinct assistant tokens for a draft vocab of %d: the %d most frequent other "
                 "tokens of the data join them%s", distinct, draft_vocab_size, filled,
                 f" ({padded} slots still left)" if padded else "")
    if padded:
        log.warning("only %d distinct assistant tokens%s for a draft vocab of %d: the last %d slots are padded "
                    "with the lowest target ids never seen in the data", distinct,
                    f" (+{filled} other tokens of the data)" if filled else "", draft_vocab_size, padded)
    if order == "target_id":
        chosen = torch.sort(chosen).values
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    total = int(counts.sum())
    info = {
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "distinct_tokens": distinct,
        "filled": filled,
        "padded": padded,
        "assistant_tokens": total,
        "coverage": (float(counts[chosen].sum()) / total) if total else 0.0,
        "order": order,
    }
    return VocabMapping(d2t, t2d), info


def validate_mapping(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int,
                     draft_vocab_size: int | None = None, source: str = "mapping") -> None:
    """Check a d2t/t2d pair against the offset convention.

    Checks: d2t is a 1-D integer tensor; every ``i + d2t[i]`` is in [0, vocab) and unique; when
    ``t2d`` is given it is bool of length ``vocab_size`` with exactly ``len(d2t)`` true entries,
    at exactly the target ids of d2t; ``len(d2t) == draft_vocab_size`` when given.

    Raises:
        VocabError: naming ``source`` and the first bad draft index. If ``d2t`` looks like
            absolute target ids rather than offsets, the message says so.
    """
    if d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise VocabError(f"{source}: d2t must be a 1-D integer tensor, got {d2t.dtype} {tuple(d2t.shape)}")
    n = d2t.numel()
    if draft_vocab_size is not None and n != draft_vocab_size:
        raise VocabError(f"{source}: d2t has {n} entries, the config says draft_vocab_size {draft_vocab_size}")
    d2t = d2t.to(torch.int64)
    tids = torch.arange(n) + d2t
    looks_absolute = _looks_absolute(d2t, t2d, vocab_size)
    hint = " (d2t looks like ABSOLUTE target ids; the convention is offsets: d2t[i] = target_id - i)" \
        if looks_absolute else ""
    bad = ((tids < 0) | (tids >= vocab_size)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise VocabError(f"{source}: draft index {i} maps to target id {int(tids[i])}, outside "
                         f"[0, {vocab_size}){hint}")
    seen: dict[int, int] = {}
    for i, t in enumerate(tids.tolist()):
        if t in seen:
            raise VocabError(f"{source}: draft indices {seen[t]} and {i} both map to target id {t}{hint}")
        seen[t] = i
    if t2d is None:
        return
    if t2d.dtype != torch.bool or t2d.dim() != 1 or t2d.numel() != vocab_size:
        raise VocabError(f"{source}: t2d must be a bool mask of length {vocab_size}, got "
                         f"{t2d.dtype} {tuple(t2d.shape)}")
    if int(t2d.sum()) != n:
        raise VocabError(f"{source}: t2d has {int(t2d.sum())} true entries, d2t has {n}")
    in_mask = t2d[tids]
    if not bool(in_mask.all()):
        i = int((~in_mask).nonzero()[0])
        raise VocabError(f"{source}: draft index {i} maps to target id {int(tids[i])}, which t2d does "
                         f"not mark{hint}")


def _looks_absolute(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int) -> bool:
    if d2t.numel() == 0 or int(d2t.min()) < 0 or int(d2t.max()) >= vocab_size:
        return False
    if len(set(d2t.tolist())) != d2t.numel():
        return False
    return t2d is None or bool(t2d[d2t].all())


def compare_mappings(a: VocabMapping, b: VocabMapping) -> dict:
    """Overlap of two mappings through target ids.

    Returns ``positions_agree`` (draft indices i where both map i to the same target id),
    ``shared_tokens`` (target ids in both draft vocabs) and the two sizes.
    """
    ta, tb = a.target_ids(), b.target_ids()
    n = min(len(ta), len(tb))
    shared = len(set(ta.tolist()) & set(tb.tolist()))
    return {
        "positions_agree": int((ta[:n] == tb[:n]).sum()),
        "shared_tokens": shared,
        "draft_vocab_size_a": len(ta),
        "draft_vocab_size_b": len(tb),
    }


def save_mapping(out_dir: str | Path, mapping: VocabMapping, counts: torch.Tensor, info: dict) -> None:
    """Write ``vocab.safetensors`` (d2t int64, t2d bool, counts int64) and ``vocab.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors({"d2t": mapping.d2t, "t2d": mapping.t2d, "counts": counts.to(torch.int64)},
                     out / "vocab.safetensors")
    write_json(out / "vocab.json", info)


def load_mapping(vocab_dir: str | Path) -> tuple[VocabMapping, torch.Tensor]:
    """Read and validate a mapping written by :func:`save_mapping` -> (mapping, counts).

    Raises:
        FileNotFoundError: no ``vocab.safetensors`` in ``vocab_dir``.
        VocabError: the mapping fails :func:`validate_mapping`.
    """
    path = Path(vocab_dir) / "vocab.safetensors"
    t = load_safetensors(path)
    validate_mapping(t["d2t"], t["t2d"], t["t2d"].numel(), source=str(path))
    return VocabMapping(t["d2t"], t["t2d"]), t["counts"]
