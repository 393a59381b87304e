"""``distill``: self-distillation, the target regenerating assistant turns (stage self-distill,
eyas/data/distill.py; through an inference server: eyas/data/remote.py)."""

from __future__ import annotations

import math
import urllib.parse
from dataclasses import dataclass

from eyas.params.schema import FEATURE_SPLITS, ParamsError, check_ranges, loaded

NAME = "distill"


@dataclass(kw_only=True)
class DistillServerParams:
    """``distill.backend: server``: an inference engine already hosting the target generates the replies
    (eyas.data.remote)."""
    api: str  # 'vllm' (/v1/completions), 'sglang' (/generate) or 'llamacpp' (/completion)
    url: str  # the engine's base URL (no path)
    model: str  # the hosted model's name: checked against GET /v1/models; part of DVC's params
    revision: str  # the hosted model's revision (hub commit sha or a weights hash): DVC's key
    concurrency: int  # requests in flight (the engine batches them)
    timeout: float  # seconds per request before it counts as failed


@dataclass(kw_only=True)
class DistillParams:
    """Self-distillation (stage self-distill): the target regenerates assistant turns."""
    enabled: bool  # false: copy the splits unchanged (the DAG stays the same)
    turns: str  # 'last': the last assistant turn; 'all': every one (eyas.data.distill)
    max_new_tokens: int  # generation budget per reply
    batch_size: int  # prompts per generate() call (left padding, sorted by length)
    max_prompt_tokens: int  # drop earliest turns beyond this; 0 = extract.max_length - max_new_tokens
    splits: list[str]
    backend: str  # 'hf': transformers generate in the stage; 'server': distill.server
    server: DistillServerParams


SCHEMA = DistillParams
RANGES = [
    ("distill.max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("distill.batch_size", lambda v: v >= 1, ">= 1"),
    ("distill.turns", lambda v: v in ("last", "all"), "'last' or 'all'"),
    ("distill.max_prompt_tokens", lambda v: v >= 0, ">= 0 (0 = extract.max_length - distill.max_new_tokens)"),
    ("distill.splits", lambda v: len(v) > 0 and set(v) <= set(FEATURE_SPLITS),
     f"a non-empty list of splits among {list(FEATURE_SPLITS)} to regenerate (to regenerate none, set "
     f"'distill.enabled: false')"),
    ("distill.backend", lambda v: v in ("hf", "server"), "'hf' or 'server'"),
]


def _base_url(v: str) -> bool:
    """``http(s)://host[:port]`` with at most a ``/`` after it (eyas.data.remote appends ``/v1/...``)."""
    try:
        u = urllib.parse.urlsplit(v)
        u.port  # noqa: B018 - raises ValueError on a port that is not a number in [0, 65535]
    except ValueError:
        return False
    return (u.scheme in ("http", "https") and bool(u.hostname) and u.path in ("", "/") and not u.query
            and not u.fragment and not any(c.isspace() for c in v))


# checked only when self-distill runs through a server ('distill.backend: server')
SERVER_RANGES = [
    ("distill.server.api", lambda v: v in ("vllm", "sglang", "llamacpp"), "'vllm', 'sglang' or 'llamacpp'"),
    ("distill.server.url", _base_url,
     "an http:// or https:// base URL with a host and no path, e.g. http://127.0.0.1:8000 (not .../v1: "
     "eyas appends /v1/completions, /generate or /completion)"),
    ("distill.server.model", lambda v: v != "", "the hosted model's name (GET /v1/models)"),
    ("distill.server.revision", lambda v: v.strip() != "",
     "the hosted weights' revision (a hub commit sha or a weights hash): DVC reruns self-distill when it changes"),
    ("distill.server.concurrency", lambda v: 1 <= v <= 1024, "in [1, 1024] (one thread per request in flight)"),
    ("distill.server.timeout", lambda v: math.isfinite(v) and v > 0, "a finite number > 0 (seconds)"),
]


def check(p, source: str) -> None:
    """The server's keys when self-distill runs through one; with ``extract`` loaded too, the reply
    and its prompt against ``extract.max_length``.

    Raises:
        ParamsError: naming the key (a server key: "when 'distill.backend' is 'server'").
    """
    d = p.distill
    if d.enabled and d.backend == "server":
        check_ranges(p, SERVER_RANGES, source, " when 'distill.backend' is 'server'")
    if not loaded(p, "extract"):
        return
    length = p.extract.max_length
    if d.enabled and d.max_new_tokens >= length:
        raise ParamsError(f"{source}: 'distill.max_new_tokens' ({d.max_new_tokens}) must be < "
                          f"'extract.max_length' ({length}): the reply must fit a sample")
    if d.enabled and d.max_prompt_tokens and d.max_prompt_tokens + d.max_new_tokens > length:
        raise ParamsError(f"{source}: 'distill.max_prompt_tokens' ({d.max_prompt_tokens}) + 'distill.max_new_tokens' "
                          f"({d.max_new_tokens}) must be <= 'extract.max_length' ({length}): extract would cut the "
                          f"target's reply off the longest prompts (0 = extract.max_length - max_new_tokens)")
