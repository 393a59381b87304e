"""DVC stage `extract`: run the target over each split and store EAGLE-3 features.

Reads params `target`, `extract`, `data.on_bad_line`, `train.mode`; reads `data/distilled/{train,val,publish}.jsonl`
(self-distill: regenerated rows are taken as the token ids the target generated); writes
`data/features/<split>/` (sharded safetensors + manifest.json), `data/features/target_head.safetensors`
(the target's embedding and lm_head) and `metrics/extract.json`.
Before the target's weights load it renders every split with the tokenizer and refuses to start
when the shards would not fit the free disk (features.check_disk_space: exact token counts, +10%).
With `train.mode: online` it writes a token store instead (input_ids, loss_mask, offsets: 5 bytes
per token, manifest `"contents": "tokens"`): the target's weights load only for its embedding and
lm_head, build-vocab counts tokens as before, and the train stages compute the hidden states batch
by batch (eyas/training/online.py). The DAG and every output path stay the same.
Run from the repository root: `python -m stages.extract`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eyas import features
from eyas.data.conversations import DataError, read_jsonl, render_with_loss_mask
from eyas.io import save_safetensors, write_json
from eyas.params import data as data_schema
from eyas.params import extract as extract_schema
from eyas.params import target as target_schema
from eyas.params import train as train_schema
from eyas.params.schema import FEATURE_SPLITS, load_sections
from eyas.pipeline.provenance import check
from eyas.pipeline.provenance import record as fingerprint
from eyas.pipeline.runlock import hold
from eyas.target import layers
from eyas.target.model import load_target, load_tokenizer_and_config
from eyas.tracking.runs import start_stage_run
from stages.common import DISTILLED, FEATURES, METRICS

SPLITS = FEATURE_SPLITS
# in-progress shards live OUTSIDE the DVC out (DVC deletes data/features before the stage runs), so
# a killed extract resumes from its last complete shard; finished splits are moved into place
WORK = Path(".eyas", "work", "extract")  # repo-relative


def sample_of(tokenizer, conv: dict, max_length: int) -> dict:
    """One conversation -> ``{"input_ids", "loss_mask", "truncated"}``.

    A self-distilled row (``reply_ids``, eyas/data/distill.py) is used as the target generated it:
    ``prompt_ids + reply_ids``, supervised on the reply only (its stop token included when the
    target wrote one; a reply cut at the budget ends without one). Any other conversation (human
    data: the publish split, or ``distill.enabled: false``) is rendered through the chat template
    with :func:`eyas.data.conversations.render_with_loss_mask` (every assistant turn and its end-of-turn token).
    """
    if "reply_ids" in conv:
        ids = list(conv["prompt_ids"]) + list(conv["reply_ids"])
        mask = [0] * len(conv["prompt_ids"]) + [1] * len(conv["reply_ids"])
        return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length], "truncated": len(ids) > max_length}
    return render_with_loss_mask(tokenizer, conv["messages"], max_length)


def render_split(tokenizer, convs: list[dict], out_dir: Path, max_length: int,
                 on_bad_line: str = "error") -> tuple[list[dict], int, int, list[str]]:
    """Render one split's conversations (:func:`sample_of`) -> (samples with supervised tokens,
    sorted by length; truncated count; dropped count; ids of conversations the chat template
    refused, skipped under ``on_bad_line: skip``).

    Raises:
        DataError: the template refused a conversation (``on_bad_line: error``), naming its id.
        FeatureError: (naming ``out_dir``) the loss masks say the chat template or the roles are
            wrong.
    """
    rendered, truncated, refused = [], 0, []
    for c in convs:
        try:
            r = sample_of(tokenizer, c, max_length)
        except Exception as e:  # noqa: BLE001  DataError (content not located), jinja2's TemplateError
            if on_bad_line == "error":
                raise DataError(f"{out_dir.name}: conversation {c.get('id')!r}: cannot render it with the "
                                f"chat template ({type(e).__name__}: {e}); set data.on_bad_line: skip to "
                                "skip and count such conversations") from None
            refused.append(c.get("id"))
            continue
        truncated += r["truncated"]
        rendered.append(r)
    empty = sum(1 for r in rendered if sum(r["loss_mask"]) == 0)
    full = sum(1 for r in rendered if all(r["loss_mask"]))
    if (empty + full) * 2 > len(rendered):
        raise features.FeatureError(
            f"{out_dir}: loss mask is all zeros for {empty} and all ones for {full} of "
            f"{len(rendered)} samples: the chat template or the assistant roles are wrong")
    rendered = [r for r in rendered if sum(r["loss_mask"]) > 0]
    if not rendered:
        raise features.FeatureError(f"{out_dir.name}: no samples with assistant tokens ({len(convs)} "
                                    f"conversations, {empty} without supervised tokens after rendering)")
    rendered.sort(key=lambda r: len(r["input_ids"]))  # length bucketing: little padding
    return rendered, truncated, empty, refused


def extract_split(target, rendered: list[dict], truncated: int, empty: int, refused: list[str], out_dir: Path,
                  p, aux_ids: list[int], provenance: dict) -> tuple[dict, int]:
    """Run the target over one split's rendered samples and store them -> (manifest, bytes of
    tensor data in its shards)."""
    e = p.extract
    # everything that determines the shards' contents and order: a rerun with the same key resumes
    resume_key = hashlib.sha256(json.dumps(
        [provenance, {"dtype": e.dtype, "shard_samples": e.shard_samples, "max_length": e.max_length,
                      "aux": aux_ids}, [(r["input_ids"], r["loss_mask"]) for r in rendered]],
        sort_keys=True, default=str).encode()).hexdigest()
    dtype = getattr(torch, e.dtype)
    if p.train.mode == "online":
        return store_tokens(rendered, truncated, empty, refused, out_dir, p, dtype, resume_key, provenance)
    fp8 = dtype == features.FP8
    # fp8: aux states are quantised on the device (per-token scales) before the host copy; the
    # final hidden state is stored in bf16
    host_dtype = torch.bfloat16 if fp8 else dtype
    dev = target.device
    # Overlap: batch i+1's forward runs while batch i's features cross to pinned host memory on a
    # side stream and earlier shards are written (fsync'd) by writer threads.
    # the writer refuses a hidden state that is inf/NaN as stored (features.check_finite)
    writer = features.ShardWriter(out_dir, e.shard_samples, dtype, background=dev.type == "cuda",
                                  resume_key=resume_key, aux_layers=aux_ids)
    if writer.resumed_samples:
        print(f"extract {out_dir.name}: resuming after {writer.resumed_samples} samples in complete shards")
    host = features.HostCopy(dev)
    pending = None  # (handle, chunk, ids) of the previous batch

    def store(handle, chunk, ids):
        out = handle.wait()
        for j, r in enumerate(chunk):
            n = len(r["input_ids"])
            writer.add(ids[j, :n], torch.tensor(r["loss_mask"]), out["aux_hidden"][j, :n],
                       out["final_hidden"][j, :n], out["target_argmax"][j, :n],
                       out["aux_scale"][j, :n] if fp8 else None)

    for i in tqdm(range(writer.resumed_samples, len(rendered), e.batch_size), desc=f"extract {out_dir.name}",
                  unit="batch"):
        chunk = rendered[i : i + e.batch_size]
        T = max(len(r["input_ids"]) for r in chunk)
        ids = torch.zeros(len(chunk), T, dtype=torch.int64)
        att = torch.zeros(len(chunk), T, dtype=torch.int64)
        for j, r in enumerate(chunk):
            ids[j, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            att[j, : len(r["input_ids"])] = 1
        out = target.capture(ids.to(dev, non_blocking=True), att.to(dev, non_blocking=True), aux_ids)
        if fp8:
            out = features.quantize_capture(out, len(aux_ids))
        handle = host.submit(out, {"final_hidden": host_dtype, "target_argmax": torch.int32,
                                   **({} if fp8 else {"aux_hidden": host_dtype})})
        if pending is not None:
            store(*pending)
        pending = (handle, chunk, ids)
    if pending is not None:
        store(*pending)
    manifest = writer.finish(truncated_samples=truncated, dropped_no_supervised_tokens=empty,
                             skipped_template=len(refused), skipped_template_ids=refused,
                             max_length=e.max_length, **provenance)
    return manifest, writer.bytes_written


def store_tokens(rendered: list[dict], truncated: int, empty: int, refused: list[str], out_dir: Path, p,
                 dtype: torch.dtype, resume_key: str, provenance: dict) -> tuple[dict, int]:
    """``train.mode: online``: store one split's token ids and loss masks only (no target forward)
    -> (manifest with ``"contents": "tokens"``, bytes of tensor data). ``storage_dtype`` in the
    manifest is the dtype the train stages round the target's hidden states to, as extract would
    have stored them (eyas/training/online.py)."""
    writer = features.ShardWriter(out_dir, p.extract.shard_samples, dtype, resume_key=resume_key)
    for r in rendered[writer.resumed_samples:]:
        writer.add_tokens(torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"]))
    manifest = writer.finish(contents=features.TOKENS, truncated_samples=truncated,
                             dropped_no_supervised_tokens=empty, skipped_template=len(refused),
                             skipped_template_ids=refused, max_length=p.extract.max_length, **provenance)
    return manifest, writer.bytes_written


def publish(work: Path, dest: Path) -> None:
    """Move a finished split (manifest written) from the work dir to its DVC out."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(work, dest)
    except OSError:  # another filesystem
        shutil.move(str(work), str(dest))


