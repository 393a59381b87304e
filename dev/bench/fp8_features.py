"""fp8 (e4m3, per-token per-layer scales) aux feature storage against bf16: bytes, fidelity, val acc.

Reads existing bf16 features (default ``data/features/{train,val}``, read-only), writes fp8 copies
with eyas' own writer (``extract.dtype: float8_e4m3fn``, eyas/features.py) under ``--work``, then
1. bytes per token of both (manifest formula and bytes on disk),
2. reconstruction error of the dequantised hidden states against the bf16 ones (val), per layer,
   and whether the target's greedy token ``argmax(lm_head(final_hidden))`` survives (val),
3. the scratch drafter trained on each for the same budget (same seed, data order and params;
   ``--epochs``, default 1), compared on val acc_0..3 of its own val set.
Verdict: fp8 passes when |val acc_0(fp8) - val acc_0(bf16)| <= 0.005 (0.5 points).

Run from the repository root (CPU; one thread so it shares the machine):
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python -m dev.bench.fp8_features
Writes dev/results/fp8_features_cpu.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from dev.bench.common import write_result
from eyas.features import FP8, FeatureStore, ShardWriter, bytes_per_token, dequantize_fp8, head_path, quantize_fp8
from eyas.io import load_safetensors
from eyas.params.full import load_params
from eyas.tracking.runs import NoOpTracker
from eyas.training.loop import new_drafter, train_drafter
from eyas.vocab.mapping import load_mapping

WRITER_KEYS = {"format_version", "num_samples", "num_tokens", "supervised_tokens", "storage_dtype", "shards",
               "aux_layers_convention"}


def to_fp8(src: FeatureStore, out: Path) -> FeatureStore:
    """Re-store ``src`` in fp8, same samples in the same order and shard sizes."""
    w = ShardWriter(out, src.manifest["shards"][0]["samples"], FP8)
    for s in src.iter_samples():
        w.add(s["input_ids"], s["loss_mask"], s["aux_hidden"], s["final_hidden"], s["target_argmax"])
    w.finish(**{k: v for k, v in src.manifest.items() if k not in WRITER_KEYS})
    return FeatureStore.open(out)


def disk_bytes(store: FeatureStore) -> int:
    return sum((store.root / s["file"]).stat().st_size for s in store.manifest["shards"])


def fidelity(ref: FeatureStore, q: FeatureStore, lm_head: torch.Tensor) -> dict:
    """Relative RMS error ||x_q - x|| / ||x|| per aux layer and for the final hidden state (bf16
    in both stores), the max abs error, the share of tokens whose argmax(lm_head(final_hidden)) is
    unchanged, and the same two figures had the final hidden state been stored in fp8 too."""
    keys = ("aux_hidden", "final_hidden", "target_argmax")
    a, b = next(ref.iter_shards(keys)), next(q.iter_shards(keys))
    H, n_aux = ref.manifest["hidden_size"], len(ref.aux_layers)
    out = {}
    for i in range(n_aux + 1):
        x = (a["aux_hidden"][:, i * H:(i + 1) * H] if i < n_aux else a["final_hidden"]).float()
        y = (b["aux_hidden"][:, i * H:(i + 1) * H] if i < n_aux else b["final_hidden"]).float()
        name = f"aux_layer_{ref.aux_layers[i]}" if i < n_aux else "final"
        out[name] = {"rel_rms_error": ((y - x).norm() / x.norm()).item(), "max_abs": x.abs().max().item(),
                     "max_abs_error": (y - x).abs().max().item()}
    am_ref = (a["final_hidden"].float() @ lm_head.T).argmax(-1)
    am_q = (b["final_hidden"].float() @ lm_head.T).argmax(-1)
    out["greedy_token_agreement"] = (am_ref == am_q).float().mean().item()
    out["greedy_matches_stored_argmax_bf16"] = (am_ref == a["target_argmax"].long()).float().mean().item()
    out["greedy_matches_stored_argmax_fp8"] = (am_q == b["target_argmax"].long()).float().mean().item()
    # why the final hidden state stays bf16: the same checks with it quantised too
    fq = dequantize_fp8(*quantize_fp8(a["final_hidden"], 1)).float()
    x = a["final_hidden"].float()
    am_fq = (fq @ lm_head.T).argmax(-1)
    out["final_if_fp8"] = {"rel_rms_error": ((fq - x).norm() / x.norm()).item(),
                           "greedy_token_agreement": (am_ref == am_fq).float().mean().item()}
    out["tokens"] = int(am_ref.numel())
    return out


def train_on(train: FeatureStore, val: FeatureStore, tp, lr: float, seed: int, vocab: Path, head: dict) -> dict:
    mapping, _ = load_mapping(vocab)
    drafter = new_drafter(train.manifest, mapping, head["embed_tokens"], seed)
    r = train_drafter(drafter, train_store=train, val_store=val, lm_head=head["lm_head"], tp=tp, lr=lr,
                      seed=seed, tracker=NoOpTracker(), device=torch.device("cpu"), checkpoint_dir=None,
                      checkpoint_every=0)
    return {"val": r.final_val, "step0_val": r.step0_val, "steps": r.steps, "seconds": round(r.seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--features", default="data/features")
    ap.add_argument("--vocab", default="models/vocab")
    ap.add_argument("--work", default="/tmp/eyas_fp8_features")
    ap.add_argument("--epochs", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    p = load_params()
    tp = dataclasses.replace(p.train, epochs=args.epochs, eval_every=10**9, checkpoint_every=0, max_steps=0)
    head = load_safetensors(head_path(args.features))
    ref = {s: FeatureStore.open(Path(args.features) / s) for s in ("train", "val")}
    t0 = time.time()
    q = {s: to_fp8(ref[s], Path(args.work) / s) for s in ("train", "val")}
    convert_s = time.time() - t0
    m = ref["train"].manifest
    storage = {}
    for name, stores in (("bfloat16", ref), ("float8_e4m3fn", q)):
        tokens = sum(st.manifest["num_tokens"] for st in stores.values())
        on_disk = sum(disk_bytes(st) for st in stores.values())
        storage[name] = {"bytes_per_token_formula": bytes_per_token(len(m["aux_layers"]), m["hidden_size"],
                                                                    getattr(torch, name)),
                         "bytes_on_disk": on_disk, "tokens": tokens,
                         "bytes_per_token_on_disk": round(on_disk / tokens, 1)}
    fid = fidelity(ref["val"], q["val"], head["lm_head"])
    print("storage", storage, "\nfidelity", fid, flush=True)
    runs = {}
    for name, stores in (("bfloat16", ref), ("float8_e4m3fn", q)):
        runs[name] = train_on(stores["train"], stores["val"], tp, p.lr, p.seed, Path(args.vocab), head)
        print(name, runs[name], flush=True)
    diff = {f"acc_{k}": runs["float8_e4m3fn"]["val"][f"acc_{k}"] - runs["bfloat16"]["val"][f"acc_{k}"]
            for k in range(tp.ttt_length)}
    doc = {"what": "scratch drafter trained on bf16 features vs fp8 aux hidden states (e4m3, per-token "
                   "per-layer fp32 scales; final hidden state bf16)",
           "features": args.features, "feature_manifest_target": m["target"], "aux_layers": m["aux_layers"],
           "train_params": dataclasses.asdict(tp), "lr": p.lr, "seed": p.seed,
           "convert_seconds": round(convert_s, 1), "storage": storage, "fidelity_val": fid, "runs": runs,
           "val_acc_fp8_minus_bf16": diff, "bar_points": 0.5,
           "fp8_passes": abs(diff["acc_0"]) <= 0.005}
    print("wrote", write_result("fp8_features_cpu.json", doc), diff)


if __name__ == "__main__":
    main()
