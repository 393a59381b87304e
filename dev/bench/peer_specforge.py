"""The second peer's training step: SGLang's SpecForge 0.2.0 EAGLE-3 trainer (PyPI ``specforge``),
timed the way its own trainer runs (dev/README.md, "The second peer").

Its offline training run as ``specforge train`` builds it for one process (sgl-project/SpecForge
0.2.0: ``specforge/cli.py`` ``_train``, ``specforge/training/assembly.py`` ``build_training_run``,
``specforge/launch.py`` ``build_offline_runtime``), from its typed ``Config`` with its schema's
defaults (``specforge/config/schema.py``: ttt_length 7, flex attention, bf16 weights with fp32
AdamW masters (``BF16Optimizer``), lr 1e-4 cosine with 1.5% warm-up, grad clip 0.5, FSDP
``SHARD_GRAD_OP``, batch size 1, log_interval 50):

- the target: a Llama-3.1-8B-shaped ``config.json`` and the two tensors it reads (the embedding and
  the lm_head, random, in a safetensors file with its index), in a temp dir;
- the draft config generated from the target's (``_generate_draft_config``: one layer, draft vocab
  32000), the draft model, ``OnlineEagle3Model`` and the frozen ``TargetHead`` by its
  ``build_model_bundle``; the d2t/t2d map by its ``_install_dataset_vocab_mapping`` from token counts
  of the synthetic documents (what ``_ensure_offline_vocab_mapping`` counts in the feature files);
- a one-process ``torch.distributed`` group (``_bootstrap_single_process_env``,
  ``init_distributed``), ``FSDP_SHARDING`` and the seed (accelerate's ``set_seed``) as ``_train`` sets
  them; the trainer by its ``_assemble_trainer`` with ``build_offline_runtime``'s arguments.

One thing differs from the offline CLI: the features. Its reader (``OfflineManifestReader``) refers
to ``.ckpt`` files written with ``torch.save`` (pickle), each read by ``torch.load`` in the loader;
here the same four tensors per sample (``input_ids``, ``loss_mask``, ``hidden_state``,
``aux_hidden_state``) are put in its in-memory ``LocalFeatureStore`` (the store its online path
fills) and the refs carry the offline reader's metadata: the loader, the eagle3 offline normalizer
and collator, the strategy and the trainer are the same. SpecForge does not pack documents: a step
is one sample of --tokens tokens (batch size 1, one document).

Timing: ``TrainerController`` measures ``perf/optimizer_step_time_s`` over each log window and hands
it to the run's logger: the harness's logger keeps each window with a wall-clock stamp. The first
window includes compilation; the figure is the median of the later windows (``ms_per_step``), each
window's own figure kept. Its step reads its metrics and grad norm back (``TrainerCore._result``:
``.item()``), a host sync every step. FLOPs: bench_train.py's exact count for one document of
--tokens tokens with the lm_head trainable (the draft lm_head trains in SpecForge), the same
convention as eyas' lm_head-trainable runs: SpecForge's full-vocabulary teacher projection is its
own extra work, not counted.

Needs ``specforge`` and its training-path dependencies importable (``device.sh specforge`` installs
the carried wheels into /tmp/site-sf and /tmp/site). The step runs on a GPU only: FSDP needs an
accelerator and its loss is a Triton kernel (``specforge/core/loss.py``); on CPU, --tiny builds
everything up to the FSDP wrap, where it stops.

    python3 dev/bench/peer_specforge.py --tokens 2048 --out peer_specforge_2048.json
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from benchmarks.bench_train import config, exact_flops  # noqa: E402
from benchmarks.common import PEAK_BF16_TFLOPS, median  # noqa: E402
from dev.bench.common import write_result  # noqa: E402
from dev.bench.peer_speculators import target_config  # noqa: E402

VERSION = "0.2.0"  # the release whose assembly this harness follows


def write_target(root: Path, cfg: dict) -> Path:
    """The target directory SpecForge reads: config.json, the embedding and lm_head (random bf16)
    in ``model.safetensors`` and the index ``TargetHead.load_weights`` requires."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(1)
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    tensors = {"model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).to(torch.bfloat16),
               "lm_head.weight": (torch.randn(v, h, generator=g) * 0.02).to(torch.bfloat16)}
    save_file(tensors, str(root / "model.safetensors"))
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in tensors}}))
    return root


