"""A shared DVC remote with the REAL dvc: a shared directory and SSH to a real sshd on 127.0.0.1.

A tiny two-stage pipeline in a temporary git repo (python one-liners; not the training DAG)::

    make (params: n) -> data.txt -> total -> total.json (+ metrics/total.json, cache: false)

is run in clone A, pushed with ``dvc push --run-cache`` (through ``eyas.pipeline.team_remote``), and pulled
with ``dvc pull --run-cache`` into clone B, cloned from A at another path: there ``dvc status`` is
clean, ``dvc repro`` runs nothing and the outputs are A's byte for byte (no stage hash depends on
the machine or the path). Negative control: clone C without the pull is not clean and recomputes.
The bad remotes (a shared directory that is not there, an SSH port nobody listens on, a wrong key,
a remote pushed without ``--run-cache``) each fail naming the URL, and leave the local cache as it
was. The eyas part: ``dvc.yaml``'s commands and paths hold nothing of one machine.

Run: ``python3 -m pytest tests/pipeline/test_team_remote.py -q -s`` (``-s`` prints the round trip's timings).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from eyas.pipeline import team_remote
from tests import team_servers

ROOT = Path(__file__).resolve().parents[2]

DVC_YAML = """\
stages:
  make:
    cmd: python3 steps/make.py
    deps: [steps/make.py]
    params: [n]
    outs: [data.txt]
  total:
    cmd: python3 steps/total.py
    deps: [steps/total.py, data.txt]
    outs: [total.json]
    metrics: [{metrics/total.json: {cache: false}}]
"""
MAKE = ("import yaml\nn = yaml.safe_load(open('params.yaml'))['n']\nprint('COMPUTE make', flush=True)\n"
        "open('data.txt', 'w').write(str(n) * 1000 + '\\n')\n")
TOTAL = ("import json, os\nprint('COMPUTE total', flush=True)\nd = open('data.txt').read().strip()\n"
         "os.makedirs('metrics', exist_ok=True)\n"
         "open('total.json', 'w').write(json.dumps({'len': len(d)}) + '\\n')\n"
         "open('metrics/total.json', 'w').write(json.dumps({'len': len(d)}) + '\\n')\n")
UP_TO_DATE = "Data and pipelines are up to date."
TIMINGS: dict[str, float] = {}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DVC_", "MLFLOW_"))}
    env.update(DVC_NO_ANALYTICS="1", GIT_TERMINAL_PROMPT="0", PYTHONPATH=str(ROOT),
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), **extra)
    return env


def sh(cwd: Path, *cmd: str, check: bool = True, timeout: float = 120, label: str | None = None):
    t0 = time.monotonic()
    r = subprocess.run(list(cmd), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    if label:
        TIMINGS[label] = round(time.monotonic() - t0, 2)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def eyas_remote(cwd: Path, *args: str, label: str | None = None):
    return sh(cwd, sys.executable, "-m", "eyas.pipeline.team_remote", *args, check=False, label=label)


def computed(r) -> set[str]:
    return set(re.findall(r"COMPUTE (\w+)", r.stdout + r.stderr))


def cache_files(repo: Path) -> dict[str, int]:
    c = repo / ".dvc" / "cache"
    return {str(p.relative_to(c)): p.stat().st_size for p in c.rglob("*") if p.is_file()}


def make_origin(path: Path, url: str) -> Path:
    """Clone A: the pipeline run, committed with remote ``team`` = ``url``."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    path.mkdir(parents=True)
    (path / "steps").mkdir()
    (path / "steps" / "make.py").write_text(MAKE)
    (path / "steps" / "total.py").write_text(TOTAL)
    (path / "dvc.yaml").write_text(DVC_YAML)
    (path / "params.yaml").write_text("n: 2\n")
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "config", "user.name", "eyas test"],
                ["git", "config", "user.email", "eyas-test@example.invalid"],
                ["git", "config", "commit.gpgsign", "false"], ["dvc", "init", "-q"],
                ["dvc", "config", "core.analytics", "false"], ["dvc", "remote", "add", "-d", "team", url]):
        sh(path, *cmd)
    r = sh(path, "dvc", "repro")
    assert computed(r) == {"make", "total"}, r.stdout
    sh(path, "git", "add", "-A")
    sh(path, "git", "commit", "-q", "-m", "baseline")
    return path


