"""A team's DVC remote: checked before ``dvc push --run-cache`` / ``dvc pull --run-cache``.

A shared remote lets a second clone (another machine, another path) reuse what one clone computed:
``dvc push --run-cache`` there, ``dvc pull --run-cache`` here, and ``dvc repro`` runs nothing
(docs/team.md). Two kinds are documented and tested (tests/pipeline/test_team_remote.py):

- a shared directory (``/mnt/team/eyas-dvc``: what NFS or Lustre gives a cluster), DVC's ``local``
  remote;
- SSH (``ssh://host[:port]/path``), through DVC's ``dvc-ssh`` plugin (asyncssh).

What DVC itself does on a bad remote, and what this module says instead (:func:`check_remote`):

- no remote configured: ``dvc push`` fails with "no remote specified"; the message here gives the
  ``dvc remote add`` line;
- a shared directory that is not there: ``dvc push`` CREATES it, so an unmounted NFS path silently
  fills the local disk; refused here, naming the path and the mount;
- an unreachable SSH server or a refused login: asyncssh's error, here with the URL, the port and
  ``dvc remote modify --local`` for the key; a refused HTTP connection, which DVC's ``exists`` reads
  as a missing file: here "unreachable";
- a path that does not exist on a server that answers: ``dvc push`` creates it there (a typo in
  the path starts a remote the team does not use) and ``dvc pull`` finds nothing; refused here,
  with the ``ssh ... mkdir -p`` line; an SSH path that is a file likewise;
- a URL DVC's config refuses (a scheme it does not know, an unclosed IPv6 bracket), a config file
  that does not parse, or a scheme whose plugin is absent (``s3://`` without ``dvc-s3``): DVC's
  ConfigError or ImportError traceback; here the config file, the remote and its URL;
- a remote without the run-cache (no ``runs/`` beside ``files/``: pushed with plain ``dvc push``):
  ``dvc pull --run-cache`` succeeds and then experiments recompute what the team computed; refused
  here before the pull, saying to push with ``--run-cache``.

Every refusal names the config file that sets the remote's URL (``.dvc/config``,
``.dvc/config.local``, or the user's or system's by path). Nothing here writes to the remote or the
local cache; a refused push or pull leaves ``.dvc/cache`` and the workspace as they were. A transfer
that ran, finished or failed half way, says what it changed here (:func:`snapshot` before and after:
the files added to the local cache, objects and run-cache records apart, and the workspace files DVC
wrote or removed, by name); DVC transfers object by object, so a transfer cut off half way keeps
what arrived and the next one fetches only the rest.

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

from eyas.urls import safe_uri

RUN_CACHE_DIR = "runs"  # where `dvc push --run-cache` puts the run-cache, beside `files/` (dvc/stage/cache.py)


class RemoteError(RuntimeError):
    """A remote that cannot be used: the message names it (URL) and says what to do."""


def _repo(root: str | os.PathLike):
    from dvc.config import ConfigError
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo

    try:
        return Repo(str(root))
    except NotDvcRepoError:
        raise RemoteError(
            f"{Path(root).resolve()}: not a DVC repository (no .dvc/ here or above it): run this in the "
            f"clone's root or name it with -C DIR; `dvc init` makes one") from None
    except ConfigError as e:
        raise RemoteError(_config_error(root, e)) from None


def _config_files(root: str | os.PathLike) -> list[tuple[str, Path]]:
    """DVC's config files for the repository at ``root``, as (shown name, path), the one whose
    settings win first: ``.dvc/config.local``, ``.dvc/config``, the user's, the system's."""
    from dvc.config import Config
    from dvc.repo import Repo

    top = Path(Repo.find_root(str(root)))
    dvc_dir = top / Repo.DVC_DIR
    files = [dvc_dir / Config.CONFIG_LOCAL, dvc_dir / Config.CONFIG,
             *(Path(Config.get_dir(level)) / Config.CONFIG for level in ("global", "system"))]
    return [(str(f.relative_to(top)) if f.is_relative_to(top) else str(f), f) for f in files]


def _config_error(root: str | os.PathLike, e: Exception) -> str:
    """DVC's ConfigError ``e`` as a message naming the config file at fault and, where the fault is a
    remote's setting, the remote and its URL (password masked) and why the URL is refused."""
    from dvc.config import Config, ConfigError, get_compiled_schema
    from voluptuous import Invalid

    for shown, path in _config_files(root):
        try:
            raw = Config.load_file(str(path))
        except FileNotFoundError:
            continue
        except ConfigError as bad:
            return f"{shown}: not a valid DVC config file ({bad}): fix or remove it (`dvc config --list` reads it)"
        try:
            get_compiled_schema()(raw)
        except Invalid as bad:
            where = [str(k) for k in bad.path]
            if len(where) >= 2 and where[0] == "remote":
                name = where[1]
                url = str((raw["remote"].get(name) or {}).get("url", ""))
                try:
                    urlsplit(url).port  # noqa: B018 - says why a URL does not parse (an unclosed IPv6 bracket)
                    why = bad.msg
                except ValueError as parse:
                    why = f"the URL does not parse: {parse}"
                return (f"{shown}: DVC remote {name!r} ({safe_uri(url)}) is refused by DVC ({why}): fix it with "
                        f"`dvc remote modify{' --local' if path.name == Config.CONFIG_LOCAL else ''} {name} url "
                        f"URL` (a shared directory, or ssh://host:port/path)")
            return f"{shown}: DVC refuses the setting {'.'.join(where) or 'at the top level'} ({bad.msg}): fix it"
    return f"{Path(root).resolve()}: DVC cannot load its config ({e}): `dvc config --list` shows it"


