"""eyas/vocab/: the vocab mapping (mapping.py): the validator on hand-worked good and bad mappings,
and build_mapping on a small corpus whose counts, top-k, ties and coverage are worked out by hand;
and remapping a drafter's lm_head between vocab mappings (remap.py), and the failure it prevents."""

import dataclasses
import logging
import math

import pytest
import torch

from eyas.drafter.model import DrafterConfig, Eagle3Drafter
from eyas.export.eagle import ExportError, check_served_tensors
from eyas.params.full import default_params
from eyas.tracking.runs import Tracker
from eyas.training.batches import PackedLoader, head_rows_for
from eyas.training.loop import GateError, new_drafter, step0_gate, train_drafter
from eyas.training.unroll import TTTUnroll, evaluate
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
from eyas.vocab.remap import naive_lm_head, remap_lm_head
from tests.tiny import tiny_target, write_features

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


# --- remap: an lm_head moved between mappings ------------------------------------------------

def mapping_from_targets(tids, vocab):
    tids = torch.tensor(tids)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[tids] = True
    return VocabMapping(tids - torch.arange(len(tids)), t2d)


def test_remap_hand_worked():
    # old draft ids -> target ids [7, 2, 5] (frequency order); new -> [2, 3, 7] (target-id order)
    old = mapping_from_targets([7, 2, 5], 10)
    new = mapping_from_targets([2, 3, 7], 10)
    assert old.d2t.tolist() == [7, 1, 3] and new.d2t.tolist() == [2, 2, 5]
    old_head = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    target_head = torch.stack([torch.tensor([float(t), 0.0]) for t in range(10)])
    counts = torch.zeros(10, dtype=torch.int64)
    counts[2], counts[3], counts[7] = 5, 3, 2
    rows, report = remap_lm_head(old_head, old, new, target_head, counts)
    # new row 0 (token 2) <- old row 1; new row 2 (token 7) <- old row 0, bit-exact
    assert torch.equal(rows[0], old_head[1]) and torch.equal(rows[2], old_head[0])
    # new row 1 (token 3) <- target row 3 = [3, 0] rescaled to the carried rows' mean norm (1.0)
    assert torch.allclose(rows[1], torch.tensor([1.0, 0.0]))
    assert report["positions_agree"] == 0
    assert report["shared_tokens"] == 2
    assert report["rows_carried"] == 2 and report["rows_initialised"] == 1
    assert report["carried_token_coverage"] == pytest.approx(0.7)


def test_naive_keeps_rows_in_place():
    old_head = torch.arange(6.0).view(3, 2)
    assert torch.equal(naive_lm_head(old_head, 2), old_head[:2])
    padded = naive_lm_head(old_head, 4)
    assert torch.equal(padded[:3], old_head) and torch.equal(padded[3], torch.zeros(2))


def test_mappings_over_different_vocabs_are_refused():
    with pytest.raises(ValueError, match="different target vocabs"):
        remap_lm_head(torch.zeros(2, 2), mapping_from_targets([0, 1], 4),
                      mapping_from_targets([0, 1], 5), torch.zeros(5, 2))


@pytest.fixture(scope="module")
def two_mappings(tmp_path_factory):
    """Features from a tiny target; mapping A (frequency order, data slice A) and mapping B
    (target-id order, other data) that share most tokens but agree on few positions."""
    root = tmp_path_factory.mktemp("remap")
    target = tiny_target()
    train = write_features(target, root / "train", 24, seed=1)
    val = write_features(target, root / "val", 6, seed=2)
    ids, mask = train.token_stats()
    map_a, _ = build_mapping(count_tokens(ids, mask, 128), 96, order="frequency")
    ids_v, mask_v = val.token_stats()
    counts_b = count_tokens(torch.cat([ids_v, ids[:200]]), torch.cat([mask_v, mask[:200]]), 128)
    map_b, _ = build_mapping(counts_b, 96, order="target_id")
    head = target.head_weights()
    return target, train, val, map_a, map_b, head


