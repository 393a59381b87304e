"""The decoding-modes table: chain vs tree vs sampled, for a drafter and the n-gram floor, on a few
prompts decoded for real by eyas' own loops.

Engines serve at temperature 0.6-1.0 with top-p, and draft trees (SGLang ``topk`` /
``num_steps`` / ``num_draft_tokens``); a drafter ranked on greedy chain acceptance can rank
differently there. :func:`evaluate_modes` decodes the first ``prompts`` prompts of a benchmark in
those modes (no engine serves here; llama.cpp serving the drafter is eyas/eval/llamacpp.py). Its
params (``eval.served_prompts``, ``eval.served_max_new_tokens``), its metrics key (``served.<bench>``)
and its MLflow keys (``<bench>/served/<row>/accept_len``) keep the older name ``served``: the modes
engines serve with. Rows:

- ``<proposer>/chain/T<t>``: chain drafts of ``num_draft_tokens``; ``t`` 0 is greedy
  (:func:`eyas.eval.speculative.speculative_generate`, one run per prompt), ``t`` > 0 speculative
  sampling at top-p (:func:`eyas.eval.sampling.sampled_generate`, one run per prompt and seed, the
  ``torch.Generator`` seeded with the seed itself), for the EAGLE drafter (``eagle``) and prompt
  lookup (``ngram``);
- ``eagle/tree/T0``: greedy static trees (:func:`eyas.eval.tree.tree_generate`), whose output must equal
  the greedy chain's (``matches_greedy``). Sampled trees are not measured (eyas/eval/tree.py says why).

Each row's ``accept_len`` pools every verify step of its runs (tokens committed per verify
step, the bonus counted: eyas/eval/speculative.py); ``ci95`` is a 95% percentile bootstrap interval
over prompts (1,000 resamples of the prompts with replacement, each prompt's runs over all seeds
kept together, ``torch.Generator`` seed 0): the prompts are the unit that varies most.
``accept_len_per_seed`` gives the pooled value of each seed alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eyas.eval.sampling import sampled_generate
from eyas.eval.speculative import NgramProposer, acceptance_length, speculative_generate
from eyas.eval.tree import tree_generate

__all__ = ["bootstrap_ci", "evaluate_modes", "row_name"]

BOOTSTRAP_RESAMPLES = 1000


def row_name(proposer: str, mode: str, temperature: float) -> str:
    """The key of one table row: ``eagle/chain/T0.7``, ``ngram/chain/T0``, ``eagle/tree/T0``."""
    return f"{proposer}/{mode}/T{temperature:g}"


def bootstrap_ci(steps_per_prompt: list[list[int]], resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = 0) -> list[float] | None:
    """95% percentile bootstrap interval of the pooled acceptance length over prompts.

    Args:
        steps_per_prompt: per prompt, the committed-token counts of all its verify steps (every
            seed's runs together).
    Returns:
        ``[low, high]`` (2.5th and 97.5th percentiles of the resampled pooled values), None
        without verify steps.
    """
    tot = torch.tensor([float(sum(s)) for s in steps_per_prompt])
    cnt = torch.tensor([float(len(s)) for s in steps_per_prompt])
    if not len(tot) or cnt.sum() == 0:
        return None
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(tot), (resamples, len(tot)), generator=g)
    c = cnt[idx].sum(1)
    pooled = tot[idx].sum(1)[c > 0] / c[c > 0]
    lo, hi = torch.quantile(pooled.double(), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return [lo, hi]


def _row(runs: dict[int, list[dict]], extra: dict | None = None) -> dict:
    """Row metrics from ``runs[seed]`` = one run per prompt."""
    n_prompts = len(next(iter(runs.values())))
    per_prompt = [[c for seed_runs in runs.values() for c in seed_runs[i]["committed_per_step"]]
                  for i in range(n_prompts)]
    every = [c for s in per_prompt for c in s]
    per_seed = {str(s): acceptance_length([c for r in rs for c in r["committed_per_step"]])
                if any(r["num_verify_steps"] for r in rs) else None for s, rs in runs.items()}
    return {"accept_len": acceptance_length(every) if every else None, "ci95": bootstrap_ci(per_prompt),
            "accept_len_per_seed": per_seed, "num_runs": sum(map(len, runs.values())),
            "num_verify_steps": len(every), "new_tokens": sum(len(r["tokens"]) for rs in runs.values() for r in rs),
            **(extra or {})}


def evaluate_modes(target, drafter, prompts: list[list[int]], *, num_draft_tokens: int, max_new_tokens: int,
                   stop_ids: Sequence[int], aux_layer_ids: list[int], temperatures: Sequence[float], top_p: float,
                   seeds: Sequence[int], tree_topk: int, tree_num_steps: int,
                   tree_num_draft_tokens: int) -> dict:
    """The chain-vs-tree-vs-sampled table of one benchmark (module docstring).

    Args:
        target: ``eyas.target.model.Target`` or a causal LM. drafter: an Eagle3Drafter on its device.
        prompts: the prompts to decode (token ids; the caller picks how many).
        num_draft_tokens: chain length k. max_new_tokens: reply budget. stop_ids: the stop set.
        aux_layer_ids: the drafter's aux layers. temperatures: >= 0 each (0 = greedy). top_p: in
            (0, 1]. seeds: one sampled run per prompt and seed at each temperature > 0.
        tree_topk, tree_num_steps, tree_num_draft_tokens: the static tree (eyas/eval/tree.py).
    Returns:
        ``{"settings": {...}, "rows": {row_name: {"accept_len", "ci95", "accept_len_per_seed",
        "num_runs", "num_verify_steps", "new_tokens"[, "matches_greedy", "tree_nodes"]}}}``.
    Raises:
        ValueError: no prompts, no seeds with a temperature > 0, a negative temperature.
    """
    if not prompts:
        raise ValueError("evaluate_modes: no prompts")
    if any(t < 0 for t in temperatures):
        raise ValueError(f"evaluate_modes: temperatures must be >= 0, got {list(temperatures)}")
    if any(t > 0 for t in temperatures) and not seeds:
        raise ValueError("evaluate_modes: sampling (a temperature > 0) needs at least one seed")
    k = num_draft_tokens
    kw = dict(max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    proposers = {"eagle": lambda: drafter, "ngram": NgramProposer}
    rows: dict[str, dict] = {}
    greedy_chain = [speculative_generate(target, drafter, p, num_draft_tokens=k, aux_layer_ids=aux_layer_ids, **kw)
                    for p in prompts]
    for t in temperatures:
        for name, make in proposers.items():
            aux = aux_layer_ids if name == "eagle" else None
            if t == 0:
                runs = {0: greedy_chain if name == "eagle" else [
                    speculative_generate(target, make(), p, num_draft_tokens=k, aux_layer_ids=aux, **kw)
                    for p in prompts]}
            else:
                runs = {s: [sampled_generate(target, make(), p, num_draft_tokens=k, aux_layer_ids=aux, temperature=t,
                                             top_p=top_p, generator=torch.Generator().manual_seed(s), **kw)
                            for p in prompts] for s in seeds}
            rows[row_name(name, "chain", t)] = _row(runs)
    tree = [tree_generate(target, drafter, p, topk=tree_topk, num_steps=tree_num_steps,
                          num_draft_tokens=tree_num_draft_tokens, aux_layer_ids=aux_layer_ids, **kw) for p in prompts]
    nodes = [n for r in tree for n in r["tree_nodes_per_step"]]
    rows[row_name("eagle", "tree", 0)] = _row({0: tree}, {
        "matches_greedy": all(r["tokens"] == c["tokens"] for r, c in zip(tree, greedy_chain)),
        "tree_nodes": sum(nodes) / len(nodes) if nodes else None})
    return {
        "settings": {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "num_draft_tokens": k,
                     "temperatures": [float(t) for t in temperatures], "top_p": top_p, "seeds": list(seeds),
                     "tree": {"topk": tree_topk, "num_steps": tree_num_steps,
                              "num_draft_tokens": tree_num_draft_tokens, "temperature": 0.0},
                     "interval": f"95% percentile bootstrap over prompts ({BOOTSTRAP_RESAMPLES} resamples, "
                                 "torch.Generator seed 0), each prompt's verify steps pooled over its seeds",
                     "sampling": "standard speculative sampling (eyas/eval/sampling.py); generator seeded with "
                                 "each seed for every prompt"},
        "rows": rows,
    }