def remote_config(root: str | os.PathLike = ".", name: str | None = None) -> tuple[str, str, str | None]:
    """(name, url, config file) of remote ``name``, or of the default remote (``core.remote``); the
    config file is the one whose ``url`` wins (``.dvc/config.local``, ``.dvc/config``, or the user's
    or the system's by path).

    Raises:
        RemoteError: a config file DVC cannot load (named), no default remote and no ``name``, or
            no remote of that name.
    """
    from dvc.config import Config

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
        source = next((shown for shown, path in _config_files(root) if path.is_file()
                       and "url" in (Config.load_file(str(path)).get("remote", {}).get(name) or {})), None)
        return name, remotes[name]["url"], source
    finally:
        repo.close()


def check_remote(root: str | os.PathLike = ".", name: str | None = None, run_cache: bool = False,
                 write: bool = False) -> dict:
    """Check that remote ``name`` (default: the default remote) can be reached and that its
    directory is there, with ``write`` that a shared directory can be written (a push), and, with
    ``run_cache``, that it holds a run-cache.

    Returns ``{"name", "url", "source", "run_cache": bool, "writable"}`` (``source``: the config file
    that sets the URL; whether ``<remote>/runs`` exists; whether a shared directory can be written,
    None for the other kinds).

    Raises:
        RemoteError: not a DVC repository; a config file DVC refuses (an unsupported scheme, a URL
            that does not parse); no such remote; a port out of range; a scheme whose DVC plugin is
            not installed (``s3://`` without ``dvc-s3``); a shared directory that does not exist (not
            mounted?), is a file, or (``write``) is read-only; a server that refuses or does not
            answer, or a refused login; a path that does not exist on a server that answers, or
            (SSH) is a file; with ``run_cache``, a remote without ``runs/``. Each message names the
            config file, the remote, its URL (password masked) and what to do.
    """
    name, url, source = remote_config(root, name)
    shown = safe_uri(url)
    who = f"{source + ': ' if source else ''}DVC remote {name!r} ({shown})"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port out of range or not a number
    except ValueError as e:
        raise RemoteError(f"{who}: the URL does not parse ({e}): fix it, e.g. "
                          f"`dvc remote modify {name} url ssh://host:22/srv/eyas-dvc` (a port is 1-65535)") from None
    scheme = parts.scheme
    repo = _repo(root)
    try:
        local = _local_dir(root, url, parts)
        if local is not None:
            has_runs, writable = _check_local(who, name, local, write)
        else:
            has_runs = _check_server(who, name, scheme, parts, repo)
            writable = None  # not probed on a server: the push itself says
        if run_cache and not has_runs:
            raise RemoteError(
                f"{who} has no run-cache ({RUN_CACHE_DIR}/ is missing): it was pushed "
                f"without --run-cache, so a pull would bring the data but no record of the runs. In the clone "
                f"that ran the pipeline: `dvc push --run-cache -r {name}`; then pull again")
        return {"name": name, "url": shown, "source": source, "run_cache": has_runs, "writable": writable}
    finally:
        repo.close()


def _local_dir(root: str | os.PathLike, url: str, parts) -> Path | None:
    """The directory a shared-directory remote (no scheme, or ``file://``) points at, a relative one
    resolved against ``<root>/.dvc`` as DVC resolves it; None for a server (any other scheme)."""
    scheme = parts.scheme
    if scheme in ("", "file") and not Path(parts.path if scheme else url).expanduser().is_absolute():
        base = (Path(root) / ".dvc").resolve()  # DVC resolves a relative local remote against .dvc/
        return base / url
    if scheme in ("", "file"):
        return Path(parts.path if scheme else url).expanduser()
    return None


