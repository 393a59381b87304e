"""Static-tree drafting with an EAGLE-3 drafter, verified by the target in ONE forward with a tree
attention mask (greedy).

The tree is SGLang's (``--speculative-eagle-topk``, ``--speculative-num-steps``,
``--speculative-num-draft-tokens``; ``python/sglang/srt/speculative/eagle_worker.py``
``draft_forward``, ``select_top_k_tokens`` and ``organize_draft_results`` in
``python/sglang/srt/speculative/eagle_utils.py``):

- step 0 takes the ``topk`` most likely draft tokens after the last verified position; each
  candidate's score is its drafter probability;
- each of the ``num_steps - 1`` further steps expands the ``topk`` current leaves by their
  ``topk`` most likely next tokens (``topk**2`` candidates, score = parent score x probability)
  and keeps the ``topk`` best as the next leaves (the drafter's hidden state and KV entries
  follow each kept leaf's branch);
- the tree verified is the ``num_draft_tokens - 1`` best-scoring candidates of all steps, in
  step order (parents before children), plus the root: the last verified token. A parent
  always scores at least as high as its children (probabilities <= 1), so the set is a tree.

With ``topk = 1`` and ``num_draft_tokens = num_steps + 1`` the tree is the chain
:class:`eyas.eval.speculative.EagleProposer` drafts (tests/eval/test_tree.py checks the accepted counts are
equal).

Verification: the target reads ``[x_last, n_1..n_m]`` at positions ``n_done + depth`` with a 4D
float attention mask (0 = attend, dtype minimum = masked: each node sees the prefix, its
ancestors and itself); transformers 5.x uses a 4D ``attention_mask`` as given
(``masking_utils._preprocess_mask_arguments``). The greedy walk descends from the root to the
child whose token is the target's argmax at the current node, the bonus token being the argmax
where it stops (EAGLE ``evaluate_posterior``, ``eagle/model/utils.py``); the KV cache then keeps
the prefix, the root and the accepted path, in order (:class:`eyas.eval.speculative.TargetCache`: rows
of transformers' dynamic cache selected, or, on CUDA, columns of the static cache whose tree steps
replay a CUDA graph moved). Sampled trees need a multi-draft rejection
rule (SpecInfer's recursive rejection sampling, SGLang ``tree_speculative_sampling_target_only``)
and are not implemented: the sampled numbers are chain (eyas/eval/sampling.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eyas.drafter.model import Eagle3Drafter, KVCache
from eyas.eval.speculative import EagleProposer, _aux_layers, _model, stop_set, target_cache
from eyas.target import graphed

__all__ = ["DraftTree", "EagleTreeProposer", "tree_attention_mask", "tree_generate", "tree_visibility",
           "verify_tree_greedy"]


@dataclass
class DraftTree:
    """``tokens[j]``: target id of node j; ``parents[j]``: its parent node (-1 = the root, the last
    verified token); parents come before children."""

    tokens: list[int]
    parents: list[int]

    def depths(self) -> list[int]:
        """Depth of every node (children of the root: 1)."""
        d: list[int] = []
        for par in self.parents:
            d.append(1 if par < 0 else d[par] + 1)
        return d


class EagleTreeProposer(EagleProposer):
    """:class:`~eyas.eval.speculative.EagleProposer` that also drafts static trees (:meth:`propose_tree`)."""

    def propose_tree(self, topk: int, num_steps: int, num_draft_tokens: int) -> DraftTree:
        """The SGLang static tree after the last verified position (module docstring).

        Raises:
            ValueError: ``topk`` or ``num_steps`` < 1, or ``num_draft_tokens - 1`` outside
                [1, topk + (num_steps - 1) * topk**2] (the candidates drafted).
        """
        n_cand = topk + (num_steps - 1) * topk * topk
        if topk < 1 or num_steps < 1 or not 1 <= num_draft_tokens - 1 <= n_cand:
            raise ValueError(f"tree: topk {topk} >= 1, num_steps {num_steps} >= 1 and num_draft_tokens - 1 "
                             f"({num_draft_tokens - 1}) in [1, {n_cand}] required")
        d = self.drafter
        probs = torch.softmax(d.logits(self.h[:, -1]).float(), -1)              # [1, Vd]
        score, tok = probs.topk(topk, dim=-1)                                    # [1, topk]
        scores, tokens, parents = [score[0]], [tok[0]], [torch.full((topk,), -1, device=self.device)]
        leaves = torch.arange(topk, device=self.device)                          # candidate ids
        h = self.h.expand(topk, 1, -1)
        kv = KVCache()
        kv.k, kv.v = (None, None) if self.kv.k is None else (self.kv.k.expand(topk, -1, -1, -1),
                                                             self.kv.v.expand(topk, -1, -1, -1))
        leaf_score, leaf_tok = score[0], tok[0]
        for i in range(1, num_steps):
            ids = d.draft_to_target(leaf_tok)[:, None]                               # [topk, 1]
            pos = torch.full((topk, 1), self.n_real + i - 1, device=self.device)
            h = d.decode(h, ids, pos, kv, self.weights)                              # [topk, 1, H]
            p, t = torch.softmax(d.logits(h[:, -1]).float(), -1).topk(topk, dim=-1)  # [topk, topk]
            cand = (leaf_score[:, None] * p).flatten()                               # [topk**2]
            base = topk + (i - 1) * topk * topk                                      # first candidate id of step i
            scores.append(cand)
            tokens.append(t.flatten())
            parents.append(leaves.repeat_interleave(topk))
            leaf_score, best = cand.topk(topk)
            branch = best // topk                                                    # the leaf each kept child extends
            leaves, leaf_tok = base + best, t.flatten()[best]
            h, kv.k, kv.v = h[branch], kv.k[branch], kv.v[branch]
        scores, tokens, parents = torch.cat(scores), torch.cat(tokens), torch.cat(parents)
        keep = scores.topk(num_draft_tokens - 1).indices.sort().values.tolist()
        index = {c: j for j, c in enumerate(keep)}
        targets = d.draft_to_target(tokens).tolist()
        tree_tokens, tree_parents = [], []
        for c in keep:
            par = int(parents[c])
            if par >= 0 and par not in index:  # a tie at probability 1.0 let a child in without its parent
                continue
            index[c] = len(tree_tokens)
            tree_tokens.append(targets[c])
            tree_parents.append(-1 if par < 0 else index[par])
        return DraftTree(tree_tokens, tree_parents)


def tree_visibility(tree: DraftTree) -> torch.Tensor:
    """Which of the verified tokens (root, then the m nodes) each one sees: [m + 1, m + 1] bool,
    its ancestors and itself."""
    m = len(tree.tokens)
    allowed = torch.zeros(m + 1, m + 1, dtype=torch.bool)
    allowed[:, 0] = True
    for j, par in enumerate(tree.parents):
        allowed[j + 1, j + 1] = True
        if par >= 0:
            allowed[j + 1] |= allowed[par + 1]
    return allowed


def tree_attention_mask(tree: DraftTree, n_done: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The verify forward's mask [1, 1, m + 1, n_done + m + 1] (rows: root, nodes): 0.0 where a
    query may attend (the cached prefix, its ancestors, itself), the dtype's minimum elsewhere."""
    full = torch.cat([torch.ones(len(tree.tokens) + 1, n_done, dtype=torch.bool), tree_visibility(tree)], dim=1)
    return graphed.additive_mask(full, dtype)[None, None].to(device)


