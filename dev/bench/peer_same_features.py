"""The `speculators` (vLLM project, 0.9.0) EAGLE-3 trainer on eyas' own features, judged by eyas' code.

Parts (``--part``; ``all`` runs convert, peer-train, check, eyas-time, eval in that order; convert,
peer-train and check run in the peer's venv, ``--peer-python``, which also holds ``datasets``):

- ``convert``: eyas features -> the peer's offline-training format under ``--work``:
  ``data/`` (a ``datasets`` Arrow dataset: ``input_ids``, ``loss_mask``, ``seq_len``, train samples
  then val samples, so ``--train-data-ratio`` cuts exactly at eyas' split), ``data/hidden_states/
  hs_<i>.safetensors`` (``hidden_states`` [T, 4, H] float32 = the 3 aux layers then the final layer,
  ``token_ids`` [T] int64: hs_connectors' FileTransfer layout), ``d2t.npy``/``t2d.npy`` (eyas'
  models/vocab: the same offset convention, ``target = draft + d2t[draft]``, draft ids in ascending
  target-id order, checked) and ``verifier/`` (config.json, the tokenizer, model.safetensors with the target's
  embed_tokens, lm_head and final norm weight). The peer applies the verifier's final RMSNorm to the
  last hidden state itself, while eyas stores it AFTER that norm (x = w * h/rms(h)); the converter
  stores x / w, which the peer's RMSNorm (rms(x/w) = 1 up to eps) maps back to x. Everything the
  converter writes is safetensors/Arrow/npy (the peer's own format; eyas never reads these files).
- ``peer-train``: the peer's own CLI entry
  (``speculators.train.cli.main(TrainConfig.resolve(argv))``) with EAGLE-3's served architecture
  (``--no-norm-before-residual --no-norm-before-fc --no-norm-output``: the flags eyas, SGLang and
  vLLM's served layer compute; the peer's CLI defaults are all True), AdamW, cosine schedule,
  ``--draft-attn-impl sdpa`` and ``--loss-implementation eager`` (its CPU-capable options: the
  defaults, flex attention and a Triton loss, need CUDA) and ``--hidden-states-dtype float32``
  (its Trainer autocasts with device type 'cuda', which is disabled on a CPU-only build; eyas also
  trains in fp32 on CPU). CPU shim (the one change to the peer's code path): its Trainer moves the
  model and batches to ``get_local_rank()`` (int 0 = cuda:0, speculators/train/trainer.py lines
  221, 348, 533); the shim makes that return ``"cpu"``, and makes ``torch.accelerator.synchronize``
  (its step timer) a no-op when there is no accelerator; a subclass of its Trainer only times
  ``run_training`` and reads ``global_step``.
- ``check``: the peer's own model and eyas' reading of its checkpoint compute the
  same logits on one val sample over the TTT steps (:func:`check_same_function`).
- ``eyas-time`` (main env): eyas' ``train_drafter`` on the same features for ``--epochs`` (or
  ``--eyas-steps`` optimizer steps), same thread setting, no tracking/checkpoints; the drafter is
  saved to ``--work``/eyas_drafter so ``eval`` scores it beside the peer at the same budget. It may
  run at the same time as ``peer-train`` (two processes, one thread each): on a shared machine both
  then see the same contention.
- ``eval`` (main env): the peer's final checkpoint loaded with ``eyas.export.load.load_drafter``
  (speculators layout detected and converted), val acc_0..3 with ``eyas.training.unroll.evaluate`` (the
  definition of metrics/train_scratch.json ``val``; models/scratch is re-evaluated the same way as a
  check that the path reproduces the committed figures) and acceptance length at k =
  ``eval.num_draft_tokens`` with ``eyas.eval.speculative.evaluate_prompts`` on the prompts of
  stages/eval_accept_len.py.

Run from the repo root with ``OMP_NUM_THREADS=1 MKL_NUM_THREADS=1``:
``python3 dev/bench/peer_same_features.py --part all`` (results:
dev/results/peer_same_features_cpu.json; parts merge into it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "dev" / "results" / "peer_same_features_cpu.json"
sys.path.insert(0, str(ROOT))  # eyas from this checkout, also in the peer's venv


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["convert", "peer-train", "check", "eyas-time", "eval", "all"], default="all")
    p.add_argument("--check-ckpt", default=None, help="check: peer checkpoint (default: peer-train's)")
    p.add_argument("--features", default=str(ROOT / "data/features"), help="eyas feature root (train/, val/)")
    p.add_argument("--vocab", default=str(ROOT / "models/vocab"), help="eyas d2t/t2d directory")
    p.add_argument("--work", default="/tmp/peer_same_features", help="where the peer's files go")
    p.add_argument("--peer-python", default="/tmp/peer-venv/bin/python",
                   help="python of the isolated venv holding speculators 0.9.0")
    p.add_argument("--epochs", type=int, default=None, help="default: params.yaml train.epochs")
    p.add_argument("--lr", type=float, default=None, help="default: params.yaml lr (the scratch drafter's)")
    p.add_argument("--total-seq-len", type=int, default=None,
                   help="peer tokens per optimizer step (one packed row); default train.batch_tokens")
    p.add_argument("--attn-impl", default="sdpa", help="peer --draft-attn-impl (sdpa or eager on CPU)")
    p.add_argument("--eyas-steps", type=int, default=0,
                   help="optimizer steps eyas is timed for (0: --epochs decide)")
    p.add_argument("--out", default=str(RESULT))
    p.add_argument("--inside-peer-venv", action="store_true",
                   help="internal: this process runs a convert/peer-train part with --peer-python")
    return p.parse_args(argv)


def _params():
    from eyas.params.full import load_params

    return load_params(ROOT / "params.yaml")


def _settings(args) -> dict:
    p = _params()
    return {"epochs": args.epochs or p.train.epochs, "lr": args.lr or p.lr,
            "total_seq_len": args.total_seq_len or p.train.batch_tokens,
            "ttt_length": p.train.ttt_length, "step_decay": p.train.step_decay,
            "warmup_ratio": p.train.warmup_ratio, "weight_decay": p.train.weight_decay,
            "attn_impl": args.attn_impl, "seed": p.seed}


def _merge(out: Path, part: str, doc: dict) -> None:
    """Merge ``doc`` under key ``part`` into the result file (atomic replace)."""
    res = json.loads(out.read_text()) if out.exists() else {}
    res[part] = doc
    res.setdefault("commands", {})[part] = " ".join(["python3"] + sys.argv)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str))
    os.replace(tmp, out)


def _env() -> dict:
    import torch
    import transformers

    return {"device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared)",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0], "threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


# ----------------------------------------------------------------------------- convert

def convert(args) -> dict:
    """Write the peer's offline format under ``args.work`` (see the module docstring).

    Raises:
        ValueError: the vocab mapping is not in ascending target-id order (the peer's convention:
            it selects lm_head rows with ``lm_head[t2d]``), or the target's final norm has a zero
            weight (x / w undefined).
    """
    import numpy as np
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    from eyas.features import FeatureStore, head_path
    from eyas.io import load_safetensors
    from eyas.target.model import load_target
    from eyas.vocab.mapping import load_mapping

    p = _params()
    work = Path(args.work)
    hs_dir = work / "data" / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)

    mapping, _ = load_mapping(args.vocab)
    draft_ids = torch.arange(mapping.draft_vocab_size)
    if not torch.equal(draft_ids + mapping.d2t, mapping.t2d.nonzero().squeeze(1)):
        raise ValueError(f"{args.vocab}: draft ids are not in ascending target-id order; the peer "
                         f"(lm_head[t2d]) would pair rows with the wrong tokens")
    np.save(work / "d2t.npy", mapping.d2t.numpy())
    np.save(work / "t2d.npy", mapping.t2d.numpy())

    target = load_target(p.target.path, p.target.gguf_file, "float32", p.target.trust_remote_code,
                         revision=p.target.revision)
    model = target.model
    w = model.model.norm.weight.detach().float()
    if (w == 0).any():
        raise ValueError("target final norm has zero weights: final_hidden / w is undefined")
    # embed/lm_head: the very tensors eyas' teacher uses (extract's target_head.safetensors)
    th = load_safetensors(head_path(args.features))
    head = {"model.embed_tokens.weight": th["embed_tokens"].float().contiguous(),
            "lm_head.weight": th["lm_head"].float().clone().contiguous(),
            "model.norm.weight": w.clone().contiguous()}
    vdir = work / "verifier"
    vdir.mkdir(exist_ok=True)
    save_file(head, str(vdir / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    (vdir / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    target.tokenizer.save_pretrained(str(vdir))  # the peer's CLI loads it (resolve_mask_token_id)

    feats = Path(args.features)
    cols = {"input_ids": [], "loss_mask": [], "seq_len": []}
    n_split, aux_layers = {}, None
    for split in ("train", "val"):
        store = FeatureStore.open(feats / split)
        aux_layers = store.manifest["aux_layers"]
        n_aux, H = len(aux_layers), store.manifest["hidden_size"]
        n = 0
        for s in store.iter_samples(("input_ids", "loss_mask", "aux_hidden", "final_hidden")):
            i = len(cols["seq_len"])
            T = s["input_ids"].shape[0]
            hs = torch.cat([s["aux_hidden"].float().view(T, n_aux, H),
                            (s["final_hidden"].float() / w).view(T, 1, H)], dim=1)
            ids = s["input_ids"].long()
            save_file({"hidden_states": hs.contiguous(), "token_ids": ids}, str(hs_dir / f"hs_{i}.safetensors"))
            cols["input_ids"].append(ids.tolist())
            cols["loss_mask"].append(s["loss_mask"].bool().tolist())
            cols["seq_len"].append(T)
            n += 1
        n_split[split] = n
    Dataset.from_dict(cols).with_format("torch").save_to_disk(str(work / "data"))
    n_all = sum(n_split.values())
    ratio = (n_split["train"] + 0.5) / n_all  # int(n_all * ratio) == n_train exactly
    assert int(n_all * ratio) == n_split["train"]
    info = {"samples": n_split, "train_data_ratio": ratio, "aux_layers": aux_layers,
            "train_real_tokens": sum(cols["seq_len"][: n_split["train"]]),
            "train_tokens_after_peer_shift": sum(cols["seq_len"][: n_split["train"]]) - n_split["train"],
            "final_hidden": "stored as eyas final_hidden / target norm weight (peer re-applies the norm)",
            "hidden_states_dtype": "float32"}
    return info


# ----------------------------------------------------------------------------- peer training

def peer_argv(args, info: dict, s: dict) -> list[str]:
    """The peer CLI's arguments for this comparison (settings ``s`` from :func:`_settings`)."""
    import numpy as np

    work = Path(args.work)
    return ["--speculator-type", "eagle3", "--verifier-name-or-path", str(work / "verifier"),
            "--data-path", str(work / "data"), "--d2t-path", str(work / "d2t.npy"),
            "--t2d-path", str(work / "t2d.npy"), "--draft-vocab-size", str(len(np.load(work / "d2t.npy"))),
            "--target-layer-ids", *[str(x) for x in info["aux_layers"]],
            "--num-layers", "1", "--draft-arch", "llama",
            "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output",
            "--draft-attn-impl", s["attn_impl"], "--loss-implementation", "eager",
            "--hidden-states-dtype", "float32", "--on-missing", "raise",
            "--total-seq-len", str(s["total_seq_len"]), "--train-data-ratio", repr(info["train_data_ratio"]),
            "--num-workers", "0", "--ttt-steps", str(s["ttt_length"]),
            "--ttt-step-loss-decay", str(s["step_decay"]), "--optimizer", "adamw", "--lr", str(s["lr"]),
            "--weight-decay", str(s["weight_decay"]), "--scheduler-type", "cosine",
            "--scheduler-warmup-ratio", str(s["warmup_ratio"]), "--epochs", str(s["epochs"]),
            "--seed", str(s["seed"]), "--save-path", str(work / "ckpt"), "--no-resume-from-checkpoint",
            "--log-dir", str(work / "logs")]


