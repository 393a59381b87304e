"""Where the eval stage's time goes on a GPU: a random SmolLM2-135M-shaped target (30 layers,
hidden 576, vocab 49,152, fp32) and a random drafter (draft vocab 8,192), 10 prompts of 40-300
tokens, 64 new tokens. Times unbatched greedy decoding, real speculative decoding, the chain
oracle (EAGLE and n-gram) and batched HF generate at 128/512/1024 prompts, then profiles three
speculative runs (torch.profiler, the 25 ops with the most CPU time). Writes
dev/results/eval_profile.json (and $OUT/, where set). Run on a GPU machine from the
repository root (the `eval` recipe of dev/gpu/device.sh):

    python3 dev/bench/profile_eval_gpu.py
"""
import json
import sys
import time

import torch

sys.path.insert(0, ".")  # the repository root
from transformers import LlamaConfig, LlamaForCausalLM

from dev.bench.common import write_result
from eyas.drafter.model import DrafterConfig, Eagle3Drafter
from eyas.eval.oracle import accepted_draft_counts
from eyas.eval.speculative import NgramProposer, evaluate_prompts, greedy_generate

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
dev = torch.device("cuda")
model = LlamaForCausalLM(cfg).to(dev).eval()
dc = DrafterConfig.for_target(cfg, draft_vocab_size=8192)
dr = Eagle3Drafter(dc).to(dev).eval()
dr.set_embedding(model.get_input_embeddings().weight)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(100, 40000, (int(n),), generator=g).tolist() for n in torch.randint(40, 300, (10,), generator=g)]
aux = dc.resolved_aux_layers()
res = {}
def T(name, f):
    torch.cuda.synchronize(); t0 = time.perf_counter(); out = f(); torch.cuda.synchronize()
    res[name] = round(time.perf_counter() - t0, 2); print(name, res[name], flush=True); return out
with torch.no_grad():
    T("warm_greedy", lambda: greedy_generate(model, prompts[0], max_new_tokens=4, stop_ids=[]))
    greedy = T("greedy_10x64", lambda: [greedy_generate(model, p, max_new_tokens=64, stop_ids=[]) for p in prompts])
    fed = []
    r = T("evaluate_prompts_10", lambda: evaluate_prompts(model, dr, prompts, num_draft_tokens=4, max_new_tokens=64, stop_ids=[],
                                                        aux_layer_ids=aux, baseline=greedy, baseline_seconds=1.0, features_out=fed))
    T("oracle_eagle_10", lambda: [accepted_draft_counts(model, dr, p, y, num_draft_tokens=4, aux_layer_ids=aux, features=f) for p, y, f in zip(prompts, greedy, fed)])
    T("oracle_eagle_10_again", lambda: [accepted_draft_counts(model, dr, p, y, num_draft_tokens=4, aux_layer_ids=aux, features=f) for p, y, f in zip(prompts, greedy, fed)])
    T("oracle_ngram_10", lambda: [accepted_draft_counts(model, NgramProposer(), p, y, num_draft_tokens=4, aux_layer_ids=None) for p, y in zip(prompts, greedy)])
    from eyas.data.distill import generate_batch
    for bs in (128, 512, 1024):
        ps = [torch.randint(100, 40000, (200,), generator=g).tolist() for _ in range(bs)]
        T(f"generate_batch_{bs}x128", lambda: generate_batch(model, ps, 128, 0, []))
        res[f"gen_tok_s_{bs}"] = round(bs * 128 / res[f"generate_batch_{bs}x128"])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        evaluate_prompts(model, dr, prompts[:3], num_draft_tokens=4, max_new_tokens=64, stop_ids=[], aux_layer_ids=aux, baseline=greedy[:3], baseline_seconds=1.0)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
print(json.dumps(res))
write_result("eval_profile.json", {"seconds": res})
