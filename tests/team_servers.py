"""Real servers on the loopback address for the team tests: OpenSSH's ``sshd`` and PostgreSQL.

Each is started in a temporary directory and stopped (its own pid, nothing else) by its context
manager. Neither needs root, but PostgreSQL refuses to run as root: as root the data directory is
owned by, and the server run as, the ``postgres`` user (Debian's package creates it) through
``runuser``. ``scripts/install.sh`` installs both (Debian's ``openssh-server`` and ``postgresql``);
:func:`find_sshd` / :func:`find_pg_bin` return None only where the binaries are absent.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until 127.0.0.1:``port`` accepts a connection. Raises RuntimeError after ``timeout``
    seconds or when ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    """Wait until ``GET <url>/health`` answers 200 (llama-server's and MLflow's health route). Raises
    AssertionError, with ``log``'s last 2,000 characters, when ``proc`` exits first or after ``timeout`` s."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f"exited {proc.returncode}" if proc.poll() is not None else f"not healthy after {timeout} s"
            raise AssertionError(f"the server at {url} {why}:\n{log.read_text()[-2000:]}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM ``proc`` (only it), then SIGKILL after ``timeout`` s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------------------------
# sshd


def find_sshd() -> str | None:
    return shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd",) if os.access(p, os.X_OK)), None)


@contextlib.contextmanager
def sshd() -> Iterator[dict]:
    """A real ``sshd`` on 127.0.0.1 (a free port), public-key login only, SFTP served.

    Yields ``{"port", "user", "keyfile", "dir"}``: log in as ``user`` (the current user) with
    the private key ``keyfile``. Raises RuntimeError when it does not start listening in 15 s.
    """
    exe = find_sshd()
    d = Path(tempfile.mkdtemp(prefix="eyas-sshd-"))
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    port = free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nPidFile {d / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nStrictModes no\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nPermitRootLogin prohibit-password\n"
        "Subsystem sftp internal-sftp\n")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # its privilege-separation directory
    log = open(d / "sshd.log", "w")
    proc = subprocess.Popen([exe, "-D", "-e", "-f", str(d / "sshd_config")], stdout=log, stderr=log)
    try:
        try:
            wait_port(port, 15, proc)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{(d / 'sshd.log').read_text()}") from e
        yield {"port": port, "user": pwd.getpwuid(os.getuid()).pw_name, "keyfile": str(d / "client_key"),
               "dir": d}
    finally:
        stop(proc)
        log.close()
        shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# PostgreSQL


def find_pg_bin() -> Path | None:
    """The directory holding ``initdb`` and ``postgres`` (Debian keeps them off PATH, under
    /usr/lib/postgresql/<version>/bin), newest version first; None when absent."""
    found = shutil.which("initdb")
    if found and os.access(Path(found).resolve().parent / "postgres", os.X_OK):
        return Path(found).resolve().parent
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True):
        if os.access(os.path.join(d, "initdb"), os.X_OK):
            return Path(d)
    return None


@contextlib.contextmanager
def postgres(user: str = "eyas", password: str = "eyas-test-pw", db: str = "mlflow") -> Iterator[dict]:
    """A real PostgreSQL server on 127.0.0.1 (a free port) with a password-authenticated role
    ``user`` (scram-sha-256 over TCP) owning database ``db``.

    Yields ``{"port", "user", "password", "db", "url"}`` (``url``: the SQLAlchemy URL MLflow
    takes, with the psycopg2 driver named). Raises RuntimeError when initdb fails or the server
    does not listen within 30 s.
    """
    pg = find_pg_bin()
    d = Path(tempfile.mkdtemp(prefix="eyas-pg-"))
    as_root = os.geteuid() == 0
    run_as = ["runuser", "-u", "postgres", "--"] if as_root else []
    (d / "pw").write_text(password + "\n")
    if as_root:
        os.chmod(d, 0o755)
        shutil.chown(d, "postgres", "postgres")
        shutil.chown(d / "pw", "postgres", "postgres")
    data = d / "data"
    r = subprocess.run(run_as + [str(pg / "initdb"), "-D", str(data), "-U", user, f"--pwfile={d / 'pw'}",
                                 "--auth-host=scram-sha-256", "--auth-local=trust", "-E", "UTF8",
                                 "--locale=C"], capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(d, ignore_errors=True)
        raise RuntimeError(f"initdb failed: {r.stderr[-2000:]}")
    port = free_port()
    log = open(d / "pg.log", "w")
    if as_root:
        shutil.chown(d / "pg.log", "postgres", "postgres")
    proc = subprocess.Popen(run_as + [str(pg / "postgres"), "-D", str(data), "-p", str(port),
                                      "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={d}",
                                      "-c", "fsync=off"], stdout=log, stderr=log)
    try:
        try:
            wait_port(port, 30, proc)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{(d / 'pg.log').read_text()[-2000:]}") from e
        import psycopg2

        deadline = time.monotonic() + 30
        while True:  # listening precedes accepting logins by a moment (recovery/startup)
            try:
                conn = psycopg2.connect(host="127.0.0.1", port=port, user=user, password=password, dbname="postgres")
                break
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{db}" OWNER "{user}"')
        conn.close()
        yield {"port": port, "user": user, "password": password, "db": db,
               "url": f"postgresql+psycopg2://{user}:{password}@127.0.0.1:{port}/{db}"}
    finally:
        # fast shutdown (SIGINT: end the sessions, no wait for clients) sent to the postmaster itself,
        # whose pid it wrote (runuser, in between as root, forwards only SIGTERM: a "smart" shutdown)
        try:
            os.kill(int((data / "postmaster.pid").read_text().split()[0]), signal.SIGINT)
        except (OSError, ValueError, IndexError):
            pass
        stop(proc, timeout=20)
        log.close()
        shutil.rmtree(d, ignore_errors=True)
