"""Online training (train.mode: online) against offline (extract, then train) on one or two GPUs.

An 8B-shaped Llama target (random bf16 weights, sdpa; as bench_extract.py) and the EAGLE-3 drafter
eyas builds for it (draft vocab 32,000, ``--ttt`` steps), on random token ids packed into rows of
``--max-len`` tokens, ``--batch-tokens`` per optimizer step. Everything goes through eyas' own
code: ``stages.extract.extract_split`` writes the feature store (offline) or the token store
(online), ``eyas.training.loop.train_drafter`` trains (one GPU: CUDA-graph steps), with
``eyas.training.online.TargetCapture`` as the online capture.

Figures (tokens/s: train_drafter's train_tokens per second, i.e. positions of the packed batches):
  extract        extract_split's tokens/s and bytes written (feature store, bf16);
  offline        train_drafter's steady step time on the feature store (median step interval after
                 ``--warmup`` steps: shard reads + the drafter's step);
  online         the same on the token store, target on the drafter's GPU (``ahead`` 1: batch
                 i+1's capture is launched before batch i's step; ``ahead`` 0: on demand);
  online_2gpu    target on cuda:1, drafter on cuda:0 (when 2 GPUs are visible);
  capture        the target forward of one batch alone (TargetCapture, synchronised): where the
                 online step's time goes = capture + drafter step - what overlaps;
  overlap        (capture_ms + offline step_ms - online step_ms) / min(capture_ms, offline step_ms):
                 0 = serial, 1 = the shorter one fully hidden;
  end_to_end     offline (extract once + E epochs of training) and online (E epochs of capture +
                 training) tokens/s for E = 1 and 5 epochs, from the figures above.

On one H200 (the lead's device command; writes dev/results/online_h200.json):

    python3 dev/bench/bench_online.py --out online_h200.json

Tiny CPU check of the plumbing (seconds): ``python3 dev/bench/bench_online.py --tiny --out /tmp/x.json``
(``--out`` with a directory writes there instead of dev/results/).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.common import env, sync  # noqa: E402
from dev.bench.common import write_result  # noqa: E402
from eyas.features import FeatureStore  # noqa: E402
from eyas.params.full import parse_params  # noqa: E402
from eyas.target import layers  # noqa: E402
from eyas.target.model import Target, summarise_config  # noqa: E402
from eyas.tracking.runs import Tracker  # noqa: E402
from eyas.training.loop import new_drafter, train_drafter  # noqa: E402
from eyas.training.online import OnlineLoader, TargetCapture  # noqa: E402
from eyas.vocab.mapping import build_mapping, count_tokens  # noqa: E402
from stages.extract import extract_split  # noqa: E402


def build_target(tiny: bool, device: str) -> tuple[Target, object]:
    """An 8B-shaped (or, ``tiny``, a 64-wide) Llama with random weights on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096)
    else:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16 if device.startswith("cuda") else torch.float32)
        model = LlamaForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
    identity = {"path": "random-8b-shaped" if not tiny else "random-tiny", "num_layers": cfg.num_hidden_layers}
    return Target(model, None, identity), cfg


