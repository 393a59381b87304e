"""A real engine serves an eyas drafter: llama.cpp's ``llama-server --spec-type draft-eagle3``.

A drafter is trained on the embedded SmolLM2 target's own greedy replies to the six shortest
HumanEval prompts (it learns them well, so its acceptance is far from 1), converted by llama.cpp's
converter (eyas.export.gguf), and served with the target at the precision eyas evaluates it (an F32
GGUF of the same de-quantised weights). The engine's counters (``llamacpp:n_decode_total``, ``timings``) are
held to eyas' own figures on the same prompts (eyas.eval.llamacpp.agreement): eyas' exact chain
oracle (eyas.eval.oracle, what the eval stage's ``per_prompt`` holds) on eyas' own greedy outputs
(batched, as the eval stage's reference); and the engine's output with the drafter to its own
output without it (lossless).

Negative controls: the same drafter with its aux layer ids shifted, and with its d2t scrambled,
each converted the same way: eyas refuses each before serving (eyas.export.gguf.require_served_as_trained),
and served anyway for a few short requests, each falls to an acceptance near 1 in the engine and
fails the agreement with eyas' figures for those requests.

Cost: one module-scoped fixture trains the drafter once and converts the target and the three
drafters once (two converter processes at a time: each is mostly its own start-up); the controls
serve fewer prompts and tokens than the good drafter, enough for an acceptance near 1 to show.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.data.conversations import code_user_turn, humaneval_problems
from eyas.data.distill import generate_batch
from eyas.eval.llamacpp import EngineError, agreement, serve_benchmark, server_binary
from eyas.eval.oracle import accepted_draft_counts, per_prompt_walks, walk_metrics
from eyas.export.eagle import save_drafter
from eyas.export.gguf import CONVERTER, ServeMismatchError, convert, require_served_as_trained, write_target_dir
from eyas.features import FeatureStore, ShardWriter
from eyas.params.full import default_params
from eyas.target.model import load_target
from eyas.tracking.runs import Tracker
from eyas.training.loop import new_drafter, train_drafter
from eyas.vocab.mapping import build_mapping, count_tokens
from stages.eval_accept_len import fit_benchmarks

K = 4
MAX_NEW = 48
N_PROMPTS = 6
CONTROL_PROMPTS = 3  # the negative controls' requests: the first prompts, their first tokens
CONTROL_NEW = 24


def _have_engine() -> bool:
    try:
        server_binary()
    except EngineError:
        return False
    return CONVERTER.is_file()


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _have_engine(), reason="llama.cpp not built: bash scripts/build_llama_server.sh")]


def _shift(cfg: dict, tensors: dict) -> None:
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]  # trained on [2, 15, 27]
    # far: a one-layer shift barely moves a drafter that memorised its prompts


def _scramble(cfg: dict, tensors: dict) -> None:
    d2t = tensors["d2t"]
    tids = d2t + torch.arange(len(d2t))
    perm = torch.randperm(len(tids), generator=torch.Generator().manual_seed(0))
    tensors["d2t"] = (tids[perm] - torch.arange(len(tids))).to(d2t.dtype)


VARIANTS = {"shifted": _shift, "scrambled": _scramble}


def _variant(tmp: Path, name: str, edit) -> Path:
    """A copy of the trained drafter's checkpoint changed by ``edit(config, tensors)``."""
    dst = tmp / name
    shutil.copytree(tmp / "drafter", dst)
    cfg = json.loads((dst / "config.json").read_text())
    tensors = load_file(dst / "model.safetensors")
    edit(cfg, tensors)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The target, the prompts, eyas' greedy outputs, the drafter trained on them, eyas' figures
    for every prompt, and in ``tmp`` the drafter's checkpoint and its two variants, each with its
    GGUF (``<name>.gguf``), and the F32 target GGUF."""
    tmp = tmp_path_factory.mktemp("llamacpp")
    target = load_target("embedded", device=torch.device("cpu"))
    problems = sorted(humaneval_problems(), key=lambda p: len(p["prompt"]))[:N_PROMPTS]
    chats = [[code_user_turn(p["prompt"])] for p in problems]
    prompts = fit_benchmarks(target.tokenizer, {"humaneval": chats}, 0)["humaneval"][0]
    assert len(prompts) == N_PROMPTS
    aux = [2, target.num_layers // 2, target.num_layers - 3]
    # eyas' greedy outputs as the eval stage makes them for its untimed prompts (one batched generate)
    outputs = generate_batch(target.model, prompts, MAX_NEW, getattr(target.tokenizer, "pad_token_id", None) or 0,
                             target.stop_ids)
    w = ShardWriter(tmp / "features", shard_samples=8, dtype=torch.float32)
    for p, y in zip(prompts, outputs):
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
    tp = dataclasses.replace(default_params().train, ttt_length=K, batch_tokens=256, epochs=30, eval_every=10 ** 6,
                             warmup_ratio=0.0, checkpoint_every=0, grad_clip=1.0)
    train_drafter(drafter, train_store=store, val_store=store, lm_head=head["lm_head"], tp=tp, lr=3e-3, seed=0,
                  tracker=Tracker(), device=torch.device("cpu"))
    drafter.eval()
    save_drafter(drafter, tmp / "drafter")
    for name, edit in VARIANTS.items():
        _variant(tmp, name, edit)
    tdir = write_target_dir(target.model, target.tokenizer, tmp / "target", weights=True)
    with ThreadPoolExecutor(2) as pool:  # the drafters' conversions read only tdir's config and tokenizer
        jobs = [pool.submit(convert, tdir, tmp / "target.gguf", outtype="f32")]
        jobs += [pool.submit(convert, tmp / name, tmp / f"{name}.gguf", outtype="f32", target_model_dir=tdir)
                 for name in ("drafter", *VARIANTS)]
        for j in jobs:
            j.result()
    (tdir / "model.safetensors").unlink()
    b = {"tmp": tmp, "target": target, "drafter": drafter, "aux": aux, "prompts": prompts, "outputs": outputs}
    b["eyas"] = _eyas(b, N_PROMPTS, MAX_NEW)
    return b


def _eyas(built, n_prompts: int, max_new: int) -> dict:
    """eyas' figures for the first ``n_prompts`` prompts, ``max_new`` tokens each: ``accept_len``
    and ``per_prompt`` (eyas.eval.oracle's walks at k = K) on eyas' greedy outputs cut to
    ``max_new`` (greedy: the output of a shorter request is their prefix)."""
    prompts, outs = built["prompts"][:n_prompts], [y[:max_new] for y in built["outputs"][:n_prompts]]
    with torch.no_grad():
        counts = [accepted_draft_counts(built["target"], built["drafter"], p, y, num_draft_tokens=K,
                                        aux_layer_ids=built["aux"]) for p, y in zip(prompts, outs)]
    return {"accept_len": walk_metrics(counts, outs, K)["accept_len"], "per_prompt": per_prompt_walks(counts, outs, K)}


def _serve(built, name: str, n_prompts: int, max_new: int) -> dict:
    return serve_benchmark(built["tmp"] / "target.gguf", built["tmp"] / f"{name}.gguf", built["prompts"][:n_prompts],
                           k=K, max_new_tokens=max_new, threads=2, log_dir=built["tmp"] / f"logs_{name}")


def test_the_engine_serves_the_drafter_losslessly_at_eyas_acceptance(built):
    require_served_as_trained(built["tmp"] / "drafter.gguf", built["tmp"] / "drafter", 30)  # passes: no raise
    e = _serve(built, "drafter", N_PROMPTS, MAX_NEW)
    r = built["eyas"]
    assert e["lossless"], e["mismatched_prompts"]
    assert e["accepted"] > 0 and e["drafted"] >= e["accepted"]
    a = agreement(e["per_prompt"], r["per_prompt"])
    assert a["compared"] >= N_PROMPTS - 1, a  # F32 weights in both: the greedy outputs are the same
    assert a["ok"] is True, a
    # eyas' pooled figure over every prompt, and the engine's, agree as well
    assert abs(e["accept_len"] - r["accept_len"]) <= 0.1 * r["accept_len"], (e["accept_len"], r["accept_len"])
    assert r["accept_len"] > 2.5  # the drafter is good enough for the controls below to mean something
    # ... on the controls' short requests too: what they fall from
    assert _eyas(built, CONTROL_PROMPTS, CONTROL_NEW)["accept_len"] > 2.5


def _served_control(built, name: str) -> tuple[dict, dict, dict]:
    """The control served for its short requests: (engine figures, eyas' for the same requests,
    their agreement), the agreement checked on every request (equal outputs)."""
    e = _serve(built, name, CONTROL_PROMPTS, CONTROL_NEW)
    r = _eyas(built, CONTROL_PROMPTS, CONTROL_NEW)
    assert e["lossless"], e["mismatched_prompts"]  # a bad drafter slows the engine but never changes its output
    a = agreement(e["per_prompt"], r["per_prompt"])
    assert a["compared"] == CONTROL_PROMPTS, a  # so its verdict is a comparison, not "unchecked"
    return e, r, a


def test_shifted_aux_layers_fall_to_acceptance_near_one_and_fail_the_agreement(built):
    gguf = built["tmp"] / "shifted.gguf"
    with pytest.raises(ServeMismatchError, match=r"target_layers \[1, 2, 3\] != .*\[2, 15, 27\]"):
        require_served_as_trained(gguf, built["tmp"] / "drafter", 30)  # eyas refuses it before serving
    e, r, a = _served_control(built, "shifted")
    assert e["accept_len"] < 0.6 * r["accept_len"], (e["accept_len"], r["accept_len"])
    assert e["accept_len"] < 1.6, e["accept_len"]
    assert a["ok"] is False, a


def test_a_scrambled_d2t_falls_to_acceptance_near_one(built):
    gguf = built["tmp"] / "scrambled.gguf"
    with pytest.raises(ServeMismatchError, match=r"d2t .* agrees with .* at \d+ of 512 draft positions"):
        require_served_as_trained(gguf, built["tmp"] / "drafter", 30)
    e, r, a = _served_control(built, "scrambled")
    assert e["accept_len"] < 1.3, e["accept_len"]
    assert a["ok"] is False, a