def peer_train(args) -> dict:
    """Run in the peer's venv: its CLI main with the CPU shim; returns wall time and steps."""
    import torch

    torch.set_num_threads(1)
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer_mod
    from speculators.train.config import TrainConfig

    trainer_mod.get_local_rank = lambda: "cpu"  # its Trainer does model.to(local_rank)
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.synchronize = lambda *a, **k: None

    record = {}

    class TimedTrainer(trainer_mod.Trainer):
        def run_training(self):
            t0 = time.perf_counter()
            out = super().run_training()
            record["train_seconds"] = time.perf_counter() - t0
            record["steps"] = self.global_step
            return out

    cli.Trainer = TimedTrainer
    work = Path(args.work)
    info = json.loads((work / "convert.json").read_text())
    s = _settings(args)
    argv = peer_argv(args, info, s)
    t0 = time.perf_counter()
    cli.main(TrainConfig.resolve(argv))
    record["wall_seconds_incl_setup"] = time.perf_counter() - t0
    epochs = sorted(int(d.name) for d in (work / "ckpt").iterdir() if d.name.isdigit())
    record["checkpoint"] = str(work / "ckpt" / str(epochs[-1]))
    record["argv"] = argv
    record["settings"] = s
    real = info["train_tokens_after_peer_shift"] * s["epochs"]
    record["train_tokens_real"] = real
    record["tokens_per_second_real"] = real / record["train_seconds"]
    from importlib.metadata import version

    record["env"] = {**_env(), "speculators": version("speculators")}
    return record