def test_fine_tuning_failure_reproduced_and_fixed(two_mappings):
    target, train, val, map_a, map_b, head = two_mappings
    tp = dataclasses.replace(default_params().train, ttt_length=2, batch_tokens=96, epochs=4, eval_every=1000,
                             warmup_ratio=0.0, checkpoint_every=0)
    src = new_drafter(train.manifest, map_a, head["embed_tokens"], seed=0)
    train_drafter(src, train_store=train, val_store=val, lm_head=head["lm_head"], tp=tp, lr=1e-2,
                  seed=0, tracker=Tracker(), device=torch.device("cpu"))

    ta, tb = map_a.target_ids(), map_b.target_ids()
    agree = int((ta == tb).sum())
    assert agree < 20  # few positions agree ...
    assert len(set(ta.tolist()) & set(tb.tolist())) > 70  # ... although most tokens are shared

    loader = PackedLoader(val, 96, 0, shuffle=False)

    def loss0(d):
        return evaluate(TTTUnroll(d, head_rows_for(head["lm_head"], d), 2, 0.8), loader, "cpu")

    def under_b(rows):
        d = new_drafter(train.manifest, map_b, head["embed_tokens"], seed=0)
        d.load_state_dict({k: v for k, v in src.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")},
                          strict=False)
        d.lm_head.weight.data.copy_(rows)
        return d

    own = loss0(src)
    naive = loss0(under_b(naive_lm_head(src.lm_head.weight.data, 96)))
    rows, _ = remap_lm_head(src.lm_head.weight.data, map_a, map_b, head["lm_head"])
    remapped = loss0(under_b(rows))
    chance = math.log(96)
    assert own["loss_0"] < chance - 0.5  # the source learned something
    assert naive["loss_0"] > chance - 0.5  # rows in place: near chance
    assert abs(remapped["loss_0"] - own["loss_0"]) < 0.25  # remap recovers the source's loss
    assert remapped["acc_0"] > own["acc_0"] - 0.05  # and its accuracy
    assert naive["acc_0"] < own["acc_0"] / 2

    gate = step0_gate(96, margin=0.5, min_acc=0.05, override=False)
    with pytest.raises(GateError, match="vocab mapping"):
        gate(naive)
    gate(remapped)  # passes


class _Metrics:
    def __init__(self):
        self.logged = {}

    def log_metrics(self, m):
        self.logged.update(m)


def test_gate_passes_a_domain_shift_and_refuses_chance_accuracy(caplog):
    """A loss near chance with real accuracy is what a source trained on other data gives: the CPU
    default's remap at 4,096 draft ids with 3x the code (README, the data recipe), loss_0 7.871 over
    ln(4096) - 0.5 = 7.818 at acc_0 0.068. It warns and trains; accuracy at chance refuses whatever
    the loss."""
    tracker = _Metrics()
    gate = step0_gate(4096, margin=0.5, min_acc=0.05, override=False, tracker=tracker)
    with caplog.at_level(logging.WARNING, logger="eyas.training.loop"):
        gate({"loss_0": 7.871, "acc_0": 0.068})
    assert "other data" in caplog.text and "partly wrong vocab mapping" in caplog.text and "step0_val" in caplog.text
    assert tracker.logged == {"gate/fired": 0.0, "gate/loss_near_chance": 1.0, "gate/chance_loss": math.log(4096)}
    caplog.clear()
    bar = math.log(4096) - 0.5
    with caplog.at_level(logging.WARNING, logger="eyas.training.loop"):
        gate({"loss_0": bar, "acc_0": 0.068})  # at the bar, not over it: no warning
    assert caplog.text == "" and tracker.logged["gate/loss_near_chance"] == 0.0
    with pytest.raises(GateError, match="predicts at chance"):
        gate({"loss_0": 8.55, "acc_0": 0.0006})
    assert tracker.logged == {"gate/fired": 1.0, "gate/loss_near_chance": 1.0, "gate/chance_loss": math.log(4096)}
    with pytest.raises(GateError, match="predicts at chance"):  # a low loss does not excuse chance accuracy
        gate({"loss_0": 5.0, "acc_0": 0.0004})
    with pytest.raises(GateError, match="above chance but under the floor") as under:
        gate({"loss_0": 6.0, "acc_0": 0.049})
    assert "other data" in str(under.value) and "vocab mapping" in str(under.value)


@pytest.mark.parametrize("vocab,acc", [(4096, 0.000555), (6144, 0.000595)])
def test_gate_refuses_rows_in_place_with_no_floor(vocab, acc):
    """Rows left in place (remap's naive_rows_in_place, metrics/remap.json at 4,096 and 6,144 draft
    ids) score 2.3x and 3.7x uniform chance, skewed token frequencies: a floor of 0 (allowed) must
    still refuse them. With the loss near chance, 10 / V is the chance bar (eyas.training.loop); with a low
    loss, 2 / V (a trained drafter on a small vocab sits at 6x uniform chance: the test above)."""
    with pytest.raises(GateError, match="predicts at chance") as e:
        step0_gate(vocab, 0.5, 0.0, False)({"loss_0": 8.7, "acc_0": acc})
    assert f"10 / {vocab}" in str(e.value) and f"{acc:.5f}" in str(e.value)
    step0_gate(vocab, 0.5, 0.0, False)({"loss_0": 8.7, "acc_0": 11 / vocab})  # above the bar: passes
    step0_gate(vocab, 0.5, 0.0, False)({"loss_0": 5.0, "acc_0": acc})  # a low loss: 2 / V is the bar
    with pytest.raises(GateError, match="2 / "):
        step0_gate(vocab, 0.5, 0.0, False)({"loss_0": 5.0, "acc_0": 2 / vocab})


def test_gate_bar_stays_reachable_on_a_tiny_vocab():
    """2 / V and 10 / V reach 1 at V = 2 and V = 10: the chance bar is capped at a coin flip."""
    step0_gate(2, 0.5, 0.0, False)({"loss_0": 0.1, "acc_0": 1.0})
    step0_gate(10, 0.5, 0.0, False)({"loss_0": 2.0, "acc_0": 0.99})
    with pytest.raises(GateError, match="predicts at chance"):
        step0_gate(2, 0.5, 0.0, False)({"loss_0": 0.1, "acc_0": 0.5})


def test_gate_override_warns_instead(caplog):
    with caplog.at_level(logging.WARNING, logger="eyas.training.loop"):
        step0_gate(4096, 0.5, 0.05, override=True)({"loss_0": 8.55, "acc_0": 0.0006})
    assert "predicts at chance" in caplog.text and "(overridden)" in caplog.text


@pytest.mark.parametrize("m,near", [({"loss_0": float("nan"), "acc_0": 0.5}, 0.0),
                                    ({"loss_0": 9.0, "acc_0": float("nan")}, 1.0),
                                    ({"loss_0": float("inf"), "acc_0": 0.3}, 1.0),
                                    ({"loss_0": float("-inf"), "acc_0": 0.5}, 0.0)])
def test_gate_fires_on_non_finite_metrics(m, near, caplog):
    tracker = _Metrics()
    with pytest.raises(GateError, match="not finite"):
        step0_gate(4096, 0.5, 0.05, override=False, tracker=tracker)(m)
    assert tracker.logged == {"gate/fired": 1.0, "gate/loss_near_chance": near, "gate/chance_loss": math.log(4096)}
    with caplog.at_level(logging.WARNING, logger="eyas.training.loop"):  # overridden: warns, with the same message
        step0_gate(4096, 0.5, 0.05, override=True)(m)
    assert "not finite" in caplog.text and "(overridden)" in caplog.text


@pytest.mark.parametrize("vocab,margin", [(4096, -1.0), (96, 10.0), (96, math.log(96)), (1, 0.5)])
def test_gate_refuses_a_margin_outside_0_to_chance(vocab, margin):
    with pytest.raises(ValueError, match="gate_margin"):
        step0_gate(vocab, margin, 0.05, override=False)


def test_train_drafter_loss_decreases(two_mappings):
    _, train, val, map_a, _, head = two_mappings
    tp = dataclasses.replace(default_params().train, ttt_length=2, batch_tokens=96, epochs=2, eval_every=1000,
                             checkpoint_every=0)
    d = new_drafter(train.manifest, map_a, head["embed_tokens"], seed=0)
    r = train_drafter(d, train_store=train, val_store=val, lm_head=head["lm_head"],
                      tp=dataclasses.replace(tp), lr=1e-2, seed=0, tracker=Tracker(),
                      device=torch.device("cpu"))
    assert r.step0_val["loss_0"] == pytest.approx(math.log(96), abs=0.3)  # random init: chance
    assert r.final_val["loss_0"] < r.step0_val["loss_0"] - 0.3
    assert r.steps == sum(PackedLoader(train, 96, 0).num_batches(e) for e in range(2))


def test_a_new_drafter_starts_with_the_targets_lm_head_rows(two_mappings):
    """new_drafter(lm_head=...) copies the target's lm_head rows of each draft id (target id =
    draft id + d2t[draft id]), in draft-id order; without it the head is random."""
    target, train, val, map_a, map_b, head = two_mappings
    d = new_drafter(train.manifest, map_a, head["embed_tokens"], seed=0, lm_head=head["lm_head"])
    tids = torch.arange(map_a.draft_vocab_size) + map_a.d2t  # computed here, not through the drafter
    assert torch.equal(d.lm_head.weight, head["lm_head"][tids])
    assert not torch.equal(d.lm_head.weight, head["lm_head"][torch.arange(map_a.draft_vocab_size)])  # frequency order
    r = new_drafter(train.manifest, map_a, head["embed_tokens"], seed=0)
    assert not torch.equal(r.lm_head.weight, d.lm_head.weight)
    with pytest.raises(Exception, match="lm_head has 5 rows"):
        new_drafter(train.manifest, map_a, head["embed_tokens"], seed=0, lm_head=head["lm_head"][:5])