def _check_local(who: str, name: str, local: Path, write: bool) -> tuple[bool, bool]:
    """A shared-directory remote checked on this machine: ``(has a run-cache, writable)``.

    Raises:
        RemoteError: ``local`` is a file, does not exist (not mounted?), cannot be read by this user, or
            (``write``) is read-only; each names the remote (``who``) and what to do.
    """
    if local.exists() and not local.is_dir():
        raise RemoteError(
            f"{who} is a file, not a directory: point the remote at the team's "
            f"directory on the shared storage: `dvc remote modify {name} url /mnt/...`")
    if not local.is_dir():
        raise RemoteError(
            f"{who} does not exist on this machine: is the shared filesystem "
            f"mounted here (`findmnt {local.parent}`)? DVC would create the directory on the local disk "
            f"and the team would not see it. Create it once on the shared storage (`mkdir -p {local}`) "
            f"or fix the path: `dvc remote modify {name} url /mnt/...`")
    if not os.access(local, os.R_OK | os.X_OK):
        raise RemoteError(f"{who} cannot be read by this user ({os.getuid()}): "
                          f"give the team's group read access (`chmod -R g+rX {local}`)")
    if write and not os.access(local, os.W_OK | os.X_OK):
        raise RemoteError(
            f"{who} is read-only here (a read-only mount, or no write permission "
            f"for this user): a push would fail half way. Mount it read-write (`findmnt {local}`) or "
            f"give the team's group write access (`chmod -R g+w {local}`); a pull needs read access only")
    return (local / RUN_CACHE_DIR).is_dir(), os.access(local, os.W_OK | os.X_OK)


def _check_server(who: str, name: str, scheme: str, parts, repo) -> bool:
    """A server remote (SSH, S3, ...) through DVC's own client for it (``repo.cloud.get_remote``):
    whether it holds a run-cache (:func:`_probe`).

    Raises:
        RemoteError: the scheme's DVC plugin is not installed, DVC refuses the remote's settings, or
            :func:`_probe`'s refusals; each names the remote (``who``) and what to do.
    """
    try:
        remote = repo.cloud.get_remote(name)
    except ImportError as e:  # DVC's "s3 is supported, but requires 'dvc-s3' to be installed"
        raise RemoteError(f"{who} cannot be used here ({e}): `pip install dvc-{scheme}`, or use a shared "
                          f"directory or SSH (docs/team.md)") from None
    except Exception as e:  # noqa: BLE001 - DVC's own refusal of the remote's settings, whatever its type
        raise RemoteError(f"{who} cannot be used here ({type(e).__name__}: {e}): fix its settings "
                          f"(`dvc remote modify {name} ...`)") from None
    return _probe(who, name, scheme, parts, remote)


def _probe(who: str, name: str, scheme: str, parts, remote) -> bool:
    """Whether the remote's ``runs/`` exists, after checking that its server answers and that its path
    is there (for SSH: a directory).

    Raises:
        RemoteError: the server does not answer or refuses the login; the path does not exist; an
            SSH path that is a file.
    """
    fs, path = remote.fs, remote.path
    try:
        try:
            kind = fs.info(path).get("type")
        except FileNotFoundError as e:
            # fsspec's HTTP reports a refused connection as a missing file, the OSError as its cause
            if isinstance(e.__cause__, OSError) and not isinstance(e.__cause__, FileNotFoundError):
                raise e.__cause__ from None
            kind = None
        has_runs = kind is not None and fs.exists(fs.join(path, RUN_CACHE_DIR))
    except Exception as e:  # noqa: BLE001 - asyncssh/OSError/timeout: all mean "cannot reach"
        raise RemoteError(_unreachable(who, name, scheme, e)) from e
    if kind is None:
        make = (f"`ssh{f' -p {parts.port}' if parts.port else ''} {parts.hostname} mkdir -p {path}`"
                if scheme == "ssh" else "on that server")
        raise RemoteError(
            f"{who}: {path} does not exist there (the server answers): a pull would find nothing, and a push "
            f"would start a new remote the team does not use. Fix the path (`dvc remote modify {name} url ...`) "
            f"or create it once {make}")
    if kind == "file" and scheme == "ssh":  # HTTP reports every URL as a file
        raise RemoteError(f"{who}: {path} is a file, not a directory: point the remote at the team's directory: "
                          f"`dvc remote modify {name} url ssh://host:port/srv/eyas-dvc`")
    return has_runs