def round_trip(a: Path, b: Path, local_config: dict | None = None, kind: str = "") -> None:
    """Push from A (through eyas.pipeline.team_remote), clone to B, pull there; B is clean and a no-op."""
    r = eyas_remote(a, "push", label=f"{kind} push --run-cache (A)")
    assert r.returncode == 0, r.stderr
    sh(a.parent, "git", "clone", "-q", str(a), str(b))
    for key, value in (local_config or {}).items():  # credentials stay out of git: .dvc/config.local
        sh(b, "dvc", "remote", "modify", "--local", "team", key, value)
    assert "not in cache" in sh(b, "dvc", "status").stdout  # before the pull: nothing there
    r = sh(b, "dvc", "pull", "--run-cache", label=f"{kind} pull --run-cache (B)")
    assert sh(b, "dvc", "status", label=f"{kind} status (B)").stdout.strip() == UP_TO_DATE
    r = sh(b, "dvc", "repro", label=f"{kind} repro (B)")
    assert computed(r) == set() and "Running stage" not in r.stdout, r.stdout
    assert "Stage 'make' didn't change, skipping" in r.stdout
    assert sh(b, "dvc", "status").stdout.strip() == UP_TO_DATE
    for f in ("data.txt", "total.json", "metrics/total.json", "dvc.lock"):
        assert (b / f).read_bytes() == (a / f).read_bytes(), f
    # the run-cache arrived: the same records as A's
    runs = lambda repo: sorted(p.name for p in (repo / ".dvc" / "cache" / "runs").rglob("*") if p.is_file())  # noqa: E731
    assert runs(b) and runs(b) == runs(a)
    assert b.resolve() != a.resolve()


def test_shared_directory_round_trip_and_negative_control(tmp_path):
    remote = tmp_path / "shared" / "eyas-dvc"
    remote.mkdir(parents=True)  # the mounted shared filesystem
    a = make_origin(tmp_path / "host-a" / "A", str(remote))
    round_trip(a, tmp_path / "host-b" / "work" / "B", kind="shared-dir")
    assert (remote / "runs").is_dir() and (remote / "files" / "md5").is_dir()
    # negative control: a clone that did not pull is not clean, and recomputes
    c = tmp_path / "host-c" / "C"
    sh(a.parent, "git", "clone", "-q", str(a), str(c))
    assert sh(c, "dvc", "status").stdout.strip() != UP_TO_DATE
    assert computed(sh(c, "dvc", "repro")) == {"make", "total"}
    print("\nround trip timings (s):", TIMINGS)


@pytest.fixture(scope="module")
def ssh_server():
    if team_servers.find_sshd() is None:
        pytest.skip("sshd is absent (Debian's openssh-server; scripts/install.sh installs it)")
    pytest.importorskip("dvc_ssh", reason="dvc-ssh is absent (pip install -e '.[team]')")
    # asyncssh checks ~/.ssh/known_hosts where it exists: a HOME of its own, for this process and the
    # dvc subprocesses, so that a developer's known_hosts (without this loopback port) cannot interfere
    home, old = tempfile.mkdtemp(prefix="eyas-home-"), os.environ.get("HOME")
    os.environ["HOME"] = home
    try:
        with team_servers.sshd() as server:
            yield server
    finally:
        if old is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = old
        shutil.rmtree(home, ignore_errors=True)


def test_ssh_round_trip(tmp_path, ssh_server):
    remote = tmp_path / "srv" / "eyas-dvc"
    url = f"ssh://127.0.0.1:{ssh_server['port']}{remote}"
    creds = {"user": ssh_server["user"], "keyfile": ssh_server["keyfile"]}
    a = tmp_path / "host-a" / "A"
    a.mkdir(parents=True)
    a.rmdir()
    a = make_origin(a, url)
    remote.mkdir(parents=True)  # created once on the server: a path that is not there is refused
    for key, value in creds.items():
        sh(a, "dvc", "remote", "modify", "--local", "team", key, value)
    round_trip(a, tmp_path / "host-b" / "B", creds, kind="ssh")
    assert (remote / "runs").is_dir()  # what sshd wrote, seen from this side
    print("\nround trip timings (s):", TIMINGS)


