"""Time of one speculative (chain) step vs a bare target decode step, 8B-shaped target and drafter.

A speculative step = k drafter decode calls (eyas.drafter.model.Eagle3Drafter.decode with its KV cache)
+ one target forward over k+1 tokens (verify) + rolling both caches back; a bare step = one target
forward over 1 token. Both at a context of --ctx tokens, batch 1, bf16, random weights (speed
only). Speed-up at acceptance length a (tokens committed per verify, bonus included) is
a * bare_ms / spec_ms.

    python benchmarks/bench_eval.py --out eval_step.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_extract import build  # noqa: E402
from benchmarks.common import median, timed, write_result  # noqa: E402
from eyas.drafter.model import DrafterConfig, Eagle3Drafter, KVCache  # noqa: E402
from eyas.eval.speculative import _crop  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="eval_step.json")
    a = ap.parse_args()
    from transformers import DynamicCache
    target, cfg = build(a.tiny)
    dev = target.device
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    dc = DrafterConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                       head_dim=cfg.hidden_size // cfg.num_attention_heads, vocab_size=cfg.vocab_size,
                       draft_vocab_size=min(32000, cfg.vocab_size // 2), target_hidden_size=cfg.hidden_size,
                       num_target_layers=cfg.num_hidden_layers, rope_theta=500000.0)
    d = Eagle3Drafter(dc).to(dev, dt).eval()
    m = target.model
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, cfg.vocab_size, (1, a.ctx), generator=g).to(dev)
    res = {"what": "speculative chain step vs bare target decode step, batch 1", "ctx": a.ctx, "rows": []}
    with torch.inference_mode():
        cache = DynamicCache()
        m(input_ids=ctx, past_key_values=cache, use_cache=True)
        dkv = KVCache()
        feats = torch.randn(1, a.ctx, 3 * cfg.hidden_size, device=dev, dtype=dt)
        pos = torch.arange(a.ctx, device=dev)[None]
        w = d.midlayer.weights()  # built once per sequence, as eyas.eval.speculative.EagleProposer does
        d.decode(feats, ctx, pos, dkv, w)
        one = ctx[:, -1:]

        def bare():
            m(input_ids=one, past_key_values=cache, use_cache=True)
            _crop(cache, a.ctx)

        _, t = timed(bare, 5, 30)
        res["bare_decode_ms"] = median(t) * 1e3
        for k in a.k:
            def spec():
                h = torch.randn(1, 1, 3 * cfg.hidden_size, device=dev, dtype=dt)
                tok = one
                toks = []
                for i in range(k):
                    h = d.decode(h, tok, pos[:, -1:] + 1 + i, dkv, w)
                    tok = d.draft_to_target(d.logits(h).argmax(-1))
                    toks.append(tok)
                dkv.crop(a.ctx)
                out = m(input_ids=torch.cat([one, *toks], 1), past_key_values=cache, use_cache=True,
                        output_hidden_states=True)
                out.logits.argmax(-1).tolist()  # the accept rule needs the target's tokens on host
                _crop(cache, a.ctx)

            def draft_only():
                h = torch.randn(1, 1, 3 * cfg.hidden_size, device=dev, dtype=dt)
                tok = one
                for i in range(k):
                    h = d.decode(h, tok, pos[:, -1:] + 1 + i, dkv, w)
                    tok = d.draft_to_target(d.logits(h).argmax(-1))
                dkv.crop(a.ctx)

            def verify_only():
                m(input_ids=ctx[:, :k + 1], past_key_values=cache, use_cache=True)
                _crop(cache, a.ctx)

            row = {"k": k}
            for name, fn in (("spec_step_ms", spec), ("draft_ms", draft_only), ("verify_ms", verify_only)):
                _, t = timed(fn, 3, 15)
                row[name] = median(t) * 1e3
            row["spec_over_bare"] = row["spec_step_ms"] / res["bare_decode_ms"]
            row["break_even_accept_len"] = row["spec_over_bare"]
            res["rows"].append(row)
            print(row, flush=True)
    print("bare decode ms", res["bare_decode_ms"])
    write_result(a.out, res)


if __name__ == "__main__":
    main()
