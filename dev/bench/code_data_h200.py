"""Code data (data.code_prompts) on one GPU: extract features for the committed distilled chat train/val plus the
self-distilled code conversations, train two scratch drafters (chat only / chat + code) with the
default params, and measure real speculative decoding (eyas.eval.speculative.evaluate_prompts) on the
10 HumanEval + 10 chat prompts of the default eval.
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
from eyas.eval.speculative import NgramProposer, evaluate_prompts, greedy_generate
from eyas.export.eagle import save_drafter
from eyas.export.load import load_drafter
from eyas.features import FeatureStore
from eyas.params.full import load_params
from eyas.target import layers
from eyas.target.model import load_target
from eyas.training.loop import new_drafter, train_drafter
from eyas.vocab.mapping import load_mapping
from stages.extract import extract_split

C = Path(sys.argv[1]); OUT = Path(os.environ["OUT"]); W = Path("/tmp/h6w")
seeds = [int(s) for s in sys.argv[2].split(",")]
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
res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "load_s": round(time.time() - T0, 1)}
chat_tr, chat_va = read_jsonl(C / "distilled/train.jsonl"), read_jsonl(C / "distilled/val.jsonl")
from eyas.data.conversations import write_jsonl
from eyas.data.distill import regenerate
from stages.self_distill import prompt_budget

code = {}
for split in ("train", "val"):
    t = time.time()
    code[split], st = regenerate(target, read_jsonl(C / f"code_{split}_raw.jsonl"), max_new_tokens=p.distill.max_new_tokens,
                                 batch_size=p.distill.batch_size, max_prompt_tokens=prompt_budget(p))
    res[f"distill_code_{split}"] = {**st, "wall_s": round(time.time() - t, 1)}
    write_jsonl(OUT / f"code_{split}.jsonl", code[split])
code_tr, code_va = code["train"], code["val"]
sets = {"chat": chat_tr, "chat_code": chat_tr + code_tr, "code_only": code_tr, "val": chat_va + code_va}
man = {}
for name, convs in sets.items():
    t = time.time()
    m = extract_split(target, convs, W / name, p, aux, prov)
    man[name] = {"samples": m["num_samples"], "tokens": m["num_tokens"],
                 "supervised": m["supervised_tokens"], "s": round(time.time() - t, 1)}
res["features"] = man
mapping, _ = load_mapping(C / "vocab")
t2d = mapping.t2d.bool()
head = {k: v.float().cpu() for k, v in target.head_weights().items()}
# draft-vocab coverage of the code features' supervised tokens (the tokens the drafter must propose)
for name in ("code_only", "chat"):
    ids, mask = FeatureStore.open(W / name).token_stats()
    sup = ids[mask.bool()].long()
    res[f"{name}_supervised_in_draft_vocab"] = round(t2d[sup].float().mean().item(), 4)
he = json.load(open(C / "humaneval10.json")); ch = json.load(open(C / "chat10.json"))
kw = dict(num_draft_tokens=p.eval.num_draft_tokens, max_new_tokens=p.eval.max_new_tokens, stop_ids=target.stop_ids)
bench = {}
for bname, chats in (("humaneval", he), ("chat", ch)):
    prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in chats]
    prompts = [list(tok(x, add_special_tokens=False)["input_ids"]) for x in prompts]
    t = time.time()
    greedy = [greedy_generate(target.model, ids, max_new_tokens=p.eval.max_new_tokens, stop_ids=target.stop_ids) for ids in prompts]
    gs = time.time() - t
    allg = torch.tensor([x for g in greedy for x in g])
    bench[bname] = (prompts, greedy, gs)
    res[f"{bname}_greedy_in_draft_vocab"] = round(t2d[allg].float().mean().item(), 4)
    r = evaluate_prompts(target, NgramProposer(), prompts, aux_layer_ids=None, baseline=greedy, timing_repeats=0, **kw)
    res[f"ngram_{bname}"] = {k: r[k] for k in ("accept_len", "per_position_accept_rate", "lossless")}
(OUT / "greedy_humaneval.json").write_text(json.dumps([tok.decode(g) for g in bench["humaneval"][1]], indent=1))
print(json.dumps(res), flush=True)
dev = torch.device("cuda")
for seed in seeds:
    for arm in ("chat", "chat_code"):
        t = time.time()
        tr, va = FeatureStore.open(W / arm), FeatureStore.open(W / "val")
        d = new_drafter(tr.manifest, mapping, head["embed_tokens"], seed)
        r = train_drafter(d, train_store=tr, val_store=va, lm_head=head["lm_head"], tp=p.train,
                          lr=p.lr, seed=seed, tracker=Null(), device=dev, checkpoint_every=0)
        out = W / f"drafter_{arm}_{seed}"
        save_drafter(d.cpu(), out)
        d = load_drafter(out, num_target_layers=target.num_layers)
        d.set_embedding(target.model.get_input_embeddings().weight)
        d.to(target.device).eval()
        row = {"train_s": round(time.time() - t, 1), "steps": r.steps, "val": r.final_val}
        for bname, (prompts, greedy, gs) in bench.items():
            m = evaluate_prompts(target, d, prompts, aux_layer_ids=d.config.resolved_aux_layers(),
                                 baseline=greedy, timing_repeats=0, **kw)
            row[bname] = {k: m[k] for k in ("accept_len", "per_position_accept_rate", "lossless", "accepted_histogram")}
        res[f"{arm}_seed{seed}"] = row
        print(arm, seed, json.dumps(row), flush=True)
        (OUT / "result.json").write_text(json.dumps(res, indent=1))
res["total_s"] = round(time.time() - T0, 1)
(OUT / "result.json").write_text(json.dumps(res, indent=1))