def set_remote(repo: Path, level: str = "repo", **settings: str | None) -> None:
    """Edit remote ``team`` in ``.dvc/config`` (level ``repo``) or ``.dvc/config.local`` (``local``)
    through DVC's own config API, in-process (what ``dvc remote modify [--local]`` does); None unsets."""
    from dvc.repo import Repo

    with Repo(str(repo)) as r, r.config.edit(level) as conf:
        remote = conf["remote"].setdefault("team", {})
        for key, value in settings.items():
            if value is None:
                remote.pop(key, None)
            else:
                remote[key] = value


def refused(repo: Path, op: str = "push") -> str:
    """The message of the RemoteError that refuses ``op`` (in-process: DVC is imported once)."""
    with pytest.raises(team_remote.RemoteError) as e:
        team_remote.transfer(op, repo)
    return str(e.value)


def test_bad_remotes_fail_naming_the_url(tmp_path, ssh_server):
    remote = tmp_path / "shared" / "eyas-dvc"
    remote.mkdir(parents=True)
    a = make_origin(tmp_path / "A", str(remote))
    before = cache_files(a)

    # a shared directory that is not there (not mounted): refused, and NOT created
    missing = tmp_path / "mnt" / "team" / "eyas-dvc"
    set_remote(a, url=str(missing))
    msg = refused(a)
    assert str(missing) in msg and "mounted" in msg, msg
    assert not missing.exists()

    # an SSH port nobody listens on; through the command line: exit status 2, the message on stderr
    port = team_servers.free_port()
    url = f"ssh://127.0.0.1:{port}/srv/eyas-dvc"
    set_remote(a, url=url)
    set_remote(a, "local", keyfile=ssh_server["keyfile"])
    r = eyas_remote(a, "push")
    assert r.returncode == 2 and url in r.stderr and "unreachable" in r.stderr, r.stderr
    assert "local cache is untouched" in r.stderr

    # the real sshd, a key it does not know
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    url = f"ssh://127.0.0.1:{ssh_server['port']}{tmp_path / 'srv'}"
    set_remote(a, url=url)
    set_remote(a, "local", user=ssh_server["user"], keyfile=str(other))
    msg = refused(a)
    assert url in msg and "refused the login" in msg, msg
    assert cache_files(a) == before  # nothing computed was lost
    # the right key, a path that is not there on the server: refused, naming the file that sets the URL
    set_remote(a, "local", keyfile=ssh_server["keyfile"])
    srv = tmp_path / "srv"
    msg = refused(a)
    assert msg.startswith(f".dvc/config: DVC remote 'team' ({url}): {srv} does not exist there (the server answers)")
    assert f"ssh -p {ssh_server['port']} 127.0.0.1 mkdir -p {srv}" in msg, msg
    assert not srv.exists()
    # a path that is a file on the server
    srv.write_text("x")
    msg = refused(a)
    assert msg.startswith(f".dvc/config: DVC remote 'team' ({url}): {srv} is a file, not a directory"), msg
    srv.unlink()
    # positive control: the directory there, the same check passes
    srv.mkdir()
    info = team_remote.check_remote(a)
    assert (info["url"], info["source"], info["run_cache"]) == (url, ".dvc/config", False)

    # a remote pushed without --run-cache: a pull is refused before it transfers anything
    set_remote(a, "local", user=None, keyfile=None)  # a local remote takes no SSH settings
    set_remote(a, url=str(remote))
    sh(a, "dvc", "push")
    assert not (remote / "runs").exists()
    b = tmp_path / "B"
    sh(a, "git", "clone", "-q", str(a), str(b))
    msg = refused(b, "pull")
    assert str(remote) in msg and "no run-cache" in msg and "dvc push --run-cache" in msg, msg
    assert not (b / "data.txt").exists()
    # positive control: pushed with --run-cache, the same pull goes through
    assert team_remote.transfer("push", a) == 0
    assert team_remote.transfer("pull", b) == 0
    assert sh(b, "dvc", "status").stdout.strip() == UP_TO_DATE


