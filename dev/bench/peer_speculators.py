"""The peer's training step: vLLM's ``speculators`` 0.9.0 EAGLE-3 trainer, timed the way its own
``Trainer.train_epoch`` runs (dev/README.md, "The peer").

Everything on the compute path is the library's own, called as its training CLI and Trainer call it
(vllm-project/speculators 0.9.0, ``src/speculators/train/cli.py`` and ``trainer.py``):

- the draft decoder-layer config: ``speculators.train.cli.create_transformer_layer_config`` from the
  target's ``config.json`` (a Llama-3.1-8B-shaped config written to a temp dir, random weights);
- d2t/t2d: ``build_vocab_mappings_from_distribution`` over a random token distribution;
- the model: ``Eagle3DraftModel.from_training_args`` with the CLI's eagle3 defaults (one llama
  layer, silu, sliding window 2048, ``norm_before_residual``/``norm_before_fc``/``norm_output`` true,
  ``fc_norm`` false, frozen embedding), whose ``load_verifier_weights`` reads the frozen embedding,
  lm_head and verifier head from a random safetensors file; its forward is compiled by the library
  (``conditional_torch_compile``);
- batches: per-document samples packed into one row by its ``CollateFn`` with the eagle3
  ``shift_batch``, in pinned memory (its DataLoader's ``pin_memory=True``);
- the trainer: ``TrainerConfig`` as ``cli.main`` fills it from the CLI's defaults (linear schedule
  with 1% warm-up, ``checkpoint_freq`` 1, bf16), except AdamW (lr 1e-3, weight decay 0.01) for its
  default Muon: AdamW is what eyas uses; ``Trainer`` built on it, its ``build_optimizers`` and
  schedulers, with the CLI's root and metric loggers (``setup_root_logger``,
  ``setup_metric_logger``: each logged step is printed).

Timed, in one process on one model, optimizer and scheduler (the Trainer's), each variant as a block
of --block-warmup untimed and --steps timed steps, over --rounds rounds (a drift between rounds
shows as a difference between them):

- ``body_log<F>``: one iteration of ``Trainer.train_epoch``'s loop (trainer.py L512-605), copied line
  for line onto the Trainer's objects, at ``log_freq`` F (--log-freq). F = 1, the CLI's default,
  makes every step a logged step: ``_StepTimer`` synchronises the device at each of its 7 marks and
  its closing ``now()``, and the step's metrics are read back (``.item()``) and logged. On a step
  that is not logged the loop still synchronises once: ``torch.tensor(batch["error_records"],
  device=...)`` after the clip is a blocking host-to-device copy;
- ``epoch_log<F>``: the real ``Trainer.train_epoch`` over an in-memory DataLoader of the same
  collated, pinned batches (``batch_size=None``, ``pin_memory=True``: the CLI's loader with its
  worker processes replaced by batches ready in memory), with its tqdm progress bar; a step is the
  interval between its ``step_callback`` calls, and at F = 1 its own logged ``profile`` (``step_ms``,
  ``fwd_ms``, ...) is kept as well;
- ``v1_step``: this harness's earlier step (the loop body without the Trainer's timer, metrics
  tensors and logging; a device sync before and after each step and the loss read back), the way
  ``peer_<T>.json`` of 2026-12-02 and earlier was timed, for comparison within the call.

Each block's figure: ``ms_per_step`` = wall time of its timed steps (device synchronised at both ends,
nothing added between steps) / steps, and the median of the host intervals between steps. The
fastest faithful figure is the smallest ``ms_per_step`` of the ``body_*``/``epoch_*`` blocks.
Then, with --profile N, N body steps at the largest log_freq under torch.profiler per round (GPU
kernel time against wall time) and, on CUDA, the host-device syncs of two steps of each variant
(``count_host_syncs``: explicit ``synchronize`` calls and what CUDA's sync debug mode flags).

FLOPs by bench_train.py's exact count with the lm_head frozen (the peer's trainable set). Needs the
``speculators`` package importable (the device recipe installs carried wheels into /tmp/site). The
Trainer needs an accelerator (``Trainer.setup_model`` moves the model with ``.to(local_rank)``,
trainer.py L348): on CPU (--tiny) only ``v1_step`` runs.

    python3 dev/bench/peer_speculators.py --ttt-steps 7 --seq-len 2048 --out peer_2048.json
    python3 dev/bench/peer_speculators.py --tiny --out peer_tiny.json     # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from benchmarks.bench_train import DOCS, TINY_DOCS, config, exact_flops, profile_steps  # noqa: E402
from benchmarks.common import PEAK_BF16_TFLOPS, count_host_syncs, median, sync  # noqa: E402
from dev.bench.common import write_result  # noqa: E402

VERSION = "0.9.0"  # the release whose train_epoch loop epoch_body copies (its line numbers below)


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
    """``Eagle3DraftModel`` as ``cli.build_draft_model`` makes it from the CLI's eagle3 defaults."""
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


