"""A real engine serves an eyas drafter: llama.cpp's ``llama-server --spec-type draft-eagle3``.

A drafter is trained on the embedded SmolLM2 target's own greedy replies to six HumanEval prompts
(it learns them well, so its acceptance is far from 1), converted by llama.cpp's converter
(eyas.export.gguf), and served with the target at the precision eyas evaluates it (an F32 GGUF of
the same de-quantised weights). The engine's counters (``timings.draft_n_accepted``) are held to
eyas' own decoding loop on the same prompts (eyas.eval.llamacpp.agreement), and the engine's output with
the drafter to its own output without it (lossless).

Negative controls: the same drafter with its aux layer ids shifted by one, and with its d2t
scrambled, served the same way, fall to an acceptance near 1 in the engine, and the agreement
check fails on the shifted one.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.data.conversations import humaneval_prompts
from eyas.eval.acceptance import evaluate_benchmark
from eyas.eval.llamacpp import EngineError, agreement, serve_benchmark, server_binary
from eyas.eval.speculative import greedy_generate
from eyas.export.eagle import save_drafter
from eyas.export.gguf import CONVERTER, ServeMismatchError, convert, require_served_as_trained, write_target_dir
from eyas.features import FeatureStore, ShardWriter
from eyas.pipeline.tracking import Tracker
from eyas.target.model import load_target
from eyas.training.loop import new_drafter, train_drafter
from eyas.training.params import default_params
from eyas.vocab.mapping import build_mapping, count_tokens
from stages.eval_accept_len import fit_benchmarks

K = 4
MAX_NEW = 48
N_PROMPTS = 6


def _have_engine() -> bool:
    try:
        server_binary()
    except EngineError:
        return False
    return CONVERTER.is_file()


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _have_engine(), reason="llama.cpp not built: bash scripts/build_llama_server.sh")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(target, prompts, eyas' chain result, dirs): a drafter trained on the target's greedy
    replies, its GGUF and the F32 target GGUF."""
    tmp = tmp_path_factory.mktemp("llamacpp")
    target = load_target("embedded", device=torch.device("cpu"))
    prompts = fit_benchmarks(target.tokenizer, {"humaneval": humaneval_prompts(N_PROMPTS)}, 0)["humaneval"][0]
    aux = [2, target.num_layers // 2, target.num_layers - 3]
    w = ShardWriter(tmp / "features", shard_samples=8, dtype=torch.float32)
    for p in prompts:
        y = greedy_generate(target.model, p, max_new_tokens=MAX_NEW, stop_ids=target.stop_ids)
        ids = torch.tensor(p + y)
        mask = torch.zeros(len(ids), dtype=torch.uint8)
        mask[len(p):] = 1
        cap = target.capture(ids[None], torch.ones(1, len(ids), dtype=torch.int64), aux)
        w.add(ids, mask, cap["aux_hidden"][0], cap["final_hidden"][0], cap["target_argmax"][0])
    c = target.config
    w.finish(aux_layers=aux, num_layers=target.num_layers, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
             target=target.identity, max_length=1024, target_config=target.config_summary())
    store = FeatureStore.open(tmp / "features")
    ids, mask = store.token_stats()
    mapping, _ = build_mapping(count_tokens(ids, mask, c.vocab_size), 512, order="target_id",
                               fill_counts=count_tokens(ids, torch.ones_like(mask), c.vocab_size))
    head = target.head_weights()
    drafter = new_drafter(store.manifest, mapping, head["embed_tokens"], seed=0, lm_head=head["lm_head"])
    tp = dataclasses.replace(default_params().train, ttt_length=K, batch_tokens=512, epochs=60, eval_every=10 ** 6,
                             warmup_ratio=0.0, checkpoint_every=0, grad_clip=1.0)
    train_drafter(drafter, train_store=store, val_store=store, lm_head=head["lm_head"], tp=tp, lr=3e-3, seed=0,
                  tracker=Tracker(), device=torch.device("cpu"))
    drafter.eval()
    save_drafter(drafter, tmp / "drafter")
    tdir = write_target_dir(target.model, target.tokenizer, tmp / "target", weights=True)
    convert(tdir, tmp / "target.gguf", outtype="f32")
    (tdir / "model.safetensors").unlink()
    convert(tmp / "drafter", tmp / "drafter.gguf", outtype="f32", target_model_dir=tdir)
    r, _ = evaluate_benchmark(target, drafter, prompts, num_draft_tokens=K, max_new_tokens=MAX_NEW,
                              stop_ids=target.stop_ids, aux_layer_ids=aux, timed_prompts=1, timing_repeats=1,
                              batch_size=4)
    return {"tmp": tmp, "prompts": prompts, "eyas": r, "target_dir": tdir}


def _serve(built, drafter_gguf: Path, name: str) -> dict:
    return serve_benchmark(built["tmp"] / "target.gguf", drafter_gguf, built["prompts"], k=K,
                           max_new_tokens=MAX_NEW, threads=2, log_dir=built["tmp"] / f"logs_{name}")


def _variant(built, name: str, edit) -> Path:
    """A copy of the trained drafter changed by ``edit(config, tensors)``, converted to GGUF."""
    src, dst = built["tmp"] / "drafter", built["tmp"] / name
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    tensors = load_file(dst / "model.safetensors")
    edit(cfg, tensors)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, dst / "model.safetensors")
    return convert(dst, built["tmp"] / f"{name}.gguf", outtype="f32", target_model_dir=built["target_dir"])


