"""A tiny randomly initialised Llama target and features extracted from it, for fast CPU tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.features import FeatureStore, ShardWriter
from eyas.target.model import Target

VOCAB = 128
LAYERS = 8  # default aux layers [2, 4, 5]


def tiny_target(seed: int = 0) -> Target:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    # a sharper output distribution than random init gives, so drafters have something to learn
    model.lm_head.weight.data *= 40.0
    return Target(model, tokenizer=None, identity={"path": "tiny", "num_layers": LAYERS})


def greedy_replies(target: Target, seed: int, n_prompts: int, max_new_tokens: int) -> tuple[list, list]:
    """``n_prompts`` random 8-token prompts (generator seed ``seed``) and the target's greedy replies of
    ``max_new_tokens`` tokens to them (no stop ids): (prompts, outputs), lists of token-id lists."""
    from eyas.eval.speculative import greedy_generate

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (8,), generator=g).tolist() for _ in range(n_prompts)]
    return prompts, [greedy_generate(target, p, max_new_tokens=max_new_tokens, stop_ids=[]) for p in prompts]


def manifest_fields(target: Target, aux_layers: list[int]) -> dict:
    c = target.model.config
    return {
        "aux_layers": aux_layers, "num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size, "target": target.identity, "max_length": 64,
        "target_config": {
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.hidden_size // c.num_attention_heads, "num_hidden_layers": c.num_hidden_layers,
            "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": 10000.0,
            "max_position_embeddings": c.max_position_embeddings,
        },
    }


def write_features(target: Target, out: Path, n_samples: int, seed: int, length: int = 48,
                   token_range: tuple[int, int] = (0, VOCAB), aux_layers=None) -> FeatureStore:
    """Random token sequences from ``token_range`` (first quarter unsupervised, like a prompt),
    run through ``target`` and stored with :class:`ShardWriter` in float32."""
    from eyas.target import layers

    ids_all = layers.resolve(aux_layers, LAYERS)
    g = torch.Generator().manual_seed(seed)
    w = ShardWriter(out, shard_samples=8, dtype=torch.float32)
    for _ in range(n_samples):
        ids = torch.randint(token_range[0], token_range[1], (length,), generator=g)
        mask = torch.zeros(length, dtype=torch.uint8)
        mask[length // 4:] = 1
        cap = target.capture(ids[None], torch.ones(1, length, dtype=torch.int64), ids_all)
        w.add(ids, mask, cap["aux_hidden"][0], cap["final_hidden"][0], cap["target_argmax"][0])
    w.finish(**manifest_fields(target, ids_all))
    return FeatureStore.open(out)


def trained_drafter(target: Target, prompts: list[list[int]], outputs: list[list[int]], ttt_length: int,
                    steps: int = 40):
    """An EAGLE-3 drafter (full draft vocab) trained briefly (TTT, ``steps`` Adam steps) on the
    target's own greedy ``outputs`` of ``prompts``, so that chains of every length get accepted
    and rejected."""
    from eyas.drafter.model import DrafterConfig, Eagle3Drafter
    from eyas.training.batches import head_rows_for, pack
    from eyas.training.unroll import ttt_forward

    m = target.model
    torch.manual_seed(1)
    d = Eagle3Drafter(DrafterConfig.for_target(m.config, draft_vocab_size=VOCAB))
    d.set_embedding(m.get_input_embeddings().weight)
    d.set_vocab(torch.zeros(VOCAB, dtype=torch.int64), torch.ones(VOCAB, dtype=torch.bool))
    rows = []
    for p, y in zip(prompts, outputs):
        ids = torch.tensor(p + y)
        with torch.no_grad():
            cap = target.capture(ids[None], torch.ones(1, len(ids), dtype=torch.int64), None)
        rows.append([{"input_ids": ids, "loss_mask": torch.ones(len(ids), dtype=torch.bool),
                      **{k: v[0] for k, v in cap.items()}}])
    batch, head = pack(rows, list(range(len(rows)))), head_rows_for(m.lm_head.weight.detach(), d)
    opt = torch.optim.Adam([q for q in d.parameters() if q.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss, _, _ = ttt_forward(d, batch, head, ttt_length, 0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


def tiny_training_setup(root: Path, vocab_dir: Path):
    """(drafter, train store, val store, lm_head): a tiny target's features under ``root/f``, a
    64-id draft vocab built from them and saved in ``vocab_dir``, and a fresh drafter on it: what a
    training stage holds before ``train_drafter``."""
    from eyas.training.loop import new_drafter
    from eyas.vocab.mapping import build_mapping, count_tokens, save_mapping

    target = tiny_target()
    train = write_features(target, root / "f" / "train", 8, seed=1)
    val = write_features(target, root / "f" / "val", 4, seed=2)
    ids, mask = train.token_stats()
    counts = count_tokens(ids, mask, train.manifest["vocab_size"])
    mapping, info = build_mapping(counts, 64)
    save_mapping(vocab_dir, mapping, counts, info)
    embed = target.model.get_input_embeddings().weight.detach()
    drafter = new_drafter(train.manifest, mapping, embed, 0)
    return drafter, train, val, target.model.lm_head.weight.detach()