class InMemoryBatches(torch.utils.data.Dataset):
    """``n`` items cycling over ready collated batches (a shallow copy each: the loop pops keys)."""

    def __init__(self, ready: list[dict], n: int):
        self.ready, self.n = ready, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return dict(self.ready[i % len(self.ready)])


def in_memory_loader(ready: list[dict], n: int):
    """The training DataLoader of ``n`` steps: the CLI's ``pin_memory=True`` loader
    (``speculators/train/dataloader.py`` ``_setup_dataloader``), its batches already collated."""
    return torch.utils.data.DataLoader(InMemoryBatches(ready, n), batch_size=None, shuffle=False, num_workers=0,
                                       pin_memory=torch.cuda.is_available())


def trainer_config(train_kwargs: dict, save_path: str, log_freq: int):
    """``TrainerConfig`` as ``cli.main`` fills it (cli.py L742-768) from the CLI's defaults
    (``train/config/schema.py``), optimizer AdamW instead of its default Muon."""
    from speculators.train.trainer import TrainerConfig

    return TrainerConfig(num_epochs=20, save_path=save_path, lr=1e-3, resume_from_checkpoint=True,
                         train_call_kwargs=train_kwargs, val_call_kwargs=train_kwargs, optimizer="adamw",
                         weight_decay=0.01, muon_lr=1e-3, muon_momentum=0.95, muon_weight_decay=0.1,
                         muon_ns_steps=5, muon_adjust_lr_fn="match_rms_adamw", scheduler_type="linear",
                         scheduler_warmup_steps=None, scheduler_warmup_ratio=None, scheduler_total_steps=None,
                         scheduler_num_cosine_cycles=0.5, checkpoint_freq=1.0, save_best=False,
                         hidden_states_dtype=torch.bfloat16, log_freq=log_freq, fsdp_shard=False,
                         gradient_checkpointing=False, max_steps=None)


def epoch_body(tr, batch: dict, epoch: int, loop: dict) -> None:
    """One iteration of speculators 0.9.0 ``Trainer.train_epoch``'s loop (trainer.py L512-605) on the
    Trainer ``tr``'s model, config, optimizers and schedulers. ``loop`` carries what the loop keeps
    across iterations: ``timer`` (``_StepTimer``), ``recovery`` (``BatchRecoveryCoordinator``),
    ``t_before_fetch``, ``local_step_rel`` and ``remaining_steps``. Left out, as on one process
    without a mid-epoch checkpoint or max_steps: the distributed all-reduce (L576-577), the
    checkpoint at ``step_interval`` (None at checkpoint_freq 1: L503-507, L607-614), the max_steps
    stop (L601-605) and the step callback (L598-599)."""
    from speculators.train.trainer import _should_sync_recovery, metric_logger
    from speculators.train.utils import normalize_counted_metrics

    timer, recovery = loop["timer"], loop["recovery"]
    loop["local_step_rel"] += 1
    timer.reset(tr.global_step % tr.config.log_freq == 0)  # L515
    timer.mark_value("start", loop["t_before_fetch"])
    will_stop = tr.config.max_steps is not None and tr.global_step + 1 >= tr.config.max_steps
    timer.mark("queue")
    recovery.consume(batch, synchronize=_should_sync_recovery(loop["local_step_rel"], loop["remaining_steps"],
                                                               will_stop=will_stop))  # L523-530
    timer.mark("pre_h2d")
    gpu_batch = {k: v.to(tr.local_rank, non_blocking=True) if isinstance(v, torch.Tensor) else v
                 for k, v in batch.items()}  # L532-537
    with torch.autocast(tr.device_type, dtype=tr.config.hidden_states_dtype):
        timer.mark("fetch")
        _draft_tokens, loss, metrics = tr.model(**gpu_batch, **(tr.config.train_call_kwargs or {}))
    timer.mark("fwd")
    tr._optimizers_zero_grad()  # L548: Optimizer.zero_grad(), set_to_none=True by default
    loss.backward()
    timer.mark("pre_clip")
    torch.nn.utils.clip_grad_norm_(tr.model.parameters(), 1.0)  # L551
    # L553-560: two blocking host-to-device copies (a device sync each step, logged or not)
    metrics["error_records_sum"] = torch.tensor(batch["error_records"], dtype=torch.float32, device=loss.device)
    metrics["error_records_total"] = torch.tensor(1.0 if tr.rank == 0 else 0, dtype=torch.float32,
                                                  device=loss.device)
    timer.mark("bwd")
    tr._optimizers_step()
    current_lrs = {type(opt).__name__: opt.param_groups[0]["lr"] for opt in tr.optimizers}
    tr._schedulers_step()
    timer.mark("opt")
    loop["t_before_fetch"] = timer.now() or time.perf_counter()  # L570
    if timer.enabled:  # L573-596: a logged step
        num_tokens = int((gpu_batch["document_ids"] != -1).sum().item())
        profile = timer.profile(num_tokens)
        metrics = {k: v.item() for k, v in metrics.items()}
        metrics = normalize_counted_metrics(metrics, 1)
        lr_info = current_lrs if len(current_lrs) > 1 else next(iter(current_lrs.values()))
        metric_logger.info({"train": metrics, "profile": profile, "epoch": epoch, "lr": lr_info,
                            "global_step": tr.global_step}, extra={"step": tr.global_step})
    tr.global_step += 1


