"""Scaling table: val acc_0..3 and acceptance length vs training tokens, scratch vs fine-tune (CPU).

On the embedded default's existing features (``data/features/{train,val}``, ``models/vocab``,
``models/remapped``; read only), one-layer EAGLE-3 drafters are trained exactly as the stages do
(stages/train_scratch.py: random init, lr = top-level ``lr``; stages/train_finetune.py: from
``models/remapped`` with the step-0 gate, lr ``train_finetune.lr``; both with params ``train`` and
``seed``) on the first N train conversations (``data/distilled/train.jsonl`` order; extract
stores samples sorted by length, so they are found by their token ids), for each N in ``--sizes``. Every size runs ``train.epochs`` epochs, so training tokens grow with N.

Each drafter is then measured two ways:
- val acc_0..3 / loss_0..3: ``eyas.training.unroll.evaluate`` on the full val split, the definition of
  ``metrics/train_*.json`` ``val``;
- acceptance length at k = ``eval.num_draft_tokens`` on the eval prompts (params ``eval``: chat
  prompts from ``data/conversations/test.jsonl`` and HumanEval), pooled over verify steps like
  ``metrics/eval_*.json``, with the exact chain oracle ``eyas.eval.oracle`` (it equals real
  speculative decoding under greedy verification) against the target's greedy outputs, which are
  computed once and cached (``<work>/greedy.json``). Chain lengths 1..k come from the same counts.

Flags:
  --sizes N ...     train-set sizes (samples); the largest possible is all train samples
  --reuse-240       size 240 (all 238 train samples) is the committed run: evaluate
                    ``models/scratch`` and ``models/finetune`` and read their training record from
                    ``metrics/train_*.json`` instead of retraining (same params, same data)
  --arms A ...      scratch and/or finetune (default both)
  --work DIR        trained drafters (eyas export format) under DIR/<arm>_<N>/ plus train.json,
                    feature subsets, checkpoints, the greedy cache (default /tmp/scaling). A
                    drafter whose train.json exists is not retrained.
  --root DIR        the workspace holding params.yaml, data/ and models/ (default: this repo)
  --train-only      train the missing drafters of --arms and stop (no target is loaded)
  --no-train        measure only the drafters already trained (the rest is listed as not_trained)
  --out FILE        the result JSON (default scaling_cpu.json)
  --threads T       torch threads per process (default 1); missing arms train as parallel
                    processes, one per arm

    OMP_NUM_THREADS=1 python dev/bench/scaling.py --sizes 60 120 240 --reuse-240

writes ``--out`` (default ``scaling_cpu.json``).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from eyas.drafter.backend import Backend  # noqa: E402
from eyas.export.eagle import save_drafter  # noqa: E402
from eyas.export.load import load_drafter  # noqa: E402
from eyas.features import FeatureStore, ShardWriter, check_compatible, head_path  # noqa: E402
from eyas.io import load_safetensors, read_json, sha256_file, write_json  # noqa: E402
from eyas.params.full import load_params  # noqa: E402
from eyas.tracking.runs import Tracker  # noqa: E402
from eyas.training import checkpoint  # noqa: E402
from eyas.training.batches import PackedLoader, head_rows_for  # noqa: E402
from eyas.training.loop import new_drafter, step0_gate, train_drafter  # noqa: E402
from eyas.training.unroll import TTTUnroll, evaluate  # noqa: E402
from eyas.vocab.mapping import load_mapping  # noqa: E402

ARMS = ("scratch", "finetune")
CPU = torch.device("cpu")
# manifest fields ShardWriter.finish computes itself
_COMPUTED = {"format_version", "num_samples", "num_tokens", "supervised_tokens", "storage_dtype", "shards",
             "aux_layers_convention"}


def conversation_order(store: FeatureStore, convs: list[dict], tokenizer, max_length: int) -> list[int]:
    """Store sample indices in conversation (file) order. Extract sorts samples by length, so the
    first N samples of a store are the N shortest; this matches each conversation, rendered as
    extract renders it (eyas.data.conversations.render_with_loss_mask at ``max_length``), to the sample with
    the same input_ids. Conversations without a sample (no supervised tokens) are skipped.

    Raises:
        ValueError: some sample matches no conversation (other data or tokenizer than extract's).
    """
    from eyas.data.conversations import render_with_loss_mask

    by_ids: dict[tuple, list[int]] = {}
    for i, s in enumerate(store.iter_samples(("input_ids",))):
        by_ids.setdefault(tuple(s["input_ids"].tolist()), []).append(i)
    order = []
    for c in convs:
        hits = by_ids.get(tuple(render_with_loss_mask(tokenizer, c["messages"], max_length)["input_ids"]))
        if hits:
            order.append(hits.pop(0))
    if len(order) != store.manifest["num_samples"]:
        raise ValueError(f"{store.root}: only {len(order)} of {store.manifest['num_samples']} samples match a "
                         f"conversation; the features were extracted from other data or with another tokenizer")
    return order


def subset_features(src: FeatureStore, indices: list[int], out_dir: Path) -> FeatureStore:
    """The samples ``indices`` of ``src`` as a feature store in ``out_dir``, kept in ``src``'s
    order (extract's length order); same tensors, dtypes and manifest fields, counts recomputed.
    Returns ``src`` itself for all of its samples; reuses a complete ``out_dir`` of the same subset."""
    keep = sorted(set(indices))
    if len(keep) == src.manifest["num_samples"]:
        return src
    if (out_dir / "manifest.json").is_file():
        store = FeatureStore.open(out_dir)
        if store.manifest.get("subset_of") == str(src.root) and store.manifest.get("subset_indices") == keep:
            return store
    dtype = getattr(torch, src.manifest["storage_dtype"])
    w = ShardWriter(out_dir, max(s["samples"] for s in src.manifest["shards"]), dtype)
    wanted = set(keep)
    for i, s in enumerate(src.iter_samples()):
        if i in wanted:
            w.add(s["input_ids"], s["loss_mask"], s["aux_hidden"], s["final_hidden"], s["target_argmax"])
    fields = {k: v for k, v in src.manifest.items() if k not in _COMPUTED}
    w.finish(**fields, subset_of=str(src.root), subset_indices=keep)
    return FeatureStore.open(out_dir)


def tokenizer_for(p):
    """The target's tokenizer alone at ``target.revision`` (as eyas.target.model.load_target finds it; no
    weights loaded)."""
    from eyas.target.model import load_tokenizer_and_config

    return load_tokenizer_and_config(p.target.path, p.target.gguf_file, p.target.trust_remote_code,
                                     revision=p.target.revision)[0]


def train_order(root: Path, work: Path) -> list[int]:
    """:func:`conversation_order` of the train features, cached in ``work/train_order.json``."""
    cache = work / "train_order.json"
    if cache.is_file():
        return read_json(cache)["order"]
    from eyas.data.conversations import read_jsonl

    p = load_params(root / "params.yaml")
    store = FeatureStore.open(root / "data/features/train")
    order = conversation_order(store, read_jsonl(root / "data/distilled/train.jsonl"), tokenizer_for(p),
                               p.extract.max_length)
    write_json(cache, {"features": str(store.root), "order": order})
    return order


def initial_drafter(arm: str, root: Path, p, manifest: dict, head: dict):
    """(drafter, peak lr, gate) as stages/train_<arm>.py builds them."""
    if arm == "scratch":
        mapping, _ = load_mapping(root / "models/vocab")
        d = new_drafter(manifest, mapping, head["embed_tokens"], p.seed, mapping_source=str(root / "models/vocab"))
        return d, p.lr, None
    src = root / "models/remapped"
    d = load_drafter(src, num_target_layers=manifest["num_layers"])
    c = d.config
    check_compatible(manifest, aux_layers=c.resolved_aux_layers(), hidden_size=c.target_hidden_size,
                     vocab_size=c.vocab_size, source=str(src))
    d.set_embedding(head["embed_tokens"])
    f = p.train_finetune
    return d, f.lr, step0_gate(c.draft_vocab_size, f.gate_margin, f.gate_min_acc, f.gate_override)


def train_one(arm: str, n: int, root: Path, work: Path) -> dict:
    """Train ``arm`` on the first ``n`` train samples; export to ``work/<arm>_<n>/`` and write its
    training record ``train.json`` there last (its presence marks the drafter done). Resumable:
    checkpoints go to ``work/.ckpt/<arm>_<n>``. Returns the record."""
    p = load_params(root / "params.yaml")
    feats = root / "data/features"
    # the first n train conversations; a size beyond the split (240 conversations, 238 kept by
    # self-distill) means all of it
    train = subset_features(FeatureStore.open(feats / "train"), train_order(root, work)[:n], work / f"features_{n}")
    val = FeatureStore.open(feats / "val")
    head = load_safetensors(head_path(feats))
    drafter, lr, gate = initial_drafter(arm, root, p, train.manifest, head)
    ckpt = work / ".ckpt" / f"{arm}_{n}"
    load0 = os.getloadavg()
    r = train_drafter(drafter, train_store=train, val_store=val, lm_head=head["lm_head"], tp=p.train, lr=lr,
                      seed=p.seed, tracker=Tracker(), device=CPU, gate=gate, checkpoint_dir=ckpt)
    out = work / f"{arm}_{n}"
    save_drafter(drafter.cpu(), out)
    rec = {"arm": arm, "size": n, "train_samples": train.manifest["num_samples"], "lr": lr, "steps": r.steps, "train_tokens": r.train_tokens,
           "sample_tokens": train.manifest["num_tokens"] * p.train.epochs,
           "supervised_tokens": train.manifest["supervised_tokens"] * p.train.epochs,
           "seconds": round(r.seconds, 1), "threads": torch.get_num_threads(),
           "loadavg_1min_start_end": [load0[0], os.getloadavg()[0]],
           "step0_val": r.step0_val, "val": r.final_val, "source": str(out)}
    write_json(out / "train.json", rec)
    checkpoint.clear(ckpt)
    return rec


def committed_record(arm: str, root: Path) -> dict:
    """The committed full-data run (``models/<arm>``, ``metrics/train_<arm>.json``) as a record."""
    p = load_params(root / "params.yaml")
    m = read_json(root / f"metrics/train_{arm}.json")
    man = FeatureStore.open(root / "data/features/train").manifest
    return {"arm": arm, "size": 240, "train_samples": man["num_samples"], "lr": p.lr if arm == "scratch" else p.train_finetune.lr,
            "steps": m["steps"], "train_tokens": m["train_tokens"],
            "sample_tokens": man["num_tokens"] * p.train.epochs,
            "supervised_tokens": man["supervised_tokens"] * p.train.epochs, "seconds": m["seconds"],
            "threads": "dvc repro (see README: 2 cores)", "step0_val": m["step0_val"], "val": m["val"],
            "source": str(root / f"models/{arm}")}


def val_metrics(drafter, root: Path, p, head: dict) -> dict:
    """``eyas.training.unroll.evaluate`` of a loaded drafter on the full val split (as train_drafter's final
    evaluation: PackedLoader(val, batch_tokens, seed, shuffle=False), CPU fp32)."""
    val = FeatureStore.open(root / "data/features/val")
    drafter.set_embedding(head["embed_tokens"])
    loader = PackedLoader(val, p.train.batch_tokens, p.seed, shuffle=False)
    with torch.no_grad():
        unroll = TTTUnroll(drafter, head_rows_for(head["lm_head"], drafter), p.train.ttt_length,
                           p.train.step_decay, Backend.of(p.train.backend))
        return evaluate(unroll, loader, CPU)


def eval_prompts(root: Path, p, tokenizer) -> dict[str, list[list[int]]]:
    """Rendered prompt ids per benchmark, exactly as stages/eval_accept_len.py builds them."""
    from eyas.data.conversations import chat_prompts, humaneval_prompts, read_jsonl, render_prompt

    e = p.eval
    chats = {"chat": chat_prompts(read_jsonl(root / "data/conversations/test.jsonl"), e.chat_prompts),
             "humaneval": humaneval_prompts(e.humaneval_prompts)}
    return {b: [render_prompt(tokenizer, m) for m in c] for b, c in chats.items()}


def greedy_outputs(target, prompts: dict, p, cache: Path) -> dict[str, list[list[int]]]:
    """The target's greedy outputs (``eval.max_new_tokens``, stop token included) per benchmark and
    prompt, cached in ``cache`` keyed by the prompts and settings (recomputed when they differ)."""
    from eyas.eval.speculative import greedy_generate

    key = {"prompts": prompts, "max_new_tokens": p.eval.max_new_tokens, "stop_ids": target.stop_ids}
    if cache.is_file():
        c = read_json(cache)
        if c.get("key") == key:
            return c["outputs"]
    with torch.no_grad():
        outs = {b: [greedy_generate(target.model, ids, max_new_tokens=p.eval.max_new_tokens,
                                    stop_ids=target.stop_ids) for ids in ps]
                for b, ps in prompts.items()}
    write_json(cache, {"key": key, "outputs": outs})
    return outs


def acceptance(target, drafter, prompts: dict, outputs: dict, k: int, real: dict | None = None) -> dict:
    """Acceptance length per benchmark from the exact chain oracle (eyas/eval/oracle.py): counts
    at k drafts per prompt, walked at chain lengths 1..k and pooled over prompts as
    sum(new tokens - 1) / sum(verify steps) (the prefill's token is not a verify step), the
    definition of metrics/eval_*.json ``accept_len``. Also the pooled figure at k without the
    outputs that end in a repetition loop. With ``real`` (an eval_*.json of this drafter on the
    same prompts), ``oracle_matches_real`` says whether the k-walk reproduces its verify steps,
    new tokens and accepted histogram exactly."""
    from eyas.eval.oracle import accepted_draft_counts, chain_acceptance_length, chain_report, repetition_loop_period

    drafter.set_embedding(target.model.get_input_embeddings().weight)  # as the eval stage does
    aux = drafter.config.resolved_aux_layers()
    res = {}
    for bench, ps in prompts.items():
        ys = outputs[bench]
        counts = [accepted_draft_counts(target, drafter, ids, y, num_draft_tokens=k, aux_layer_ids=aux)
                  for ids, y in zip(ps, ys)]

        def pooled(j: int, which: list[int]) -> float | None:
            steps = sum(chain_acceptance_length(counts[i], len(ys[i]), j)[1] for i in which)
            return sum(len(ys[i]) - 1 for i in which) / steps if steps else None

        looping = [i for i, y in enumerate(ys) if repetition_loop_period(y) is not None]
        r = {"accept_len": {str(j): pooled(j, list(range(len(ys)))) for j in range(1, k + 1)},
             "accept_len_non_looping": pooled(k, [i for i in range(len(ys)) if i not in looping]),
             "looping_prompts": len(looping), "new_tokens": sum(map(len, ys))}
        if real is not None:
            r["real_accept_len"] = real[bench]["accept_len"]
            r["oracle_matches_real"] = chain_report(counts, ys, k, real[bench])["oracle_matches_real"]
        res[bench] = r
    return res


def measure(rec: dict, arm: str, committed: bool, root: Path, work: Path, p, head: dict, target_side) -> dict:
    """val metrics and acceptance of the drafter in ``rec["source"]``, cached in
    ``work/eval/<arm>_<size>.json`` under a key of its weights, the greedy outputs and the
    settings (the target is only loaded when the cache misses: ``target_side()``)."""
    cache = work / "eval" / f"{arm}_{rec['size']}.json"
    greedy = work / "greedy.json"
    key = {"weights": sha256_file(Path(rec["source"]) / "model.safetensors"), "eval": vars(p.eval),
           "train": vars(p.train), "seed": p.seed, "greedy": sha256_file(greedy) if greedy.is_file() else None}
    if cache.is_file() and read_json(cache)["key"] == key:
        return read_json(cache)["measured"]
    ev = target_side()
    key["greedy"] = sha256_file(greedy)
    drafter = load_drafter(rec["source"], num_target_layers=ev["target"].num_layers).eval()
    t0 = time.time()
    val = val_metrics(drafter, root, p, head)
    real = read_json(root / f"metrics/eval_{arm}.json") if committed else None
    acc = acceptance(ev["target"], drafter, ev["prompts"], ev["outputs"], p.eval.num_draft_tokens, real)
    out = {"val_eval": val, "acceptance": acc, "eval_seconds": round(time.time() - t0, 1)}
    write_json(cache, {"key": key, "measured": out})
    return out


def markdown_table(rows: list[dict], k: int) -> str:
    """The scaling table in Markdown: one line per (size, arm)."""
    lines = [f"| N conv. | arm | train tokens | steps | train s | val acc_0 | acc_1 | acc_2 | acc_3 | "
             f"chat accept@{k} | humaneval accept@{k} | chat by chain length 1..{k} |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        v, c, h = r["val_eval"], r["acceptance"]["chat"], r["acceptance"]["humaneval"]
        by = " / ".join(f"{c['accept_len'][str(j)]:.3f}" for j in range(1, k + 1))
        lines.append(f"| {r['train_samples']} | {r['arm']} | {r['train_tokens']:,} | {r['steps']} | {r['seconds']:.0f} | "
                     + " | ".join(f"{v[f'acc_{i}']:.4f}" for i in range(4))
                     + f" | {c['accept_len'][str(k)]:.3f} | {h['accept_len'][str(k)]:.3f} | {by} |")
    return "\n".join(lines)


def train_missing(arms, sizes, root: Path, work: Path, reuse: int | None, threads: int) -> None:
    """One process per arm with missing drafters (``--train-only``), run in parallel; the feature
    subsets they share are written here first."""
    procs = []
    for arm in arms:
        todo = [n for n in sizes if n != reuse and not (work / f"{arm}_{n}" / "train.json").is_file()]
        for n in todo:
            subset_features(FeatureStore.open(root / "data/features/train"), train_order(root, work)[:n],
                            work / f"features_{n}")
        if todo:
            cmd = [sys.executable, __file__, "--train-only", "--arms", arm, "--sizes", *map(str, todo),
                   "--root", str(root), "--work", str(work), "--threads", str(threads)]
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
            procs.append((arm, subprocess.Popen(cmd, env=env)))
    for arm, proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"training arm {arm} failed (exit {proc.returncode}); rerun resumes it")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[60, 120, 240])
    ap.add_argument("--reuse-240", action="store_true")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--work", type=Path, default=Path("/tmp/scaling"))
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    ap.add_argument("--train-only", action="store_true")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("scaling_cpu.json"))
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(a.threads)
    root, work = a.root.resolve(), a.work
    reuse = 240 if a.reuse_240 else None
    if a.train_only:
        for arm in a.arms:
            for n in a.sizes:
                if not (work / f"{arm}_{n}" / "train.json").is_file():
                    rec = train_one(arm, n, root, work)
                    print(f"{arm} N={n}: {rec['steps']} steps, {rec['train_tokens']} tokens, {rec['seconds']} s, "
                          f"val acc_0 {rec['val']['acc_0']:.4f}", flush=True)
        return
    if not a.no_train:
        train_order(root, work)  # once, before the training processes start
        train_missing(a.arms, a.sizes, root, work, reuse, a.threads)

    p = load_params(root / "params.yaml")
    k = p.eval.num_draft_tokens
    head = load_safetensors(head_path(root / "data/features"))
    ev: dict = {}  # the target, prompts and greedy outputs, loaded at the first drafter to measure

    def target_side() -> dict:
        if not ev:
            from eyas.target.model import load_target

            ev["target"] = t = load_target(p.target.path, p.target.gguf_file, p.target.dtype,
                                           p.target.trust_remote_code, revision=p.target.revision)
            ev["prompts"] = eval_prompts(root, p, t.tokenizer)
            ev["outputs"] = greedy_outputs(t, ev["prompts"], p, work / "greedy.json")
        return ev

    rows, missing = [], []
    for n in a.sizes:
        for arm in a.arms:
            if n == reuse:
                rec = committed_record(arm, root)
            elif (work / f"{arm}_{n}" / "train.json").is_file():
                rec = read_json(work / f"{arm}_{n}" / "train.json")
            else:  # only with --no-train
                missing.append(f"{arm}_{n}")
                continue
            rows.append({**rec, **measure(rec, arm, n == reuse, root, work, p, head, target_side)})
            r = rows[-1]
            print(f"{arm} N={n}: val acc_0 {r['val_eval']['acc_0']:.4f}, accept_len@{k} "
                  + ", ".join(f"{b} {x['accept_len'][str(k)]:.3f}" for b, x in r["acceptance"].items()), flush=True)
    import transformers

    doc = {"command": " ".join(["python"] + sys.argv),
           "env": {"device": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                   "torch": torch.__version__, "transformers": transformers.__version__,
                   "python": sys.version.split()[0]},
           "settings": {"sizes": a.sizes, "reuse_240": a.reuse_240, "threads_per_process": a.threads,
                        "lr": p.lr, "seed": p.seed, "train": vars(p.train), "train_finetune": vars(p.train_finetune),
                        "eval": vars(p.eval), "target": p.target.path},
           "rows": rows, "not_trained": missing}
    write_json(a.out, doc)
    print(markdown_table(rows, k))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
