"""Data-parallel (DDP or FSDP2) training of the Llama-3.1-8B-shaped drafter: scaling and loss agreement.

Run once per world size and strategy (plain python = 1 GPU; torchrun = W GPUs):

    python dev/bench/bench_ddp.py --out ddp_w1.json
    torchrun --standalone --nproc-per-node 2 dev/bench/bench_ddp.py --out ddp_w2.json
    torchrun --standalone --nproc-per-node 8 dev/bench/bench_ddp.py --strategy fsdp --global-rows 8 \
        --out scale_fsdp_w8.json

Shapes and step body as bench_train.py (lm_head trainable, as eyas trains it), wrapped exactly as
eyas.training.loop.train_drafter does under torchrun: ``eyas.training.unroll.TTTUnroll`` wrapped by
``eyas.training.distributed.wrap_data_parallel`` (``--strategy ddp``: bucketed gradient all-reduce
overlapping backward; ``fsdp``: FSDP2 ``fully_shard``, weights, gradients and AdamW state sharded
over the ranks; kernels: params.yaml's ``train.backend``), each step's loss normalised by the
GLOBAL supervised-token count (all-reduced), loss all-reduced for logging, clip (under FSDP the
norm over all shards), AdamW, cosine schedule.

Phase 1 (scaling, CUDA): every rank trains on its own 4 x 2048-token rows (8192 tokens/GPU/step):
tokens/s per GPU vs the same per-GPU batch on 1 GPU (weak scaling), peak memory per rank
(``torch.cuda.max_memory_allocated``).
Phase 2 (agreement): a fixed global batch of ``--global-rows`` rows per step (the 4 rows cycled;
fresh drafter, seed 0), rank r taking rows r::W; the first --equiv-steps global losses and
gradient norms are compared across world sizes and strategies. After it, each rank's training
state in bytes, counted from the tensors it holds (FSDP: its local shards): trainable weights,
their gradients, the AdamW state, and the frozen (replicated) embedding.

``--reference`` names this script's W = 1 result of the same call: the output then also holds
``vs_reference`` (scaling efficiency, loss and gradient-norm max abs/rel differences).
``--device cpu --tiny`` runs the same code on gloo CPU processes with a tiny drafter
(dev/bench/scale_cpu.py drives it at 1, 2, 4 and 8 processes). ``--out`` is a file name under
dev/results/ (and $OUT), or an absolute path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.bench_train import DOCS, TINY_DOCS, config, make_batch  # noqa: E402
from benchmarks.common import median, timed  # noqa: E402
from dev.bench.common import RESULTS, write_result  # noqa: E402
from eyas.drafter.backend import Backend  # noqa: E402
from eyas.drafter.model import Eagle3Drafter  # noqa: E402
from eyas.params.full import load_params  # noqa: E402
from eyas.training import distributed as du  # noqa: E402
from eyas.training.batches import Batch, autocast  # noqa: E402
from eyas.training.unroll import TTTUnroll, supervised_counts  # noqa: E402

BACKEND = load_params(Path(__file__).resolve().parents[2] / "params.yaml").train.backend
BACKEND = Backend.of(BACKEND)


def slice_rows(b: Batch, rows) -> Batch:
    kw = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in b.__dict__.items()}
    return Batch(**kw)


def setup(c, dev, world, ttt, strategy, lr):
    torch.manual_seed(0)
    with torch.device(dev):
        d = Eagle3Drafter(c)
    d.embed_tokens.weight.data.normal_(std=0.02)
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(c.vocab_size, generator=g)[: c.draft_vocab_size].sort().values
    d.set_vocab(perm - torch.arange(c.draft_vocab_size), torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, perm, True))
    d.to(dev).train()
    head_rows = (torch.randn(c.draft_vocab_size, c.target_hidden_size, generator=g) * 0.02).to(dev)
    model = du.wrap_data_parallel(TTTUnroll(d, head_rows, ttt, 0.8, BACKEND), strategy, dev)
    params = [p for p in model.parameters() if p.requires_grad]  # after wrapping: FSDP's DTensors
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    from transformers import get_cosine_schedule_with_warmup
    sched = get_cosine_schedule_with_warmup(opt, 10, 10_000)
    return d, model, params, opt, sched, head_rows


def make_step(model, params, opt, sched, world, ttt, strategy, losses, grad_norms=None):
    fsdp = world > 1 and strategy == "fsdp"

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
        if fsdp:  # the norm over all shards, as eyas.training.loop clips
            gn = gn.full_tensor()
        opt.step()
        sched.step()
        losses.append(loss_g.item())
        gn = gn.item()
        if grad_norms is not None:
            grad_norms.append(gn)
    return step


def per_rank(values: list[float], dev, world) -> list[list[float]]:
    """[world][len(values)]: every rank's ``values`` (an all-reduce of a one-hot-by-rank table)."""
    v = torch.zeros(max(world, 1), len(values), dtype=torch.float64, device=dev)
    v[du.rank()] = torch.tensor(values, dtype=torch.float64)
    return du.all_reduce_sum(v).cpu().tolist()


def peak_per_rank(dev, world) -> list[float]:
    return [r[0] for r in per_rank([torch.cuda.max_memory_allocated(dev) / 2**30], dev, world)]


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if not isinstance(t, torch.Tensor):
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


