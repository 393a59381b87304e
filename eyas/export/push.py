"""``eyas push``: publish an exported drafter to a Hugging Face Hub model repository.

What goes up is what SGLang and vLLM load from a drafter repository (``--speculative-draft-model-path``
/ ``speculative_config.model``): ``config.json`` and ``model.safetensors``, nothing else (no
fingerprint, no pickles). The directory is loaded with :func:`eyas.export.load.load_drafter` first, so a
checkpoint eyas would refuse to serve (wrong keys, shapes, a variant no engine runs) is never
published, nor one :func:`eyas.export.inspector.inspect_checkpoint` reports errors for (what SGLang or vLLM
would misread), nor a repository id the hub would refuse. ``dry_run`` does everything but the
upload: no token and no network needed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["PUSH_FILES", "PushError", "push_plan", "push"]

PUSH_FILES = ("config.json", "model.safetensors")


class PushError(ValueError):
    """The directory is not a servable drafter, or the upload failed."""


def push_plan(drafter_dir: str | Path, target: dict | None = None) -> dict:
    """The files :func:`push` uploads and what ``eyas inspect`` warns about them:
    ``{"files": [{"file", "bytes", "sha256"}] in PUSH_FILES order, "warnings": [str]}``. With a
    ``target``, a context length or RoPE that differs from the target's is a warning (served as
    configured, not as the target runs), as ``eyas inspect --target`` reports it.

    Args:
        drafter_dir: an exported drafter directory.
        target: the target it is published for (:func:`eyas.export.inspector.target_summary`): its
            context length, RoPE, vocab, hidden size and aux layers are checked against the drafter's
            as ``eyas inspect --target`` does (a drafter made for another target version is refused).

    Raises:
        PushError: a file is missing, :func:`eyas.export.load.load_drafter` refuses the checkpoint
            (its message is kept), or ``eyas inspect`` finds errors (each is listed).
    """
    from eyas.export.inspector import inspect_checkpoint
    from eyas.export.load import load_drafter

    d = Path(drafter_dir)
    missing = [f for f in PUSH_FILES if not (d / f).is_file()]
    if missing:
        raise PushError(f"{d}: missing {missing} (an exported drafter has {list(PUSH_FILES)})")
    try:
        load_drafter(d)
    except Exception as e:  # noqa: BLE001 -- ExportError, ValueError, KeyError from a foreign config
        raise PushError(f"{d}: not a drafter eyas would serve: {type(e).__name__}: {e}") from None
    report = inspect_checkpoint(d, target=target)
    errors = report["errors"]
    if errors:
        with_target = "" if target is None else " --target ..."
        raise PushError(f"{d}: `eyas inspect {d}{with_target}` finds errors for serving: " + "; ".join(errors))
    out = []
    for f in PUSH_FILES:
        h = hashlib.sha256()
        with open(d / f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        out.append({"file": f, "bytes": (d / f).stat().st_size, "sha256": h.hexdigest()})
    return {"files": out, "warnings": list(report["warnings"])}


def push(drafter_dir: str | Path, repo_id: str, *, revision: str | None = None, private: bool = True,
         dry_run: bool = False, target: dict | None = None) -> dict:
    """Upload :data:`PUSH_FILES` of ``drafter_dir`` to ``repo_id`` in one commit.

    Args:
        drafter_dir: an exported drafter (``models/scratch``, ``models/finetune``).
        repo_id: ``org/name``; the repository is created (``private``) when it does not exist.
        revision: the branch to commit to (default ``main``).
        dry_run: check and describe, upload nothing.
        target: as :func:`push_plan`.
    Returns:
        ``{"repo", "revision", "files", "warnings", "dry_run"}`` (``files`` and ``warnings`` from
        :func:`push_plan`) plus, after an upload,
        ``"commit"`` (its sha) and ``"url"``.
    Raises:
        PushError: ``repo_id`` is not a valid hub id (``huggingface_hub.utils.validate_repo_id``,
            checked in a dry run too), as :func:`push_plan`, or the hub refused (no token, no permission).
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise PushError(f"--repo {repo_id!r}: {e}") from None
    if "/" not in repo_id:
        raise PushError(f"--repo {repo_id!r}: give the owner too, as org/name (a bare name goes to the token's user)")
    plan = push_plan(drafter_dir, target)
    out = {"repo": repo_id, "revision": revision or "main", **plan, "dry_run": dry_run}
    if dry_run:
        return out
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(folder_path=str(drafter_dir), repo_id=repo_id, revision=revision,
                                 allow_patterns=list(PUSH_FILES), commit_message="eyas push: EAGLE-3 drafter")
    except HfHubHTTPError as e:
        raise PushError(f"push to {repo_id} (revision {revision or 'main'}): {e}") from None
    return {**out, "commit": info.oid, "url": info.commit_url}
