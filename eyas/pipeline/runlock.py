"""One run of a stage at a time in a workspace: an OS file lock per stage and per output.

Two runs of one stage in one workspace (``python -m stages.train_scratch`` by hand beside ``dvc repro``,
or twice by hand) write the same checkpoint directory and the same outputs, and one of them dies
half way (a rename onto a directory the other filled, a file the other removed). DVC's own lock
(``.dvc/tmp/rwlock``) covers only DVC commands, not a stage script run by hand. So every stage takes,
at its start, :func:`hold`: an exclusive ``fcntl.flock`` on ``.eyas/locks/<stage>.lock`` and on one
lock file per output it declares in the pipeline files (``outs``, ``metrics``, ``plots``;
eyas.pipeline.dvcfiles), and writes its pid and command line into the stage's lock file. A second run
finds a lock held and stops before it touches anything, naming the run that holds it (pid, command,
start time). A lock is the kernel's and belongs to the open file: it goes when its process ends,
however it ends (``kill -9`` included), so there is no stale lock to remove by hand.

The locks live under the working directory, where the stage runs: a queued DVC experiment runs in a
copy of the workspace of its own (``.dvc/tmp/exps/...``) and does not contend with the workspace.
Under ``torchrun`` only rank 0 takes them (``$RANK``; the other ranks are that same run).

DVC deletes a stage's outputs before it starts the stage's command (``dvc/stage/__init__.py``,
``Stage.run`` -> ``remove_outs``), before any lock can be checked: a ``dvc repro`` started beside a
run by hand removes that run's finished outputs and then stops at the lock. eyas' stages write their
outputs at the end (their work in progress lives under ``.eyas/``), so the run by hand still
completes them.

Upstream: ``flock(2)`` (Linux man-pages); DVC's ``dvc/rwlock.py`` does the same for DVC commands.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

LOCKS = Path(".eyas/locks")

_held: dict[str, int] = {}  # lock file -> open fd, for the life of this process


class StageBusy(RuntimeError):
    """Another run of the stage (or of a stage writing the same output) holds its lock in this
    workspace: the message names that run's pid and command."""


def _lock_file(kind: str, name: str) -> Path:
    return LOCKS / kind / (re.sub(r"[^A-Za-z0-9_.@-]", "%", name.replace("/", "%2F")) + ".lock")


def _declared_outputs(stage: str) -> list[str]:
    """The outputs ``stage`` declares over the pipeline files in the working directory (none when
    it is not declared there, e.g. a stage run outside the repository)."""
    from eyas.pipeline import dvcfiles

    try:
        body = dvcfiles.stages(".").get(stage) or {}
    except (OSError, ValueError):  # a pipeline file DVC itself would refuse: the stage lock still holds
        return []
    out = []
    for key in ("outs", "metrics", "plots"):
        for entry in body.get(key) or []:
            out += list(entry) if isinstance(entry, dict) else [entry]
    return sorted({os.path.normpath(str(o)) for o in out})


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
        return f"pid {info['pid']} ({info['command']}, running {info['stage']} since {started})"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"


def hold(stage: str) -> list[Path]:
    """Lock ``stage`` (its DVC name, ``eval-accept-len@scratch``) and every output it declares, for the
    life of this process; returns the lock files held. Taking them again in the same process is a
    no-op.

    Raises:
        StageBusy: a lock is held by another process (a run of this stage, or of another stage that
            declares the same output), naming its pid, command and start time and what to do. Nothing
            was written then.
    """
    rank = os.environ.get("RANK")
    if rank is not None and rank.strip() not in ("", "0"):
        return []
    own = _lock_file("stage", stage)
    files = [own] + [_lock_file("out", o) for o in _declared_outputs(stage)]
    taken = []
    for f in files:
        key = str(f.resolve())
        if key in _held:
            continue
        f.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            for g in taken:  # what this run took so far goes back
                os.close(_held.pop(g))  # closing the only descriptor releases its lock
            what = "this stage" if f == own else f"an output of {stage} ({_output_name(f)})"
            raise StageBusy(
                f"{stage}: another run holds {what} in this workspace ({Path.cwd()}): {_holder(f)}. Two runs would "
                f"overwrite each other's checkpoint and outputs, so this one stops here and writes nothing: wait "
                f"for that run to end, or stop it (`kill <pid>`; a killed training stage resumes from its "
                f"checkpoint). Lock file: {f}") from None
        _held[key] = fd
        taken.append(key)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"pid": os.getpid(), "stage": stage, "started": time.time(),
                                   "command": _command()}) + "\n").encode(), 0)
    return files


def _output_name(f: Path) -> str:
    return f.name.removesuffix(".lock").replace("%2F", "/")


def _command() -> str:
    """This process's command line as it was typed (``/proc/self/cmdline``: ``python -m stages.x``),
    else ``sys.argv``; on one line, an argument longer than 100 characters cut short."""
    try:
        argv = [a.decode(errors="replace") for a in Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").split(b"\0")]
    except OSError:
        argv = [sys.executable, *sys.argv]
    argv = [a.replace("\n", "\\n") for a in argv]
    return shlex.join(a if len(a) <= 100 else a[:97] + "..." for a in argv)