def samples(n_tokens: int, max_len: int, vocab: int, seed: int) -> list[dict]:
    """Random rendered samples (lengths uniform in [max_len/8, max_len], first quarter unsupervised)
    totalling about ``n_tokens``, sorted by length as extract's render_split returns them."""
    g = torch.Generator().manual_seed(seed)
    out, total = [], 0
    while total < n_tokens:
        T = int(torch.randint(max_len // 8, max_len + 1, (1,), generator=g))
        out.append({"input_ids": torch.randint(0, vocab, (T,), generator=g).tolist(),
                    "loss_mask": [0] * (T // 4) + [1] * (T - T // 4), "truncated": False})
        total += T
    return sorted(out, key=lambda r: len(r["input_ids"]))


class StepClock(Tracker):
    """Records the wall time of every optimizer step's log call (the loop syncs on the loss first)."""

    def __init__(self):
        self.times: list[float] = []

    def log_metrics(self, metrics, step=None):
        if "train/loss" in metrics:
            self.times.append(time.perf_counter())


def steady_ms(clock: StepClock, warmup: int) -> dict:
    gaps = [(b - a) * 1e3 for a, b in zip(clock.times[warmup:], clock.times[warmup + 1:])]
    return {"step_ms_median": statistics.median(gaps), "step_ms_min": min(gaps), "step_ms_max": max(gaps),
            "steps_timed": len(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a 64-wide target and tiny batches (CPU plumbing check)")
    ap.add_argument("--tokens", type=int, default=0, help="train tokens (default: 48 batches' worth)")
    ap.add_argument("--batch-tokens", type=int, default=0, help="tokens per step (default 8192; tiny 256)")
    ap.add_argument("--max-len", type=int, default=0, help="sample / row length (default 2048; tiny 64)")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--extract-batch", type=int, default=4, help="samples per target forward in extract")
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the timing (compile, graph capture)")
    ap.add_argument("--workdir", default=None, help="where the stores go (default: a temporary directory)")
    ap.add_argument("--out", default="online_h200.json")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda:0" if cuda else "cpu"
    bt = a.batch_tokens or (256 if a.tiny else 8192)
    max_len = a.max_len or (64 if a.tiny else 2048)
    n_tokens = a.tokens or 48 * bt
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench_online_"))
    doc: dict = {"what": "online vs offline EAGLE-3 training, 8B-shaped Llama target (random bf16 weights)"
                 + (" [tiny CPU check]" if a.tiny else ""), "batch_tokens": bt, "max_len": max_len,
                 "ttt_length": a.ttt, "extract_batch": a.extract_batch, "gpus": torch.cuda.device_count()}

    t0 = time.perf_counter()
    target, cfg = build_target(a.tiny, dev)
    doc["target_build_s"] = round(time.perf_counter() - t0, 1)
    aux = layers.resolve(None, cfg.num_hidden_layers)
    prov = {"target": target.identity, "aux_layers": aux, "num_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "target_config": summarise_config(cfg)}
    data = {"train": samples(n_tokens, max_len, cfg.vocab_size, 1),
            "val": samples(2 * max_len, max_len, cfg.vocab_size, 2)}
    stores: dict = {}
    for mode in ("offline", "online"):
        p = parse_params({"extract": {"dtype": "bfloat16", "shard_samples": 64, "max_length": max_len,
                                      "batch_size": a.extract_batch},
                          "distill": {"max_new_tokens": min(64, max_len - 1)}, "train": {"mode": mode}})
        for split, rendered in data.items():
            sync()
            t1 = time.perf_counter()
            m = extract_split(target, rendered, 0, 0, [], work / mode / split, p, aux, prov)[0]
            sync()
            dt = time.perf_counter() - t1
            if split == "train":
                nbytes = sum((work / mode / split / s["file"]).stat().st_size for s in m["shards"])
                doc[f"extract_{mode}"] = {"tokens": m["num_tokens"], "seconds": round(dt, 2),
                                          "tokens_per_s": m["num_tokens"] / dt, "bytes": nbytes,
                                          "bytes_per_token": nbytes / m["num_tokens"]}
                print(f"extract {mode}: {doc[f'extract_{mode}']}", flush=True)
        stores[mode] = (FeatureStore.open(work / mode / "train"), FeatureStore.open(work / mode / "val"))

    head = target.head_weights()
    ids, mask = stores["offline"][0].token_stats()
    mapping, _ = build_mapping(count_tokens(ids, mask, cfg.vocab_size), 200 if a.tiny else 32000)
    tp = parse_params({"train": {"ttt_length": a.ttt, "batch_tokens": bt, "epochs": 1, "warmup_ratio": 0.03,
                                 "eval_every": 10 ** 9, "max_steps": 0, "checkpoint_every": 0}}).train

    def run(name: str, store_mode: str, capture) -> dict:
        drafter = new_drafter(stores[store_mode][0].manifest, mapping, head["embed_tokens"], 0,
                              lm_head=head["lm_head"])
        clock = StepClock()
        res = train_drafter(drafter, train_store=stores[store_mode][0], val_store=stores[store_mode][1],
                            lm_head=head["lm_head"], tp=tp, lr=1e-4, seed=0, tracker=clock,
                            device=torch.device(dev), capture=capture)
        r = steady_ms(clock, min(a.warmup, max(0, len(clock.times) - 3)))
        r["tokens_per_step"] = res.train_tokens / res.steps
        r["tokens_per_s"] = r["tokens_per_step"] / (r["step_ms_median"] / 1e3)
        r["steps"], r["loop_s"] = res.steps, round(res.seconds, 1)
        r["final_val_acc_0"] = res.final_val.get("acc_0")
        print(f"{name}: {r['tokens_per_s']:.0f} tok/s, step {r['step_ms_median']:.1f} ms; {r}", flush=True)
        return r

    doc["offline"] = run("offline", "offline", None)
    doc["online"] = {}
    for ahead in (1, 0):
        doc["online"][f"ahead_{ahead}"] = run(f"online ahead {ahead}", "online",
                                              TargetCapture(target, aux, "bfloat16", bt, ahead=ahead))

    # the target forward of one batch alone, synchronised: the capture's share of an online step
    loader = OnlineLoader(stores["online"][0], bt, 0, capture=lambda s: [{}] * len(s), ahead=0)
    plans = loader.plan(0)[: 8]
    cap = TargetCapture(target, aux, "bfloat16", bt)
    times = []
    for i, plan_rows in enumerate(plans):
        smp = loader._samples(plan_rows, {})
        sync()
        t1 = time.perf_counter()
        cap(smp)
        sync()
        if i >= 2:
            times.append((time.perf_counter() - t1) * 1e3)
    capture_ms = statistics.median(times)
    doc["capture"] = {"ms_per_batch_median": capture_ms, "batches_timed": len(times),
                      "tokens_per_s": doc["offline"]["tokens_per_step"] / (capture_ms / 1e3)}

    if torch.cuda.device_count() >= 2:
        target.model.to("cuda:1")
        doc["online_2gpu"] = run("online 2 GPUs (target cuda:1, drafter cuda:0)", "online",
                                 TargetCapture(target, aux, "bfloat16", bt))

    step_off = doc["offline"]["step_ms_median"]
    for key, r in [(f"online.{k}", v) for k, v in doc["online"].items()] + (
            [("online_2gpu", doc["online_2gpu"])] if "online_2gpu" in doc else []):
        r["overlap"] = (capture_ms + step_off - r["step_ms_median"]) / min(capture_ms, step_off)
    ext = doc["extract_offline"]["tokens_per_s"]
    trn = doc["offline"]["tokens_per_s"]
    best_online = max([v["tokens_per_s"] for v in doc["online"].values()]
                      + ([doc["online_2gpu"]["tokens_per_s"]] if "online_2gpu" in doc else []))
    doc["end_to_end"] = {f"{e}_epochs": {
        "offline_tokens_per_s": e / (1 / ext + e / trn),  # extract once, train e epochs
        "online_tokens_per_s_1gpu": max(v["tokens_per_s"] for v in doc["online"].values()),
        "online_tokens_per_s_best": best_online} for e in (1, 5)}
    doc["env"] = env()
    shutil.rmtree(work, ignore_errors=True)
    out = Path(a.out)
    if out.parent != Path("."):
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {out}")
    else:
        print(f"wrote {write_result(a.out, doc)}")


if __name__ == "__main__":
    main()