def bare_repo(path: Path) -> Path:
    """A DVC repo with one tracked file and remote ``team`` (no pipeline: DVC's start-up only)."""
    path.mkdir(parents=True)
    sh(path, "git", "init", "-q")
    sh(path, "dvc", "init", "-q")
    (path / "a.txt").write_text("hi\n")
    sh(path, "dvc", "add", "-q", "a.txt")
    sh(path, "dvc", "remote", "add", "-d", "team", str(path.parent / "unset"))
    return path


def test_malformed_remotes_and_places_fail_naming_them(tmp_path):
    """No DVC repo, a remote that is a file, a port out of range, a read-only shared directory and
    a password in an SSH URL: one error line naming the place and what to do (was: tracebacks, a
    "mkdir -p" for a path that is a file, a read-only mount passed as fine, DVC's "unexpected error"
    half way through the push). Nothing is transferred; the local cache is as it was."""
    # no DVC repository: exit 2, the directory named, no traceback
    plain = tmp_path / "plain"
    plain.mkdir()
    r = eyas_remote(plain, "check")
    assert r.returncode == 2 and f"{plain}: not a DVC repository" in r.stderr and "Traceback" not in r.stderr, r.stderr
    a = bare_repo(tmp_path / "A")
    before = cache_files(a)
    # the remote is a file, not a directory
    f = tmp_path / "afile"
    f.write_text("x")
    set_remote(a, url=str(f))
    msg = refused(a)
    assert f"({f}) is a file, not a directory" in msg and "mkdir" not in msg, msg
    # a port out of range: refused naming the URL, before DVC parses it
    set_remote(a, url="ssh://127.0.0.1:99999/srv/eyas-dvc")
    msg = refused(a)
    assert "ssh://127.0.0.1:99999/srv/eyas-dvc" in msg and "does not parse" in msg, msg
    # a password in the URL is never printed (the CLI's stderr, an unreachable port)
    url = f"ssh://bob:TopSecret9@127.0.0.1:{team_servers.free_port()}/srv/eyas-dvc"
    set_remote(a, url=url)
    r = eyas_remote(a, "push")
    assert r.returncode == 2 and "bob:***@127.0.0.1" in r.stderr and "TopSecret9" not in r.stdout + r.stderr, r.stderr
    assert cache_files(a) == before
    # a read-only shared directory (a read-only bind mount: root writes through chmod): a push is refused,
    # a check says so, a pull's check passes (reading is all it needs)
    src, ro = tmp_path / "rw", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    if subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("no read-only bind mount here (needs root)")
    try:
        set_remote(a, url=str(ro))
        msg = refused(a)
        assert f"({ro}) is read-only here" in msg and "findmnt" in msg, msg
        assert list(ro.iterdir()) == [] and cache_files(a) == before
        r = eyas_remote(a, "check")
        assert r.returncode == 0 and "read-only here" in r.stdout, r.stdout + r.stderr
        assert team_remote.check_remote(a, run_cache=False)["writable"] is False
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    # negative control: the same directory, writable, takes the push
    set_remote(a, url=str(src))
    assert team_remote.check_remote(a, write=True)["writable"] is True
    assert team_remote.transfer("push", a) == 0 and (src / "files").is_dir()


def write_local_remote(repo: Path, url: str) -> None:
    """``.dvc/config.local`` holding the default remote ``r`` = ``url``, written as a file (DVC's own
    config API refuses to save the URLs DVC cannot load)."""
    (repo / ".dvc" / "config.local").write_text(f"[core]\n    remote = r\n['remote \"r\"']\n    url = {url}\n")