def check_same_function(args, ckpt: str, sample: int = 0) -> dict:
    """Run in the peer's venv: the peer's own ``Eagle3DraftModel`` (loaded from ``ckpt``) and eyas'
    ``load_drafter(ckpt)`` on one val sample, teacher-forced for ``ttt_length`` steps; returns the
    max |logit difference| and the argmax agreement per step (the conversion check: a mismatch would
    mean eyas scores a different function than the peer trained).

    The peer's logits are read with a forward hook on its ``lm_head`` (its forward returns only the
    argmax tokens). Index t of the peer's shifted batch (``shift_batch``: input x[t+1], hidden g[t])
    is index t of eyas' step (eyas/training/batches.py alignment), so both cover t < T-1-k at step k.
    """
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    from eyas.export.load import load_drafter
    from eyas.features import FeatureStore, head_path
    from eyas.io import load_safetensors
    from eyas.training.batches import shift_left

    torch.set_num_threads(1)
    s = _settings(args)
    work = Path(args.work)
    info = json.loads((work / "convert.json").read_text())
    cfg = Eagle3DraftModel.config_class.from_pretrained(ckpt)
    cfg.transformer_layer_config._attn_implementation = s["attn_impl"]  # noqa: SLF001 (as its CLI does)
    peer = Eagle3DraftModel.from_pretrained(ckpt, config=cfg).float().eval()
    ds = ArrowDataset(max_len=10_000, datapath=str(work / "data"), on_missing="raise",
                      train_ratio=info["train_data_ratio"], split="val", hidden_states_dtype=torch.float32)
    raw = ds[sample]
    T = raw["input_ids"].shape[0]
    b = CollateFn(max_len=T - 1, hidden_size=peer.hidden_size, dtype=torch.float32, preprocess=shift_batch)([raw])
    peer_logits = []
    hook = peer.lm_head.register_forward_hook(lambda m, i, o: peer_logits.append(o.detach()))
    with torch.no_grad():
        peer(hidden_states=b["hidden_states"], input_ids=b["input_ids"], document_ids=b["document_ids"],
             position_ids=b["position_ids"], ttt_steps=s["ttt_length"])
    hook.remove()

    feats = Path(args.features)
    ey = load_drafter(ckpt, num_target_layers=FeatureStore.open(feats / "val").manifest["num_layers"])
    ey.set_embedding(load_safetensors(head_path(feats))["embed_tokens"])
    x = next(iter(FeatureStore.open(feats / "val").iter_samples(("input_ids", "aux_hidden"))))
    assert x["input_ids"].shape[0] == T and torch.equal(x["input_ids"].long(), raw["input_ids"])
    ids = x["input_ids"].long()[None]
    pos, doc = torch.arange(T)[None], torch.zeros(1, T, dtype=torch.long)
    out, cache = [], []
    with torch.no_grad():
        h = ey.project(x["aux_hidden"].float()[None])
        for k in range(s["ttt_length"]):
            h = ey.ttt_step(h, shift_left(ids, 1 + k, 0), pos + k, doc, cache)
            a, bb = ey.logits(h)[0, : T - 1 - k], peer_logits[k][0, : T - 1 - k]
            out.append({"step": k, "max_abs_logit_diff": float((a - bb).abs().max()),
                        "logit_scale": float(bb.abs().max()),
                        "argmax_agree": float((a.argmax(-1) == bb.argmax(-1)).float().mean())})
    return {"checkpoint": ckpt, "sample_tokens": T, "steps": out}


