"""The vocab mapping: the validator on hand-worked good and bad mappings, and build_mapping on a
small corpus whose counts, top-k, ties and coverage are worked out by hand."""

import logging

import pytest
import torch

from eyas.drafter.model import DrafterConfig, Eagle3Drafter
from eyas.export.eagle import ExportError, check_served_tensors
from eyas.vocab.mapping import (
    VocabError,
    VocabMapping,
    build_mapping,
    compare_mappings,
    count_tokens,
    load_mapping,
    save_mapping,
    validate_mapping,
)

V = 16


def mask(*ids, n=V) -> torch.Tensor:
    m = torch.zeros(n, dtype=torch.bool)
    m[list(ids)] = True
    return m


def d2t(*xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


# --- validate_mapping ------------------------------------------------------------------------

def test_valid_offsets_pass():
    # target ids i + d2t[i] = 0+1, 1+2, 2+3, 3+4 = 1, 3, 5, 7: exactly the t2d marks
    validate_mapping(d2t(1, 2, 3, 4), mask(1, 3, 5, 7), V, 4)
    # d2t = [1, 1, 1, 1] -> 1, 2, 3, 4
    validate_mapping(d2t(1, 1, 1, 1), mask(1, 2, 3, 4), V, 4)
    # negative offsets are fine (frequency order): [5, 2, 1, 0] = draft ids ordered by frequency
    validate_mapping(d2t(5, 1, -1, -3), mask(0, 1, 2, 5), V)


def test_absolute_ids_are_named():
    # d2t stored as ABSOLUTE ids [1, 3, 5, 7]: targets 0+1, 1+3, 2+5, 3+7 = 1, 4, 7, 10
    # index 0 -> 1 is marked; index 1 -> 4 is not: first bad index is 1
    with pytest.raises(VocabError, match=r"draft index 1 maps to target id 4.*ABSOLUTE"):
        validate_mapping(d2t(1, 3, 5, 7), mask(1, 3, 5, 7), V, 4, source="ckpt")


@pytest.mark.parametrize("offsets, t2d, pattern", [
    # out of range: 3 + 13 = 16 >= V (indices 0..2 map to 1, 3, 5)
    ((1, 2, 3, 13), mask(1, 3, 5, 7), r"draft index 3 maps to target id 16, outside \[0, 16\)"),
    # negative: 0 + (-1) = -1 at index 0
    ((-1, 2, 3, 4), mask(1, 3, 5, 7), r"draft index 0 maps to target id -1"),
    # duplicate: 0+1 = 1 and 1+0 = 1
    ((1, 0, 3, 4), mask(1, 3, 5, 7), r"draft indices 0 and 1 both map to target id 1"),
    # duplicate later: 1, 3, 5, then 3+2 = 5 again
    ((1, 2, 3, 2), mask(1, 3, 5, 7), r"draft indices 2 and 3 both map to target id 5"),
    # t2d mismatch: targets 1, 3, 5, 7 but t2d marks 8 instead of 7 -> index 3
    ((1, 2, 3, 4), mask(1, 3, 5, 8), r"draft index 3 maps to target id 7, which t2d does not mark"),
    # t2d count wrong: five marks for four draft ids
    ((1, 2, 3, 4), mask(1, 3, 5, 7, 9), r"t2d has 5 true entries, d2t has 4"),
    # t2d of the wrong length
    ((1, 2, 3, 4), mask(1, 3, 5, 7, n=20), r"t2d must be a bool mask of length 16"),
])
def test_bad_mappings_name_the_first_bad_index(offsets, t2d, pattern):
    with pytest.raises(VocabError, match=pattern) as e:
        validate_mapping(d2t(*offsets), t2d, V, 4, source="my.safetensors")
    assert "my.safetensors" in str(e.value)
    assert "ABSOLUTE" not in str(e.value)


def test_dtype_and_size_errors():
    with pytest.raises(VocabError, match="1-D integer"):
        validate_mapping(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask(1, 3, 5, 7), V)
    with pytest.raises(VocabError, match="1-D integer"):
        validate_mapping(torch.ones(4, dtype=torch.bool), None, V)
    with pytest.raises(VocabError, match="t2d must be a bool"):
        validate_mapping(d2t(1, 2, 3, 4), mask(1, 3, 5, 7).long(), V)
    with pytest.raises(VocabError, match="d2t has 4 entries, the config says draft_vocab_size 8"):
        validate_mapping(d2t(1, 2, 3, 4), mask(1, 3, 5, 7), V, 8)


def test_reduced_vocab_without_d2t_is_an_export_error():
    c = DrafterConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=4, vocab_size=V, draft_vocab_size=4, target_hidden_size=8, num_target_layers=8)
    d = Eagle3Drafter(c)
    d.set_vocab(d2t(1, 2, 3, 4), mask(1, 3, 5, 7))
    tensors = dict(d.state_dict_for_export())
    check_served_tensors(tensors, c, "ok")  # complete: passes
    del tensors["d2t"]
    with pytest.raises(ExportError, match=r"missing tensor\(s\) \['d2t'\]"):
        check_served_tensors(tensors, c, "ckpt")
    # and absolute ids in the drafter's buffers are caught at export too
    tensors = dict(d.state_dict_for_export(), d2t=d2t(1, 3, 5, 7))
    with pytest.raises(VocabError, match="ABSOLUTE"):
        check_served_tensors(tensors, c, "ckpt")


