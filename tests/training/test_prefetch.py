"""eyas/training/batches.py ``prefetch``: the training loop's batches packed by a background thread.

The prefetched loader yields exactly the plain loader's batches (several epochs, a resume start);
an exception of the loader (a bad shard) reaches the consumer naming the shard's file, with its
traceback; stopping early (a break, an exception, max_steps in train_drafter) leaves no thread
behind. On a GPU the batches come pinned and training on them equals training on unpinned ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import threading
import traceback
from pathlib import Path

import pytest
import torch
from tiny import tiny_target, write_features

from eyas.features import FeatureError, FeatureStore, ShardWriter
from eyas.params.full import default_params
from eyas.tracking.runs import Tracker
from eyas.training.batches import TENSOR_FIELDS, PackedLoader, prefetch
from eyas.training.loop import Trainer, new_drafter, train_drafter
from eyas.vocab.mapping import build_mapping, count_tokens

LENGTHS = [3, 11, 5, 2, 9, 7, 4, 12, 6, 1, 8, 10, 5, 3, 7, 2, 9, 4, 6, 11, 8, 5, 2, 7]


def _store(root: Path, lengths=LENGTHS, shard_samples: int = 5) -> FeatureStore:
    g = torch.Generator().manual_seed(0)
    w = ShardWriter(root, shard_samples=shard_samples, dtype=torch.float32)
    for n in lengths:
        w.add(torch.randint(0, 50, (n,), generator=g), (torch.rand(n, generator=g) > 0.4),
              torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g), torch.randint(0, 50, (n,), generator=g))
    w.finish(aux_layers=[1, 2], hidden_size=4, vocab_size=50)
    return FeatureStore.open(root)


def _ours() -> set:
    return {t for t in threading.enumerate() if t.name == "eyas-prefetch"}


def _same(a, b) -> None:
    assert a.sample_ids == b.sample_ids
    for k in TENSOR_FIELDS:
        assert getattr(a, k).dtype == getattr(b, k).dtype and torch.equal(getattr(a, k), getattr(b, k)), k


def test_prefetched_batches_equal_the_plain_loaders(tmp_path):
    """Three epochs and a mid-epoch resume start, depth 1 and 3: batch for batch the same tensors
    and samples. The useful tokens of an epoch are the samples' lengths summed (the packed
    batches hold more: row padding)."""
    loader = PackedLoader(_store(tmp_path / "s"), batch_tokens=24, seed=3)
    assert loader.row_tokens == 12 and loader.rows_per_batch == 2
    for epoch, start in ((0, 0), (1, 0), (2, 0), (1, 3)):
        plain = list(loader.batches(epoch, start=start))
        for depth in (1, 3):
            got = list(prefetch(loader.batches(epoch, start=start), depth, pin=False))
            assert len(got) == len(plain) == loader.num_batches(epoch) - start
            for a, b in zip(got, plain):
                _same(a, b)
        if start == 0:
            assert sum(b.useful_tokens() for b in plain) == sum(LENGTHS)
            assert sum(b.input_ids.numel() for b in plain) > sum(LENGTHS)
    assert not _ours()


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_bad_shard_raises_in_the_consumer_naming_the_file(tmp_path):
    """A shard cut short after the loader opened it: the consumer gets the batches before it, then
    FeatureError naming that file, with the loader's frames in its traceback; no thread is left."""
    store = _store(tmp_path / "s")
    loader = PackedLoader(store, batch_tokens=24, seed=3)
    plan = loader.plan(0)
    bad_shard = plan[2][0][0][0]  # the shard the third batch starts in
    first_bad = next(i for i, b in enumerate(plan) if any(si == bad_shard for row in b for si, _ in row))
    bad = store.root / store.manifest["shards"][bad_shard]["file"]
    _truncate(bad)
    for it in (loader.batches(0), prefetch(loader.batches(0), 2, pin=False)):
        got = []
        with pytest.raises(FeatureError, match=f"{bad}: cannot read this feature shard") as e:
            for b in it:
                got.append(b)
        assert len(got) == first_bad
        assert "read_shard" in [f.name for f in traceback.extract_tb(e.value.__traceback__)]
    assert not _ours()


