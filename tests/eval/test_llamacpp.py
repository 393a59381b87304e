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
fails the agreement with eyas' figures for those requests. A drafter trained with aux layer id L
(the target's layer count) is refused on this Llama target, whose llama.cpp graph never fills
that state (eyas.export.llamacpp_nextn), and served anyway falls below eyas' figures for it.

Every test runs on each backend: llama.cpp's CPU build, and (``-m gpu``, on a CUDA machine with
``scripts/build_llama_server.sh --cuda``) its CUDA build with every layer offloaded, where the good
drafter is also served across a k sweep and the CUDA build is shown to refuse a start without a GPU.

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
from eyas.eval.evaluate import fit_benchmarks
from eyas.eval.llamacpp import EngineError, LlamaServer, agreement, serve_benchmark, server_binary
from eyas.eval.oracle import accepted_draft_counts, per_prompt_walks, walk_metrics
from eyas.export.eagle import save_drafter
from eyas.export.gguf import CONVERTER, ServeMismatchError, convert, require_served_as_trained, write_target_dir
from eyas.features import FeatureStore, ShardWriter
from eyas.params.full import default_params
from eyas.target.model import load_target
from eyas.tracking.runs import Tracker
from eyas.training.loop import new_drafter, train_drafter
from eyas.vocab.mapping import build_mapping, count_tokens

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


def _have_cuda_engine() -> bool:
    try:
        server_binary("cuda")
    except EngineError:
        return False
    return torch.cuda.is_available()


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _have_engine(), reason="llama.cpp not built: bash scripts/build_llama_server.sh")]


NO_CUDA = "no GPU or no llama-server-cuda: bash scripts/build_llama_server.sh --cuda"


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not _have_cuda_engine(), reason=NO_CUDA)])])
def backend(request) -> str:
    """The llama.cpp build that serves: ``cpu``, and ``cuda`` (a ``gpu`` test)."""
    return request.param


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


def _train(target, prompts, outputs, aux, features):
    """A drafter trained on the target's features at HF indices ``aux`` (written to ``features``)
    for the prompts and eyas' greedy outputs, until it has learnt them."""
    w = ShardWriter(features, shard_samples=8, dtype=torch.float32)
    for p, y in zip(prompts, outputs):
        ids = torch.tensor(p + y)
        mask = torch.zeros(len(ids), dtype=torch.uint8)
        mask[len(p):] = 1
        cap = target.capture(ids[None], torch.ones(1, len(ids), dtype=torch.int64), aux)
        w.add(ids, mask, cap["aux_hidden"][0], cap["final_hidden"][0], cap["target_argmax"][0])
    c = target.config
    w.finish(aux_layers=aux, num_layers=target.num_layers, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
             target=target.identity, max_length=1024, target_config=target.config_summary())
    store = FeatureStore.open(features)
    ids, mask = store.token_stats()
    mapping, _ = build_mapping(count_tokens(ids, mask, c.vocab_size), 512, order="target_id",
                               fill_counts=count_tokens(ids, torch.ones_like(mask), c.vocab_size))
    head = target.head_weights()
    drafter = new_drafter(store.manifest, mapping, head["embed_tokens"], seed=0, lm_head=head["lm_head"])
    tp = dataclasses.replace(default_params().train, ttt_length=K, batch_tokens=256, epochs=30, eval_every=10 ** 6,
                             warmup_ratio=0.0, checkpoint_every=0, grad_clip=1.0)
    train_drafter(drafter, train_store=store, val_store=store, lm_head=head["lm_head"], tp=tp, lr=3e-3, seed=0,
                  tracker=Tracker(), device=torch.device("cpu"))
    return drafter.eval()


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
    drafter = _train(target, prompts, outputs, aux, tmp / "features")
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