def v1_step(model, opts, scheds, train_kwargs, dev, batch: dict) -> float:
    """This harness's step before the Trainer was driven (peer_<T>.json of 2026-12-02 and earlier):
    the loop body without ``_StepTimer``, the metrics tensors and logging; the loss read back."""
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


def block_stats(t0: float, stamps: list[float], t_end: float, n: int) -> dict:
    """``ms_per_step`` (``t0`` to ``t_end``, device synchronised at both, over ``n`` steps) and the
    host intervals between the steps' end stamps (the last one ends at ``t_end``)."""
    ends = stamps[-n:-1] + [t_end]
    gaps = [b - a for a, b in zip([t0] + ends[:-1], ends)]
    return {"steps": n, "ms_per_step": (t_end - t0) / n * 1e3, "step_ms_median": median(gaps) * 1e3,
            "step_ms_min": min(gaps) * 1e3, "step_ms_max": max(gaps) * 1e3,
            "step_ms_all": [round(g * 1e3, 2) for g in gaps]}


class KeepProfiles(logging.Handler):
    """Keeps the ``profile`` dict of each metrics record the Trainer logs (added to its metric
    logger beside the CLI's handlers, not instead of them)."""

    def __init__(self, into: list):
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and record.msg.get("profile"):
            self.into.append(dict(record.msg["profile"]))


