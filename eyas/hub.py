"""Hugging Face Hub ids for ``target.path`` and ``remap.source``: a pinned snapshot, safetensors only.

A hub id (``org/name``, not an existing local path) is fetched with ``huggingface_hub.snapshot_download``
at the params' revision (``target.revision``, ``remap.revision``: a commit sha pins it; a branch or
tag is resolved to the commit it points at, which is recorded) into the standard HF cache
(``HF_HOME``/``HF_HUB_CACHE``; ``HF_HUB_OFFLINE=1`` reads the cache only), and the stage reads the
local snapshot directory. Only the files eyas reads are fetched: configs, tokenizer files, chat
templates, ``*.safetensors`` (and the index), a named GGUF file, and ``*.py`` only with
``trust_remote_code``. Pickled weights (``*.bin``, ``*.pt``, ``*.pth``, ``*.pkl``, ``*.ckpt``) are
never fetched or loaded: a snapshot without safetensors weights is refused, naming the id and the
revision (convert such a checkpoint to safetensors first, e.g. with ``safetensors.torch.save_file``
in a process you trust).
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["HubError", "is_hub_id", "snapshot"]

_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_METADATA = ["*.json", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken"]


class HubError(ValueError):
    """A hub id, revision or file cannot be had, or the snapshot holds no safetensors weights."""


def is_hub_id(path: str) -> bool:
    """True for ``org/name`` that is not an existing local path and does not start with ``.`` or
    ``/`` (those are local paths, even when missing). The shape only: :func:`snapshot` validates the
    id with huggingface_hub's own rules (``validate_repo_id``)."""
    return bool(_ID.match(path)) and not Path(path).exists()


def snapshot(repo_id: str, revision: str | None, *, param: str, gguf_file: str | None = None,
             trust_remote_code: bool = False) -> tuple[Path, str]:
    """The local snapshot of a hub model at ``revision``, fetched as needed.

    Args:
        repo_id: ``org/name``.
        revision: a commit sha (pins it), a branch or tag, or None (``main``).
        param: the params key that named it (``target.path``, ``remap.source``), for messages.
        gguf_file: fetch this GGUF file instead of safetensors weights.
        trust_remote_code: also fetch the repository's ``*.py`` (custom model code).
    Returns:
        ``(directory, commit sha)``: the snapshot directory in the HF cache
        (``models--org--name/snapshots/<sha>``) and the commit it holds.
    Raises:
        HubError: the id is not a valid hub id (huggingface_hub ``validate_repo_id``: e.g. ``.git``
            suffix, ``--`` or ``..``), the id or revision does not exist (or is not in the cache offline), a file is
            missing (``config.json``; the GGUF file; safetensors weights), or the snapshot's
            weights are pickled only; each message names the id and the revision.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    at = f"{param} {repo_id!r} at revision {revision or 'main'!r}"
    local = f"no local directory {repo_id!r}"  # an org/name-shaped path may be a mistyped local one
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubError(f"{param} {repo_id!r}: {local}, and not a valid hub id: {e}") from None
    patterns = _METADATA + ([gguf_file] if gguf_file else ["*.safetensors", "*.safetensors.index.json"])
    if trust_remote_code:
        patterns.append("*.py")
    try:
        d = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except RevisionNotFoundError:
        raise HubError(f"{at}: no such revision on the hub") from None
    except RepositoryNotFoundError:
        raise HubError(f"{at}: {local} and no hub repo {repo_id!r} (or it is private/gated and no token "
                       f"is set)") from None
    except (LocalEntryNotFoundError, EntryNotFoundError) as e:
        raise HubError(f"{at}: {local}, and the hub repo is not in the local HF cache and the hub cannot be "
                       f"reached (HF_HUB_OFFLINE?): {type(e).__name__}") from None
    except HfHubHTTPError as e:
        raise HubError(f"{at}: the hub refused the request ({e})") from None
    sha = d.name
    if not (d / "config.json").is_file():
        raise HubError(f"{at} (commit {sha}): config.json is missing")
    if gguf_file:
        if not (d / gguf_file).is_file():
            raise HubError(f"{at} (commit {sha}): {gguf_file} is missing")
    elif not any(d.glob("*.safetensors")):
        raise HubError(f"{at} (commit {sha}): no *.safetensors weights; eyas loads safetensors only "
                       f"(pickled {'/'.join(PICKLE_SUFFIXES)} checkpoints are refused: convert them first)")
    return d, sha
