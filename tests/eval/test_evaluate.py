"""The eval's front door (eyas.eval.evaluate.evaluate_drafter) called directly on the tiny target.

Its figures are held to runs made here independently (speculative_generate with the drafter and
with prompt lookup, pooled per benchmark; the decoding-modes table's greedy chain row on the first
prompt) and to the values stages/eval_accept_len.py wrote on these fixtures before the eval moved
out of the stage. Negative controls: an untrained drafter through the same door gives other
figures (each again equal to its own independent runs), and a drafter built for another target
(layers, vocab, hidden size) or benchmarks with nothing to measure are refused by name before anything
is decoded; a stored chain part the eval cannot read is recomputed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from eyas.eval.evaluate import EvalError, EvalFiles, evaluate_drafter
from eyas.eval.speculative import NgramProposer, acceptance_length, speculative_generate
from eyas.params.full import default_params
from eyas.pipeline.resume import Parts
from tests.tiny import trained_drafter

K, MAX_NEW, MODES_NEW = 3, 12, 8
SETTINGS = {"max_prompt_tokens": 0, "prompts_shortened": 0, "prompts_dropped_too_long": 0}
# what the stage's own loop (stages/eval_accept_len.py `run`, before evaluate_drafter) wrote for this
# drafter and these params: accept_len and the n-gram floor per benchmark, the modes table's greedy chain row
BEFORE = {"chat": (11 / 8, 22 / 17, 7 / 5), "humaneval": (22 / 13, 22 / 15, 7 / 4)}


def _params():
    p = default_params()
    return dataclasses.replace(
        p, eval=dataclasses.replace(p.eval, num_draft_tokens=K, max_new_tokens=MAX_NEW, timed_prompts=1,
                                    timing_repeats=1, batch_size=2, served_prompts=1, served_max_new_tokens=MODES_NEW,
                                    temperatures=[0.0, 0.8], top_p=0.9, seeds=[3], tree_topk=2, tree_num_steps=K,
                                    tree_num_draft_tokens=6),
        serve=dataclasses.replace(p.serve, engine="none"))


def _files(tmp_path: Path) -> EvalFiles:
    return EvalFiles(drafter=tmp_path / "models/x", drafter_gguf=tmp_path / "models/x.gguf",
                     target_gguf=tmp_path / "models/target_gguf", work=tmp_path / "work")


def _pooled(target, proposer, prompts, max_new):
    steps = [c for p in prompts for c in speculative_generate(
        target, proposer, p, num_draft_tokens=K, max_new_tokens=max_new, stop_ids=target.stop_ids,
        aux_layer_ids=None)["committed_per_step"]]
    return acceptance_length(steps)


def _evaluate(tmp_path, target, drafter, benchmarks):
    """evaluate_drafter with a fresh parts file; returns (metrics, logged metrics, parts file)."""
    logged: dict = {}
    parts = Parts(tmp_path / "work" / "parts.json", {"test": tmp_path.name})
    metrics = evaluate_drafter("x", _params(), target, drafter, benchmarks, parts, _files(tmp_path), logged.update)
    return metrics, logged, parts


@pytest.fixture(scope="module")
def tiny(tiny_greedy):
    target, prompts, outputs = tiny_greedy
    benchmarks = {"chat": (prompts[:2], SETTINGS), "humaneval": (prompts[2:], SETTINGS)}
    return target, prompts, outputs, benchmarks


def test_the_front_door_gives_the_figures_of_independent_runs(tiny, tmp_path, capsys):
    target, prompts, outputs, benchmarks = tiny
    drafter = trained_drafter(target, prompts, outputs, K, steps=30)
    metrics, logged, parts = _evaluate(tmp_path, target, drafter, benchmarks)
    assert sorted(metrics) == ["chat", "drafter", "humaneval", "ngram", "served"] and metrics["drafter"] == "x"
    for bench, (bench_prompts, _) in benchmarks.items():
        r, n, rows = metrics[bench], metrics["ngram"][bench], metrics["served"][bench]["rows"]
        eagle = _pooled(target, drafter, bench_prompts, MAX_NEW)
        ngram = _pooled(target, NgramProposer(), bench_prompts, MAX_NEW)
        modes = _pooled(target, drafter, bench_prompts[:1], MODES_NEW)
        assert (r["accept_len"], n["accept_len"], rows["eagle/chain/T0"]["accept_len"]) == (eagle, ngram, modes)
        assert (eagle, ngram, modes) == pytest.approx(BEFORE[bench], abs=1e-12), bench
        assert r["lossless"] is True and r["oracle_matches_real"] is True and r["settings"]["max_prompt_tokens"] == 0
        assert rows["eagle/tree/T0"]["matches_greedy"] is True
        assert r["serving_verdict"]["beats_ngram_floor"] == (eagle > ngram)  # judged here, from the parts
        assert logged[f"{bench}/accept_len"] == eagle and logged[f"{bench}/ngram_accept_len"] == ngram
        assert logged[f"{bench}/served/eagle/chain/T0/accept_len"] == modes
    assert parts.names == ["chat/chain", "chat/served", "humaneval/chain", "humaneval/served"]
    # the parts file holds measurements only; writing the metrics file is the stage's
    assert "serving_verdict" not in parts.get("chat/chain")["eagle"] and not (tmp_path / "metrics").exists()
    assert f"eval x chat: accept_len {BEFORE['chat'][0]} (n-gram {BEFORE['chat'][1]})" in capsys.readouterr().out

    # negative control: an untrained drafter, through the same door, gives its own (other) figures
    untrained = trained_drafter(target, prompts, outputs, K, steps=0)
    other, _, _ = _evaluate(tmp_path / "untrained", target, untrained, benchmarks)
    chat = benchmarks["chat"][0]
    assert other["chat"]["accept_len"] == _pooled(target, untrained, chat, MAX_NEW) != metrics["chat"]["accept_len"]
    assert other["ngram"] == metrics["ngram"]  # the floor does not depend on the drafter


def test_a_drafter_of_another_target_is_refused_by_name(tiny, tmp_path):
    target, prompts, outputs, benchmarks = tiny
    drafter = trained_drafter(target, prompts, outputs, K, steps=0)
    drafter.config.num_target_layers += 1
    with pytest.raises(EvalError, match=rf"{tmp_path / 'models/x'}: built for a target with "
                                        rf"{target.num_layers + 1} layers .* this target has {target.num_layers}"):
        _evaluate(tmp_path, target, drafter, benchmarks)
    assert Parts(tmp_path / "work" / "parts.json", {"test": tmp_path.name}).names == []  # nothing decoded


@pytest.mark.parametrize("change, says", [
    ({"target_hidden_size": 8}, "hidden size 40"),  # its fc reads aux hidden states of another width
    ({"hidden_size": 8}, "embedding width 40"),  # it shares an input embedding of another width
])
def test_a_drafter_of_another_hidden_size_is_refused_by_name(tiny, tmp_path, change, says):
    """Before: a RuntimeError of torch's matmul shapes (another target_hidden_size) or a ValueError naming
    no file (another hidden_size), tracebacks through the stage; now an EvalError naming the drafter's
    directory and both figures, before anything is decoded."""
    from eyas.drafter.model import DrafterConfig, Eagle3Drafter
    from tests.tiny import VOCAB
    target = tiny[0]
    cfg = DrafterConfig.for_target(target.model.config, draft_vocab_size=VOCAB)
    width = target.config.hidden_size
    assert width == 32  # the tiny target's, so 40 below is the drafter's
    drafter = Eagle3Drafter(dataclasses.replace(cfg, **{k: getattr(cfg, k) + v for k, v in change.items()}))
    with pytest.raises(EvalError, match=rf"^{tmp_path / 'models/x'}: built for a target with .*{says}.*\); "
                                        rf"this target has {target.num_layers} layers \(vocab .*hidden size {width}, "
                                        rf"embedding width {width}\)$"):
        _evaluate(tmp_path, target, drafter, tiny[3])
    assert Parts(tmp_path / "work" / "parts.json", {"test": tmp_path.name}).names == []  # nothing decoded


@pytest.mark.parametrize("benchmarks, says", [
    ({}, "eval x: no benchmark to evaluate"),
    ({"chat": ([], {**SETTINGS, "max_prompt_tokens": 16, "prompts_dropped_too_long": 3}),
      "humaneval": ([[5]], SETTINGS)},
     "eval x chat: no prompt to evaluate (3 dropped as longer than eval.max_prompt_tokens 16: raise it, or 0 for "
     "no budget)"),
    ({"chat": ([[5, 6]], SETTINGS), "humaneval": ([], SETTINGS)}, "eval x humaneval: no prompt to evaluate"),
    ({"chat": ([[5, 6], [], [7]], SETTINGS)}, "eval x chat: prompts [1] hold no token"),
])
def test_benchmarks_with_nothing_to_measure_are_refused_before_decoding(tiny, tmp_path, benchmarks, says):
    """Before: no benchmark gave metrics with no acceptance at all, silently; a benchmark whose prompts the
    budget all dropped decoded its chain part and then stopped on ValueError 'evaluate_modes: no prompts',
    and an empty prompt on the decoder's 'empty prompt' ValueError, neither naming the benchmark."""
    target, prompts, outputs, _ = tiny
    drafter = trained_drafter(target, prompts, outputs, K, steps=0)
    with pytest.raises(EvalError) as err:
        _evaluate(tmp_path, target, drafter, benchmarks)
    assert str(err.value) == says
    assert Parts(tmp_path / "work" / "parts.json", {"test": tmp_path.name}).names == []


