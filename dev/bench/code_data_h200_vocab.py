"""Code data, run 2: as code_data_h200.py, but the draft vocab is rebuilt from the chat+code train features (what
build-vocab does in a pipeline run with data.code_prompts > 0), for 64 and 128 code prompts.
Run on the device (nvidia-h200) as `python3 benchmarks/<this file> <dir> [seeds]`, where <dir> holds
params.yaml, the GGUF target under smol/, data/distilled/{train,val}.jsonl of the committed run and
code_{train,val}_raw.jsonl from `eyas.data.code` (prepare-data with data.code_prompts); results
under $OUT (committed as results/code_data_h200*.json). An experiment driver, not a pipeline stage.
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

from eyas.data.conversations import read_jsonl
from eyas.data.distill import regenerate
from eyas.eval.speculative import evaluate_prompts, greedy_generate
from eyas.export.eagle import save_drafter
from eyas.export.load import load_drafter
from eyas.features import FeatureStore
from eyas.params.full import load_params
from eyas.target import layers
from eyas.target.model import load_target
from eyas.training.loop import new_drafter, train_drafter
from eyas.vocab.mapping import build_mapping, count_tokens
from stages.extract import extract_split
from stages.self_distill import prompt_budget

C = Path(sys.argv[1]); OUT = Path(os.environ["OUT"]); W = Path("/tmp/h6w2")
class Null:
    def __getattr__(self, _): return lambda *a, **k: None
T0 = time.time()
p = load_params(C / "params.yaml")
target = load_target(str(C / "smol"), "SmolLM2-135M-Instruct.Q4_1.gguf", "float32", False)
tok = target.tokenizer
aux = layers.resolve(p.extract.aux_layers, target.num_layers)
prov = {"target": target.identity, "aux_layers": aux, "num_layers": target.num_layers,
        "hidden_size": target.config.hidden_size, "vocab_size": target.config.vocab_size,
        "target_config": target.config_summary()}
res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
code128 = {}
for split in ("train", "val"):
    code128[split], st = regenerate(target, read_jsonl(C / f"code128_{split}_raw.jsonl"), max_new_tokens=p.distill.max_new_tokens,
                                    batch_size=p.distill.batch_size, max_prompt_tokens=prompt_budget(p))
    res[f"distill_code128_{split}"] = st
chat_tr, chat_va = read_jsonl(C / "distilled/train.jsonl"), read_jsonl(C / "distilled/val.jsonl")
sets = {"code64": chat_tr + read_jsonl(C / "code64_train.jsonl"), "code128": chat_tr + code128["train"],
        "code_only": code128["train"], "val": chat_va + read_jsonl(C / "code64_val.jsonl")}
for name, convs in sets.items():
    m = extract_split(target, convs, W / name, p, aux, prov)
    res[f"features_{name}"] = {"samples": m["num_samples"], "tokens": m["num_tokens"], "supervised": m["supervised_tokens"]}
head = {k: v.float().cpu() for k, v in target.head_weights().items()}
he = json.load(open(C / "humaneval10.json")); ch = json.load(open(C / "chat10.json"))
kw = dict(num_draft_tokens=p.eval.num_draft_tokens, max_new_tokens=p.eval.max_new_tokens, stop_ids=target.stop_ids)
bench = {}
for bname, chats in (("humaneval", he), ("chat", ch)):
    prompts = [list(tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]) for m in chats]
    greedy = [greedy_generate(target.model, ids, max_new_tokens=p.eval.max_new_tokens, stop_ids=target.stop_ids) for ids in prompts]
    bench[bname] = (prompts, greedy)
he_tokens = torch.tensor([x for g in bench["humaneval"][1] for x in g])
code_ids, code_mask = FeatureStore.open(W / "code_only").token_stats()
code_sup = code_ids[code_mask.bool()].long()
dev = torch.device("cuda")
for arm in ("code64", "code128"):
    tr, va = FeatureStore.open(W / arm), FeatureStore.open(W / "val")
    ids, mask = tr.token_stats()
    mapping, info = build_mapping(count_tokens(ids, mask, tr.manifest["vocab_size"]), p.vocab.draft_vocab_size, order="target_id")
    t2d = mapping.t2d.bool()
    res[f"vocab_{arm}"] = {"coverage_train": info["coverage"], "distinct": info["distinct_tokens"],
                           "code128_supervised_in_vocab": round(t2d[code_sup].float().mean().item(), 4),
                           "humaneval_greedy_in_vocab": round(t2d[he_tokens].float().mean().item(), 4)}
    print(arm, res[f"vocab_{arm}"], flush=True)
    for seed in (0, 1):
        t = time.time()
        d = new_drafter(tr.manifest, mapping, head["embed_tokens"], seed)
        r = train_drafter(d, train_store=tr, val_store=va, lm_head=head["lm_head"], tp=p.train,
                          lr=p.lr, seed=seed, tracker=Null(), device=dev, checkpoint_every=0)
        out = W / f"drafter_{arm}_{seed}"
        save_drafter(d.cpu(), out)
        d = load_drafter(out, num_target_layers=target.num_layers)
        d.set_embedding(target.model.get_input_embeddings().weight)
        d.to(target.device).eval()
        row = {"train_s": round(time.time() - t, 1), "steps": r.steps, "val_acc": [r.final_val[f"acc_{i}"] for i in range(4)]}
        for bname, (prompts, greedy) in bench.items():
            m = evaluate_prompts(target, d, prompts, aux_layer_ids=d.config.resolved_aux_layers(), baseline=greedy, timing_repeats=0, **kw)
            row[bname] = {k: m[k] for k in ("accept_len", "per_position_accept_rate", "lossless", "accepted_histogram")}
        res[f"{arm}_newvocab_seed{seed}"] = row
        print(arm, seed, json.dumps(row), flush=True)
        (OUT / "result2.json").write_text(json.dumps(res, indent=1))
res["total_s"] = round(time.time() - T0, 1)
(OUT / "result2.json").write_text(json.dumps(res, indent=1))
