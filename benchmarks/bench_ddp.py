"""Data-parallel (DDP) training of the Llama-3.1-8B-shaped drafter: scaling and loss agreement.

Run once per world size (plain python = 1 GPU; torchrun = W GPUs):

    python benchmarks/bench_ddp.py --out ddp_w1.json
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_ddp.py --out ddp_w2.json

Shapes and step body as bench_train.py (lm_head trainable, as eyas trains it), wrapped exactly as
eyas.train.train_drafter does under torchrun: ``eyas.unroll.TTTUnroll`` in DDP (bucketed gradient
all-reduce overlapping backward; kernels: params.yaml's ``train.backend``), each step's loss normalised by the GLOBAL supervised-token count
(all-reduced), loss all-reduced for logging, clip, AdamW, cosine schedule.

Phase 1 (scaling): every rank trains on its own 4 x 2048-token rows (8192 tokens/GPU/step):
tokens/s per GPU vs the same per-GPU batch on 1 GPU (weak scaling), peak memory per rank.
Phase 2 (agreement): a fixed global batch of 4 rows per step (fresh drafter, seed 0), rank r
taking rows r::W; the first --equiv-steps global losses are compared across world sizes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_train import DOCS, config, make_batch  # noqa: E402
from benchmarks.common import median, timed, write_result  # noqa: E402
from eyas import distributed as du  # noqa: E402
from eyas.config import load_params  # noqa: E402
from eyas.drafter import Eagle3Drafter  # noqa: E402
from eyas.ttt import Batch, autocast  # noqa: E402
from eyas.unroll import TTTUnroll, supervised_counts  # noqa: E402

BACKEND = load_params(Path(__file__).resolve().parents[1] / "params.yaml").train.backend


def slice_rows(b: Batch, rows) -> Batch:
    kw = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in b.__dict__.items()}
    return Batch(**kw)


def setup(c, dev, world, ttt):
    torch.manual_seed(0)
    with torch.device(dev):
        d = Eagle3Drafter(c)
    d.embed_tokens.weight.data.normal_(std=0.02)
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(c.vocab_size, generator=g)[: c.draft_vocab_size].sort().values
    d.set_vocab(perm - torch.arange(c.draft_vocab_size), torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, perm, True))
    d.to(dev).train()
    head_rows = (torch.randn(c.draft_vocab_size, c.target_hidden_size, generator=g) * 0.02).to(dev)
    params = [p for p in d.parameters() if p.requires_grad]
    model = TTTUnroll(d, head_rows, ttt, 0.8, BACKEND)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    from transformers import get_cosine_schedule_with_warmup
    sched = get_cosine_schedule_with_warmup(opt, 10, 10_000)
    return d, model, params, opt, sched, head_rows


def make_step(model, params, opt, sched, world, ttt, losses):
    def step(batch):
        norms = None
        if world > 1:
            n_glob = du.all_reduce_sum(supervised_counts(batch, ttt))
            norms = n_glob.clamp(min=1).to(torch.float32) / world
        with autocast(batch.input_ids.device):
            loss, _ = model(batch, norms)
        loss_g = loss.detach() if world == 1 else du.all_reduce_sum(loss.detach()) / world
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss_g.item())
        gn.item()
    return step


def peak_per_rank(dev, world) -> list[float]:
    v = torch.zeros(max(world, 1), dtype=torch.float64, device=dev)
    v[du.rank()] = torch.cuda.max_memory_allocated(dev) / 2**30
    return du.all_reduce_sum(v).cpu().tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--equiv-steps", type=int, default=10)
    ap.add_argument("--skip-scaling", action="store_true", help="phase 2 (loss agreement) only")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="ddp.json")
    a = ap.parse_args()
    rank, world, dev = du.init_distributed("cuda" if torch.cuda.is_available() else "cpu")
    c = config(a.tiny)
    rows = DOCS[8192]  # 4 rows of 2048 tokens
    doc = {"what": "eyas DDP training, Llama-3.1-8B-shaped drafter (lm_head trainable), 7 TTT steps",
           "world": world, "rows": rows}

    if not a.skip_scaling:  # phase 1: weak scaling, 8192 tokens per GPU per step
        d, model, params, opt, sched, head_rows = setup(c, dev, world, a.ttt)
        batches = [make_batch(rows, c, dev, 100 * rank + s) for s in range(2)]
        losses: list = []
        st = make_step(model, params, opt, sched, world, a.ttt, losses)
        it = [0]

        def one():
            st(batches[it[0] % 2])
            it[0] += 1

        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        w, t = timed(one, a.warmup, a.steps)
        tok = sum(map(sum, rows))
        doc["scaling"] = {"tokens_per_gpu_step": tok, "step_ms_median": median(t) * 1e3,
                          "step_ms_all": [round(x * 1e3, 1) for x in t], "warmup_ms": [round(x * 1e3, 1) for x in w],
                          "tokens_per_s_per_gpu": tok / median(t), "tokens_per_s_total": world * tok / median(t),
                          "peak_alloc_GiB_per_rank": peak_per_rank(dev, world) if dev.type == "cuda" else None}
        if rank == 0:
            print("scaling", {k: v for k, v in doc["scaling"].items() if k != "step_ms_all"}, flush=True)
        del d, model, opt, batches
        torch.cuda.empty_cache() if dev.type == "cuda" else None

    # phase 2: the same global batch split over the ranks; losses must agree across world sizes
    d, model, params, opt, sched, head_rows = setup(c, dev, world, a.ttt)
    losses = []
    st = make_step(model, params, opt, sched, world, a.ttt, losses)
    for s in range(a.equiv_steps):
        gb = make_batch(rows, c, torch.device("cpu"), 1000 + s)
        st(slice_rows(gb, list(range(rank, len(rows), world))).to(dev))
    doc["equiv"] = {"global_rows": len(rows), "rows_per_rank": len(rows) // world, "losses": losses}
    if rank == 0:
        print("equiv losses", losses, flush=True)
        write_result(a.out, doc)
    du.destroy()


if __name__ == "__main__":
    main()