def test_stopping_early_leaves_no_thread(tmp_path):
    """A consumer that breaks after two batches (the producer blocked on the full queue) and one
    that raises: the thread is joined when the generator closes."""
    loader = PackedLoader(_store(tmp_path / "s"), batch_tokens=24, seed=3)
    with contextlib.closing(prefetch(loader.batches(0), 2, pin=False)) as it:
        for i, _ in enumerate(it):
            if i == 1:
                break
        assert _ours()  # the producer is blocked on the full queue until the close
    assert not _ours()
    with pytest.raises(KeyError):
        with contextlib.closing(prefetch(loader.batches(1), 1, pin=False)) as it:
            next(it)
            raise KeyError("the consumer failed")
    assert not _ours()


def _mapping(train: FeatureStore):
    ids, mask = train.token_stats()
    return build_mapping(count_tokens(ids, mask, train.manifest["vocab_size"]), 64)[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = tiny_target()
    train = write_features(target, root / "train", 16, seed=1)
    val = write_features(target, root / "val", 4, seed=2)
    return target.head_weights(), train, val


def _run(tiny, device, tracker=None, **kw) -> tuple:
    head, train, val = tiny
    d = new_drafter(train.manifest, _mapping(train), head["embed_tokens"], seed=0)
    tp = dataclasses.replace(default_params().train, ttt_length=2, step_decay=0.8, batch_tokens=96,
                             warmup_ratio=0.0, grad_clip=1.0, eval_every=100, **kw)
    res = train_drafter(d, train_store=train, val_store=val, lm_head=head["lm_head"], tp=tp, lr=1e-3, seed=0,
                        tracker=tracker or Tracker(), device=torch.device(device))
    return res, d


class _Steps(Tracker):
    """Records the per-step metrics; at step 1 cuts ``corrupt`` short or raises ``fail``."""

    def __init__(self, corrupt: Path | None = None, fail: Exception | None = None):
        self.rows, self.corrupt, self.fail = [], corrupt, fail

    def log_metrics(self, metrics, step=None):
        if "train/loss" in metrics:
            self.rows.append(metrics)
            if self.corrupt is not None and step == 1:
                _truncate(self.corrupt)
            if self.fail is not None and step == 1:
                raise self.fail


def test_train_drafter_reports_useful_tokens_and_stops_its_thread(tiny, tmp_path):
    """max_steps inside the first epoch: the run returns with no thread alive; ms/step and useful
    tok/s are logged each step and summed into the result (16 samples of 48 tokens, 2 per batch:
    96 useful tokens a step). A step that raises, and a shard cut short mid-run (FeatureError
    naming it): no thread left while the exception is still held."""
    rec = _Steps()
    res, _ = _run(tiny, "cpu", rec, epochs=1, max_steps=3)
    assert res.steps == 3 and res.useful_tokens == 3 * 96 and not _ours()
    with pytest.raises(KeyError, match="a failing step"):
        _run(tiny, "cpu", _Steps(fail=KeyError("a failing step")), epochs=1)
    assert not _ours()
    assert [round(r["train/useful_tokens_per_second"] * r["train/ms_per_step"] / 1e3) for r in rec.rows] == [96] * 3
    assert res.step_seconds == pytest.approx(sum(r["train/ms_per_step"] for r in rec.rows) / 1e3)
    head, train, val = tiny
    copy = tmp_path / "train"
    shutil.copytree(train.root, copy)
    bad = copy / train.manifest["shards"][1]["file"]
    with pytest.raises(FeatureError, match=f"{bad}: cannot read"):
        _run((head, FeatureStore.open(copy), val), "cpu", _Steps(corrupt=bad), epochs=2)
    assert not _ours()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_batches_train_as_unpinned_ones(tiny, monkeypatch):
    """On CUDA train_step gets pinned batches (copied with non_blocking) from the prefetch thread,
    while the step's CUDA graph is captured; the same run with the loader in the training thread
    (prefetch_depth 0: pageable batches, blocking copies) gives the same losses and weights."""
    seen = []
    real = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self, b, e: (seen.append(b.is_pinned()), real(self, b, e))[1])
    runs = {}
    for depth in (2, 0):
        monkeypatch.setattr(PackedLoader, "prefetch_depth", depth)
        seen.clear()
        res, d = _run(tiny, "cuda", epochs=2, max_steps=10)
        assert seen == [depth > 0] * 10
        runs[depth] = ([c["loss"] for c in res.curve if c["split"] == "train"],
                       torch.cat([p.detach().float().flatten() for p in d.parameters() if p.requires_grad]))
    assert runs[2][0] == pytest.approx(runs[0][0], rel=1e-4)  # a copy read before it landed: far off
    assert float((runs[2][1] - runs[0][1]).norm()) <= 1e-4 * float(runs[0][1].norm())
    assert not _ours()