def _eyas(built, n_prompts: int, max_new: int, drafter=None, aux=None) -> dict:
    """eyas' figures for the first ``n_prompts`` prompts, ``max_new`` tokens each: ``accept_len``
    and ``per_prompt`` (eyas.eval.oracle's walks at k = K) on eyas' greedy outputs cut to
    ``max_new`` (greedy: the output of a shorter request is their prefix); of the fixture's
    drafter, or of ``drafter`` trained on ``aux``."""
    prompts, outs = built["prompts"][:n_prompts], [y[:max_new] for y in built["outputs"][:n_prompts]]
    with torch.no_grad():
        counts = [accepted_draft_counts(built["target"], drafter or built["drafter"], p, y, num_draft_tokens=K,
                                        aux_layer_ids=aux or built["aux"]) for p, y in zip(prompts, outs)]
    return {"accept_len": walk_metrics(counts, outs, K)["accept_len"], "per_prompt": per_prompt_walks(counts, outs, K)}


def _serve(built, name: str, n_prompts: int, max_new: int, backend: str, k_sweep=()) -> dict:
    return serve_benchmark(built["tmp"] / "target.gguf", built["tmp"] / f"{name}.gguf", built["prompts"][:n_prompts],
                           k=K, max_new_tokens=max_new, threads=2, backend=backend, k_sweep=k_sweep,
                           log_dir=built["tmp"] / f"logs_{name}_{backend}")


def test_the_engine_serves_the_drafter_losslessly_at_eyas_acceptance(built, backend):
    require_served_as_trained(built["tmp"] / "drafter.gguf", built["tmp"] / "drafter", 30)  # passes: no raise
    sweep = [1, 2, 3, 4, 5, 6, 7, 8] if backend == "cuda" else [2]
    e = _serve(built, "drafter", N_PROMPTS, MAX_NEW, backend, k_sweep=sweep)
    r = built["eyas"]
    assert e["backend"] == backend and e["build"]["backend"] == backend, (e["backend"], e["build"])
    assert (e["device"] == "cpu") == (backend == "cpu"), e["device"]
    assert e["lossless"], e["mismatched_prompts"]
    # the wall-clock sweep: every k served, lossless, with the drafter's time per step from llama.cpp's own log
    rows = e["k_sweep"]["rows"]
    assert sorted(rows, key=int) == [str(k) for k in sorted(set(sweep) | {K})], rows
    assert all(v["lossless"] and v["speedup"] > 0 and v["draft_ms_per_step"] > 0 and v["verify_ms_per_step"] > 0
               for v in rows.values()), rows
    assert str(e["k_sweep"]["recommended_k"]) == max(rows, key=lambda k: rows[k]["speedup"]), e["k_sweep"]
    assert rows[str(K)]["accept_len"] == e["accept_len"]  # k = K is the main run itself
    assert e["accepted"] > 0 and e["drafted"] >= e["accepted"]
    a = agreement(e["per_prompt"], r["per_prompt"])
    assert a["compared"] >= N_PROMPTS - 1, a  # F32 weights in both: the greedy outputs are the same
    assert a["ok"] is True, a
    # eyas' pooled figure over every prompt, and the engine's, agree as well
    assert abs(e["accept_len"] - r["accept_len"]) <= 0.1 * r["accept_len"], (e["accept_len"], r["accept_len"])
    assert r["accept_len"] > 2.5  # the drafter is good enough for the controls below to mean something
    # ... on the controls' short requests too: what they fall from
    assert _eyas(built, CONTROL_PROMPTS, CONTROL_NEW)["accept_len"] > 2.5


def _served_control(built, name: str, backend: str, drafter=None, aux=None) -> tuple[dict, dict, dict]:
    """The control served for its short requests: (engine figures, eyas' for the same requests,
    their agreement), the agreement checked on every request (equal outputs)."""
    e = _serve(built, name, CONTROL_PROMPTS, CONTROL_NEW, backend)
    r = _eyas(built, CONTROL_PROMPTS, CONTROL_NEW, drafter, aux)
    assert e["lossless"], e["mismatched_prompts"]  # a bad drafter slows the engine but never changes its output
    a = agreement(e["per_prompt"], r["per_prompt"])
    # so its verdict is a comparison, not "unchecked"; as for the good drafter, a near tie may flip one greedy
    # output between eyas (fp32 on the CPU) and the engine (F32 on the CPU or the GPU: other kernels)
    assert a["compared"] >= CONTROL_PROMPTS - 1, a
    return e, r, a