STATE_KEYS = ("trainable_weights", "grads", "adamw_state", "frozen_weights")


def state_bytes(model, opt) -> list[float]:
    """This rank's training state in bytes, from the tensors it holds (FSDP: its local shards):
    trainable weights, their gradients, AdamW's state (moments and step), frozen weights."""
    train = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return [float(sum(_local_bytes(p) for p in train)),
            float(sum(_local_bytes(p.grad) for p in train)),
            float(sum(_local_bytes(v) for p in train for v in opt.state.get(p, {}).values())),
            float(sum(_local_bytes(p) for p in frozen))]


def against(doc: dict, reference: str) -> dict:
    """Scaling efficiency (tokens/s per GPU over the reference's) and the max abs/rel differences
    of the phase-2 losses and gradient norms from a W = 1 ``reference`` result file. A missing
    reference, or one whose phase 2 ran another global batch, is said in ``"not_compared"``
    (this run's own figures are written either way)."""
    path = RESULTS / reference
    out = {"file": reference}
    if not path.is_file():
        return {**out, "not_compared": f"no such file {path}"}
    ref = json.loads(path.read_text())
    if "scaling" in doc and "scaling" in ref:
        out["scaling_efficiency"] = doc["scaling"]["tokens_per_s_per_gpu"] / ref["scaling"]["tokens_per_s_per_gpu"]
    keys = ("global_rows", "global_tokens")
    if "equiv" not in ref or [ref["equiv"].get(k) for k in keys] != [doc["equiv"][k] for k in keys] \
            or len(ref["equiv"]["losses"]) != len(doc["equiv"]["losses"]):
        return {**out, "not_compared": "the reference's phase 2 ran another global batch or step count"}
    for key in ("losses", "grad_norms"):
        a, b = doc["equiv"][key], ref["equiv"][key]
        out[f"{key}_max_abs"] = max(abs(x - y) for x, y in zip(a, b))
        out[f"{key}_max_rel"] = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--equiv-steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4, help="AdamW's peak learning rate (10 warm-up steps)")
    ap.add_argument("--skip-scaling", action="store_true", help="phase 2 (loss agreement) only")
    ap.add_argument("--strategy", choices=du.STRATEGIES, default="ddp", help="as params.yaml's train.strategy")
    ap.add_argument("--global-rows", type=int, default=4,
                    help="phase 2's global batch in rows (the 4 rows of 2048 tokens, cycled); a multiple of W")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny drafter and 128-token rows (CPU runs)")
    ap.add_argument("--reference", default=None,
                    help="a W = 1 result of this script (under dev/results/, or a path): adds the scaling "
                         "efficiency and the loss / gradient-norm differences against it")
    ap.add_argument("--out", default="ddp.json")
    a = ap.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(1)  # W processes share the host's cores
    rank, world, dev = du.init_distributed(a.device)
    if a.global_rows % world:
        raise SystemExit(f"--global-rows {a.global_rows} is not a multiple of the world size {world}")
    c = config(a.tiny)
    rows = (TINY_DOCS if a.tiny else DOCS)[8192]  # 8B: 4 rows of 2048 tokens; tiny: 2 rows of 128
    shape = "a tiny drafter (hidden 64)" if a.tiny else "Llama-3.1-8B-shaped drafter"
    doc = {"what": f"eyas {a.strategy.upper()} training, {shape} (lm_head trainable), {a.ttt} TTT steps",
           "world": world, "strategy": a.strategy, "device_type": dev.type, "rows": rows}

    if not a.skip_scaling:  # phase 1: weak scaling, 8192 tokens per GPU per step
        d, model, params, opt, sched, head_rows = setup(c, dev, world, a.ttt, a.strategy, a.lr)
        batches = [make_batch(rows, c, dev, 100 * rank + s) for s in range(2)]
        losses: list = []
        st = make_step(model, params, opt, sched, world, a.ttt, a.strategy, losses)
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
    d, model, params, opt, sched, head_rows = setup(c, dev, world, a.ttt, a.strategy, a.lr)
    losses, norms = [], []
    st = make_step(model, params, opt, sched, world, a.ttt, a.strategy, losses, norms)
    g_rows = [rows[i % len(rows)] for i in range(a.global_rows)]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for s in range(a.equiv_steps):
        gb = make_batch(g_rows, c, torch.device("cpu"), 1000 + s)
        st(slice_rows(gb, list(range(rank, len(g_rows), world))).to(dev))
    doc["equiv"] = {"global_rows": len(g_rows), "rows_per_rank": len(g_rows) // world,
                    "global_tokens": sum(map(sum, g_rows)), "losses": losses, "grad_norms": norms,
                    "state_bytes_per_rank": [dict(zip(STATE_KEYS, r))
                                             for r in per_rank(state_bytes(model, opt), dev, world)],
                    "peak_alloc_GiB_per_rank": peak_per_rank(dev, world) if dev.type == "cuda" else None}
    if rank == 0:
        print("equiv losses", losses, flush=True)
        if a.reference:
            doc["vs_reference"] = against(doc, a.reference)
            print("vs reference", doc["vs_reference"], flush=True)
        write_result(a.out, doc)
    du.destroy()


if __name__ == "__main__":
    main()