def test_the_engine_serves_the_drafter_losslessly_at_eyas_acceptance(built):
    require_served_as_trained(built["tmp"] / "drafter.gguf", built["tmp"] / "drafter", 30)  # passes: no raise
    e = _serve(built, built["tmp"] / "drafter.gguf", "good")
    r = built["eyas"]
    assert e["lossless"], e["mismatched_prompts"]
    assert e["accepted"] > 0 and e["drafted"] >= e["accepted"]
    a = agreement(e["per_prompt"], r["per_prompt"])
    assert a["compared"] >= N_PROMPTS - 1, a  # F32 weights in both: the greedy outputs are the same
    assert a["ok"], a
    # eyas' own pooled figure over every prompt, and the engine's, agree as well
    assert abs(e["accept_len"] - r["accept_len"]) <= 0.1 * r["accept_len"], (e["accept_len"], r["accept_len"])
    assert r["accept_len"] > 2.0  # the drafter is good enough for the controls below to mean something


def test_shifted_aux_layers_fall_to_acceptance_near_one_and_fail_the_agreement(built):
    def shift(cfg, tensors):
        cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]  # trained on [2, 15, 27]
    gguf = _variant(built, "shifted", shift)  # far: a one-layer shift barely moves a drafter that memorised its prompts
    with pytest.raises(ServeMismatchError, match=r"target_layers \[1, 2, 3\] != .*\[2, 15, 27\]"):
        require_served_as_trained(gguf, built["tmp"] / "drafter", 30)  # eyas refuses it before serving
    e = _serve(built, gguf, "shifted")
    assert e["lossless"]  # a bad drafter slows the engine but never changes its output
    assert e["accept_len"] < 0.6 * built["eyas"]["accept_len"], e["accept_len"]
    assert not agreement(e["per_prompt"], built["eyas"]["per_prompt"])["ok"]


def test_a_scrambled_d2t_falls_to_acceptance_near_one(built):
    def scramble(cfg, tensors):
        d2t = tensors["d2t"]
        tids = d2t + torch.arange(len(d2t))
        perm = torch.randperm(len(tids), generator=torch.Generator().manual_seed(0))
        tensors["d2t"] = (tids[perm] - torch.arange(len(tids))).to(d2t.dtype)
    gguf = _variant(built, "scrambled", scramble)
    with pytest.raises(ServeMismatchError, match=r"d2t .* agrees with .* at \d+ of 512 draft positions"):
        require_served_as_trained(gguf, built["tmp"] / "drafter", 30)
    e = _serve(built, gguf, "scrambled")
    assert e["lossless"]
    assert e["accept_len"] < 1.3, e["accept_len"]
    assert not agreement(e["per_prompt"], built["eyas"]["per_prompt"])["ok"]