# ----------------------------------------------------------------------------- eyas timing

def eyas_time(args, steps: int) -> dict:
    """eyas' train_drafter on the same features for the configured epochs (``steps`` > 0: at most
    that many optimizer steps), no tracking; saves the drafter to ``--work``/eyas_drafter."""
    import dataclasses

    import torch

    torch.set_num_threads(1)
    from eyas.export.eagle import save_drafter
    from eyas.features import FeatureStore, head_path
    from eyas.io import load_safetensors
    from eyas.tracking.runs import Tracker
    from eyas.training.batches import PackedLoader
    from eyas.training.loop import new_drafter, train_drafter
    from eyas.vocab.mapping import load_mapping

    p = _params()
    s = _settings(args)
    feats = Path(args.features)
    train, val = FeatureStore.open(feats / "train"), FeatureStore.open(feats / "val")
    mapping, _ = load_mapping(args.vocab)
    head = load_safetensors(head_path(feats))
    drafter = new_drafter(train.manifest, mapping, head["embed_tokens"], p.seed)
    tp = dataclasses.replace(p.train, max_steps=steps, epochs=s["epochs"], checkpoint_every=0)
    r = train_drafter(drafter, train_store=train, val_store=val, lm_head=head["lm_head"], tp=tp,
                      lr=s["lr"], seed=p.seed, tracker=Tracker(), device=torch.device("cpu"))
    # real (unpadded) tokens: whole epochs see every token once; a step cap, its share
    real = train.manifest["num_tokens"] * s["epochs"] * r.steps / max(1, sum(
        PackedLoader(train, tp.batch_tokens, p.seed).num_batches(e) for e in range(s["epochs"])))
    save_drafter(drafter.cpu(), Path(args.work) / "eyas_drafter")
    return {"settings": {**s, "max_steps": steps}, "steps": r.steps, "seconds": r.seconds, "train_tokens_padded": r.train_tokens,
            "tokens_per_second_padded": r.train_tokens / r.seconds, "train_tokens_real": real,
            "tokens_per_second_real": real / r.seconds, "val": r.final_val, "env": _env()}


