"""A team's DVC remote: checked before ``dvc push --run-cache`` / ``dvc pull --run-cache``.

A shared remote lets a second clone (another machine, another path) reuse what one clone computed:
``dvc push --run-cache`` there, ``dvc pull --run-cache`` here, and ``dvc repro`` runs nothing
(docs/team.md). Two kinds are documented and tested (tests/test_team_remote.py):

- a shared directory (``/mnt/team/eyas-dvc``: what NFS or Lustre gives a cluster), DVC's ``local``
  remote;
- SSH (``ssh://host[:port]/path``), through DVC's ``dvc-ssh`` plugin (asyncssh).

What DVC itself does on a bad remote, and what this module says instead (:func:`check_remote`):

- no remote configured: ``dvc push`` fails with "no remote specified"; the message here gives the
  ``dvc remote add`` line;
- a shared directory that is not there: ``dvc push`` CREATES it, so an unmounted NFS path silently
  fills the local disk; refused here, naming the path and the mount;
- an unreachable SSH server or a refused login: asyncssh's error, here with the URL, the port and
  ``dvc remote modify --local`` for the key;
- a remote without the run-cache (no ``runs/`` beside ``files/``: pushed with plain ``dvc push``):
  ``dvc pull --run-cache`` succeeds and then experiments recompute what the team computed; refused
  here before the pull, saying to push with ``--run-cache``.

Nothing here writes to the remote or the local cache; a refused push or pull leaves ``.dvc/cache``
and the workspace as they were (DVC transfers object by object, so a push cut off half way is
finished by the next one).

Run: ``python3 -m eyas.pipeline.team_remote check [-r NAME] [--run-cache]``, ``... push [-r NAME]``,
``... pull [-r NAME]`` (the check, then ``dvc push|pull --run-cache``). Exit status 2 on a refused
check, DVC's own on a failed transfer, else 0. Upstream: ``dvc/repo/push.py``, ``dvc/stage/cache.py``
(``runs/`` is the remote's run-cache), ``dvc_ssh/__init__.py`` (dvc 3.67.1, dvc-ssh 4.3.0).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from eyas.pipeline.team_tracking import safe_uri

RUN_CACHE_DIR = "runs"  # where `dvc push --run-cache` puts the run-cache, beside `files/` (dvc/stage/cache.py)


class RemoteError(RuntimeError):
    """A remote that cannot be used: the message names it (URL) and says what to do."""


def _repo(root: str | os.PathLike):
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo

    try:
        return Repo(str(root))
    except NotDvcRepoError:
        raise RemoteError(
            f"{Path(root).resolve()}: not a DVC repository (no .dvc/ here or above it): run this in the "
            f"clone's root or name it with -C DIR; `dvc init` makes one") from None


def remote_config(root: str | os.PathLike = ".", name: str | None = None) -> tuple[str, str]:
    """(name, url) of remote ``name``, or of the default remote (``core.remote``).

    Raises:
        RemoteError: no default remote and no ``name``, or no remote of that name.
    """
    repo = _repo(root)
    try:
        conf = repo.config
        remotes = conf.get("remote", {})
        name = name or conf.get("core", {}).get("remote")
        if not name:
            raise RemoteError(
                f"{Path(root).resolve()}: no DVC remote configured. Add the team's: "
                "`dvc remote add -d team /mnt/team/eyas-dvc` (a shared directory) or "
                "`dvc remote add -d team ssh://host/srv/eyas-dvc`, commit .dvc/config (docs/team.md)")
        if name not in remotes:
            raise RemoteError(f"no DVC remote named {name!r} (configured: {sorted(remotes) or 'none'}): "
                              f"`dvc remote list` shows them")
        return name, remotes[name]["url"]
    finally:
        repo.close()


def check_remote(root: str | os.PathLike = ".", name: str | None = None, run_cache: bool = False,
                 write: bool = False) -> dict:
    """Check that remote ``name`` (default: the default remote) can be reached, with ``write``
    that a shared directory can be written (a push), and, with ``run_cache``, that it holds a
    run-cache.

    Returns ``{"name", "url", "run_cache": bool, "writable"}`` (whether ``<remote>/runs`` exists;
    whether a shared directory can be written, None for SSH).

    Raises:
        RemoteError: not a DVC repository; no such remote; a URL that does not parse (a port out of
            range); a shared directory that does not exist (not mounted?), is a file, or (``write``)
            is read-only; an SSH server that refuses or does not answer, or a refused login; with
            ``run_cache``, a remote without ``runs/``. Each message names the URL (password
            masked) and what to do.
    """
    name, url = remote_config(root, name)
    shown = safe_uri(url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port out of range or not a number
    except ValueError as e:
        raise RemoteError(f"DVC remote {name!r} ({shown}): the URL does not parse ({e}): fix it, e.g. "
                          f"`dvc remote modify {name} url ssh://host:22/srv/eyas-dvc` (a port is 1-65535)") from None
    scheme = parts.scheme
    repo = _repo(root)
    try:
        if scheme in ("", "file") and not Path(urlsplit(url).path if scheme else url).expanduser().is_absolute():
            base = (Path(root) / ".dvc").resolve()  # DVC resolves a relative local remote against .dvc/
            local = base / url
        elif scheme in ("", "file"):
            local = Path(urlsplit(url).path if scheme else url).expanduser()
        else:
            local = None
        if local is not None:
            if local.exists() and not local.is_dir():
                raise RemoteError(
                    f"DVC remote {name!r} ({shown}) is a file, not a directory: point the remote at the team's "
                    f"directory on the shared storage: `dvc remote modify {name} url /mnt/...`")
            if not local.is_dir():
                raise RemoteError(
                    f"DVC remote {name!r} ({shown}) does not exist on this machine: is the shared filesystem "
                    f"mounted here (`findmnt {local.parent}`)? DVC would create the directory on the local disk "
                    f"and the team would not see it. Create it once on the shared storage (`mkdir -p {local}`) "
                    f"or fix the path: `dvc remote modify {name} url /mnt/...`")
            if not os.access(local, os.R_OK | os.X_OK):
                raise RemoteError(f"DVC remote {name!r} ({shown}) cannot be read by this user ({os.getuid()}): "
                                  f"give the team's group read access (`chmod -R g+rX {local}`)")
            if write and not os.access(local, os.W_OK | os.X_OK):
                raise RemoteError(
                    f"DVC remote {name!r} ({shown}) is read-only here (a read-only mount, or no write permission "
                    f"for this user): a push would fail half way. Mount it read-write (`findmnt {local}`) or "
                    f"give the team's group write access (`chmod -R g+w {local}`); a pull needs read access only")
            has_runs = (local / RUN_CACHE_DIR).is_dir()
            writable = os.access(local, os.W_OK | os.X_OK)
        else:
            remote = repo.cloud.get_remote(name)
            fs = remote.fs
            try:
                fs.exists(remote.path)
                has_runs = fs.exists(fs.join(remote.path, RUN_CACHE_DIR))
                writable = None  # not probed over SSH: the push itself says
            except Exception as e:  # noqa: BLE001 - asyncssh/OSError/timeout: all mean "cannot reach"
                raise RemoteError(_unreachable(name, shown, e)) from e
        if run_cache and not has_runs:
            raise RemoteError(
                f"DVC remote {name!r} ({shown}) has no run-cache ({RUN_CACHE_DIR}/ is missing): it was pushed "
                f"without --run-cache, so a pull would bring the data but no record of the runs. In the clone "
                f"that ran the pipeline: `dvc push --run-cache -r {name}`; then pull again")
        return {"name": name, "url": shown, "run_cache": has_runs, "writable": writable}
    finally:
        repo.close()


def _unreachable(name: str, shown: str, e: Exception) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    low = text.lower()
    if "permission denied" in low or "auth" in low:
        what = (f"the SSH server refused the login. Give DVC the key (kept out of git): "
                f"`dvc remote modify --local {name} keyfile ~/.ssh/id_ed25519` and the user: "
                f"`dvc remote modify --local {name} user $USER`")
    else:
        what = (f"check that sshd runs there and listens on that port (`ssh -p PORT host true`), that the host "
                f"name resolves from this machine, and the URL: `dvc remote modify {name} url ssh://host:port/path`")
    return f"DVC remote {name!r} ({shown}) is unreachable ({text}): {what}. The local cache is untouched."


def transfer(op: str, root: str | os.PathLike = ".", name: str | None = None) -> int:
    """``dvc <op> --run-cache [-r name]`` after :func:`check_remote` (``op``: push or pull; a pull
    also needs the remote's run-cache). Returns DVC's exit status.

    Raises:
        RemoteError: the check failed (nothing was transferred).
    """
    if op not in ("push", "pull"):
        raise ValueError(f"op must be push or pull, not {op!r}")
    info = check_remote(root, name, run_cache=(op == "pull"), write=(op == "push"))
    cmd = ["dvc", op, "--run-cache", "-r", info["name"]]
    r = subprocess.run(cmd, cwd=root)
    if r.returncode != 0:
        sys.stderr.write(f"eyas.pipeline.team_remote: `{' '.join(cmd)}` exited {r.returncode} against {info['url']}; "
                         "the local cache (.dvc/cache) and the workspace are as they were: rerun it once the "
                         "remote answers\n")
    return r.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m eyas.pipeline.team_remote", description=__doc__.split("\n\n")[0])
    ap.add_argument("op", choices=("check", "push", "pull"))
    ap.add_argument("-r", "--remote", default=None, help="remote name (default: the default remote)")
    ap.add_argument("--run-cache", action="store_true", help="check: also require the remote's run-cache")
    ap.add_argument("-C", "--root", default=".", help="the DVC repository (default: cwd)")
    a = ap.parse_args(argv)
    try:
        if a.op == "check":
            info = check_remote(a.root, a.remote, run_cache=a.run_cache)
            print(f"DVC remote {info['name']!r} ({info['url']}): reachable"
                  f"{', read-only here (a push is refused)' if info['writable'] is False else ''}, run-cache "
                  f"{'present' if info['run_cache'] else 'absent'}")
            return 0
        return transfer(a.op, a.root, a.remote)
    except RemoteError as e:
        sys.stderr.write(f"eyas.pipeline.team_remote: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
