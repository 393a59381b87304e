"""A real engine serving the drafter: llama.cpp's ``llama-server`` with ``--spec-type draft-eagle3``.

:class:`LlamaServer` starts the server built by ``scripts/build_llama_server.sh`` on 127.0.0.1 (one
slot, so requests run one at a time and their timings are their own), with the target's GGUF and,
optionally, an eyas drafter converted by ``eyas.export.gguf`` (``-md``); :func:`serve_benchmark`
sends a benchmark's prompts as token ids, greedy, once to the target alone and once with the
drafter, and reads the engine's own counters: ``timings.draft_n`` / ``timings.draft_n_accepted``
(``tools/server/server-common.cpp`` of ggml-org/llama.cpp), the generated ``tokens`` and the
server's Prometheus counter ``llamacpp:n_decode_total`` (``--metrics``, ``GET /metrics``:
``tools/server/README.md``), read before and after each request.

Counted the engine's way: a verify step is one decode of the target after the prompt's, so a
request's verify steps are its decodes with the drafter less the prompt's decodes, which the same
prompt served without the drafter gives (its decodes less one per token after the first: each token
then takes one decode). Its acceptance length is ``tokens_after_first / verify_steps`` (the bonus
token counted, as eyas' own figure: eyas.eval.speculative.acceptance_length). ``tokens_after_first -
draft_n_accepted`` is one step short when the last step accepts the end-of-sequence token as a
draft: the server samples the bonus token after it and drops it.

:func:`agreement` holds the engine to eyas' own decoding loop on the prompts whose greedy outputs
are equal (see its docstring for the tolerance and why).

One module past 500 lines: which build serves (the CPU or the CUDA binary, its build record, the device it
sees), the server's start and its checks, its counters and the agreement with eyas' loop are one contract
with llama-server, read together when a served figure is in doubt.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import socket
import subprocess
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

from eyas.data.remote import RemoteError, http_json

ENGINE = "llama.cpp llama-server (llama-cpp-python 0.3.36 sources), --spec-type draft-eagle3"
"""What the engine block names: the pinned sources of scripts/build_llama_server.sh."""

BACKENDS = {"cpu": "llama-server", "cuda": "llama-server-cuda"}
"""The binary of each backend, as scripts/build_llama_server.sh installs them (``--cuda`` for the second)."""

DEVICES = ("auto", "cpu", "cuda")
"""params ``serve.device``: ``auto`` serves on the GPU when torch sees one (:func:`resolve_backend`)."""

MIN_EXACT_SHARE = 0.8
"""The least share of compared prompts whose verify steps equal eyas' exactly (:func:`agreement`): a
drafter served as trained agrees exactly on nearly every prompt; one the engine reads off (its default
aux layers, another backend's numerics) on few, while most of its prompts can stay inside the per-prompt
tolerance (docs/serving.md gives the measurements this threshold comes from)."""

STEP_TOLERANCE = 0.1
"""Per prompt with equal greedy outputs: the engine's verify steps may differ from eyas' by at most
``max(1, ceil(STEP_TOLERANCE * steps))`` (:func:`agreement` says why)."""


class EngineError(RuntimeError):
    """The server is missing, did not start, or answered wrongly; names the files, the URL and the
    server log's last lines."""


def server_binary(backend: str = "cpu") -> Path:
    """The backend's binary (:data:`BACKENDS`: ``llama-server`` or ``llama-server-cuda``) beside pip's
    console scripts (where scripts/build_llama_server.sh installs it), else on PATH.

    Raises:
        EngineError: neither has it (names the build command), or ``backend`` is not in :data:`BACKENDS`.
    """
    if backend not in BACKENDS:
        raise EngineError(f"unknown llama.cpp backend {backend!r}: one of {sorted(BACKENDS)}")
    name = BACKENDS[backend]
    exe = Path(sysconfig.get_path("scripts")) / name
    if exe.is_file():
        return exe
    found = shutil.which(name)
    if found is None:
        how = "bash scripts/build_llama_server.sh" + (" --cuda" if backend == "cuda" else "")
        raise EngineError(f"{name} is not installed: run `{how}`"
                          + (" (no GPU needed to build), or set params serve.device: cpu" if backend == "cuda" else ""))
    return Path(found)


def build_info(backend: str = "cpu") -> dict:
    """The build record scripts/build_llama_server.sh writes beside the backend's binary
    (``<binary>.eyas-build.json``: ``sources``, ``llama_cpp_commit``, ``backend``, ``cmake_flags``,
    ``cuda_toolkit``), with ``binary`` (its path) added. A binary without a record (built by other
    means) gives ``{"binary", "backend", "record": None}``: its figures say they come from an unknown build.

    Raises:
        EngineError: as :func:`server_binary`, or a record that is not a JSON object (names the file).
    """
    exe = server_binary(backend)
    f = exe.with_name(exe.name + ".eyas-build.json")
    if not f.is_file():
        return {"binary": str(exe), "backend": backend, "record": None}
    try:
        rec = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineError(f"{f}: unreadable build record ({e}); rebuild: `bash scripts/build_llama_server.sh"
                          f"{' --cuda' if backend == 'cuda' else ''}`") from None
    if not isinstance(rec, dict):
        raise EngineError(f"{f}: the build record is {type(rec).__name__}, not a JSON object")
    if rec.get("backend") != backend or not all(isinstance(rec.get(k), str) for k in ("sources", "cmake_flags")):
        raise EngineError(f"{f}: the build record names backend {rec.get('backend')!r} and sources "
                          f"{rec.get('sources')!r}, not a {backend} build of scripts/build_llama_server.sh; rebuild: "
                          f"`bash scripts/build_llama_server.sh{' --cuda' if backend == 'cuda' else ''}`")
    return {**rec, "binary": str(exe)}


def cuda_device(exe: Path) -> str:
    """The first CUDA device's name as the CUDA build lists it (``llama-server-cuda --list-devices``:
    ``  CUDA0: NAME (TOTAL MiB, FREE MiB free)``, common/arg.cpp ``common_print_available_devices``).

    Raises:
        EngineError: the binary cannot run, or lists no CUDA device (no GPU visible:
            ``CUDA_VISIBLE_DEVICES``, or the driver is missing).
    """
    try:
        r = subprocess.run([str(exe), "--list-devices"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EngineError(f"cannot run {exe} --list-devices: {type(e).__name__}: {e}") from None
    m = re.search(r"^\s*CUDA0: (.+?) \(\d+ MiB", r.stdout, re.MULTILINE)
    if m is None:
        raise EngineError(f"{exe} sees no CUDA device (--list-devices: {r.stdout.strip()!r}, exit {r.returncode}): "
                          f"make a GPU visible (CUDA_VISIBLE_DEVICES), or serve on the CPU with params serve.device: "
                          f"cpu\n{r.stderr.strip()[-600:]}")
    return m.group(1).strip()


def resolve_backend(device: str) -> str:
    """params ``serve.device`` (:data:`DEVICES`) as a backend of :data:`BACKENDS`: ``auto`` is ``cuda``
    when torch sees a CUDA device, else ``cpu``. Raises ValueError for another value (names the key)."""
    if device not in DEVICES:
        raise ValueError(f"params serve.device: {device!r} is not one of {DEVICES}")
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """``llama-server`` serving ``model`` (and the EAGLE-3 drafter ``draft`` with ``k`` drafts per
    step) on a free 127.0.0.1 port, as a context manager; its log goes to ``log``.

    Args:
        model: the target's GGUF. draft: an eagle3 GGUF (eyas.export.gguf.convert) or None.
        k: ``--spec-draft-n-max``; ``--spec-draft-p-min 0`` so every step drafts k tokens, as eyas'
            chain does (llama.cpp's default stops a draft at a low-probability token).
        threads: ``-t`` (CPU threads). ctx: ``-c``, the context length in tokens (shared by the slots).
        slots: ``-np``, the requests decoded together (llama-server's continuous batching); 1 for every
            speculative figure (batch 1), more to generate replies to many prompts at once (the
            target hosted for self-distill, eyas/data/remote.py).
        backend: ``cpu`` or ``cuda`` (:data:`BACKENDS`). On ``cuda`` the target and the drafter are
            put on the first CUDA device by name, every layer (``-dev CUDA0 -ngl 999``, ``-devd CUDA0
            -ngld 999``): llama.cpp's CUDA build otherwise falls back to the CPU, silently, where it
            finds no device; named, a missing device stops the start.
    Attributes: ``device`` (the GPU's name as ``--list-devices`` gives it, or ``"cpu"``), and after the
        start ``offload`` (``[(offloaded, layers)]`` per model, as llama.cpp logs them at ``-lv 4``).
    Raises:
        EngineError: the binary is missing or cannot be started, the server exits, or is not
            healthy within ``startup_s`` seconds (the message holds the command and the log's tail),
            or on ``cuda`` no CUDA device is visible or a model is not wholly on it. Whatever ends the
            start (these, an interrupt), the process is stopped first: none is left behind.
    """

    def __init__(self, model: Path, draft: Path | None, *, k: int, threads: int, ctx: int, log: Path,
                 backend: str = "cpu", slots: int = 1, startup_s: float = 300.0):
        self.backend = backend
        exe = server_binary(backend)
        self.cmd = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(_free_port()),
                    "-c", str(ctx), "-np", str(slots), "-t", str(threads), "--no-webui", "--metrics"]
        if draft is not None or slots == 1:  # not for many slots at once: its trace lines are per token and slot
            # -lv 4: llama.cpp's own INFO lines (the layers offloaded) and the speculative statistics (draft
            # calls and their time) at each request's end
            self.cmd += ["-lv", "4"]
        self.device, self.offload = "cpu", []
        if backend == "cuda":
            self.device = cuda_device(exe)
            self.cmd += ["-dev", "CUDA0", "-ngl", "999"]
        if draft is not None:
            self.cmd += ["-md", str(draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(k),
                         "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
            if backend == "cuda":
                self.cmd += ["-devd", "CUDA0", "-ngld", "999"]
        self.url = f"http://127.0.0.1:{self.cmd[self.cmd.index('--port') + 1]}"
        self.log, self.startup_s = log, startup_s
        self.proc: subprocess.Popen | None = None

    def _tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> LlamaServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as f:
            try:
                self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT)
            except OSError as e:  # not executable, not a binary for this machine
                raise EngineError(f"cannot start llama-server ({' '.join(self.cmd)}): {type(e).__name__}: {e}; "
                                  f"rebuild it: `bash scripts/build_llama_server.sh`") from None
        try:
            self._wait_healthy()
            if self.backend == "cuda":
                self._check_on_gpu()
        except BaseException:  # an exit, a timeout, Ctrl-C, a reply no HTTP client expects: stop it first
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(f"llama-server exited {self.proc.returncode} ({' '.join(self.cmd)}):\n{self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.25)
        raise EngineError(f"llama-server not healthy after {self.startup_s:.0f} s ({' '.join(self.cmd)}):\n"
                          f"{self._tail()}")

    def _check_on_gpu(self) -> None:
        """Every layer of each model on the GPU, as llama-model logs it (``offloaded N/M layers to GPU``,
        an INFO line: ``-lv 4``). The log is written by a worker thread, so its lines are awaited a few
        seconds; a build that logs none is held to ``-dev CUDA0`` alone."""
        want = 2 if "-md" in self.cmd else 1
        deadline = time.monotonic() + 5
        while True:
            text = self.log.read_text(errors="replace")
            self.offload = [(int(a), int(b)) for a, b in re.findall(r"offloaded (\d+)/(\d+) layers to GPU", text)]
            if len(self.offload) >= want or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if any(a != b for a, b in self.offload):
            raise EngineError(f"llama-server-cuda did not put every layer on {self.device} ({' '.join(self.cmd)}): "
                              f"offloaded {self.offload} (layers on the GPU / layers, per model; the target first)\n"
                              f"{self._tail()}")

    def draft_stats(self) -> dict | None:
        """The drafter's counters over every request after the first (the warm-up), from the speculative
        statistics lines llama.cpp logs, cumulative, at each request's end (``common_speculative_print_stats``
        in common/speculative.cpp, at ``-lv 4``): ``draft_calls`` and ``draft_ms`` (drafting time, ms).
        Read it once the server has stopped (its log is then complete). None with fewer than two lines
        (no drafter, or one request). Raises EngineError (naming the log) where the counters are not
        numbers or fall between the first line and the last (another run's lines in the same log)."""
        rows = re.findall(r"statistics\s+draft-eagle3: #calls\(b,g,a\) = +(\d+) +(\d+) +(\d+).*?"
                          r"dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms", self.log.read_text(errors="replace"))
        if len(rows) < 2:
            return None
        try:
            calls, ms = int(rows[-1][1]) - int(rows[0][1]), float(rows[-1][4]) - float(rows[0][4])
        except ValueError:
            raise EngineError(f"{self.log}: a speculative statistics line whose duration is not a number: "
                              f"{rows[-1]}") from None
        if calls < 0 or ms < 0:
            raise EngineError(f"{self.log}: the drafter's counters fell from {rows[0][1]} calls, {rows[0][4]} ms "
                              f"to {rows[-1][1]} calls, {rows[-1][4]} ms: the log holds more than this server's run")
        return {"draft_calls": calls, "draft_ms": ms}

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def complete(self, prompt_ids: list[int], max_new_tokens: int, timeout: float = 600.0) -> dict:
        """One greedy request (``/completion``, temperature 0, top-k 1, no penalties, no prompt
        cache) of ``prompt_ids``.

        Returns:
            ``tokens`` (the generated ids, a stop token included as the engine returns it),
            ``draft_n``, ``draft_n_accepted`` (0 without a drafter), ``n_decode`` (the target's
            decodes the request took: ``llamacpp:n_decode_total`` after less before),
            ``predicted_ms`` (decode wall time, ms) and ``stop_type``.
        Raises:
            EngineError: the request failed, the reply lacks a field or ``/metrics`` lacks the
                counter (names the URL and the log).
        """
        body = {"prompt": prompt_ids, "n_predict": max_new_tokens, "return_tokens": True, "cache_prompt": False,
                "stream": False, "top_k": 1, "temperature": 0.0, "repeat_penalty": 1.0,
                "frequency_penalty": 0.0, "presence_penalty": 0.0}
        before = self._decodes(timeout)
        try:
            r = http_json(self.url + "/completion", body, timeout)
        except RemoteError as e:
            raise EngineError(f"{e}\n{self._tail()}") from None
        n_decode = self._decodes(timeout) - before  # one slot: no other request decodes meanwhile
        t = r.get("timings") or {}
        try:
            return {"tokens": [int(x) for x in r["tokens"]], "draft_n": int(t.get("draft_n", 0)),
                    "draft_n_accepted": int(t.get("draft_n_accepted", 0)), "n_decode": n_decode,
                    "predicted_ms": float(t["predicted_ms"]), "stop_type": r.get("stop_type")}
        except (KeyError, TypeError, ValueError) as e:
            raise EngineError(f"{self.url}/completion: reply without {e}: {str(r)[:300]}") from None

    def _decodes(self, timeout: float) -> int:
        """The server's ``llamacpp:n_decode_total`` (``GET /metrics``, Prometheus text): the target's
        decodes so far. Raises EngineError naming the URL when it is unreachable or lacks the counter."""
        url = self.url + "/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                text = resp.read().decode("utf-8", "replace")
        except (OSError, urllib.error.URLError) as e:
            raise EngineError(f"{url}: cannot read the server's counters ({e})\n{self._tail()}") from None
        for line in text.splitlines():
            fields = line.split()  # name value [timestamp] (Prometheus text format)
            if len(fields) >= 2 and fields[0] == "llamacpp:n_decode_total":
                try:
                    return round(float(fields[1]))
                except (ValueError, OverflowError):  # not a number, or inf
                    raise EngineError(f"{url}: llamacpp:n_decode_total is {fields[1]!r}, not a count") from None
        raise EngineError(f"{url}: no llamacpp:n_decode_total counter in {text[:300]!r}")


def prompt_decodes(plain: dict) -> int:
    """The decodes of the prompt alone in a request served without a drafter (:meth:`LlamaServer.complete`):
    its ``n_decode`` less one per token after the first (the first comes from the prompt's decodes;
    ``n_batch`` prompt tokens per decode). Raises EngineError when that is below 1 (counters that do not
    count decodes)."""
    n = plain["n_decode"] - max(len(plain["tokens"]) - 1, 0)
    if n < 1:
        raise EngineError(f"llama-server counted {plain['n_decode']} decodes for {len(plain['tokens'])} tokens "
                          f"without a drafter: llamacpp:n_decode_total does not count the target's decodes")
    return n


def request_metrics(reply: dict, prompt_decode_count: int) -> dict:
    """One request's counts the engine's way (module docstring): ``new_tokens``, ``verify_steps``
    (its decodes less ``prompt_decode_count``, :func:`prompt_decodes` of the same prompt), ``accepted``,
    ``drafted``, ``predicted_ms`` and ``output_sha256`` (of the output ids as a JSON list, as
    eyas.eval.oracle.per_prompt_walks).

    The steps are checked against the other counters: each step commits its accepted drafts and one
    token of the target, so the steps are at least the tokens after the first less the accepted drafts
    and, unless the request stopped at end-of-sequence, at most one more (the bonus token dropped after
    an accepted end-of-sequence draft); at end-of-sequence at most one per token after the first (drafts
    the target accepts past the end token count as accepted, yet are not output).

    Raises:
        EngineError: counters that do not fit: accepted drafts below 0 or above the drafted ones, or
            verify steps outside those bounds (a ``llamacpp:n_decode_total`` that also counts other
            decodes, or one that is not the target's).
    """
    n, accepted, drafted = len(reply["tokens"]), reply["draft_n_accepted"], reply["draft_n"]
    if not 0 <= accepted <= drafted:
        raise EngineError(f"llama-server reported {accepted} accepted of {drafted} drafted tokens")
    steps = reply["n_decode"] - prompt_decode_count
    least = max(n - 1 - accepted, 1 if n > 1 else 0)
    most = max(n - 1, least) if reply.get("stop_type") == "eos" else least + 1
    if not least <= steps <= most:
        raise EngineError(f"llama-server counted {steps} verify steps ({reply['n_decode']} decodes less the prompt's "
                          f"{prompt_decode_count}) for {n} generated tokens with {accepted} accepted drafts (stop "
                          f"{reply.get('stop_type')!r}): expected {least} to {most}; llamacpp:n_decode_total does "
                          f"not count the target's decodes alone")
    return {"new_tokens": n, "verify_steps": steps,
            "accepted": accepted, "drafted": drafted, "predicted_ms": reply["predicted_ms"],
            "output_sha256": hashlib.sha256(json.dumps(reply["tokens"]).encode()).hexdigest()}


def pooled(per_prompt: list[dict]) -> dict:
    """Pooled figures over requests (:func:`request_metrics`): ``accept_len`` (tokens after the
    first per verify step; None without steps), ``verify_steps``, ``accepted``, ``drafted``,
    ``tokens_per_second`` (new tokens per second of decode wall time)."""
    steps = sum(m["verify_steps"] for m in per_prompt)
    after_first = sum(max(m["new_tokens"] - 1, 0) for m in per_prompt)
    ms = sum(m["predicted_ms"] for m in per_prompt)
    return {"accept_len": after_first / steps if steps else None, "verify_steps": steps,
            "accepted": sum(m["accepted"] for m in per_prompt), "drafted": sum(m["drafted"] for m in per_prompt),
            "tokens_per_second": sum(m["new_tokens"] for m in per_prompt) / (ms / 1000) if ms > 0 else None}


def _serve(target_gguf: Path, drafter_gguf: Path | None, prompts: list[list[int]], *, k: int, max_new_tokens: int,
           threads: int, ctx: int, backend: str, log: Path) -> tuple[list[dict], dict]:
    """One server's run: a short warm-up request (its first decodes pay for CUDA graphs, cuBLAS, page
    faults), then every prompt; returns the replies and ``{"device", "draft"}`` (:meth:`LlamaServer.draft_stats`
    over the prompts, read after the server stopped)."""
    with LlamaServer(target_gguf, drafter_gguf, k=k, threads=threads, ctx=ctx, log=log, backend=backend) as s:
        s.complete(prompts[0], min(8, max_new_tokens))
        replies = [s.complete(p, max_new_tokens) for p in prompts]
    return replies, {"device": s.device, "draft": s.draft_stats() if drafter_gguf is not None else None}


SPEEDUP_SLACK = 1.1
"""How far past its bound (the acceptance length) a measured speedup may go before it is flagged
(:func:`speedup_beyond_bound`): timing jitter between two runs of the same prompts."""


def speedup_beyond_bound(speedup: float | None, accept_len: float | None) -> bool | None:
    """Whether a measured wall-clock speedup is more than the acceptance length allows: a timing fault.

    At batch 1 a verify step of k + 1 tokens reads the same weights as one plain decode step and takes
    at least as long, and drafting adds to it; each verify step commits ``accept_len`` tokens (bonus
    included). So the tokens per second with the drafter are at most ``accept_len`` times the plain
    ones: speedup <= accept_len. A measured speedup above ``accept_len * SPEEDUP_SLACK`` says the two runs
    were timed under different load (another process on the cores, a clock change), not what the
    drafter buys.

    Returns:
        True (flagged), False, or None when either figure is missing or not finite.
    """
    if speedup is None or accept_len is None or not math.isfinite(speedup) or not math.isfinite(accept_len):
        return None
    return speedup > accept_len * SPEEDUP_SLACK


def _with_drafter(plain: list[dict], spec: list[dict], prefill: list[int], draft: dict | None) -> dict:
    """The figures of one run with the drafter against the plain run of the same prompts: :func:`pooled`,
    ``tokens_per_second_plain``, ``speedup``, ``lossless``/``mismatched_prompts``, the time per step
    (``draft_ms_per_step``: the drafter's, from llama.cpp's statistics; ``verify_ms_per_step``: the rest of
    the decode wall time per verify step) and ``per_prompt``."""
    per_prompt = [request_metrics(r, d) for r, d in zip(spec, prefill)]
    out = pooled(per_prompt)
    tps_plain = pooled([request_metrics(r, d) for r, d in zip(plain, prefill)])["tokens_per_second"]
    out["tokens_per_second_plain"] = tps_plain
    out["speedup"] = out["tokens_per_second"] / tps_plain if out["tokens_per_second"] and tps_plain else None
    out["speedup_flagged"] = speedup_beyond_bound(out["speedup"], out["accept_len"])
    steps, ms = out["verify_steps"], sum(m["predicted_ms"] for m in per_prompt)
    out["draft_ms_per_step"] = draft["draft_ms"] / draft["draft_calls"] if draft and draft["draft_calls"] else None
    out["verify_ms_per_step"] = ((ms - draft["draft_ms"]) / steps if draft and steps else None)
    bad = [i for i, (a, b) in enumerate(zip(plain, spec)) if a["tokens"] != b["tokens"]]
    out["lossless"], out["mismatched_prompts"] = not bad, bad
    out["per_prompt"] = per_prompt
    return out


def serve_benchmark(target_gguf: Path, drafter_gguf: Path, prompts: list[list[int]], *, k: int,
                    max_new_tokens: int, threads: int, log_dir: Path, backend: str = "cpu",
                    k_sweep: list[int] | tuple[int, ...] = ()) -> dict:
    """Serve ``prompts`` (token ids) with the target alone, then with the drafter, greedy, at batch 1
    (one slot); with ``k_sweep``, once more with the drafter at each other k listed.

    Args:
        target_gguf: the target as llama.cpp serves it. drafter_gguf: the eagle3 GGUF.
        k: drafts per step. max_new_tokens: ``n_predict``. threads: CPU threads of the server.
        log_dir: the servers' logs (``plain.log``, ``eagle3.log``, ``eagle3_k<k>.log``).
        backend: ``cpu`` or ``cuda`` (:class:`LlamaServer`).
        k_sweep: the k values of the wall-clock sweep (``k`` itself is taken from the main run); empty:
            no sweep.
    Returns:
        ``target_gguf`` (its file name), ``backend``, ``device`` (the GPU's name, or ``cpu``), ``build``
        (:func:`build_info`), ``accept_len``, ``verify_steps``, ``accepted``, ``drafted``,
        ``tokens_per_second`` (with the drafter), ``tokens_per_second_plain``, ``plain_ms_per_token``,
        ``speedup`` (their ratio: the engine's wall-clock speedup), ``speedup_flagged``
        (:func:`speedup_beyond_bound`: more than the acceptance allows, a timing fault), ``draft_ms_per_step``,
        ``verify_ms_per_step``, ``lossless`` (every output equals the engine's own greedy output) with
        ``mismatched_prompts``, ``per_prompt`` (:func:`request_metrics`) and, with a sweep, ``k_sweep``:
        ``{"rows": {k: {accept_len, tokens_per_second, speedup, speedup_flagged, draft_ms_per_step,
        verify_ms_per_step, lossless}}, "recommended_k"}`` (:func:`recommended_k`: the engine's own choice).
    Raises:
        EngineError: as :class:`LlamaServer`.
        ValueError: ``prompts`` is empty, not a list of token-id lists or holds an empty prompt or a
            token id that is not a whole number >= 0; ``k``, a ``k_sweep`` entry, ``max_new_tokens`` or
            ``threads`` is not a whole number >= 1 (llama-server reads ``--draft-max 2.5`` as 2).
        FileNotFoundError: ``target_gguf`` or ``drafter_gguf`` is not a file (no server started).
    """
    if not prompts:
        raise ValueError(f"serve_benchmark: no prompts to serve with {drafter_gguf}")
    if not isinstance(prompts, list) or not all(isinstance(p, list) for p in prompts):
        raise ValueError(f"serve_benchmark: prompts must be a list of token-id lists, got {str(prompts)[:60]}")
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"serve_benchmark: prompts {empty[:5]} hold no token (a served request needs its prompt)")
    bad = [i for i, p in enumerate(prompts) if not all(_whole(t, 0) for t in p)]
    if bad:
        raise ValueError(f"serve_benchmark: prompts {bad[:5]} hold a token id that is not a whole number >= 0")
    if not _whole(max_new_tokens, 1) or not _whole(threads, 1):
        raise ValueError(f"serve_benchmark: max_new_tokens {max_new_tokens!r} and threads {threads!r} must be >= 1, "
                         f"whole numbers")
    if not all(_whole(x, -math.inf) for x in [k, *k_sweep]):
        raise ValueError(f"serve_benchmark: k {k!r} and k_sweep {list(k_sweep)} must be whole numbers")
    ks = sorted(set(k_sweep) | {k}) if k_sweep else [k]
    if ks[0] < 1:
        raise ValueError(f"serve_benchmark: k must be >= 1, got {ks[0]} (k_sweep {list(k_sweep)})")
    for what, f in (("target_gguf", target_gguf), ("drafter_gguf", drafter_gguf)):
        if not Path(f).is_file():
            raise FileNotFoundError(f"serve_benchmark: {what} {f} is not a file")
    ctx = max(len(p) for p in prompts) + max_new_tokens + max(ks) + 8
    kw = {"max_new_tokens": max_new_tokens, "threads": threads, "ctx": ctx, "backend": backend}
    plain, info = _serve(target_gguf, None, prompts, k=k, log=log_dir / "plain.log", **kw)
    prefill = [prompt_decodes(r) for r in plain]
    runs = {}
    for kk in ks:
        spec, sinfo = _serve(target_gguf, drafter_gguf, prompts, k=kk, **kw,
                             log=log_dir / ("eagle3.log" if kk == k else f"eagle3_k{kk}.log"))
        runs[kk] = _with_drafter(plain, spec, prefill, sinfo["draft"])
    out = {"target_gguf": Path(target_gguf).name, "backend": backend, "device": info["device"],
           "build": build_info(backend), **runs[k]}
    out["plain_ms_per_token"] = 1000 / out["tokens_per_second_plain"] if out["tokens_per_second_plain"] else None
    if k_sweep:
        rows = {str(kk): {key: r[key] for key in ("accept_len", "tokens_per_second", "speedup", "speedup_flagged",
                                                  "draft_ms_per_step", "verify_ms_per_step", "lossless")}
                for kk, r in runs.items()}
        out["k_sweep"] = {"rows": rows, "recommended_k": recommended_k(rows)}
    return out


def _whole(x, least: float) -> bool:
    """Whether ``x`` is an int (not a bool) >= ``least``."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= least


def recommended_k(rows: dict[str, dict]) -> int | None:
    """The k to serve with, from a wall-clock sweep's ``rows`` (``{str(k): {"speedup", "lossless", ...}}``,
    :func:`serve_benchmark`): the k of the highest speedup among the lossless rows (the smaller k on a tie).
    None when no row is lossless or none has a speedup: a k whose outputs differ from the target's own
    greedy outputs is no candidate, whether the engine is broken or its verify batch runs other kernels
    that flip near-tied logits (llama.cpp's CUDA build on BF16 weights of a random target does): its
    tokens/s times other outputs than the plain run's. A speedup that is None, NaN or infinite, or that a
    row's ``speedup_flagged`` marks (:func:`speedup_beyond_bound`), is unmeasured (the row is no candidate).

    Raises:
        ValueError: ``rows`` that is not an object, a key that is not a k (a whole number >= 1 written in
            decimal) or names a k another key names too (``"2"`` and ``2``), a row that is not an object,
            a ``lossless`` or ``speedup_flagged`` that is not a bool or None, or a ``speedup`` that is not a
            number or is <= 0 (a ratio of two rates is > 0) (the key and the value named).
    """
    if not isinstance(rows, dict):
        raise ValueError(f"k sweep rows {str(rows)[:80]} are not an object of rows by k")
    ok, seen = [], set()
    for key, r in rows.items():
        kk = int(key) if isinstance(key, str) and key.isdecimal() and str(int(key)) == key else key
        if not _whole(kk, 1):
            raise ValueError(f"k sweep row {key!r}: not a k (a whole number >= 1)")
        if kk in seen:
            raise ValueError(f"k sweep row {key!r}: k {kk} twice")
        seen.add(kk)
        if not isinstance(r, dict):
            raise ValueError(f"k sweep row {key!r}: {r!r} is not an object of figures")
        lossless, speedup = r.get("lossless"), r.get("speedup")
        for name in ("lossless", "speedup_flagged"):
            if r.get(name) is not None and not isinstance(r[name], bool):
                raise ValueError(f"k sweep row {key!r}: {name!r} is {r[name]!r}, not true or false")
        if speedup is not None and (isinstance(speedup, bool) or not isinstance(speedup, (int, float))):
            raise ValueError(f"k sweep row {key!r}: 'speedup' is {speedup!r}, not a number")
        if speedup is not None and speedup <= 0:
            raise ValueError(f"k sweep row {key!r}: 'speedup' is {speedup!r}, not a ratio > 0")
        if lossless and speedup is not None and math.isfinite(speedup) and r.get("speedup_flagged") is not True:
            ok.append((kk, speedup))
    return max(sorted(ok), key=lambda row: row[1])[0] if ok else None


def agreement(engine_per_prompt: list[dict], eyas_per_prompt: list[dict]) -> dict:
    """The engine's per-prompt counts held to eyas' own (eyas.eval.oracle.per_prompt_walks) on the
    prompts whose greedy outputs are equal.

    Why a tolerance and this one: both decoders run the same float32 weights on the same tokens,
    so on equal outputs the target's verdicts are equal and the drafts are the same except where
    the drafter's top two logits are closer than the two libraries' rounding (torch vs ggml sum in
    another order). A flipped draft changes that step's accepted count and moves the later step
    boundaries, a few steps' worth; a wrong aux layer, d2t or norm moves nearly every step (the
    acceptance falls toward 1). So each prompt's verify steps must agree within
    ``max(1, ceil(STEP_TOLERANCE * eyas_steps))``, and the pooled acceptance lengths within the
    same fraction. A near-miss (the engine's default aux layers, another backend's numerics) can keep
    most prompts inside that tolerance while few agree exactly, so at least :data:`MIN_EXACT_SHARE` of the
    compared prompts must have exactly eyas' verify steps.

    Returns:
        ``compared`` (prompts with equal outputs), ``equal_outputs`` (their indices),
        ``exact`` (prompts with equal verify steps), ``exact_share`` (``exact / compared``; None
        without compared prompts), ``outside_tolerance`` (``[{prompt,
        engine_steps, eyas_steps, allowed}]``), ``accept_len_engine`` / ``accept_len_eyas`` pooled
        over the compared prompts, ``tolerance`` (its rule), ``ok`` (True / False; ``None`` when no
        prompt could be compared: the check did not run, and it must not read as passed) and
        ``unchecked`` (why, when ``ok`` is None; else None).
    Raises:
        ValueError: the two lists cover different numbers of prompts.
    """
    if len(engine_per_prompt) != len(eyas_per_prompt):
        raise ValueError(f"agreement: {len(engine_per_prompt)} engine prompts vs {len(eyas_per_prompt)} of eyas'")
    same = [i for i, (e, m) in enumerate(zip(engine_per_prompt, eyas_per_prompt))
            if e["output_sha256"] == m["output_sha256"]]
    outside, exact = [], 0
    for i in same:
        got, want = engine_per_prompt[i]["verify_steps"], eyas_per_prompt[i]["verify_steps"]
        allowed = max(1, math.ceil(STEP_TOLERANCE * want))
        exact += got == want
        if abs(got - want) > allowed:
            outside.append({"prompt": i, "engine_steps": got, "eyas_steps": want, "allowed": allowed})

    def accept_len(rows: list[dict]) -> float | None:
        steps = sum(r["verify_steps"] for r in rows)
        return sum(r["new_tokens"] - 1 for r in rows) / steps if steps else None

    a_engine = accept_len([engine_per_prompt[i] for i in same])
    a_eyas = accept_len([eyas_per_prompt[i] for i in same])
    pooled_ok = a_engine is None or a_eyas is None or abs(a_engine - a_eyas) <= STEP_TOLERANCE * a_eyas
    share = exact / len(same) if same else None
    unchecked = None if same else (
        "no prompts to compare" if not eyas_per_prompt else
        f"none of the {len(eyas_per_prompt)} prompts has the same greedy output in llama.cpp as in eyas: the engine "
        f"may not serve the weights eyas evaluates (models/target_gguf/target.gguf vs target.dtype)")
    return {"compared": len(same), "equal_outputs": same, "exact": exact, "exact_share": share,
            "outside_tolerance": outside, "accept_len_engine": a_engine, "accept_len_eyas": a_eyas,
            "tolerance": f"per prompt |steps - eyas steps| <= max(1, ceil({STEP_TOLERANCE} x eyas steps)); "
                         f"pooled acceptance within {STEP_TOLERANCE:.0%}; at least {MIN_EXACT_SHARE:.0%} of the "
                         f"compared prompts with exactly eyas' verify steps",
            "ok": None if unchecked else not outside and pooled_ok and share >= MIN_EXACT_SHARE,
            "unchecked": unchecked}


def disagreement_message(name: str, bench: str, a: dict) -> str:
    """The eval's failure text for an :func:`agreement` that is not ok: both figures and the likely
    causes, in the order they are seen in practice."""
    rows = "; ".join(f"prompt {o['prompt']}: engine {o['engine_steps']} steps, eyas {o['eyas_steps']} "
                     f"(allowed +-{o['allowed']})" for o in a["outside_tolerance"][:5])
    return (f"eval {name} {bench}: llama.cpp's acceptance {a['accept_len_engine']} disagrees with eyas' "
            f"{a['accept_len_eyas']} on {a['compared']} prompts with equal greedy outputs ({a['tolerance']}): "
            f"{a['exact']} of {a['compared']} agree exactly; {rows or 'none outside the per-prompt tolerance'}. "
            f"Likely causes: the aux layer ids the GGUF reads (eagle3.target_layers vs the features' "
            f"aux_layers), the d2t mapping, the norm flags (norm_before_residual, norm_before_fc), RoPE "
            f"(rope_theta / rope_scaling), the context length, or the backend's numerics (a CUDA build against the "
            f"CPU one: serve both, params serve.device); `eyas inspect` on the GGUF shows what llama.cpp uses")