# ----------------------------------------------------------------------------- eval

def evaluate_drafters(args, ckpt: str, partial=None) -> dict:
    """Val metrics (eyas.training.unroll.evaluate) of the peer checkpoint, of eyas' drafter from ``eyas-time``
    (``--work``/eyas_drafter, when present) and, as a check of this path, of the committed
    models/scratch; acceptance length of the first two on stages/eval_accept_len.py's prompts.

    Raises:
        ValueError: the peer checkpoint's aux layers differ from the features' (layer-id mix-up).
    """
    import torch

    torch.set_num_threads(1)
    from eyas.data.conversations import chat_prompts, humaneval_prompts, read_jsonl, render_prompt
    from eyas.eval.speculative import evaluate_prompts, greedy_generate
    from eyas.export.load import load_drafter
    from eyas.features import FeatureStore, head_path
    from eyas.io import load_safetensors
    from eyas.target.model import load_target
    from eyas.training.batches import PackedLoader, head_rows_for
    from eyas.training.unroll import TTTUnroll, evaluate

    p = _params()
    feats = Path(args.features)
    val = FeatureStore.open(feats / "val")
    head = load_safetensors(head_path(feats))
    L = val.manifest["num_layers"]
    out = {"checkpoint": ckpt}
    drafters = {"peer": load_drafter(ckpt, num_target_layers=L)}
    if (Path(args.work) / "eyas_drafter").is_dir():
        drafters["eyas_same_budget"] = load_drafter(Path(args.work) / "eyas_drafter", L)
    drafters["eyas_scratch_committed"] = load_drafter(ROOT / "models/scratch", L)
    for name, d in drafters.items():
        d.set_embedding(head["embed_tokens"])
        loader = PackedLoader(val, p.train.batch_tokens, p.seed, shuffle=False)
        unroll = TTTUnroll(d, head_rows_for(head["lm_head"], d), p.train.ttt_length, p.train.step_decay,
                           p.train.backend)
        out[f"val_{name}"] = evaluate(unroll, loader, torch.device("cpu"))
    peer = drafters["peer"]
    out["peer_aux_layers"] = peer.config.resolved_aux_layers()
    if out["peer_aux_layers"] != val.manifest["aux_layers"]:
        raise ValueError(f"{ckpt}: aux layers {out['peer_aux_layers']} != features' {val.manifest['aux_layers']}")

    e = p.eval
    target = load_target(p.target.path, p.target.gguf_file, p.target.dtype, p.target.trust_remote_code,
                         revision=p.target.revision)
    tok = target.tokenizer
    benches = {"chat": chat_prompts(read_jsonl(ROOT / "data/conversations/test.jsonl"), e.chat_prompts),
               "humaneval": humaneval_prompts(e.humaneval_prompts)}
    kw = dict(num_draft_tokens=e.num_draft_tokens, max_new_tokens=e.max_new_tokens, stop_ids=target.stop_ids)
    greedy = {}  # one greedy baseline per benchmark, shared by the drafters (as the stage does)
    for bench, chats in benches.items():
        prompts = [render_prompt(tok, m) for m in chats]
        t0 = time.perf_counter()
        greedy[bench] = (prompts, [greedy_generate(target.model, ids, max_new_tokens=e.max_new_tokens,
                                                   stop_ids=target.stop_ids) for ids in prompts],
                         time.perf_counter() - t0)
    out["env"] = _env()
    for name in [n for n in drafters if n != "eyas_scratch_committed"]:
        d = drafters[name]
        d.set_embedding(target.model.get_input_embeddings().weight)
        d.to(target.device).eval()
        for bench, (prompts, base, base_s) in greedy.items():
            r = evaluate_prompts(target, d, prompts, aux_layer_ids=d.config.resolved_aux_layers(),
                                 baseline=base, timing_repeats=0, **kw)
            out[f"accept_{name}_{bench}"] = r
            print(f"{name} {bench}: accept_len {r['accept_len']} lossless {r['lossless']}", flush=True)
            if partial is not None:
                partial(out)  # keep what is done if a later drafter is cut short
    return out