@contextlib.contextmanager
def http_server(directory: Path):
    """A real HTTP server on 127.0.0.1 serving ``directory`` (Python's http.server)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_unusable_remote_urls_fail_naming_the_file_remote_and_url(tmp_path):
    """Every URL the remote cannot be used with is one error naming the config file, the remote, the URL
    and why (was: a refused HTTP connection checked as "reachable", exit 0; tracebacks for a scheme
    whose plugin is absent, a scheme DVC does not know, a URL that does not parse, a config file
    that does not parse). A server that answers but lacks the path is refused too. Nothing is
    transferred; the local cache is as it was."""
    a = bare_repo(tmp_path / "A")
    before = cache_files(a)
    # through the command line: a refused HTTP connection; exit 2, no "reachable" on stdout
    url = f"http://127.0.0.1:{team_servers.free_port()}/x"
    write_local_remote(a, url)
    r = eyas_remote(a, "check")
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert r.stderr.startswith(f"eyas.pipeline.team_remote: error: .dvc/config.local: DVC remote 'r' ({url}) "
                               "is unreachable (ClientConnectorError: Cannot connect to host"), r.stderr
    # the same, in-process, for every other kind of unusable URL
    cases = [
        ("gs://bucket/x", "cannot be used here (gs is supported, but requires 'dvc-gs' to be installed): "
                          "`pip install dvc-gs`"),
        ("weird://x", "is refused by DVC (Unsupported URL type weird://): fix it with "
                      "`dvc remote modify --local r url URL`"),
        ("ssh://[::1/x", "is refused by DVC (the URL does not parse: Invalid IPv6 URL)"),
        ("ssh://127.0.0.1:abc/x", "the URL does not parse (Port could not be cast to integer value as 'abc')"),
    ]
    if importlib.util.find_spec("dvc_gs") is not None:
        cases = cases[1:]
    for url, why in cases:
        write_local_remote(a, url)
        with pytest.raises(team_remote.RemoteError) as e:
            team_remote.check_remote(a)
        assert str(e.value).startswith(f".dvc/config.local: DVC remote 'r' ({url})") and why in str(e.value), e.value
    # a config file that does not parse: named, with its line
    (a / ".dvc" / "config.local").write_text("[core\n")
    with pytest.raises(team_remote.RemoteError, match=r"^\.dvc/config\.local: not a valid DVC config file .*"
                                                      r"Invalid line \('\[core'\).* at line 1"):
        team_remote.check_remote(a)
    # an HTTP server that answers but lacks the path: refused, not "reachable"
    served = tmp_path / "served"
    served.mkdir()
    with http_server(served) as port:
        url = f"http://127.0.0.1:{port}/eyas-dvc"
        write_local_remote(a, url)
        with pytest.raises(team_remote.RemoteError) as e:
            team_remote.check_remote(a)
        assert str(e.value).startswith(f".dvc/config.local: DVC remote 'r' ({url}): {url} does not exist there "
                                       "(the server answers)"), e.value
        # negative control: the path there, the same check passes
        (served / "eyas-dvc").mkdir()
        info = team_remote.check_remote(a)
        assert (info["url"], info["source"], info["run_cache"], info["writable"]) == (url, ".dvc/config.local",
                                                                                      False, None)
    assert cache_files(a) == before


def machine_bound(doc: dict, root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(stage, field, value) of every absolute or home-relative path in a dvc.yaml document, and of
    every command that does not start with ``python`` or names this checkout or the home directory."""
    out = []
    for name, st in doc["stages"].items():
        body = st.get("do", st)
        for key in ("deps", "outs", "metrics", "plots"):
            for item in body.get(key) or []:
                for path in (item if isinstance(item, dict) else {item: None}):
                    if str(path).startswith(("/", "~")):
                        out.append((name, key, str(path)))
        cmd = body["cmd"]
        if cmd.split()[0] != "python" or str(root) in cmd or os.path.expanduser("~") in cmd:
            out.append((name, "cmd", cmd))
    return out