def verify_tree_greedy(tree: DraftTree, target_greedy: list[int],
                       stop_ids: frozenset[int]) -> tuple[list[int], list[int]]:
    """Greedy walk over a verified tree.

    Args:
        tree: the drafted tree (m nodes). target_greedy: m + 1 target argmax ids, index 0 the
            root's, j + 1 node j's. stop_ids: an accepted stop token ends the walk (no bonus).
    Returns:
        ``(path, committed)``: the accepted nodes' indices (root first excluded), and the tokens
        to append (their tokens, then the bonus token unless a stop token ended it).
    Raises:
        ValueError: ``len(target_greedy) != m + 1``.
    """
    if len(target_greedy) != len(tree.tokens) + 1:
        raise ValueError(f"verify_tree_greedy: {len(tree.tokens)} nodes need {len(tree.tokens) + 1} target tokens, "
                         f"got {len(target_greedy)}")
    children: dict[int, list[int]] = {}
    for j, par in enumerate(tree.parents):
        children.setdefault(par, []).append(j)
    path, committed, cur = [], [], -1
    while True:
        want = target_greedy[cur + 1]
        nxt = next((c for c in children.get(cur, []) if tree.tokens[c] == want), None)
        if nxt is None:
            return path, committed + [want]
        path.append(nxt)
        committed.append(want)
        if want in stop_ids:
            return path, committed
        cur = nxt


