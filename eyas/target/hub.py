"""Hugging Face Hub ids for ``target.path``: a pinned snapshot, safetensors only.

A hub id (``org/name``, not an existing local path) is fetched with ``huggingface_hub.snapshot_download``
at the params' revision (``target.revision``: a commit sha pins it; a branch or tag is resolved to the
commit it points at, which is recorded) into the standard HF cache
(``HF_HOME``/``HF_HUB_CACHE``; ``HF_HUB_OFFLINE=1`` reads the cache only), and the stage reads the
local snapshot directory. Only the files eyas reads are fetched: configs, tokenizer files, chat
templates, the safetensors weights that transformers loads (:func:`weight_files`: the shards
``model.safetensors.index.json`` names, else ``model.safetensors``; never a second copy such as
Mistral's ``consolidated.safetensors`` or gpt-oss' ``original/``), a named GGUF file, and ``*.py``
only with ``trust_remote_code``. Pickled weights (``*.bin``, ``*.pt``, ``*.pth``, ``*.pkl``, ``*.ckpt``) are
never fetched or loaded: a snapshot without safetensors weights is refused, naming the id and the
revision (convert such a checkpoint to safetensors first, e.g. with ``safetensors.torch.save_file``
in a process you trust).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["HubError", "is_hub_id", "snapshot", "weight_files"]

_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_METADATA = ["*.json", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken"]
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HubError(ValueError):
    """A hub id, revision or file cannot be had, or the snapshot holds no safetensors weights."""


def is_hub_id(path: str) -> bool:
    """True for ``org/name`` that is not an existing local path and does not start with ``.`` or
    ``/`` (those are local paths, even when missing). The shape only: :func:`snapshot` validates the
    id with huggingface_hub's own rules (``validate_repo_id``)."""
    return bool(_ID.match(path)) and not Path(path).exists()


def weight_files(repo_files, index: dict | None) -> list[str]:
    """The safetensors files of a repository that transformers loads, and no others.

    transformers' ``from_pretrained`` loads ``model.safetensors`` when the repository has one,
    else the shards that ``model.safetensors.index.json``'s ``weight_map`` names
    (``huggingface/transformers: src/transformers/modeling_utils.py``,
    ``_get_resolved_checkpoint_files``). Any other ``*.safetensors`` is a second copy of the weights
    in another layout (Mistral's ``consolidated.safetensors``, gpt-oss' ``original/``) that a
    ``*.safetensors`` glob would fetch for nothing.

    Args:
        repo_files: every file path of the repository at the revision (``/``-separated).
        index: the parsed ``model.safetensors.index.json``, or None when the repository has none.
    Returns:
        the file paths to fetch, sorted, without duplicates.
    Raises:
        HubError: the index has no ``weight_map`` or names a file the repository lacks; neither
            ``model.safetensors`` nor an index (the message lists the weights there are: pickled,
            or safetensors in another layout).
    """
    files = set(repo_files)
    if SINGLE in files:
        return [SINGLE]
    if index is not None:
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise HubError(f"{INDEX}: no 'weight_map' (a non-empty tensor-name -> file map)")
        names = sorted(set(map(str, weight_map.values())))
        missing = [n for n in names if n not in files]
        if missing:
            raise HubError(f"{INDEX}: its weight_map names {missing}, which are not among the repository's files")
        return names
    others = sorted(f for f in files if f.endswith(".safetensors"))
    pickled = sorted(f for f in files if f.endswith(PICKLE_SUFFIXES))
    raise HubError(f"neither {SINGLE} nor {INDEX}: eyas loads safetensors weights in transformers' layout only"
                   + (f"; other safetensors here, which transformers does not load: {others}" if others else "")
                   + (f"; pickled {'/'.join(PICKLE_SUFFIXES)} checkpoints are refused, convert them first: "
                      f"{pickled}" if pickled else ""))


def _repo_files(repo_id: str, sha: str, d: Path) -> tuple[list[str], str]:
    """(every file of the repository at commit ``sha``, where that list comes from): the hub's
    listing, or offline (``HF_HUB_OFFLINE``) the files of the cached snapshot ``d``."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return [p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()], "the local HF cache (offline)"
    return HfApi().list_repo_files(repo_id, revision=sha), "the hub"


def snapshot(repo_id: str, revision: str | None, *, param: str, gguf_file: str | None = None,
             trust_remote_code: bool = False) -> tuple[Path, str]:
    """The local snapshot of a hub model at ``revision``, fetched as needed.

    Args:
        repo_id: ``org/name``.
        revision: a commit sha (pins it), a branch or tag, or None (``main``).
        param: the params key that named it (``target.path``), for messages.
        gguf_file: fetch this GGUF file instead of safetensors weights.
        trust_remote_code: also fetch the repository's ``*.py`` (custom model code).
    Returns:
        ``(directory, commit sha)``: the snapshot directory in the HF cache
        (``models--org--name/snapshots/<sha>``) and the commit it holds.
    Raises:
        HubError: the id is not a valid hub id (huggingface_hub ``validate_repo_id``: e.g. ``.git``
            suffix, ``--`` or ``..``), the id or revision does not exist (or is not in the cache offline), a file is
            missing (``config.json``; the GGUF file; the weights :func:`weight_files` selects), or the
            snapshot's weights are pickled only; each message names the id and the revision.
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
    patterns = _METADATA + ([gguf_file] if gguf_file else [])
    if trust_remote_code:
        patterns.append("*.py")
    try:
        d = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
        sha = d.name
        if not (d / "config.json").is_file():
            raise HubError(f"{at} (commit {sha}): config.json is missing")
        if gguf_file:
            if not (d / gguf_file).is_file():
                raise HubError(f"{at} (commit {sha}): {gguf_file} is missing")
            return d, sha
        files, listed_by = _repo_files(repo_id, sha, d)
        try:
            explicit = json.loads((d / "config.json").read_text()).get("transformers_weights")
            if explicit:  # transformers then loads that file instead (modeling_utils.py, as below)
                raise HubError(f"config.json's transformers_weights {explicit!r} names the weights file; "
                               f"eyas fetches {SINGLE} or the shards of {INDEX} only")
            names = weight_files(files, json.loads((d / INDEX).read_text()) if INDEX in files else None)
        except (HubError, json.JSONDecodeError) as e:
            raise HubError(f"{at} (commit {sha}), files as listed by {listed_by}: {e}") from None
        snapshot_download(repo_id, revision=sha, allow_patterns=names)
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
    missing = [n for n in names if not (d / n).is_file()]
    if missing:
        raise HubError(f"{at} (commit {sha}): the weights {missing} did not arrive in the snapshot")
    return d, sha