def test_eyas_dvc_yaml_holds_nothing_of_one_machine():
    """Every stage command and path in eyas' own pipeline files (the default DAG and the fine-tune
    comparison) is relative: the same stage hashes in every clone, wherever it lies (what the round
    trips above show on the tiny pipeline)."""
    from eyas.pipeline.dvcfiles import PIPELINES

    docs = [yaml.safe_load((ROOT / f).read_text()) for f in PIPELINES]
    assert sum(len(d["stages"]) for d in docs) >= 12
    for d in docs:
        assert machine_bound(d) == []
    doc = docs[0]
    # negative control: an absolute dep and a command with an interpreter's path are caught
    doc["stages"]["prepare-data"]["deps"].append("/home/alice/data.jsonl")
    doc["stages"]["extract"]["cmd"] = f"{sys.executable} -m stages.extract"
    assert [(n, k) for n, k, _ in machine_bound(doc)] == [("prepare-data", "deps"), ("extract", "cmd")]


def _outs(repo: Path) -> dict[str, tuple]:
    """The pipeline's outputs in ``repo`` (the test's dvc.yaml) by path: (size, mtime_ns)."""
    return {f: ((repo / f).stat().st_size, (repo / f).stat().st_mtime_ns)
            for f in ("data.txt", "total.json", "metrics/total.json") if (repo / f).is_file()}


def _said(before_cache: dict, after_cache: dict, before_ws: dict, after_ws: dict) -> list[str]:
    """The phrases a pull's message must hold, computed from the files themselves."""
    def n(k: int, what: str) -> str:
        return f"{k} {what}{'s' if k != 1 else ''}"

    new = sorted(set(after_cache) - set(before_cache))
    runs = sum(1 for f in new if f.startswith("runs/"))
    out = [f"{n(len(new), 'file')} added to the local cache ({n(len(new) - runs, 'object')}, "
           f"{n(runs, 'run-cache record')})"]
    written = sorted(set(after_ws) - set(before_ws))
    if written:
        out.append(f"workspace: {n(len(written), 'file')} written (new): {', '.join(written)}")
    return out


def test_a_pull_says_what_it_changed_when_it_fails_half_way_and_when_it_succeeds(tmp_path):
    """A remote that lost one object: `dvc pull --run-cache` fetches the rest and exits non-zero; the
    message counts the cache files it added (objects and run-cache records) and names the workspace
    files it wrote, instead of saying that nothing changed. Then the object is back, and the
    successful pull says what it added this time."""
    remote = tmp_path / "shared" / "eyas-dvc"
    remote.mkdir(parents=True)
    a = make_origin(tmp_path / "A", str(remote))
    assert eyas_remote(a, "push").returncode == 0
    lock = yaml.safe_load((a / "dvc.lock").read_text())
    md5 = next(o["md5"] for o in lock["stages"]["make"]["outs"] if o["path"] == "data.txt")
    obj = remote / "files" / "md5" / md5[:2] / md5[2:]
    assert obj.is_file()
    lost = obj.rename(tmp_path / "lost-object")
    b = tmp_path / "B"
    sh(a.parent, "git", "clone", "-q", str(a), str(b))
    cache0, ws0 = cache_files(b), _outs(b)
    r = eyas_remote(b, "pull")
    assert r.returncode not in (0, 2), r.stderr  # DVC's own failure, after the check passed
    cache1, ws1 = cache_files(b), _outs(b)
    assert set(cache1) - set(cache0), "the failed pull added nothing: the case is not tested"
    msg = r.stderr.strip().splitlines()[-1]
    assert "as they were" not in msg and "what arrived is kept" in msg, msg
    for phrase in _said(cache0, cache1, ws0, ws1):
        assert phrase in msg, (phrase, msg)
    assert "data.txt" not in ws1  # its object is lost

    lost.rename(obj)
    r = eyas_remote(b, "pull")
    assert r.returncode == 0, r.stderr
    cache2, ws2 = cache_files(b), _outs(b)
    out = r.stdout.strip().splitlines()[-1]
    assert out.startswith(f"eyas.pipeline.team_remote: pull from {remote} done; "), out
    for phrase in _said(cache1, cache2, ws1, ws2):
        assert phrase in out, (phrase, out)
    assert sh(b, "dvc", "status").stdout.strip() == UP_TO_DATE
    # nothing left to fetch: a third pull says so
    r = eyas_remote(b, "pull")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("the local cache and the workspace are as they were"), r.stdout
