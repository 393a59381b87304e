"""Finished parts of a long stage, kept so that a killed run, rerun, recomputes only the others.

``eval-accept-len`` runs a few long parts in turn (per benchmark the chain evaluation, then the
decoding-modes table); a device call that is killed after some of them would otherwise lose them all,
because the stage writes its metrics only at the end. :class:`Parts` records each part's result
as soon as it finishes.

The design of the self-distill journal (:class:`eyas.data.distill.Journal`) and of the feature
writer's ``progress.json`` (:class:`eyas.features.ShardWriter`): a work file under ``.eyas/work/``
(git-ignored and outside every DVC out, which DVC deletes before a stage runs), a ``resume_key``
of everything the results depend on, results kept only under an equal key, the file deleted
once the stage's own output is written. The parts are few and each a whole metrics dict, so the
file is one JSON object rewritten atomically per part (:func:`eyas.io.write_json`) rather than
an append-only journal: a kill leaves either the previous file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from eyas.io import read_json, write_json
from eyas.pipeline.stage_deps import closure


class Parts:
    """The finished parts of one stage run, by name, in a JSON work file.

    The file is ``{"resume_key": {...}, "parts": {name: result}}`` (:func:`eyas.io.write_json`:
    sorted keys, NaN and inf stored as null). Opening it keeps the parts of a file with an equal
    resume key and starts afresh otherwise (no file, another key, or a file that is not valid JSON
    or not of this shape, e.g. torn by a full disk); either way the file is written at once, so a
    file made under another key is replaced before any new part is added, and results made under
    two keys are never mixed. :attr:`discarded` says why an existing file was not resumed.

    Results are JSON values (units are the caller's: the file stores them as given). :meth:`get`
    and :meth:`add` return them as stored, i.e. as a rerun will read them (tuples become lists,
    dict keys strings, non-finite floats None), as copies, so a caller that edits a result
    cannot change what is stored.
    """

    def __init__(self, path: str | Path, resume_key: dict):
        """Open (or start) the work file ``path`` for ``resume_key``.

        Args:
            path: the work file; its directory is created when missing.
            resume_key: everything the parts' results depend on, JSON-serialisable (compared
                after a JSON round trip, as it is stored).
        Raises:
            OSError: the file cannot be written, or ``path`` is a directory (named; nothing removed).
            TypeError: ``resume_key`` is not JSON-serialisable.
        """
        self.path = Path(path)
        if self.path.is_dir():
            raise IsADirectoryError(f"{self.path}: a directory where the work file of finished parts goes; "
                                    f"remove it and rerun")
        self.resume_key = json.loads(json.dumps(resume_key))
        self.discarded: str | None = None  # why an existing file was not resumed (None: resumed or none)
        self.dropped: list[str] = []  # parts :meth:`get` found malformed and dropped, with why
        self._done: dict[str, Any] = {}
        if self.path.exists():
            self._done, self.discarded = self._read()
        self._write(self._done)

    def _read(self) -> tuple[dict[str, Any], str | None]:
        try:
            rec = read_json(self.path)
        except (OSError, ValueError) as e:  # ValueError: not JSON (torn, truncated), not UTF-8, not an object
            return {}, f"{self.path}: unreadable ({e}): starting fresh"
        if "resume_key" not in rec or not isinstance(rec.get("parts"), dict):
            return {}, f"{self.path}: not a parts file (no resume_key and parts): starting fresh"
        if rec["resume_key"] != self.resume_key:
            old = rec["resume_key"]
            changed = ", ".join(_changed(old, self.resume_key)[:8]) if isinstance(old, dict) else "resume_key"
            return {}, (f"{self.path}: made under another resume key ({changed} changed): "
                        f"starting fresh, its {len(rec['parts'])} part(s) discarded")
        return rec["parts"], None

    def _write(self, done: dict[str, Any]) -> None:
        write_json(self.path, {"resume_key": self.resume_key, "parts": done})

    @property
    def names(self) -> list[str]:
        """The names of the parts finished so far, in the order the file lists them (sorted)."""
        return list(self._done)

    def get(self, name: str, valid: Callable[[Any], bool] | None = None) -> Any | None:
        """A copy of the stored result of part ``name``, or None when it is not finished. With
        ``valid``, a stored result it rejects (a file edited or written by other code under the
        same key) is dropped from the file, :attr:`dropped` says so, and None is returned: the
        caller recomputes the part."""
        if name in self._done and valid is not None and not valid(self._done[name]):
            self.dropped.append(f"{self.path}: part {name!r} is not a result of this stage: recomputing it")
            self._done = {k: v for k, v in self._done.items() if k != name}
            self._write(self._done)
        return copy.deepcopy(self._done.get(name))

    def add(self, name: str, result: Any) -> Any:
        """Store ``result`` as part ``name`` (the whole file rewritten atomically and fsync'd)
        and return it as stored (see the class docstring); use that, not ``result``, so that a
        resumed run and an uninterrupted one carry on with the same values.

        Raises:
            TypeError: ``result`` is not JSON-serialisable (the file is left as it was).
            OSError: the file cannot be written (the file is left as it was).
        """
        self._write({**self._done, name: result})
        self._done = read_json(self.path)["parts"]
        return copy.deepcopy(self._done[name])

    def remove(self) -> None:
        """Delete the work file (the stage's output is written), and its directory when empty."""
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()


def code_digest(module: str) -> str:
    """sha256 (hex) of every first-party file that running ``module`` (e.g.
    ``"stages.eval_accept_len"``) can import: the code deps dvc.yaml lists for its stage
    (:func:`eyas.pipeline.stage_deps.closure`), names and bytes, so a resume key holding it changes with
    any edit of that code."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for f in closure(root, [module]):
        h.update(f.encode() + b"\0" + (root / f).read_bytes() + b"\0")
    return h.hexdigest()


def _changed(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The dotted keys at which two resume keys (dicts) differ, nested dicts walked into."""
    out: list[str] = []
    for k in sorted(set(old) | set(new), key=str):
        a, b = old.get(k, _MISSING), new.get(k, _MISSING)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


_MISSING = object()
