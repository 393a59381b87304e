"""Move a pretrained drafter onto a new vocab mapping (no peer tool does this).

The failure this prevents: a published drafter fine-tuned under the new data's own d2t keeps its
lm_head rows in place (SpecForge loads the new d2t/t2d over a warm-started drafter without
permuting rows: ``sgl-project/SpecForge: specforge/algorithms/model_providers.py``
``build_eagle3_draft``; speculators likewise: ``vllm-project/speculators: src/speculators/model.py``
``load_vocab_mappings``), so row i (trained for target token ``i + d2t_old[i]``) is scored against
``i + d2t_new[i]``. When the mappings agree on few positions the loss sits at chance.

The remap goes through TARGET ids, never draft indices: new row j (target id ``t = j +
d2t_new[j]``) takes the old row whose target id is ``t`` when there is one (carried, bit-exact);
otherwise it is initialised from the target's lm_head row ``t``, rescaled so its L2 norm equals the
mean norm of the carried rows (the target head's rows live on a different scale than a trained
draft head's; matching the norm keeps new tokens neither dominant nor silent at step 0). When the
drafter's hidden size differs from the target's, new rows fall back to N(0, 0.02).
"""

from __future__ import annotations

import torch

from eyas.vocab.mapping import VocabMapping, compare_mappings


def remap_lm_head(old_lm_head: torch.Tensor, old: VocabMapping, new: VocabMapping,
                  target_lm_head: torch.Tensor, new_counts: torch.Tensor | None = None,
                  seed: int = 0) -> tuple[torch.Tensor, dict]:
    """Re-index lm_head rows from mapping ``old`` to mapping ``new`` through target ids.

    Args:
        old_lm_head: [old_draft_vocab, H] rows indexed by OLD draft id.
        old, new: the two mappings (same target vocab).
        target_lm_head: [vocab, H_target] the target's lm_head (row source for new tokens).
        new_counts: [vocab] assistant-token counts of the new data, for the coverage figure.
    Returns:
        (new_lm_head [new_draft_vocab, H] in old_lm_head's dtype, report) where report has
        ``positions_agree``, ``shared_tokens``, ``rows_carried``, ``rows_initialised``,
        ``init`` (how new rows were made) and ``carried_token_coverage`` (share of the new data's
        assistant tokens whose row was carried).
    Raises:
        ValueError: the two mappings are over different target vocabularies.
    """
    if old.vocab_size != new.vocab_size:
        raise ValueError(f"mappings over different target vocabs: {old.vocab_size} vs {new.vocab_size}")
    H = old_lm_head.shape[1]
    old_row_of = {t: i for i, t in enumerate(old.target_ids().tolist())}
    new_tids = new.target_ids().tolist()
    carried_new = [j for j, t in enumerate(new_tids) if t in old_row_of]
    carried_old = [old_row_of[new_tids[j]] for j in carried_new]
    fresh = [j for j, t in enumerate(new_tids) if t not in old_row_of]

    out = torch.empty(len(new_tids), H, dtype=old_lm_head.dtype)
    out[carried_new] = old_lm_head[carried_old]
    if fresh:
        fresh_tids = torch.tensor([new_tids[j] for j in fresh])
        if target_lm_head.shape[1] == H:
            rows = target_lm_head[fresh_tids].to(torch.float32)
            ref = old_lm_head[carried_old].float().norm(dim=1).mean() if carried_old \
                else old_lm_head.float().norm(dim=1).mean()
            rows = rows * (ref / rows.norm(dim=1, keepdim=True).clamp(min=1e-12))
            init = "target_lm_head_rescaled_to_carried_mean_norm"
        else:
            g = torch.Generator().manual_seed(seed)
            rows = torch.randn(len(fresh), H, generator=g) * 0.02
            init = "normal_0.02 (drafter hidden size differs from the target's)"
        out[fresh] = rows.to(out.dtype)
    else:
        init = "none needed"

    report = {
        **compare_mappings(old, new),
        "rows_carried": len(carried_new),
        "rows_initialised": len(fresh),
        "init": init,
    }
    if new_counts is not None:
        total = float(new_counts.sum())
        carried_t = torch.tensor([new_tids[j] for j in carried_new], dtype=torch.int64)
        report["carried_token_coverage"] = float(new_counts[carried_t].sum()) / total if total else 0.0
    return out, report


def naive_lm_head(old_lm_head: torch.Tensor, new_draft_vocab: int) -> torch.Tensor:
    """What SpecForge/speculators do when warm-starting under a new mapping: keep the rows in
    place (truncated, or zero-padded when the new draft vocab is larger). Used only to measure
    the failure it causes."""
    out = torch.zeros(new_draft_vocab, old_lm_head.shape[1], dtype=old_lm_head.dtype)
    n = min(new_draft_vocab, old_lm_head.shape[0])
    out[:n] = old_lm_head[:n]
    return out


def adopt_target_positions(config, target_config: dict) -> list[str]:
    """Give a remapped drafter the TARGET's context length and RoPE, in place.

    A published drafter's ``max_position_embeddings`` / ``rope_theta`` / ``rope_scaling`` describe
    the target it was trained for. Served beside this target, the engines build the drafter's
    rotary table from the drafter's own config (SGLang ``models/llama.py`` / vLLM
    ``model_executor/models/llama.py``: ``get_rope``), and the drafter attends over the target's
    positions; fine-tuning under the source's RoPE would train a function the target's context
    does not match. So the target's values win: they are what the features were extracted under.

    Args:
        config: the drafter's :class:`eyas.drafter.model.DrafterConfig` (modified).
        target_config: the feature manifest's ``target_config`` (eyas.target.model.summarise_config).
    Returns:
        One message per changed field (``"max_position_embeddings 64 -> 512 (the target's)"``),
        empty when the drafter already matched.
    Raises:
        eyas.target.rope.RopeError: the target's RoPE type is not implemented.
    """
    from eyas.target import rope

    theta, scaling = rope.normalise(target_config, source="target config")
    changes = []
    for name, new in (("max_position_embeddings", int(target_config["max_position_embeddings"])),
                      ("rope_theta", float(theta)), ("rope_scaling", scaling)):
        old = getattr(config, name)
        if old != new:
            changes.append(f"{name} {old!r} -> {new!r} (the target's)")
            setattr(config, name, new)
    return changes
