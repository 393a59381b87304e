"""Static-tree drafting (eyas/eval/tree.py) on the tiny target: the greedy walk and the tree mask on
hand-worked trees; a topk-1 tree equals the chain step for step; a branching tree's output equals
plain greedy decoding token for token (one target forward per step, the KV cache cut back to
the accepted path)."""

import pytest
import torch

from eyas.eval.speculative import greedy_generate, speculative_generate
from eyas.eval.tree import DraftTree, EagleTreeProposer, tree_attention_mask, tree_generate, verify_tree_greedy
from tests.tiny import trained_drafter as train_tiny_drafter

K = 4


@pytest.fixture(scope="module")
def setup(tiny_greedy):
    return tiny_greedy


@pytest.fixture(scope="module")
def trained_drafter(setup):
    return train_tiny_drafter(*setup, K)


def test_walk_and_mask_hand_worked():
    #        root
    #       /    \
    #   0:(5)   1:(6)
    #     |       |
    #   2:(7)   3:(8)
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 1])
    assert tree.depths() == [1, 1, 2, 2]
    # target argmax: root -> 6 (node 1), node 1 -> 8 (node 3), node 3 -> 9 (bonus)
    assert verify_tree_greedy(tree, [6, 0, 8, 0, 9], frozenset()) == ([1, 3], [6, 8, 9])
    assert verify_tree_greedy(tree, [4, 0, 0, 0, 0], frozenset()) == ([], [4])      # nothing accepted
    assert verify_tree_greedy(tree, [6, 0, 8, 0, 9], frozenset({8})) == ([1, 3], [6, 8])  # stop: no bonus
    with pytest.raises(ValueError, match="5 target tokens"):
        verify_tree_greedy(tree, [6], frozenset())
    mask = tree_attention_mask(tree, n_done=2, dtype=torch.float32, device="cpu")[0, 0] == 0
    expected = torch.tensor([
        # prefix  root  n0 n1 n2 n3
        [1, 1,    1,    0, 0, 0, 0],   # root
        [1, 1,    1,    1, 0, 0, 0],   # node 0
        [1, 1,    1,    0, 1, 0, 0],   # node 1
        [1, 1,    1,    1, 0, 1, 0],   # node 2: root, node 0, itself
        [1, 1,    1,    0, 1, 0, 1],   # node 3: root, node 1, itself
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_topk_1_tree_is_the_chain(setup, trained_drafter):
    target, prompts, outputs = setup
    for p, y in zip(prompts, outputs):
        chain = speculative_generate(target, trained_drafter, p, num_draft_tokens=K, max_new_tokens=len(y),
                                     stop_ids=[], aux_layer_ids=None)
        tree = tree_generate(target, trained_drafter, p, topk=1, num_steps=K, num_draft_tokens=K + 1,
                             max_new_tokens=len(y), stop_ids=[], aux_layer_ids=None)
        assert tree["tokens"] == chain["tokens"] == y
        assert tree["accepted_per_step"] == chain["accepted_per_step"]
        assert tree["committed_per_step"] == chain["committed_per_step"]
        assert set(tree["tree_nodes_per_step"]) == {K}


def test_branching_tree_equals_greedy(setup, trained_drafter):
    target, prompts, outputs = setup
    accepted = []
    for p, y in zip(prompts, outputs):
        run = tree_generate(target, trained_drafter, p, topk=3, num_steps=K, num_draft_tokens=10,
                            max_new_tokens=len(y), stop_ids=[], aux_layer_ids=None)
        assert run["tokens"] == y
        assert len(y) == 1 + sum(run["committed_per_step"])
        assert max(run["tree_nodes_per_step"]) == 9
        accepted += run["accepted_per_step"]
    assert len(set(accepted)) >= 3  # not vacuous: paths of several depths accepted
    # a stop token inside the tree ends the output where greedy does
    p, y = prompts[0], outputs[0]
    stop = [y[5]]
    want = greedy_generate(target, p, max_new_tokens=len(y), stop_ids=stop)
    got = tree_generate(target, trained_drafter, p, topk=2, num_steps=3, num_draft_tokens=6, max_new_tokens=len(y),
                        stop_ids=stop, aux_layer_ids=None)
    assert got["tokens"] == want and want[-1] == y[5]


def test_bad_tree_parameters_are_refused(setup, trained_drafter):
    target, prompts, _ = setup
    with pytest.raises(ValueError, match="num_draft_tokens - 1"):
        tree_generate(target, trained_drafter, prompts[0], topk=2, num_steps=2, num_draft_tokens=8,
                      max_new_tokens=4, stop_ids=[], aux_layer_ids=None)  # 2 + 4 candidates < 7
    with pytest.raises(ValueError, match="topk 0"):
        EagleTreeProposer(trained_drafter).propose_tree(0, 2, 2)