@torch.no_grad()
def tree_generate(target_model, drafter: Eagle3Drafter, prompt_ids: list[int], *, topk: int, num_steps: int,
                  num_draft_tokens: int, max_new_tokens: int, stop_ids: Sequence[int],
                  aux_layer_ids: list[int] | None, decode: str = "auto") -> dict:
    """Greedy speculative decoding with static draft trees, batch size 1.

    Args:
        target_model: a transformers causal LM (or ``eyas.target.model.Target``) taking a 4D float
            ``attention_mask`` and ``position_ids``. drafter: an Eagle3Drafter on its device.
        topk, num_steps, num_draft_tokens: SGLang's tree parameters (module docstring;
            ``num_draft_tokens`` counts the root, as SGLang's does).
        decode: the target's KV cache and step (:class:`eyas.eval.speculative.TargetCache`): ``"auto"``
            replays each tree's verify step from a CUDA graph on CUDA (one graph per tree size).
        Others as :func:`eyas.eval.speculative.speculative_generate`.
    Returns:
        ``{"tokens", "committed_per_step", "accepted_per_step", "num_verify_steps",
        "tree_nodes_per_step"}``; the output equals plain greedy decoding token for token.
    Raises:
        ValueError: empty prompt, bad tree parameters (:meth:`EagleTreeProposer.propose_tree`).
    """
    model, proposer, stop = _model(target_model), EagleTreeProposer(drafter), stop_set(stop_ids)
    if not prompt_ids:
        raise ValueError("tree_generate: empty prompt")
    aux_ids = _aux_layers(model, proposer, aux_layer_ids)
    result = {"tokens": [], "committed_per_step": [], "accepted_per_step": [], "num_verify_steps": 0,
              "tree_nodes_per_step": []}
    if max_new_tokens <= 0:
        return result
    # a tree writes num_draft_tokens positions past the committed ones
    cache = target_cache(model, decode, len(prompt_ids) + max_new_tokens + num_draft_tokens)
    _, greedy, aux = cache(prompt_ids, aux_ids, last_only=True)
    x = int(greedy[0, -1])
    proposer.prefill(prompt_ids + [x], aux)
    tokens, n_done = [x], len(prompt_ids)
    while len(tokens) < max_new_tokens and x not in stop:
        tree = proposer.propose_tree(topk, num_steps, num_draft_tokens)
        _, greedy, aux = cache([x] + tree.tokens, aux_ids, tree=(tree_visibility(tree), [0] + tree.depths()))
        path, committed = verify_tree_greedy(tree, greedy[0].tolist(), stop)
        committed = committed[: max_new_tokens - len(tokens)]
        rows = [0] + [j + 1 for j in path]  # the root and the accepted nodes: the tokens the target read
        aux = aux[:, rows[: len(committed)]]  # read before the roll-back: a copy (index list)
        cache.keep(n_done, rows[: len(committed)])
        tokens += committed
        result["committed_per_step"].append(len(committed))
        result["accepted_per_step"].append(min(len(path), len(committed)))
        result["tree_nodes_per_step"].append(len(tree.tokens))
        n_done += len(committed)
        x = committed[-1]
        proposer.accept(committed, aux)
    result.update(tokens=tokens, num_verify_steps=len(result["committed_per_step"]))
    return result