def test_a_stored_chain_part_the_eval_cannot_read_is_recomputed(tiny, tmp_path, capsys):
    """A parts file under the same resume key whose chain part lacks a key the report reads, or holds a
    position-0 rate above 1, is dropped and recomputed (before: KeyError 'repetition' / ValueError after the
    chain part was taken as valid); a real part is resumed."""
    target, prompts, outputs, benchmarks = tiny
    drafter = trained_drafter(target, prompts, outputs, K, steps=0)
    one = {"chat": benchmarks["chat"]}
    metrics, _, parts = _evaluate(tmp_path, target, drafter, one)
    real = parts.get("chat/chain")
    for broken in ({**real, "eagle": {k: v for k, v in real["eagle"].items() if k != "repetition"}},
                   {**real, "eagle": {**real["eagle"], "per_position_accept_rate": [1.5, 0.2, 0.1]}},
                   {**real, "eagle": {**real["eagle"], "num_verify_steps": "many"}}):
        parts.add("chat/chain", broken)
        capsys.readouterr()
        again, _, _ = _evaluate(tmp_path, target, drafter, one)
        out = capsys.readouterr().out
        assert "part 'chat/chain' is not a result of this stage: recomputing it" in out, out
        assert again["chat"]["accept_len"] == metrics["chat"]["accept_len"]
    capsys.readouterr()
    _evaluate(tmp_path, target, drafter, one)
    assert "eval x chat: chain resumed from" in capsys.readouterr().out  # the real part, kept