def test_shifted_aux_layers_fall_to_acceptance_near_one_and_fail_the_agreement(built, backend):
    gguf = built["tmp"] / "shifted.gguf"
    with pytest.raises(ServeMismatchError, match=r"target_layers \[1, 2, 3\] != .*\[2, 15, 27\]"):
        require_served_as_trained(gguf, built["tmp"] / "drafter", 30)  # eyas refuses it before serving
    e, r, a = _served_control(built, "shifted", backend)
    assert e["accept_len"] < 0.6 * r["accept_len"], (e["accept_len"], r["accept_len"])
    assert e["accept_len"] < 1.6, e["accept_len"]
    assert a["ok"] is False, a


def test_a_scrambled_d2t_falls_to_acceptance_near_one(built, backend):
    gguf = built["tmp"] / "scrambled.gguf"
    with pytest.raises(ServeMismatchError, match=r"d2t .* agrees with .* at \d+ of 512 draft positions"):
        require_served_as_trained(gguf, built["tmp"] / "drafter", 30)
    e, r, a = _served_control(built, "scrambled", backend)
    assert e["accept_len"] < 1.3, e["accept_len"]
    assert a["ok"] is False, a


def test_aux_id_l_is_refused_on_this_llama_target_and_served_anyway_reads_a_buffer_nothing_wrote(built):
    """A drafter trained with aux layer id L = 30 (the pre-norm state, eyas.target.layers.capture_aux):
    llama.cpp's llama graph (src/models/llama.cpp) never fills the buffer it reads id L from
    (eyas.export.llamacpp_nextn), so export and serve refuse it; served anyway it falls far below
    eyas' own figures for the same drafter."""
    tmp, L = built["tmp"], built["target"].num_layers
    aux = [2, L // 2, L]
    drafter = _train(built["target"], built["prompts"], built["outputs"], aux, tmp / "features_id_l")
    save_drafter(drafter, tmp / "id_l")
    convert(tmp / "id_l", tmp / "id_l.gguf", outtype="f32", target_model_dir=tmp / "target")
    with pytest.raises(ServeMismatchError, match=r"target layer id 30 \(= L.*llama \(src/models/llama.cpp\) never sets "
                                                 r"t_h_nextn"):
        require_served_as_trained(tmp / "id_l.gguf", tmp / "id_l", L, target_arch="LlamaForCausalLM")
    # the same file passes every other check: on a graph that fills id L before the final norm it would serve
    require_served_as_trained(tmp / "id_l.gguf", tmp / "id_l", L, target_arch="GptOssForCausalLM")
    e, r, a = _served_control(built, "id_l", "cpu", drafter, aux)
    assert r["accept_len"] > 2.0, r["accept_len"]  # eyas feeds it the pre-norm state it learnt from
    assert e["accept_len"] < r["accept_len"], (e["accept_len"], r["accept_len"])  # llama.cpp feeds it no such state
    assert a["ok"] is False, a  # outside the agreement eval holds the engine to


@pytest.mark.gpu
@pytest.mark.skipif(not _have_cuda_engine(), reason=NO_CUDA)
def test_the_cuda_build_refuses_to_serve_without_a_gpu(built, monkeypatch):
    """llama.cpp's CUDA build with no device visible runs every layer on the CPU without an error; eyas
    refuses that start, naming the device list (negative control: the same start with the GPU visible
    passes, in the tests above)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(EngineError, match=r"sees no CUDA device"):
        with LlamaServer(built["tmp"] / "target.gguf", None, k=K, threads=2, ctx=256,
                         log=built["tmp"] / "no_gpu.log", backend="cuda"):
            pass