class Run:
    """The blocks timed on one Trainer ``tr`` (None: no accelerator, ``v1_step`` only) and its model,
    optimizers and schedulers, over the collated batches ``ready``; results go into ``doc``."""

    def __init__(self, tr, model, opts, scheds, train_kwargs: dict, dev, ready: list[dict], steps: int,
                 block_warmup: int, tokens: int, flops: float, doc: dict):
        self.tr, self.model, self.opts, self.scheds, self.train_kwargs = tr, model, opts, scheds, train_kwargs
        self.dev, self.ready, self.steps, self.block_warmup = dev, ready, steps, block_warmup
        self.tokens, self.flops, self.doc = tokens, flops, doc
        self.it, self.epoch_no = 0, 0
        self.records: list[dict] = []  # the profile dicts the Trainer logs (logged steps only)
        logging.getLogger("speculators.metrics").addHandler(KeepProfiles(self.records))
        self.loop = None
        if tr is not None:
            from speculators.train.recovery import BatchRecoveryCoordinator
            from speculators.train.trainer import _StepTimer

            self.loop = {"timer": _StepTimer(), "recovery": BatchRecoveryCoordinator("training"),
                         "t_before_fetch": time.perf_counter(), "local_step_rel": 0,
                         "remaining_steps": len(tr.train_loader)}

    def next_batch(self) -> dict:
        self.it += 1
        return dict(self.ready[self.it % len(self.ready)])

    def v1(self) -> float:
        return v1_step(self.model, self.opts, self.scheds, self.train_kwargs, self.dev, self.next_batch())

    def body(self, log_freq: int, n: int, stamps: list | None = None) -> None:
        """``n`` iterations of the train_epoch loop (:func:`epoch_body`) at ``log_freq``."""
        self.tr.config = self.tr.config._replace(log_freq=log_freq)
        for _ in range(n):
            epoch_body(self.tr, self.next_batch(), 0, self.loop)
            if stamps is not None:
                stamps.append(time.perf_counter())

    def body_block(self, log_freq: int) -> tuple[float, list]:
        self.body(log_freq, self.block_warmup)
        stamps: list = []
        sync()
        t0 = time.perf_counter()
        self.body(log_freq, self.steps, stamps)
        return t0, stamps

    def epoch(self, log_freq: int, n_warm: int, n: int) -> tuple[float, list]:
        """``Trainer.train_epoch`` over an in-memory loader of ``n_warm`` + ``n`` steps at
        ``log_freq``: (t0, the end stamps of the last ``n`` steps), the device synchronised once at
        t0, the end of the warm-up steps (from its ``step_callback``, trainer.py L598-599)."""
        tr = self.tr
        tr.config = tr.config._replace(log_freq=log_freq)
        tr.train_loader = in_memory_loader(self.ready, n_warm + n)
        stamps: list = []
        t0 = [None]

        def callback():
            if t0[0] is None and len(stamps) + 1 == n_warm:
                sync()
                t0[0] = time.perf_counter()
                stamps.clear()
            else:
                stamps.append(time.perf_counter())

        if n_warm == 0:
            sync()
            t0[0] = time.perf_counter()
        self.epoch_no += 1
        tr.train_epoch(self.epoch_no, step_callback=callback)
        return t0[0], stamps

    def epoch_plain(self, log_freq: int, n: int) -> None:
        """``Trainer.train_epoch`` over ``n`` steps, nothing added (for :func:`count_host_syncs`)."""
        self.tr.config = self.tr.config._replace(log_freq=log_freq)
        self.tr.train_loader = in_memory_loader(self.ready, n)
        self.epoch_no += 1
        self.tr.train_epoch(self.epoch_no)

    def epoch_block(self, log_freq: int) -> tuple[float, list]:
        return self.epoch(log_freq, self.block_warmup, self.steps)

    def timed(self, name: str, run) -> dict:
        """One block: ``run()`` -> (t0, end stamps of the timed steps), the device synchronised at t0."""
        r = {"variant": name, "unix_time_start": time.time(), "loadavg_start": os.getloadavg()}
        n0 = len(self.records)
        t0, stamps = run()
        sync()
        t_end = time.perf_counter()
        r.update(block_stats(t0, stamps, t_end, self.steps), loadavg_end=os.getloadavg())
        own = self.records[n0:][-self.steps:]
        if own:  # the Trainer's own per-step profile (logged steps)
            r["own_profile"] = {"steps": len(own), **{f"{k}_median": median([p[k] for p in own]) for k in (
                "step_ms", "fetch_ms", "fwd_ms", "bwd_ms", "opt_ms", "h2d_ms", "clip_ms")}}
        self._rate(r, r["ms_per_step"])
        self.doc["variants"].setdefault(name, []).append(r)
        print(f"peer T={self.tokens} {name:14s}: {r['ms_per_step']:.1f} ms/step (median {r['step_ms_median']:.1f}, "
              f"min {r['step_ms_min']:.1f})  {r['tokens_per_s']:.0f} tok/s  MFU(exact) {r['mfu_exact']:.3f}"
              + (f"  its own step_ms {r['own_profile']['step_ms_median']:.1f}" if own else ""), flush=True)
        return r

    def v1_block(self) -> dict:
        """``v1_step`` timed as before: a sync around each step, the median of the step times."""
        times, unix_time_start = [], time.time()
        for _ in range(self.block_warmup + self.steps):
            sync()
            t = time.perf_counter()
            self.v1()
            sync()
            times.append(time.perf_counter() - t)
        t = times[self.block_warmup:]
        r = {"variant": "v1_step", "unix_time_start": unix_time_start, "steps": self.steps,
             "ms_per_step": sum(t) / len(t) * 1e3, "step_ms_median": median(t) * 1e3, "step_ms_min": min(t) * 1e3,
             "step_ms_max": max(t) * 1e3, "step_ms_all": [round(x * 1e3, 2) for x in t]}
        self._rate(r, r["step_ms_median"])  # its figure was the median
        self.doc["variants"].setdefault("v1_step", []).append(r)
        print(f"peer T={self.tokens} v1_step       : median {r['step_ms_median']:.1f} ms (mean {r['ms_per_step']:.1f})"
              f"  {r['tokens_per_s']:.0f} tok/s  MFU(exact) {r['mfu_exact']:.3f}", flush=True)
        return r

    def _rate(self, r: dict, ms: float) -> None:
        r["tokens_per_s"] = self.tokens / ms * 1e3
        r["mfu_exact"] = self.flops / (ms / 1e3) / (PEAK_BF16_TFLOPS * 1e12)

    def fastest_faithful(self) -> dict | None:
        """The smallest ``ms_per_step`` over the rounds of the ``body_*`` and ``epoch_*`` blocks."""
        best = {k: min(r["ms_per_step"] for r in v) for k, v in self.doc["variants"].items() if k != "v1_step"}
        if not best:
            return None
        name = min(best, key=best.get)
        out = {"variant": name, "ms_per_step": best[name], "statistic": "the smallest ms_per_step over the rounds"}
        self._rate(out, best[name])
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--seq-len", type=int, default=2048, choices=sorted(DOCS), help="packed tokens per step")
    ap.add_argument("--doc-lens", default=None,
                    help="packed document lengths, comma-separated (default: bench_train.py's for --seq-len)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps before the first block (compiles)")
    ap.add_argument("--block-warmup", type=int, default=3, help="untimed steps at the start of each block")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per block")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over the variants")
    ap.add_argument("--log-freq", type=int, nargs="+", default=[1000, 1],
                    help="the Trainer's log_freq values timed (1: the CLI's default, every step logged; "
                         "1000: no timed step logged)")
    ap.add_argument("--profile", type=int, default=3,
                    help="body steps at the largest --log-freq under torch.profiler per round (0: none)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, eager loss and attention: a CPU smoke run")
    ap.add_argument("--out", default="peer.json")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    rows = TINY_DOCS[a.seq_len] if a.tiny else DOCS[a.seq_len]
    docs = [int(x) for x in a.doc_lens.split(",")] if a.doc_lens else [d for r in rows for d in r]
    if sorted(docs) != sorted(d for r in rows for d in r):
        sys.exit(f"--doc-lens {docs}: must be the documents bench_train.py packs at {a.seq_len} tokens "
                 f"({[d for r in rows for d in r]}), or the FLOP counts differ")
    # the Trainer's steps (global_step) this run takes: warm-up, blocks, profiles, sync counts
    total = a.warmup + a.rounds * (len(a.log_freq) * 2 * (a.block_warmup + a.steps) + a.profile) + 4 * len(a.log_freq)
    if max(a.log_freq) > 1 and max(a.log_freq) <= total:
        sys.exit(f"--log-freq {max(a.log_freq)}: a logged step would fall among the {total} steps; use > {total}")
    c, cfg = config(a.tiny), target_config(a.tiny)
    fused = dev.type == "cuda"
    version = importlib.metadata.version("speculators")
    if version != VERSION:
        print(f"peer: speculators {version} installed; epoch_body copies {VERSION}'s train_epoch loop", flush=True)
    T = sum(docs)
    flops = exact_flops(c, rows, a.ttt_steps, lm_head_trainable=False)["exact_peer_convention_lm_frozen"]
    doc = {"what": "peer: speculators EAGLE-3 trainer step (dev/README.md, 'The peer')",
           "speculators": version, "ttt": a.ttt_steps, "docs": docs, "tokens_per_step": T, "flops_exact": flops,
           "loss": "kl_div " + ("fused" if fused else "eager"), "optimizer": "AdamW (build_optimizers)",
           "settings": {k: getattr(a, k) for k in ("warmup", "block_warmup", "steps", "rounds", "log_freq",
                                                   "profile")},
           "cpus": len(os.sched_getaffinity(0)),
           "workaround_untied_autotuner_attrs": untie_fused_loss_autotuners() if fused else [],
           "variants": {}, "profiles": [], "errors": []}
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import set_seed
    from speculators.train.logger import setup_metric_logger, setup_root_logger

    t_start = time.perf_counter()
    set_seed(42)  # cli.main's first steps: the seed, the root logger, the metric logger (logger "")
    tmp = Path(tempfile.mkdtemp(prefix="peer_"))
    setup_root_logger()
    setup_metric_logger(loggers="", run_name=None, output_dir=str(tmp / "logs"))
    model = build(write_verifier(tmp / "verifier", cfg), cfg, a.ttt_steps, c.draft_vocab_size,
                  "simple_flex_attention" if fused else "sdpa")
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(ttt_steps=a.ttt_steps, ttt_step_loss_decay=1.0,
                                                          loss_fn="kl_div",
                                                          loss_implementation="fused" if fused else "eager")
    ready = batches(docs, cfg, 2, pin=dev.type == "cuda")
    doc["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    doc["lm_head_trainable"] = bool(model.lm_head.weight.requires_grad)
    tc = trainer_config(train_kwargs, str(tmp / "ckpt"), max(a.log_freq))
    if dev.type == "cuda":
        from speculators.train.trainer import Trainer

        tr = Trainer(model, tc, in_memory_loader(ready, total))  # moves the model to the GPU
        opts, scheds = tr.optimizers, tr.schedulers
    else:
        from speculators.train.optimizers import build_optimizers
        from speculators.train.trainer import _resolve_scheduler_steps
        from transformers import get_linear_schedule_with_warmup

        tr = None  # Trainer.setup_optimizer's optimizers and schedulers without it
        opts = build_optimizers(model, tc)
        w, n = _resolve_scheduler_steps(tc, total)
        scheds = [get_linear_schedule_with_warmup(o, num_warmup_steps=w, num_training_steps=n) for o in opts]
        doc["errors"].append("the Trainer needs an accelerator (trainer.py L348: model.to(local_rank)): "
                             "v1_step only")
    model.train()  # train_epoch's first line (trainer.py L489), before its loop
    run = Run(tr, model, opts, scheds, train_kwargs, dev, ready, a.steps, a.block_warmup, T, flops, doc)
    doc["build_s"] = time.perf_counter() - t_start
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warm = []
    for _ in range(a.warmup):  # the first step compiles the forward and backward
        sync()
        t = time.perf_counter()
        if tr is not None:
            run.body(max(a.log_freq), 1)
        else:
            run.v1()
        sync()
        warm.append(round((time.perf_counter() - t) * 1e3, 1))
    doc["warmup_ms"] = warm
    print(f"peer T={T} warm-up (ms): {warm[:3]} ... {warm[-3:]}", flush=True)
    for rnd in range(a.rounds):
        for f in (a.log_freq if tr is not None else []):
            for name, block in ((f"body_log{f}", run.body_block), (f"epoch_log{f}", run.epoch_block)):
                try:
                    run.timed(name, lambda block=block, f=f: block(f))
                except Exception as e:  # noqa: BLE001
                    import traceback

                    traceback.print_exc()
                    doc["errors"].append(f"round {rnd} {name}: {e!r}")
        run.v1_block()
        write_result(a.out, doc)
        if a.profile and dev.type == "cuda":
            try:
                p = profile_steps(lambda: run.body(max(a.log_freq), 1), a.profile, 15)
                doc["profiles"].append({"round": rnd, "variant": f"body_log{max(a.log_freq)}", **p})
                print("profile:", {k: p[k] for k in ("wall_ms_per_step", "gpu_busy_ms_per_step", "ms_by_kind")},
                      flush=True)
            except Exception as e:  # noqa: BLE001
                doc["errors"].append(f"round {rnd} profile: {e!r}")
            write_result(a.out, doc)
    best = doc["fastest_faithful"] = run.fastest_faithful()
    if best:
        print(f"peer T={T} ttt={a.ttt_steps} fastest faithful: {best['variant']} {best['ms_per_step']:.1f} ms/step  "
              f"{best['tokens_per_s']:.0f} tok/s  MFU(exact) {best['mfu_exact']:.3f}", flush=True)
    if dev.type == "cuda":
        doc["peak_alloc_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        syncs = {}
        counted = [("v1_step", lambda: [run.v1() for _ in range(2)])]
        for f in a.log_freq:
            counted += [(f"body_log{f}", lambda f=f: run.body(f, 2)), (f"epoch_log{f}", lambda f=f: run.epoch_plain(f, 2))]
        for name, fn in counted:
            try:
                syncs[name] = count_host_syncs(fn)
            except Exception as e:  # noqa: BLE001
                doc["errors"].append(f"host syncs {name}: {e!r}")
        doc["host_syncs_two_steps"] = syncs
        print("host syncs over two steps (explicit, implicit):",
              {k: (v["explicit"], v["implicit"]) for k, v in syncs.items()}, flush=True)
    doc["wall_s"] = time.perf_counter() - t_start
    write_result(a.out, doc)


if __name__ == "__main__":
    main()