# --- build_mapping on a hand-worked corpus -----------------------------------------------------

# position:   0  1  2  3  4  5  6  7  8  9
IDS = torch.tensor([5, 3, 5, 7, 3, 5, 2, 9, 7, 1])
LM = torch.tensor([0, 1, 1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
# assistant tokens: 3, 5, 7, 3, 5, 2, 7, 1 -> counts 1:1, 2:1, 3:2, 5:2, 7:2 (5 at 0 and 9 at 7 masked)


def test_count_tokens_by_hand():
    c = count_tokens(IDS, LM, 10)
    assert c.tolist() == [0, 1, 1, 2, 0, 2, 0, 2, 0, 0]


def test_build_mapping_target_id_order_by_hand():
    counts = count_tokens(IDS, LM, 10)
    m, info = build_mapping(counts, 4, order="target_id")
    # top-4: 3, 5, 7 (count 2) then count-1 tie between 1 and 2 -> lower id 1 wins
    assert m.target_ids().tolist() == [1, 3, 5, 7]
    assert m.d2t.tolist() == [1, 2, 3, 4]  # 1-0, 3-1, 5-2, 7-3
    assert m.d2t.dtype == torch.int64 and m.t2d.dtype == torch.bool
    assert m.t2d.nonzero().flatten().tolist() == [1, 3, 5, 7]
    assert info["coverage"] == pytest.approx(7 / 8)  # 2+2+2+1 of 8 assistant tokens
    assert info["distinct_tokens"] == 5 and info["padded"] == 0 and info["assistant_tokens"] == 8
    validate_mapping(m.d2t, m.t2d, 10, 4)


def test_build_mapping_frequency_order_by_hand():
    counts = count_tokens(IDS, LM, 10)
    m, info = build_mapping(counts, 4, order="frequency")
    assert m.target_ids().tolist() == [3, 5, 7, 1]  # by count, ties by lower id
    assert m.d2t.tolist() == [3, 4, 5, -2]          # 3-0, 5-1, 7-2, 1-3
    assert m.t2d.nonzero().flatten().tolist() == [1, 3, 5, 7]
    validate_mapping(m.d2t, m.t2d, 10, 4)
    # same tokens as the target-id order, different positions: compare through target ids
    a, _ = build_mapping(counts, 4, order="target_id")
    cmp = compare_mappings(a, m)
    assert cmp["shared_tokens"] == 4
    assert cmp["positions_agree"] == 0  # [1,3,5,7] vs [3,5,7,1]


def test_build_mapping_unknown_order_and_size():
    counts = count_tokens(IDS, LM, 10)
    with pytest.raises(VocabError, match="order"):
        build_mapping(counts, 4, order="alphabetical")
    with pytest.raises(VocabError, match="draft_vocab_size 11"):
        build_mapping(counts, 11)


def test_too_few_distinct_tokens_warns_pads_and_records_coverage(caplog, tmp_path):
    # 6 distinct assistant tokens {2, 4, 6, 8, 10, 12} with counts 3, 1, 2, 1, 1, 5 (13 tokens)
    ids = torch.tensor([2, 2, 2, 4, 6, 6, 8, 10, 12, 12, 12, 12, 12, 0, 1])
    lm = torch.tensor([1] * 13 + [0, 0], dtype=torch.bool)  # 0 and 1 are user tokens: not counted
    counts = count_tokens(ids, lm, 20)
    with caplog.at_level(logging.WARNING, logger="eyas.vocab.mapping"):
        m, info = build_mapping(counts, 8)
    assert "only 6 distinct assistant tokens for a draft vocab of 8" in caplog.text
    # padded with the lowest UNSEEN target ids: 0 and 1 (unseen as assistant tokens)
    assert m.target_ids().tolist() == [0, 1, 2, 4, 6, 8, 10, 12]
    assert info["padded"] == 2 and info["distinct_tokens"] == 6
    assert info["coverage"] == 1.0
    validate_mapping(m.d2t, m.t2d, 20, 8)
    # deterministic: the same counts give the same mapping
    m2, _ = build_mapping(counts.clone(), 8)
    assert torch.equal(m.d2t, m2.d2t) and torch.equal(m.t2d, m2.t2d)
    # and coverage is recorded on disk
    save_mapping(tmp_path / "v", m, counts, info)
    back, back_counts = load_mapping(tmp_path / "v")
    assert torch.equal(back.d2t, m.d2t) and torch.equal(back_counts, counts)
    import json
    assert json.loads((tmp_path / "v" / "vocab.json").read_text())["coverage"] == 1.0


def test_fill_counts_fill_the_draft_vocab_with_the_datas_most_frequent_other_tokens(caplog):
    """Fewer distinct assistant tokens than draft ids: the rest are the data's most frequent other
    tokens (user token 15 three times, then 0 and 1 once each: the lower id first), and only ids
    unseen in both are padded, lowest first (3). Assistant ids still come first: 8 draft ids hold
    the 6 assistant ids, 15 and 0."""
    ids = torch.tensor([2, 2, 2, 4, 6, 6, 8, 10, 12, 12, 12, 12, 12, 0, 1, 15, 15, 15])
    lm = torch.tensor([1] * 13 + [0] * 5, dtype=torch.bool)
    counts, every = count_tokens(ids, lm, 20), count_tokens(ids, torch.ones_like(lm), 20)
    m, info = build_mapping(counts, 8, fill_counts=every)
    assert m.target_ids().tolist() == [0, 2, 4, 6, 8, 10, 12, 15]
    assert (info["distinct_tokens"], info["filled"], info["padded"]) == (6, 2, 0) and info["coverage"] == 1.0
    with caplog.at_level(logging.WARNING, logger="eyas.vocab.mapping"):
        m, info = build_mapping(counts, 10, order="frequency", fill_counts=every)
    assert m.target_ids().tolist() == [12, 2, 6, 4, 8, 10, 15, 0, 1, 3]
    assert (info["filled"], info["padded"]) == (3, 1)
    assert ("only 6 distinct assistant tokens (+3 other tokens of the data) for a draft vocab of 10: the last 1 "
            "slots are padded with the lowest target ids never seen in the data") in caplog.text
    validate_mapping(m.d2t, m.t2d, 20, 10)
    with pytest.raises(VocabError, match="fill_counts has shape"):
        build_mapping(counts, 8, fill_counts=every[:10])
    # counts that are not counts: a float fill would be truncated (0.9 -> 0), a negative one ranked
    with pytest.raises(VocabError, match="fill_counts must be non-negative integer counts, got dtype torch.float32"):
        build_mapping(counts, 8, fill_counts=every.float() / 10)
    with pytest.raises(VocabError, match="counts must be non-negative integer counts.*min -10"):
        build_mapping(torch.tensor([-10, 5, 0, 3]), 2)
    # enough distinct assistant ids: fill_counts changes nothing, not even the tie at the cut
    # (ids 1, 2, 3 have one assistant token each; id 3 is frequent elsewhere)
    few, other = torch.tensor([0, 1, 1, 1, 5]), torch.tensor([0, 1, 1, 9, 5])
    assert build_mapping(few, 3, fill_counts=other)[0].target_ids().tolist() == [1, 2, 4]
    assert build_mapping(few, 3)[0].target_ids().tolist() == [1, 2, 4]


def test_load_mapping_refuses_absolute_file(tmp_path):
    bad = VocabMapping(d2t(1, 3, 5, 7), mask(1, 3, 5, 7))
    save_mapping(tmp_path / "v", bad, torch.zeros(V, dtype=torch.int64), {})
    with pytest.raises(VocabError, match="ABSOLUTE"):
        load_mapping(tmp_path / "v")
