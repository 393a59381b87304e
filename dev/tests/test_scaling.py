"""Tests for the data selection of dev/bench/scaling.py: the first N conversations of a feature
store whose samples extract sorted by length, and the subset store built from them."""

from __future__ import annotations

import pytest
import torch

from dev.bench.scaling import conversation_order, subset_features
from eyas.data.conversations import render_with_loss_mask
from eyas.features import FeatureStore, ShardWriter

H = 4  # hidden size of the fake features


def _chat(user: str, reply: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


# file order; lengths strictly decreasing, so the length-sorted store reverses them
CONVS = [_chat("Tell me a long story about a fox, a crow and a piece of cheese, in detail.",
               "Once upon a time a crow sat on a branch holding a piece of cheese, and a fox came by."),
         _chat("Tell me about cheese.", "Cheese is made from milk and it is tasty."),
         _chat("Hi", "Hello"),
         {"messages": [{"role": "user", "content": "no reply here"}]}]  # no supervised tokens: no sample


def _store(tok, tmp_path, convs, max_length=4096) -> tuple[FeatureStore, list[dict]]:
    """Features as extract writes them: rendered, unsupervised ones dropped, sorted by length;
    per-token tensors carry the sample's file position so a test can tell samples apart."""
    rendered = [(i, render_with_loss_mask(tok, c["messages"], max_length)) for i, c in enumerate(convs)]
    rendered = sorted([r for r in rendered if sum(r[1]["loss_mask"])], key=lambda r: len(r[1]["input_ids"]))
    w = ShardWriter(tmp_path / "full", shard_samples=2, dtype=torch.float32)  # 2 shards: crosses a border
    for i, r in rendered:
        n = len(r["input_ids"])
        w.add(torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"]), torch.full((n, 3 * H), float(i)),
              torch.full((n, H), float(i)), torch.full((n,), i))
    w.finish(aux_layers=[2, 15, 27], vocab_size=49152)
    return FeatureStore.open(tmp_path / "full"), [r for _, r in rendered]


def test_conversation_order_and_subset(smollm_tokenizer, tmp_path):
    store, rendered = _store(smollm_tokenizer, tmp_path, CONVS)
    # store order is [conv 2, conv 1, conv 0] (shortest first); conv 3 has no sample
    order = conversation_order(store, CONVS, smollm_tokenizer, 4096)
    assert order == [2, 1, 0]

    sub = subset_features(store, order[:2], tmp_path / "first2")  # conversations 0 and 1
    samples = list(sub.iter_samples())
    assert [int(s["target_argmax"][0]) for s in samples] == [1, 0]  # kept in the store's (length) order
    assert samples[1]["input_ids"].tolist() == rendered[2]["input_ids"]  # conversation 0, unchanged
    assert samples[1]["aux_hidden"].shape == (len(rendered[2]["input_ids"]), 3 * H)
    assert sub.manifest["num_samples"] == 2
    assert sub.manifest["num_tokens"] == len(rendered[1]["input_ids"]) + len(rendered[2]["input_ids"])
    assert sub.manifest["supervised_tokens"] == sum(rendered[1]["loss_mask"]) + sum(rendered[2]["loss_mask"])
    assert sub.manifest["aux_layers"] == [2, 15, 27] and sub.manifest["subset_indices"] == [1, 2]
    assert subset_features(store, order, tmp_path / "all") is store  # every sample: the store itself


def test_conversation_order_refuses_other_data(smollm_tokenizer, tmp_path):
    store, _ = _store(smollm_tokenizer, tmp_path, CONVS)
    with pytest.raises(ValueError, match="only 2 of 3 samples match"):
        conversation_order(store, CONVS[1:], smollm_tokenizer, 4096)