def _in_peer_venv(args, part: str) -> None:
    """Run ``part`` of this script with the peer's venv python (it holds speculators and datasets)."""
    opts = [(f"--{k}", str(v)) for k, v in (("epochs", args.epochs), ("lr", args.lr),
                                          ("total-seq-len", args.total_seq_len)) if v is not None]
    cmd = [args.peer_python, __file__, "--part", part, "--work", args.work, "--features", args.features,
           "--vocab", args.vocab, "--attn-impl", args.attn_impl, "--inside-peer-venv"] + [x for kv in opts for x in kv]
    if part == "check" and args.check_ckpt:
        cmd += ["--check-ckpt", args.check_ckpt]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"{part} (peer venv) {time.perf_counter() - t0:.0f} s", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.work)
    if args.inside_peer_venv:  # set by _in_peer_venv: write the part's record into --work, nothing into the repo
        work.mkdir(parents=True, exist_ok=True)
        if args.part == "check":
            ck = args.check_ckpt or json.loads((work / "peer_train.json").read_text())["checkpoint"]
            rec = check_same_function(args, ck)
        else:
            rec = convert(args) if args.part == "convert" else peer_train(args)
        (work / f"{args.part.replace('-', '_')}.json").write_text(json.dumps(rec, indent=1, default=str))
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for part in ("convert", "peer-train", "check"):
        if args.part in (part, "all"):
            _in_peer_venv(args, part)
        rec = work / f"{part.replace('-', '_')}.json"
        if rec.exists():
            _merge(out, part.replace("-", "_"), json.loads(rec.read_text()))
    peer_rec = work / "peer_train.json"
    if args.part in ("eyas-time", "all"):
        _merge(out, "eyas_time", eyas_time(args, args.eyas_steps))
    if args.part in ("eval", "all"):
        ckpt = json.loads(peer_rec.read_text())["checkpoint"]
        _merge(out, "eval", evaluate_drafters(args, ckpt, partial=lambda doc: _merge(out, "eval", doc)))


if __name__ == "__main__":
    main()