def main() -> None:
    hold("extract")  # one run of this stage at a time in this workspace (eyas/pipeline/runlock.py)
    p = load_sections(target_schema, data_schema, extract_schema, train_schema)
    with start_stage_run("extract", p) as tracker:
        check(DISTILLED, p, reader="extract")  # replies of another target or other conversations: refused
        # size the output before the weights load: render every split with the tokenizer
        tokenizer, cfg = load_tokenizer_and_config(p.target.path, p.target.gguf_file, p.target.trust_remote_code,
                                                   revision=p.target.revision)
        aux_ids = layers.resolve(p.extract.aux_layers, cfg.num_hidden_layers)
        dtype = getattr(torch, p.extract.dtype)
        contents = features.TOKENS if p.train.mode == "online" else features.FEATURES
        renders, estimate = {}, {}
        for split in SPLITS:
            renders[split] = render_split(tokenizer, read_jsonl(DISTILLED / f"{split}.jsonl"), WORK / split,
                                          p.extract.max_length, p.data.on_bad_line)
            estimate[split] = features.estimate_split_bytes([len(r["input_ids"]) for r in renders[split][0]],
                                                            p.extract.shard_samples, len(aux_ids), cfg.hidden_size,
                                                            dtype, contents)
        head_bytes = 2 * cfg.vocab_size * cfg.hidden_size * 4  # embed_tokens + lm_head, float32
        disk = features.check_disk_space(FEATURES, sum(estimate.values()) + head_bytes, WORK, max(estimate.values()))
        print(f"extract: {sum(estimate.values())} bytes of features (+{head_bytes} target head) expected; "
              f"disk needed incl. headroom / free: {disk}")
        t0 = time.time()
        target = load_target(p.target.path, p.target.gguf_file, p.target.dtype, p.target.trust_remote_code,
                             tokenizer=tokenizer, revision=p.target.revision)
        load_s = time.time() - t0
        template = target.tokenizer.chat_template or ""
        provenance = {
            "target": target.identity,
            "tokenizer_sha256": hashlib.sha256(
                "".join(sorted(map(str, target.tokenizer.get_vocab().items()))).encode()).hexdigest(),
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
            "aux_layers": aux_ids,
            "aux_layers_default": layers.normalise(aux_ids, target.num_layers) is None,
            "num_layers": target.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "target_config": target.config_summary(),
            # what the features were built from, checked by every reader (eyas/pipeline/provenance.py)
            "fingerprint": fingerprint("extract", p, [DISTILLED / f"{s}.jsonl" for s in SPLITS]),
        }
        FEATURES.mkdir(parents=True, exist_ok=True)
        save_safetensors(target.head_weights(), features.head_path(FEATURES))
        per_split = {}
        for split in SPLITS:
            t1 = time.time()
            m, nbytes = extract_split(target, *renders.pop(split), WORK / split, p, aux_ids, provenance)
            publish(WORK / split, FEATURES / split)
            dt = time.time() - t1
            per_split[split] = {"samples": m["num_samples"], "tokens": m["num_tokens"],
                                "supervised_tokens": m["supervised_tokens"],
                                "truncated_samples": m["truncated_samples"],
                                "skipped_template": m["skipped_template"],
                                "estimated_bytes": estimate[split], "bytes": nbytes,
                                "seconds": round(dt, 1), "tokens_per_second": round(m["num_tokens"] / dt, 1)}
            print(f"extract {split}: {per_split[split]}")
        bpt = features.TOKEN_BYTES if contents == features.TOKENS else \
            features.bytes_per_token(len(aux_ids), cfg.hidden_size, dtype)
        metrics = {"splits": per_split, "contents": contents, "bytes_per_token": bpt, "aux_layers": aux_ids,
                   "storage_dtype": p.extract.dtype, "target_load_seconds": round(load_s, 1),
                   "total_tokens": sum(s["tokens"] for s in per_split.values()),
                   # shard tensor bytes: estimated from the rendered token counts before the target
                   # loaded, and written (equal unless the inputs changed mid-run)
                   "estimated_bytes": sum(estimate.values()),
                   "bytes": sum(s["bytes"] for s in per_split.values())}
        metrics["feature_gib"] = round(metrics["total_tokens"] * bpt / 2**30, 3)
        write_json(METRICS / "extract.json", metrics)
        tracker.log_metrics({"bytes_per_token": bpt, "total_tokens": metrics["total_tokens"],
                             **{f"{s}/tokens_per_second": v["tokens_per_second"] for s, v in per_split.items()}})
        tracker.log_dict(metrics, "extract.json")
        print(f"extract: {metrics['total_tokens']} tokens, {bpt} bytes/token, {metrics['feature_gib']} GiB")


if __name__ == "__main__":
    main()