def draft_config_tiny(path: Path, c) -> str:
    """--tiny: a draft config file (its generated one has draft vocab 32000, above the tiny vocab)."""
    path.write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
        "hidden_act": "silu", "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": 1e-5,
        "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size, "rope_theta": c.rope_theta,
        "tie_word_embeddings": False, "pad_token_id": 0, "torch_dtype": "bfloat16"}))
    return str(path)


def samples(tokens: int, cfg: dict, n: int) -> list[dict]:
    """``n`` distinct sample dicts of the offline feature layout (``input_ids`` [T] int64, ``loss_mask``
    [T] int64, ``hidden_state`` [1, T, H] and ``aux_hidden_state`` [1, T, 3H] bf16), one document of
    ``tokens`` tokens each."""
    g = torch.Generator().manual_seed(0)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    return [{"input_ids": torch.randint(0, v, (tokens,), generator=g),
             "loss_mask": torch.ones(tokens, dtype=torch.long),
             "hidden_state": torch.randn(1, tokens, h, generator=g).to(torch.bfloat16),
             "aux_hidden_state": torch.randn(1, tokens, 3 * h, generator=g).to(torch.bfloat16)} for _ in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per step: one document (max_length)")
    ap.add_argument("--ttt-steps", type=int, default=7, help="training.ttt_length")
    ap.add_argument("--log-interval", type=int, default=50, help="training.log_interval (its default): the window")
    ap.add_argument("--windows", type=int, default=3, help="log windows run (the first includes compilation)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny shapes and sdpa attention: a CPU run up to the FSDP wrap (FSDP needs an accelerator)")
    ap.add_argument("--out", default="peer_specforge.json")
    a = ap.parse_args()
    if a.windows < 2:
        sys.exit("--windows must be at least 2: the first includes compilation")
    c, cfg = config(a.tiny), target_config(a.tiny)
    steps = a.windows * a.log_interval
    flops = exact_flops(c, [[a.tokens]], a.ttt_steps, lm_head_trainable=True)["exact"]
    doc = {"what": "second peer: SpecForge EAGLE-3 trainer step (dev/README.md, 'The second peer')",
           "specforge": importlib.metadata.version("specforge"), "tokens_per_step": a.tokens, "docs": [a.tokens],
           "ttt": a.ttt_steps, "flops_exact": flops, "flops_convention": "bench_train exact, lm_head trainable",
           "log_interval": a.log_interval, "windows": [], "errors": []}
    if doc["specforge"] != VERSION:
        print(f"peer_specforge: specforge {doc['specforge']} installed; this harness follows {VERSION}", flush=True)
    from accelerate.utils import set_seed
    from specforge.application import resolve_run
    from specforge.cli import _bootstrap_single_process_env
    from specforge.config import Config
    from specforge.distributed import destroy_distributed, init_distributed
    from specforge.launch import _assemble_trainer, _offline_io
    from specforge.runtime.contracts import SCHEMA_VERSION
    from specforge.runtime.control_plane import DataFlowController
    from specforge.runtime.control_plane.metadata_store import NoOpMetadataStore
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.training.assembly import (
        _common_launch_kwargs,
        _install_dataset_vocab_mapping,
        build_model_bundle,
    )

    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="peer_specforge_"))
    (tmp / "features").mkdir()
    model = {"target_model_path": str(write_target(tmp / "target", cfg))}
    training = {"max_steps": steps, "ttt_length": a.ttt_steps, "log_interval": a.log_interval}
    if a.tiny:  # CPU: flex attention has no CPU backward
        model["draft_model_config"] = draft_config_tiny(tmp / "draft_config.json", c)
        training["attention_backend"] = "sdpa"
    resolved = resolve_run(Config.model_validate({
        "model": model,
        "data": {"hidden_states_path": str(tmp / "features"), "max_length": a.tokens, "cache_dir": str(tmp / "cache")},
        "training": training, "run_id": "peer-specforge", "output_dir": str(tmp / "output")}))
    cfg_sf, algorithm = resolved.config, resolved.algorithm
    doc["config"] = cfg_sf.model_dump(mode="json")["training"]
    # specforge/cli.py _train also exports FSDP_SHARDING = training.fsdp_sharding: at its default
    # (SHARD_GRAD_OP) that is ParallelConfig.from_distributed's own default (specforge/training/backend.py)
    if cfg_sf.training.fsdp_sharding != "SHARD_GRAD_OP":
        raise SystemExit(f"training.fsdp_sharding {cfg_sf.training.fsdp_sharding}: this harness runs the default only")
    set_seed(cfg_sf.training.seed)
    _bootstrap_single_process_env()
    init_distributed(timeout=cfg_sf.training.dist_timeout, tp_size=cfg_sf.training.tp_size,
                     sp_ulysses_size=cfg_sf.training.sp_ulysses_size, sp_ring_size=cfg_sf.training.sp_ring_size)
    try:
        bundle = build_model_bundle(cfg_sf, algorithm=algorithm)
        ready = samples(a.tokens, cfg, 2)
        counts = collections.Counter()
        for s in ready:  # what count_effective_feature_tokens counts: the supervised ids
            counts.update(s["input_ids"][s["loss_mask"].bool()].tolist())
        _install_dataset_vocab_mapping(cfg_sf, bundle, counts=counts, dataset_identity="synthetic documents")
        store = LocalFeatureStore(cfg_sf.run_id)
        refs = [store.put(dict(ready[i % 2]), sample_id=f"{cfg_sf.run_id}:{i:08d}", metadata={
            "run_id": cfg_sf.run_id, "strategy": "eagle3", "format": "offline_eagle3", "target_repr": "hidden_state",
            "schema_version": SCHEMA_VERSION, "ttt_length": a.ttt_steps, "max_len": a.tokens, "file_index": i,
            "num_tokens": a.tokens}) for i in range(steps)]
        collate_fn, per_sample_transform = _offline_io(algorithm, cfg_sf.model.input_modality, a.tokens,
                                                       ttt_length=a.ttt_steps, use_usp_preprocess=False)

        def logger(metrics: dict, step: int) -> None:  # the run's logger: one call per log window
            w = {"step": step, "unix_time": time.time(), "wall_s": time.perf_counter() - t_start,
                 **{k.removeprefix("perf/"): v for k, v in metrics.items() if k.startswith("perf/")},
                 "loss": metrics.get("loss")}
            doc["windows"].append(w)
            print(f"peer_specforge T={a.tokens} step {step}: {w['optimizer_step_time_s'] * 1e3:.1f} ms/step over the "
                  f"window (data wait {w['data_wait_time_s'] * 1e3:.1f} ms)", flush=True)

        launch = _common_launch_kwargs(cfg_sf, bundle, algorithm, logger=logger)
        launch.pop("modality")
        doc["dataloader_num_workers"] = launch["dataloader_num_workers"]
        trainer = _assemble_trainer(
            controller=DataFlowController(cfg_sf.run_id, metadata_store=NoOpMetadataStore(),
                                          enable_sample_queue=False),
            store=store, ref_source={"refs": refs}, model=bundle.model,
            target_head=bundle.target_head if algorithm.providers.step.uses_external_target_head else None,
            num_epochs=cfg_sf.training.num_epochs, collate_fn=collate_fn, per_sample_transform=per_sample_transform,
            durable_ack=False, resume_from=None,
            checkpoint_extra={"offline_sampler_version": 1, "sampler_seed": cfg_sf.training.seed,
                              "source_dataset_size": len(refs)}, **launch)
        draft = bundle.model.draft_model
        doc["trainable"] = sum(p.numel() for p in draft.parameters() if p.requires_grad)
        doc["lm_head_trainable"] = bool(draft.lm_head.weight.requires_grad)
        doc["build_s"] = time.perf_counter() - t_start
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        try:
            trainer.fit()
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            doc["errors"].append(f"fit: {e!r}")
        later = [w["optimizer_step_time_s"] for w in doc["windows"][1:]]
        if later:
            ms = median(later) * 1e3
            doc.update(ms_per_step=ms, tokens_per_s=a.tokens / ms * 1e3,
                       mfu_exact=flops / (ms / 1e3) / (PEAK_BF16_TFLOPS * 1e12),
                       statistic="median over the log windows after the first of its perf/optimizer_step_time_s")
            print(f"peer_specforge T={a.tokens} ttt={a.ttt_steps}: {ms:.1f} ms/step  {doc['tokens_per_s']:.0f} tok/s  "
                  f"MFU(exact, lm_head trainable) {doc['mfu_exact']:.3f}  trainable {doc['trainable']:,}", flush=True)
        if torch.cuda.is_available():
            doc["peak_alloc_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        doc["wall_s"] = time.perf_counter() - t_start
        write_result(a.out, doc)
        destroy_distributed()


if __name__ == "__main__":
    main()