def _unreachable(who: str, name: str, scheme: str, e: Exception) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    low = text.lower()
    if scheme == "ssh" and ("permission denied" in low or "auth" in low):
        what = (f"the SSH server refused the login. Give DVC the key (kept out of git): "
                f"`dvc remote modify --local {name} keyfile ~/.ssh/id_ed25519` and the user: "
                f"`dvc remote modify --local {name} user $USER`")
    elif scheme == "ssh":
        what = (f"check that sshd runs there and listens on that port (`ssh -p PORT host true`), that the host "
                f"name resolves from this machine, and the URL: `dvc remote modify {name} url ssh://host:port/path`")
    else:
        what = (f"check that the server runs and answers from this machine, and the URL: "
                f"`dvc remote modify {name} url ...`")
    return f"{who} is unreachable ({text}): {what}. The local cache is untouched."


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
    before = snapshot(root)
    r = subprocess.run(cmd, cwd=root)
    changed = describe(changes(before, snapshot(root)))
    if r.returncode != 0:
        kept = ("what arrived is kept (DVC fetches only what is missing)" if changed != UNCHANGED
                else "nothing was changed here")
        sys.stderr.write(f"eyas.pipeline.team_remote: `{' '.join(cmd)}` exited {r.returncode} against {info['url']}; "
                         f"{changed}: {kept}. Rerun it once the remote answers\n")
    else:
        print(f"eyas.pipeline.team_remote: {op} {'to' if op == 'push' else 'from'} {info['url']} done; {changed}")
    return r.returncode


UNCHANGED = "the local cache and the workspace are as they were"


def snapshot(root: str | os.PathLike = ".") -> dict[str, dict[str, tuple]]:
    """What a transfer can change here: ``{"cache": {path: stat}, "workspace": {path: stat}}``, each
    file of the local cache (DVC's ``cache.dir``: objects under ``files/``, run-cache records under
    ``runs/``) and each file of every output the repository's pipelines and ``.dvc`` files declare
    (DVC's index: what ``dvc pull`` checks out), by its path relative to ``root``, with (size,
    mtime_ns, inode) as its stat. Files that do not exist are absent."""
    repo = _repo(root)
    try:
        cache_dir = Path(repo.cache.local_cache_dir)
        outs = [Path(o.fs_path) for o in repo.index.outs]
    finally:
        repo.close()
    base = Path(root).resolve()

    def files(paths) -> dict[str, tuple]:
        out = {}
        for top in paths:
            walk = [top] if top.is_file() else (f for f in top.rglob("*") if f.is_file()) if top.is_dir() else []
            for f in walk:
                st = f.stat()
                rel = os.path.relpath(f, base)
                out[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
        return out

    return {"cache": files([cache_dir]), "workspace": files(outs)}


def changes(before: dict, after: dict) -> dict[str, dict[str, list[str]]]:
    """``{"cache"|"workspace": {"added": [...], "written": [...], "removed": [...]}}`` between two
    :func:`snapshot` s (``written``: a workspace file there before whose size, mtime or inode changed;
    the cache is content-addressed, so a cache file rewritten in place is the same file and not
    counted)."""
    out = {}
    for part in ("cache", "workspace"):
        b, a = before[part], after[part]
        written = [] if part == "cache" else sorted(k for k in set(a) & set(b) if a[k] != b[k])
        out[part] = {"added": sorted(set(a) - set(b)), "written": written, "removed": sorted(set(b) - set(a))}
    return out


def _n(k: int, what: str) -> str:
    return f"{k} {what}{'s' if k != 1 else ''}"


def describe(ch: dict, shown: int = 10) -> str:
    """:func:`changes` in words: the files added to (or removed from) the local cache, objects and
    run-cache records apart, and the workspace files by name (the first ``shown``); :data:`UNCHANGED`
    when nothing changed."""
    parts = []
    cache = ch["cache"]
    if cache["added"]:
        runs = sum(1 for f in cache["added"] if f"{os.sep}runs{os.sep}" in f"{os.sep}{f}")
        parts.append(f"{_n(len(cache['added']), 'file')} added to the local cache "
                     f"({_n(len(cache['added']) - runs, 'object')}, {_n(runs, 'run-cache record')})")
    if cache["removed"]:
        parts.append(f"{_n(len(cache['removed']), 'file')} removed from the local cache")
    for k, verb in (("added", "written (new)"), ("written", "rewritten"), ("removed", "removed")):
        names = ch["workspace"][k]
        if names:
            listed = ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
            parts.append(f"workspace: {_n(len(names), 'file')} {verb}: {listed}")
    return "; ".join(parts) or UNCHANGED


def main(argv: list[str] | None = None, prog: str = "python3 -m eyas.pipeline.team_remote") -> int:
    """``eyas remote`` (and ``python3 -m eyas.pipeline.team_remote``); returns the exit status."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
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
