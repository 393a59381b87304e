"""The peer's training step: vLLM's ``speculators`` 0.9.0 EAGLE-3 trainer, timed as bench_train.py
times eyas' (benchmarks/README.md, "The peer").

Everything on the compute path is the library's own, called as its training CLI and Trainer call it
(vllm-project/speculators, ``src/speculators/train/cli.py`` and ``trainer.py``):

- the draft decoder-layer config: ``speculators.train.cli.create_transformer_layer_config`` from the
  target's ``config.json`` (a Llama-3.1-8B-shaped config written to a temp dir, random weights);
- d2t/t2d: ``build_vocab_mappings_from_distribution`` over a random token distribution;
- the model: ``Eagle3DraftModel.from_training_args`` with the CLI's eagle3 defaults (one llama
  layer, silu, ``norm_before_residual``/``norm_before_fc``/``norm_output`` true, ``fc_norm`` false,
  frozen embedding), whose ``load_verifier_weights`` reads the frozen embedding, lm_head and
  verifier head from a random safetensors file;
- batches: its ``CollateFn`` with the eagle3 ``shift_batch``, documents packed into one row;
- the step: the body of ``Trainer.train_epoch``: bf16 autocast forward over the TTT steps with the
  loss ``get_trainer_kwargs`` selects (``kl_div``, fused kernel on CUDA), ``zero_grad``,
  ``backward``, ``clip_grad_norm_(1.0)``, AdamW from ``build_optimizers`` (lr 1e-3, weight decay
  0.01), a linear warm-up/decay schedule.

Median step time of --steps after --warmup (the first includes compilation); FLOPs by
bench_train.py's exact count with the lm_head frozen (the peer's trainable set). Needs the
``speculators`` package importable (the device recipe installs carried wheels into /tmp/site).

    python3 benchmarks/peer_speculators.py --ttt-steps 7 --seq-len 2048 --out peer_2048.json
    python3 benchmarks/peer_speculators.py --tiny --out peer_tiny.json     # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from benchmarks.bench_train import DOCS, TINY_DOCS, config, exact_flops  # noqa: E402
from benchmarks.common import PEAK_BF16_TFLOPS, median, sync, write_result  # noqa: E402


def target_config(tiny: bool) -> dict:
    """The target's HF config (Llama-3.1-8B's shapes, or bench_train.py's tiny ones)."""
    c = config(tiny)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_target_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "hidden_act": "silu", "max_position_embeddings": c.max_position_embeddings,
            "rms_norm_eps": 1e-5, "vocab_size": c.vocab_size, "rope_theta": c.rope_theta,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def write_verifier(root: Path, cfg: dict) -> Path:
    """A verifier directory: config.json and the three tensors ``load_verifier_weights`` reads."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(1)
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    save_file({"model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).to(torch.bfloat16),
               "lm_head.weight": (torch.randn(v, h, generator=g) * 0.02).to(torch.bfloat16),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}, str(root / "model.safetensors"))
    return root


def untie_fused_loss_autotuners() -> list[str]:
    """torch <= 2.11: Dynamo fails to trace speculators' compiled forward with its fused loss
    ("ListVariable ... is already tracked for mutation") because the loss's forward and backward
    Triton kernels share one ``triton.autotune`` object's lists (``speculators/losses/fused.py``;
    fixed in pytorch/pytorch PR 177874). Giving the backward kernel its own copies changes no
    kernel and no autotuning search. Returns the attributes copied."""
    from speculators.losses import fused

    fwd, bwd = fused.loss_forward_kernel, fused.loss_backward_kernel
    copied = []
    for name, val in list(vars(bwd).items()):
        if isinstance(val, (list, dict, set)) and getattr(fwd, name, None) is val:
            setattr(bwd, name, copy.deepcopy(val))
            copied.append(name)
    return copied


def build(vdir: Path, cfg: dict, ttt: int, draft_vocab: int, attn_impl: str):
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    layer = create_transformer_layer_config(verifier_name_or_path=str(vdir), num_layers=1, draft_arch="llama",
                                            hidden_act="silu", sliding_window=2048, full_attention_indices=[])
    freq = torch.randint(1, 10_000, (cfg["vocab_size"],), generator=torch.Generator().manual_seed(2)).tolist()
    d2t, t2d = build_vocab_mappings_from_distribution(dict(enumerate(freq)), draft_vocab, cfg["vocab_size"])
    return Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, verifier_name_or_path=str(vdir), draft_vocab_size=draft_vocab,
        norm_before_residual=True, norm_before_fc=True, fc_norm=False, norm_output=True, embed_requires_grad=False,
        ttt_steps=ttt, target_layer_ids=None, draft_attn_impl=attn_impl, trust_remote_code=False)


def batches(docs: list[int], cfg: dict, n: int, pin: bool) -> list[dict]:
    """``n`` packed batches of the documents ``docs`` (lengths after the eagle3 shift), as its
    dataloader yields them (in pinned memory with ``pin``, as its loader's ``pin_memory``)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    h, v = cfg["hidden_size"], cfg["vocab_size"]
    collate = CollateFn(max_len=sum(docs), hidden_size=h, num_target_layers=3, dtype=torch.bfloat16,
                        preprocess=shift_batch)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        out.append(collate([{"input_ids": torch.randint(0, v, (d + 1,), generator=g),
                             "hidden_states": torch.randn(d + 1, 3 * h, generator=g).to(torch.bfloat16),
                             "verifier_last_hidden_states": torch.randn(d + 1, h, generator=g).to(torch.bfloat16),
                             "loss_mask": torch.ones(d + 1, dtype=torch.long),
                             "lengths": torch.tensor([d + 1]), "position_ids": torch.arange(d + 1)}
                            for d in docs]))
    return [{k: v.pin_memory() if pin and isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in out]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--seq-len", type=int, default=2048, choices=sorted(DOCS), help="packed tokens per step")
    ap.add_argument("--doc-lens", default=None,
                    help="packed document lengths, comma-separated (default: bench_train.py's for --seq-len)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, eager loss and attention: a CPU smoke run")
    ap.add_argument("--out", default="peer.json")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    rows = TINY_DOCS[a.seq_len] if a.tiny else DOCS[a.seq_len]
    docs = [int(x) for x in a.doc_lens.split(",")] if a.doc_lens else [d for r in rows for d in r]
    if sorted(docs) != sorted(d for r in rows for d in r):
        sys.exit(f"--doc-lens {docs}: must be the documents bench_train.py packs at {a.seq_len} tokens "
                 f"({[d for r in rows for d in r]}), or the FLOP counts differ")
    c, cfg = config(a.tiny), target_config(a.tiny)
    fused = dev.type == "cuda"
    doc = {"what": "peer: speculators EAGLE-3 trainer step (benchmarks/README.md, 'The peer')",
           "speculators": importlib.metadata.version("speculators"), "ttt": a.ttt_steps, "docs": docs,
           "loss": "kl_div " + ("fused" if fused else "eager"), "optimizer": "AdamW (build_optimizers)",
           "workaround_untied_autotuner_attrs": untie_fused_loss_autotuners() if fused else []}
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig
    from transformers import get_linear_schedule_with_warmup

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="peer_") as tmp:
        model = build(write_verifier(Path(tmp) / "verifier", cfg), cfg, a.ttt_steps, c.draft_vocab_size,
                      "simple_flex_attention" if fused else "sdpa")
    model.to(dev).train()  # Trainer.setup_model moves it to its rank's device
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(ttt_steps=a.ttt_steps, ttt_step_loss_decay=1.0,
                                                          loss_fn="kl_div",
                                                          loss_implementation="fused" if fused else "eager")
    tc = TrainerConfig(lr=1e-3, num_epochs=1, save_path=tempfile.gettempdir(), train_call_kwargs=train_kwargs,
                       optimizer="adamw", weight_decay=0.01)
    opts = build_optimizers(model, tc)
    scheds = [get_linear_schedule_with_warmup(o, num_warmup_steps=10, num_training_steps=10_000) for o in opts]
    data = batches(docs, cfg, 2, pin=dev.type == "cuda")
    doc["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    doc["lm_head_trainable"] = bool(model.lm_head.weight.requires_grad)

    def step(batch: dict) -> float:  # Trainer.train_epoch's body, without its logging
        b = {k: v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            _, loss, _ = model(**b, **train_kwargs)
        for o in opts:
            o.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in opts:
            o.step()
        for s in scheds:
            s.step()
        return float(loss.detach())

    times, losses = [], []
    for i in range(a.warmup + a.steps):
        if i == a.warmup and dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        losses.append(step(data[i % 2]))
        sync()
        times.append(time.perf_counter() - t0)
    ms = median(times[a.warmup:]) * 1e3
    T = sum(docs)
    flops = exact_flops(c, rows, a.ttt_steps, lm_head_trainable=False)["exact_peer_convention_lm_frozen"]
    doc.update(tokens_per_step=T, step_ms_median=ms, tokens_per_s=T / ms * 1e3,
               mfu_exact=flops / (ms / 1e3) / (PEAK_BF16_TFLOPS * 1e12), flops_exact=flops,
               warmup_ms=[round(t * 1e3, 1) for t in times[:a.warmup]],
               step_ms_all=[round(t * 1e3, 2) for t in times[a.warmup:]], losses=[round(x, 4) for x in losses],
               peak_alloc_GiB=torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None)
    print(f"peer T={T} ttt={a.ttt_steps}: {ms:.1f} ms  {doc['tokens_per_s']:.0f} tok/s  "
          f"MFU(exact) {doc['mfu_exact']:.3f}  trainable {doc['trainable']:,}", flush=True)
    write_result(a.out, doc)


if __name__ == "__main__":
    main()
