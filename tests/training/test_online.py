"""Online training (eyas/training/online.py) gives the drafter offline training gives.

Both stores are written by extract's own code (``stages.extract.extract_split``) from the same
samples with the tiny target: a feature store (``train.mode: offline``) and a token store
(``online``). The online loader must plan the same batches and capture the hidden states extract
stored; a few training steps in each mode must give the same drafter weights and val metrics
within ``ATOL`` (bf16 storage: the target's run-to-run numerics may move a stored value by one
bf16 step when its batch is grouped differently), and a run with another data order must NOT
(the tolerance is tight enough to see a real difference). Resuming online after a crash gives
the uninterrupted run's drafter bit for bit.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from eyas.features import TOKENS, FeatureError, FeatureStore
from eyas.params.full import parse_params
from eyas.target import layers
from eyas.tracking.runs import Tracker
from eyas.training.batches import PackedLoader
from eyas.training.loop import new_drafter, train_drafter
from eyas.training.online import OnlineLoader, TargetCapture, capture_for, loader_for, round_to_storage
from eyas.vocab.mapping import build_mapping, count_tokens
from stages.extract import extract_split
from tests.tiny import LAYERS, VOCAB, manifest_fields, tiny_target

AUX = layers.resolve(None, LAYERS)
TRAIN = {"ttt_length": 2, "step_decay": 0.8, "batch_tokens": 128, "epochs": 2, "warmup_ratio": 0.1,
         "weight_decay": 0.0, "grad_clip": 0.5, "eval_every": 3, "max_steps": 8, "checkpoint_every": 0}
# drafter weights, online vs offline: max |difference| after 8 AdamW steps at lr 3e-3 (measured on
# 2 CPU cores: 1.2e-7 with one thread, 0 with two; another data order moves them by 2.2e-2)
ATOL = 1e-4


def _samples(n: int, seed: int) -> list[dict]:
    """Rendered samples as extract's render_split returns them: lengths 12..60, the first quarter
    unsupervised (a prompt), sorted by length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        T = int(torch.randint(12, 61, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (T,), generator=g).tolist()
        out.append({"input_ids": ids, "loss_mask": [0] * (T // 4) + [1] * (T - T // 4), "truncated": False})
    return sorted(out, key=lambda r: len(r["input_ids"]))


def _store(root, mode: str, split: str, n: int, seed: int, dtype: str = "bfloat16") -> FeatureStore:
    target = _target()
    p = parse_params({"extract": {"dtype": dtype, "shard_samples": 8, "max_length": 64, "batch_size": 4},
                      "distill": {"max_new_tokens": 16},
                      "train": {"mode": mode}})
    prov = {k: v for k, v in manifest_fields(target, AUX).items() if k != "max_length"}
    extract_split(target, _samples(n, seed), 0, 0, [], root / mode / split, p, AUX, prov)
    return FeatureStore.open(root / mode / split)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these steps are tiny, and on a loaded machine OpenMP's spinning workers
    cost 30x (the figures are the same either way: tolerance above)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def stores(one_thread, tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    return {mode: (_store(root, mode, "train", 24, 1), _store(root, mode, "val", 6, 2))
            for mode in ("offline", "online")}


@functools.cache
def _target():
    return tiny_target()  # deterministic (seeded) and only read: one per test process


def _capture(dtype: str = "bfloat16") -> TargetCapture:
    return TargetCapture(_target(), AUX, dtype, max_tokens=TRAIN["batch_tokens"])


def _max_diff(a, b) -> float:
    """Max |a - b| over two drafters' float weights (their d2t/t2d buffers must be equal)."""
    out = 0.0
    for k, v in a.state_dict().items():
        w = b.state_dict()[k]
        if v.is_floating_point():
            out = max(out, (v - w).abs().max().item())
        else:
            assert torch.equal(v, w), k
    return out


def _train(train, val, capture, seed=0, ckdir=None, tracker=None, **kw):
    head = _target().head_weights()
    ids, mask = train.token_stats()
    mapping, _ = build_mapping(count_tokens(ids, mask, train.manifest["vocab_size"]), 64)
    drafter = new_drafter(train.manifest, mapping, head["embed_tokens"], 0, lm_head=head["lm_head"])
    res = train_drafter(drafter, train_store=train, val_store=val, lm_head=head["lm_head"],
                        tp=parse_params({"train": {**TRAIN, **kw}}).train, lr=3e-3, seed=seed,
                        tracker=tracker or Tracker(), device=torch.device("cpu"), checkpoint_dir=ckdir,
                        capture=capture)
    return res, drafter


def test_token_store_holds_tokens_only_and_the_same_counts(stores):
    off, on = stores["offline"][0], stores["online"][0]
    assert on.contents == TOKENS and off.contents == "features"
    keys = set(next(on.iter_shards()))
    assert keys == {"input_ids", "loss_mask", "offsets"}
    assert on.manifest["storage_dtype"] == "bfloat16" and on.manifest["aux_layers"] == AUX
    for a, b in zip(off.token_stats(), on.token_stats()):  # build-vocab reads exactly this
        assert torch.equal(a, b)
    for k in ("num_samples", "num_tokens", "supervised_tokens"):
        assert off.manifest[k] == on.manifest[k]


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_online_batches_equal_offline(tmp_path, dtype):
    off = _store(tmp_path, "offline", "train", 20, 3, dtype)
    on = _store(tmp_path, "online", "train", 20, 3, dtype)
    a = PackedLoader(off, 128, seed=5)
    calls = []
    cap = _capture(dtype)
    b = OnlineLoader(on, 128, seed=5, capture=lambda s: calls.append(len(s)) or cap(s))
    assert a.plan(1) == b.plan(1) and a.num_batches(1) == b.num_batches(1)
    n = 0
    for x, y in zip(a.batches(1, start=1), b.batches(1, start=1)):
        n += 1
        assert x.sample_ids == y.sample_ids
        for k in ("input_ids", "loss_mask", "positions", "doc_ids", "target_argmax"):
            assert torch.equal(getattr(x, k), getattr(y, k)), k
        for k in ("aux_hidden", "final_hidden"):
            u, v = getattr(x, k), getattr(y, k)
            assert u.dtype == v.dtype == torch.bfloat16, k
            # one bf16 step at most (the target's batch grouping differs); fp8: one e4m3 step
            rel = 2 ** -7 if dtype == "bfloat16" or k == "final_hidden" else 2 ** -3
            assert torch.allclose(u.float(), v.float(), rtol=rel, atol=1e-6), (k, (u.float() - v.float()).abs().max())
    assert n == a.num_batches(1) - 1 and len(calls) == n  # one capture per batch, from batch `start`


def test_lookahead_changes_nothing(stores):
    train = stores["online"][0]
    runs = [list(OnlineLoader(train, 128, seed=3, capture=_capture(), ahead=k).batches(0, start=2))
            for k in (0, 1, 3)]
    assert len(runs[0]) == OnlineLoader(train, 128, seed=3, capture=_capture()).num_batches(0) - 2 > 2
    for other in runs[1:]:
        assert len(other) == len(runs[0])
        for x, y in zip(runs[0], other):
            assert x.sample_ids == y.sample_ids and torch.equal(x.aux_hidden, y.aux_hidden)


def test_online_training_equals_offline(stores):
    (off_t, off_v), (on_t, on_v) = stores["offline"], stores["online"]
    ref, d_off = _train(off_t, off_v, None)
    res, d_on = _train(on_t, on_v, _capture())
    assert res.steps == ref.steps == TRAIN["max_steps"] and res.train_tokens == ref.train_tokens
    diff = _max_diff(d_off, d_on)
    print(f"online vs offline: max |weight difference| {diff}")
    assert diff <= ATOL, f"online drafter differs from offline by {diff}"
    for split in ("step0_val", "final_val"):
        for k, v in getattr(ref, split).items():
            assert getattr(res, split)[k] == pytest.approx(v, rel=1e-3, abs=1e-4), (split, k)
    # the tolerance sees a real difference: another data order (seed) moves the weights far more
    _, d_other = _train(on_t, on_v, _capture(), seed=1)
    other = _max_diff(d_on, d_other)
    print(f"online, seed 1 vs seed 0: max |weight difference| {other}")
    assert other > 100 * ATOL, other


class _Crash(Exception):
    pass


class _CrashAt(Tracker):
    def __init__(self, at: int):
        self.at = at

    def log_metrics(self, metrics, step=None):
        if step == self.at and "train/loss" in metrics:
            raise _Crash(step)


def test_online_resume_after_crash_is_exact(stores, tmp_path):
    train, val = stores["online"]
    ref, d_ref = _train(train, val, _capture(), max_steps=7)
    with pytest.raises(_Crash):  # checkpoints at steps 2 and 4
        _train(train, val, _capture(), ckdir=tmp_path / "ck", tracker=_CrashAt(5), max_steps=7, checkpoint_every=2)
    assert json.loads((tmp_path / "ck/state/train_state.json").read_text())["step"] == 4
    res, d = _train(train, val, _capture(), ckdir=tmp_path / "ck", max_steps=7, checkpoint_every=2)
    assert res.final_val == ref.final_val and str(res.curve) == str(ref.curve)
    for k, v in d_ref.state_dict().items():
        assert torch.equal(v, d.state_dict()[k]), k


def test_wrong_pairings_are_refused(stores):
    (off_t, _), (on_t, _) = stores["offline"], stores["online"]
    with pytest.raises(FeatureError, match="token store .* has no hidden states"):
        loader_for(on_t, 128, 0)
    with pytest.raises(FeatureError, match="holds stored hidden states"):
        loader_for(off_t, 128, 0, capture=_capture())
    with pytest.raises(FeatureError, match="holds tokens but train.mode is offline"):
        capture_for(parse_params({"train": {"mode": "offline"}}), on_t)
    with pytest.raises(FeatureError, match="holds features but train.mode is online"):
        capture_for(parse_params({"train": {"mode": "online"}}), off_t)
    with pytest.raises(FeatureError, match="not a token store"):
        OnlineLoader(off_t, 128, 0, capture=_capture())


def test_capture_error_reaches_the_trainer(stores):
    def broken(samples):
        raise RuntimeError("capture server went away")

    loader = OnlineLoader(stores["online"][0], 128, 0, capture=broken)
    with pytest.raises(RuntimeError, match="capture server went away"):
        next(iter(loader.batches(0)))


def test_round_to_storage_is_what_the_store_reads_back():
    x = torch.randn(5, 3 * 16) * 50
    f = torch.randn(5, 16)
    aux, fin = round_to_storage(x, f, 3, "float32")
    assert torch.equal(aux, x) and torch.equal(fin, f)
    aux, fin = round_to_storage(x, f, 3, "bfloat16")
    assert torch.equal(aux, x.bfloat16()) and fin.dtype == torch.bfloat16
    aux, _ = round_to_storage(x, f, 3, "float8_e4m3fn")
    rows = x.view(5, 3, 16)
    # per token and layer, the row's max is exact (it maps to 448) and the rest within e4m3's step
    assert torch.allclose(aux.float().view(5, 3, 16).abs().amax(-1), rows.abs().amax(-1), rtol=2 ** -8)
    assert torch.allclose(aux.float(), x, rtol=2 ** -3, atol=rows.abs().amax().item() * 2 ** -9)
    with pytest.raises(FeatureError, match="unknown storage_dtype"):
        round_to_storage(x, f, 3, "int4")


# ------------------------------------------------------------------- the real stages, online


@pytest.mark.slow
def test_stages_online_with_the_embedded_target(tmp_path):
    """extract -> build-vocab -> train-scratch as `dvc repro` runs them, with train.mode: online and
    the embedded target: a token store (no hidden states on disk), a vocab from its counts, a
    servable drafter; then params back to offline: the token store is refused, naming extract."""
    repo = Path(__file__).resolve().parents[2]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["extract"].update(max_length=64, batch_size=4, shard_samples=8)
    params["distill"]["max_new_tokens"] = 16
    params["vocab"]["draft_vocab_size"] = 256
    params["train"].update(mode="online", ttt_length=2, batch_tokens=256, epochs=1, eval_every=1000,
                           checkpoint_every=0)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    g = torch.Generator().manual_seed(0)
    (tmp_path / "data/distilled").mkdir(parents=True)
    for split, n in (("train", 24), ("val", 4), ("publish", 4)):
        rows = []
        for i in range(n):
            prompt, reply = (torch.randint(0, 49152, (int(k),), generator=g).tolist()
                             for k in torch.randint(8, 32, (2,), generator=g))
            rows.append(json.dumps({"id": f"{split}-{i}", "prompt_ids": prompt, "reply_ids": reply,
                                    "finish_reason": "length"}))
        (tmp_path / f"data/distilled/{split}.jsonl").write_text("\n".join(rows) + "\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))},
           "PYTHONPATH": str(repo), "EYAS_TRACKING": "off", "OMP_NUM_THREADS": "1"}

    def stage(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", f"stages.{name}"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)

    for name in ("extract", "build_vocab", "train_scratch"):
        r = stage(name)
        assert r.returncode == 0, f"{name}: {r.stdout[-2000:]}{r.stderr[-3000:]}"
    m = json.loads((tmp_path / "data/features/train/manifest.json").read_text())
    assert m["contents"] == TOKENS and m["storage_dtype"] == "bfloat16" and m["aux_layers"] == [2, 15, 27]
    with safe_open(str(tmp_path / "data/features/train" / m["shards"][0]["file"]), framework="pt") as f:
        assert set(f.keys()) == {"input_ids", "loss_mask", "offsets"}
    ext = json.loads((tmp_path / "metrics/extract.json").read_text())
    assert ext["bytes_per_token"] == 5 and ext["bytes"] == ext["estimated_bytes"]
    tr = json.loads((tmp_path / "metrics/train_scratch.json").read_text())
    assert tr["steps"] > 0 and 0.0 <= tr["val"]["acc_0"] <= 1.0
    assert (tmp_path / "models/scratch/model.safetensors").is_file()

    params["train"]["mode"] = "offline"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    r = stage("train_scratch")
    assert r.returncode != 0 and "train.mode = 'online'" in r.stderr and "dvc repro extract" in r.stderr


def test_a_store_made_for_another_target_is_refused_before_the_target_loads(stores):
    on_t = stores["online"][0]  # made for the tiny target: path 'tiny', no GGUF file, no revision
    # neither path exists: loading would fail with TargetError, so a FeatureError means no load was tried
    with pytest.raises(FeatureError, match=r"manifest.json: the token store was made for target path = 'tiny', "
                                           r"params target.path gives 'no-such-target-dir'"):
        capture_for(parse_params({"train": {"mode": "online"}, "target": {"path": "no-such-target-dir"}}), on_t)
    with pytest.raises(FeatureError, match=r"made for target revision = None, params target.revision gives 'abc123'"):
        capture_for(parse_params({"train": {"mode": "online"}, "target": {"path": "tiny", "revision": "abc123"}}),
                    on_t)
    with pytest.raises(FeatureError, match=r"made for target gguf_file = None, params target.gguf_file gives 'm.gguf'"):
        capture_for(parse_params({"train": {"mode": "online"}, "target": {"path": "tiny", "gguf_file": "m.gguf"}}),
                    on_t)


def test_a_zero_length_sample_is_refused_by_name(stores, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = stores["online"][0]
    root = tmp_path / "store"
    shutil.copytree(src.root, root)
    shard = root / src.manifest["shards"][0]["file"]
    t = load_file(shard)
    t["offsets"][2] = t["offsets"][1]  # sample 1 now has no tokens (sample 2 starts earlier)
    save_file(t, shard)
    store = FeatureStore.open(root)
    with pytest.raises(FeatureError, match=rf"{shard.name}: sample\(s\) \[1\] of this shard have no tokens"):
        OnlineLoader(store, 128, 0, capture=_capture())
    empty = {"input_ids": torch.zeros(0, dtype=torch.int64)}
    one = {"input_ids": torch.tensor([1, 2, 3])}
    with pytest.raises(FeatureError, match=r"batch position\(s\) \[1\] have no tokens"):
        _capture()([one, empty])
