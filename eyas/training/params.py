"""Typed parameters: the schema of ``params.yaml``.

Every section of ``params.yaml`` is a dataclass below. The dataclasses hold types and no default
values: the repository's ``params.yaml`` (:data:`DEFAULTS_FILE`) is the single source of default
values, so the values DVC tracks are the values the code runs with. A params mapping or file that
leaves keys out (a test's, a preset merged into params) takes those keys from it. :func:`load_params`
rejects unknown keys, missing keys and wrong types with the key's dotted path, before any compute.
Params files are read as DVC reads them (:mod:`eyas.yaml12`: ruamel.yaml, YAML 1.2), so ``050`` is
50, ``5e-05`` (the form ``dvc exp run -S lr=5e-5`` writes) a float, and ``yes``/``no``/``on``/``off``
strings, which a bool field refuses: the value a stage runs with is the value DVC hashed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import subprocess
import types
import typing
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas import yaml12
from eyas.drafter.backend import Backend


class ParamsError(ValueError):
    """A params file is malformed: the message names the file and the key's dotted path."""


class UnknownKeyError(ParamsError):
    """A params file holds keys the schema does not know (``keys``: their dotted paths)."""

    def __init__(self, msg: str, keys: list[str]):
        super().__init__(msg)
        self.keys = keys


# The schema: types only. A new param goes into params.yaml (with its value and a comment) and here
# WITHOUT a default (tests/test_config.py fails on a default here or a key missing there).

@dataclass(kw_only=True)
class TargetParams:
    path: str
    gguf_file: str | None
    revision: str | None  # hub ids: the commit (or tag) to load; pins the target for DVC
    trust_remote_code: bool
    dtype: str


@dataclass(kw_only=True)
class SynthParams:
    """``data.synth``: prompts the target writes itself (eyas.data.synth, stage synthesize-prompts)."""
    prompts: int  # conversations synthesized (as many as survive the filters); 0 = off
    mode: str  # 'add': joined to the source's train + val; 'only': train + val are synthesized alone
    seed: int
    temperature: float  # sampling of the user turns
    top_p: float
    min_prompt_tokens: int  # a shorter user turn is dropped
    max_prompt_tokens: int  # a user turn's budget: one without its end-of-turn token by then is dropped
    turns: int  # user turns per conversation (the target answers in between, greedy)
    system_prompts: list[str]  # drawn per chat conversation; "" = none (the template's default)
    code_system_prompts: list[str]  # drawn per code conversation
    code_share: float  # share of conversations drawn as code
    topics: list[str]  # when set, one per conversation ends its system prompt (eyas.data.synth.TOPIC_SENTENCE)
    near_dup: float  # word-3-gram Jaccard at which a prompt is a near-duplicate of a kept one
    overlap: float  # share of word 3-grams from one eval prompt at which a prompt is dropped
    min_ascii_letters: float  # language filter: the least share of a prompt's letters that are ASCII
    max_rounds: int  # generation rounds before the stage gives up


@dataclass(kw_only=True)
class DataParams:
    source: str
    max_conversations: int
    val: int
    test: int
    publish: int
    on_bad_line: str
    code_prompts: int  # code conversations added to train + val (eyas.data.code); 0 = off
    code_packages: list[str]  # the pinned packages they come from (import names of eyas.data.code.PACKAGES)
    synth: SynthParams  # prompts the target writes itself (stage synthesize-prompts); prompts 0 = off


@dataclass(kw_only=True)
class DistillServerParams:
    """``distill.backend: server``: an inference engine already serving the target (eyas.data.serving)."""
    api: str  # 'vllm' (/v1/completions), 'sglang' (/generate) or 'llamacpp' (/completion)
    url: str  # the engine's base URL (no path)
    model: str  # the served model name: checked against GET /v1/models; part of DVC's params
    revision: str  # the served model's revision (hub commit sha or a weights hash): DVC's key
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


@dataclass(kw_only=True)
class ExtractParams:
    max_length: int
    aux_layers: list[int] | None
    dtype: str
    batch_size: int
    shard_samples: int


@dataclass(kw_only=True)
class VocabParams:
    draft_vocab_size: int


@dataclass(kw_only=True)
class StandInParams:
    draft_vocab_size: int
    order: str
    lr: float
    epochs: int


@dataclass(kw_only=True)
class RemapParams:
    source: str  # a local drafter directory: a dependency DVC hashes (finetune/dvc.yaml)
    min_shared_fraction: float


LOSS_TOKENS = ("assistant", "all")  # train.loss_tokens (eyas.training.batches.supervised)


@dataclass(kw_only=True)
class TrainParams:
    ttt_length: int
    step_decay: float
    batch_tokens: int
    epochs: int
    warmup_ratio: float
    weight_decay: float
    grad_clip: float
    eval_every: int
    max_steps: int
    checkpoint_every: int  # optimizer steps between resumable checkpoints; 0 = none
    nproc: int  # processes under torchrun (eyas.training.launch); 0 = one per CUDA device
    strategy: str  # data parallelism with nproc > 1: 'ddp' (replicas) or 'fsdp' (FSDP2 shards)
    mode: str  # 'offline': hidden states from extract's shards; 'online': the target computes them
    #            batch by batch, extract stores tokens only (eyas/training/online.py)
    loss_tokens: str  # positions the TTT loss supervises: 'assistant' or 'all' (eyas.training.batches.supervised)
    backend: Backend  # the TTT unroll's kernels (eyas/drafter/backend.py)


@dataclass(kw_only=True)
class TrainFinetuneParams:
    lr: float  # the fine-tune's learning rate (the scratch drafter's is the top-level ``lr``)
    gate_margin: float
    gate_min_acc: float
    gate_override: bool


@dataclass(kw_only=True)
class EvalParams:
    num_draft_tokens: int
    max_new_tokens: int
    chat_prompts: int
    humaneval_prompts: int
    timing_repeats: int  # timed greedy + speculative runs per prompt (eyas.eval.speculative.evaluate_prompts)
    max_prompt_tokens: int  # chat: earliest turns of a longer prompt dropped (eyas.data.distill.fit_prompt); 0 = none
    timed_prompts: int  # prompts per benchmark decoded for real (timed, lossless check); 0 = all
    batch_size: int  # prompts per batched greedy call for the untimed prompts' reference
    # the served table (eyas/eval/served.py): chain vs tree vs sampled on the first served_prompts prompts
    served_prompts: int  # prompts per benchmark decoded for the table; 0 = no table
    served_max_new_tokens: int
    temperatures: list[float]  # 0 = greedy
    top_p: float
    seeds: list[int]  # sampled runs per prompt at each temperature > 0
    tree_topk: int  # SGLang --speculative-eagle-topk (its default: 4)
    tree_num_steps: int  # SGLang --speculative-num-steps (tree depth; its default: 5)
    tree_num_draft_tokens: int  # SGLang --speculative-num-draft-tokens (root counted; its default: 8)


@dataclass(kw_only=True)
class ServeParams:
    # 'llamacpp': eval serves each drafter with llama-server (eyas/eval/llamacpp.py); 'none': no engine block
    engine: str
    threads: int  # llama-server's CPU threads (-t)
    quantized_target: bool  # also serve the target's own GGUF file (the embedded Q4_1), reported apart


@dataclass(kw_only=True)
class Params:
    lr: float  # the scratch drafter's learning rate (train-scratch)
    seed: int
    target: TargetParams
    data: DataParams
    distill: DistillParams
    extract: ExtractParams
    vocab: VocabParams
    stand_in: StandInParams
    remap: RemapParams
    train: TrainParams
    train_finetune: TrainFinetuneParams
    eval: EvalParams
    serve: ServeParams


def _coerce(value: Any, tp: Any, path: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, path, source)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ParamsError(f"{source}: '{path}' must be a mapping, got {type(value).__name__}")
        return _build(tp, value, path, source)
    if origin is list:
        if not isinstance(value, list):
            raise ParamsError(f"{source}: '{path}' must be a list, got {value!r}")
        return [_coerce(v, args[0], f"{path}[{i}]", source) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            note = (" (as DVC reads YAML 1.2, yes/no/on/off are strings, not booleans: write true or false)"
                    if isinstance(value, str) and value.lower() in ("yes", "no", "on", "off", "y", "n") else "")
            raise ParamsError(f"{source}: '{path}' must be true or false, got {value!r}{note}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamsError(f"{source}: '{path}' must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise ParamsError(f"{source}: '{path}' must be a number, got {value!r}")
        if not isinstance(value, (int, float)):  # a quoted "5e-5" is a string to DVC too
            raise ParamsError(f"{source}: '{path}' must be a number, got {value!r}")
        number = float(value)
        if not math.isfinite(number):  # .inf/.nan (or 'inf', 'nan') break every float param downstream
            raise ParamsError(f"{source}: '{path}' must be a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            kind = "null" if value is None else type(value).__name__
            note = "" if isinstance(value, (dict, list)) else f" (YAML reads it as {kind}: write it in quotes)"
            raise ParamsError(f"{source}: '{path}' must be a string, got {value!r}{note}")
        return value
    raise TypeError(f"unsupported schema type {tp!r} at {path}")  # a bug in this module


def _build(cls: type, raw: dict, prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(names), key=str)  # YAML keys may be ints, dates or None too
    if unknown:
        keys = [f"{prefix + '.' if prefix else ''}{k}" for k in unknown]
        where = ", ".join(f"'{k}'" for k in keys)
        raise UnknownKeyError(f"{source}: unknown key {where} (allowed: {', '.join(sorted(names))})", keys)
    missing = [f"{prefix + '.' if prefix else ''}{k}" for k in names if k not in raw]
    if missing:
        raise ParamsError(f"{source}: missing key {', '.join(repr(k) for k in missing)} (every key of the "
                          f"schema must be set; {DEFAULTS_FILE.name} beside the eyas package has them all)")
    kwargs = {
        k: _coerce(v, hints[k], f"{prefix + '.' if prefix else ''}{k}", source)
        for k, v in raw.items()
    }
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section that checks its own values (eyas.drafter.backend.Backend)
        # named by the key its message starts with ("attention must be ..."), so its line is the key's own
        key = next((f"{prefix}.{k}" for k in raw if str(e).startswith(f"{k} ")), prefix)
        raise ParamsError(f"{source}: '{key}': {e}") from None


DEFAULTS_FILE = Path(__file__).resolve().parents[2] / "params.yaml"
"""The repository's ``params.yaml``: the single source of default values (read on every call, so an
edit or a ``dvc exp run -S`` is seen at once)."""


def _read_yaml(path: Path) -> dict:
    try:
        raw = yaml12.load_file(path)
    except FileNotFoundError:
        raise ParamsError(f"{path}: no such params file") from None
    except yaml12.YamlError as e:
        raise ParamsError(str(e)) from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: the top level must be a mapping")
    return raw or {}


def with_defaults(raw: dict | None) -> dict:
    """``raw`` (a possibly partial params mapping) with every key it leaves out taken from
    :data:`DEFAULTS_FILE`, section by section; ``raw`` is not changed. A section that ``raw`` sets to
    something other than a mapping is kept as is (the schema then names it).

    Raises:
        ParamsError: :data:`DEFAULTS_FILE` is missing or is not a YAML mapping (naming the file).
    """
    def merge(base: Any, over: Any) -> Any:
        if not (isinstance(base, dict) and isinstance(over, dict)):
            return over
        return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}
    return merge(_read_yaml(DEFAULTS_FILE), raw or {})


def parse_params(raw: dict | None, source: str = "params.yaml") -> Params:
    """Validate a raw params mapping against the schema, its missing keys taken from
    :data:`DEFAULTS_FILE` (:func:`with_defaults`); ``parse_params({})`` is the defaults.

    Raises:
        ParamsError: on an unknown key, a wrong type or a value out of range (e.g. an empty
            ``distill.splits``); the message names ``source`` and the key's dotted path (e.g.
            ``params.yaml: 'train.lr' must be a number``); on a key that neither ``raw`` nor
            :data:`DEFAULTS_FILE` sets (``missing key``).
    """
    params = _build(Params, with_defaults(raw), "", source)
    _check_ranges(params, source)
    return params


def default_params() -> Params:
    """The params of :data:`DEFAULTS_FILE` alone, validated (tests and scripts start from these and
    change fields with ``dataclasses.replace``).

    Raises:
        ParamsError: :data:`DEFAULTS_FILE` is missing, incomplete or invalid.
    """
    return parse_params({}, str(DEFAULTS_FILE))


_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# feature storage adds fp8: aux hidden states in e4m3 with per-token, per-layer scales (eyas/features.py)
_STORAGE_DTYPES = _FLOAT_DTYPES + ("float8_e4m3fn",)

# (dotted key, test, what it must be): checked after types, before any compute
FEATURE_SPLITS = ("train", "val", "publish")
"""The splits self-distill may regenerate (``distill.splits``) and extract turns into features, in
stage order; ``test`` only supplies eval prompts."""
_SEED_MAX = 2 ** 63  # torch.Generator.manual_seed takes a signed 64-bit integer
MAX_EPOCHS = 1000
"""Upper bound of ``train.epochs`` and ``stand_in.epochs``: the loop plans every epoch's batches before
its first step (eyas.training.loop: the cosine schedule's length), so a huge count stalled at start-up."""
EPOCHS_RANGE = f"in [1, {MAX_EPOCHS}] (every epoch's batches are planned before the first step)"
STAND_IN = "models/stand_in"
"""What published/dvc.yaml's stand-in-drafter writes: the one ``remap.source`` that need not exist yet
(DVC runs the stand-in before remap). Any other ``remap.source`` must be a directory already, relative
to the repository root, where the stages run."""


def _nonempty(v) -> bool:
    return v.strip() != ""


def _null_or_nonempty(v) -> bool:
    return v is None or v.strip() != ""


_RANGES = [
    ("lr", lambda v: 0 < v < 1, "in (0, 1)"),
    ("seed", lambda v: 0 <= v < _SEED_MAX, "in [0, 2**63)"),
    ("target.path", _nonempty, "a non-empty string ('embedded', a local HF directory or a hub id org/name)"),
    ("target.gguf_file", _null_or_nonempty, "null or a non-empty file name"),
    ("target.revision", _null_or_nonempty, "null (the hub's main) or a non-empty commit sha, branch or tag"),
    ("data.source", _nonempty, "a non-empty string"),
    ("target.dtype", lambda v: v in _FLOAT_DTYPES, f"one of {_FLOAT_DTYPES}"),
    ("data.max_conversations", lambda v: v >= 0, ">= 0 (0 = all)"),
    ("data.val", lambda v: v >= 1, ">= 1 (val features drive the step-0 gate and val metrics)"),
    ("data.test", lambda v: v >= 1, ">= 1 (eval prompts come from it)"),
    ("data.publish", lambda v: v >= 1, ">= 1 (the stand-in drafter trains on it)"),
    ("data.on_bad_line", lambda v: v in ("error", "skip"), "'error' or 'skip'"),
    ("data.code_prompts", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("data.code_packages", lambda v: len(v) > 0 and len(set(v)) == len(v),
     "a non-empty list of distinct import names (prepare-data checks them against eyas/data/code.py PACKAGES)"),
    ("data.synth.prompts", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("data.synth.mode", lambda v: v in ("add", "only"),
     "'add' (joined to the source's train + val) or 'only' (train + val are synthesized alone)"),
    ("data.synth.seed", lambda v: 0 <= v < _SEED_MAX, "in [0, 2**63)"),
    ("data.synth.temperature", lambda v: 0 < v <= 10,
     "in (0, 10] (prompts are sampled: greedy decoding writes one prompt per system prompt)"),
    ("data.synth.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("data.synth.min_prompt_tokens", lambda v: v >= 1, ">= 1"),
    ("data.synth.max_prompt_tokens", lambda v: v >= 1, ">= 1"),
    ("data.synth.turns", lambda v: v >= 1, ">= 1"),
    ("data.synth.system_prompts", lambda v: len(v) > 0 and len(set(v)) == len(v),
     "a non-empty list of distinct strings (\"\" = no system turn: the template's default)"),
    ("data.synth.code_system_prompts", lambda v: len(set(v)) == len(v) and all(x.strip() for x in v),
     "a list of distinct non-empty strings"),
    ("data.synth.code_share", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("data.synth.topics", lambda v: len(set(v)) == len(v) and all(x.strip() for x in v),
     "a list of distinct non-empty strings ([] = none)"),
    ("data.synth.near_dup", lambda v: 0 < v <= 1, "in (0, 1] (word-3-gram Jaccard; 1 = exact duplicates only)"),
    ("data.synth.overlap", lambda v: 0 < v <= 1, "in (0, 1] (share of word 3-grams from one eval prompt)"),
    ("data.synth.min_ascii_letters", lambda v: 0 <= v <= 1, "in [0, 1] (0 = no language filter)"),
    ("data.synth.max_rounds", lambda v: v >= 1, ">= 1"),
    ("distill.max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("distill.batch_size", lambda v: v >= 1, ">= 1"),
    ("distill.turns", lambda v: v in ("last", "all"), "'last' or 'all'"),
    ("distill.max_prompt_tokens", lambda v: v >= 0, ">= 0 (0 = extract.max_length - distill.max_new_tokens)"),
    ("distill.splits", lambda v: len(v) > 0 and set(v) <= set(FEATURE_SPLITS),
     f"a non-empty list of splits among {list(FEATURE_SPLITS)} to regenerate (to regenerate none, set "
     f"'distill.enabled: false')"),
    ("distill.backend", lambda v: v in ("hf", "server"), "'hf' or 'server'"),
    ("extract.max_length", lambda v: v >= 8, ">= 8"),
    ("extract.dtype", lambda v: v in _STORAGE_DTYPES,
     f"one of {_STORAGE_DTYPES} (hidden states are stored in it; float8_e4m3fn: aux states in fp8 with "
     f"per-token scales, final state bfloat16)"),
    ("extract.batch_size", lambda v: v >= 1, ">= 1"),
    ("extract.shard_samples", lambda v: v >= 1, ">= 1"),
    ("extract.aux_layers", lambda v: v is None or (len(v) > 0 and min(v) >= 1 and v == sorted(set(v))),
     "null or HF hidden_states indices >= 1, unique and ascending"),
    ("vocab.draft_vocab_size", lambda v: v >= 1, ">= 1"),
    ("stand_in.draft_vocab_size", lambda v: v >= 1, ">= 1"),
    ("stand_in.order", lambda v: v in ("target_id", "frequency"), "'target_id' or 'frequency'"),
    ("stand_in.lr", lambda v: 0 < v < 1, "in (0, 1)"),
    ("stand_in.epochs", lambda v: 1 <= v <= MAX_EPOCHS, EPOCHS_RANGE),
    ("remap.min_shared_fraction", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("train.ttt_length", lambda v: v >= 1, ">= 1"),
    ("train.step_decay", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("train.batch_tokens", lambda v: v >= 1, ">= 1"),
    ("train.epochs", lambda v: 1 <= v <= MAX_EPOCHS, EPOCHS_RANGE),
    ("train.warmup_ratio", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("train.weight_decay", lambda v: v >= 0, ">= 0"),
    ("train.grad_clip", lambda v: v > 0,
     "> 0 (the gradients' total L2 norm is clipped to it; 0 or less would zero or flip them)"),
    ("train.eval_every", lambda v: v >= 1, ">= 1"),
    ("train.strategy", lambda v: v in ("ddp", "fsdp"),
     "'ddp' or 'fsdp' (eyas/training/distributed.py: DDP replicates the drafter, FSDP2 shards it)"),
    ("train.mode", lambda v: v in ("offline", "online"),
     "'offline' (extract stores the aux hidden states) or 'online' (extract stores tokens only; the train "
     "stages run the target batch by batch: eyas/training/online.py)"),
    ("train.loss_tokens", lambda v: v in LOSS_TOKENS,
     "'assistant' (assistant turns only, as EAGLE-3 and SpecForge) or 'all' (every token: the teacher is the "
     "target's own distribution, prompt tokens included: eyas.training.batches.supervised)"),
    ("train.max_steps", lambda v: v >= 0, ">= 0 (0 = epochs decide)"),
    ("train.checkpoint_every", lambda v: v >= 0, ">= 0 (0 = no checkpoints)"),
    ("train.nproc", lambda v: v >= 0, ">= 0 (0 = one per CUDA device)"),
    ("train_finetune.lr", lambda v: 0 < v < 1, "in (0, 1)"),
    ("train_finetune.gate_margin", lambda v: v >= 0, ">= 0 (a negative margin would not flag a loss above chance)"),
    ("train_finetune.gate_min_acc", lambda v: 0 <= v < 1, "in [0, 1) (a floor of 1 refuses every drafter)"),
    ("eval.num_draft_tokens", lambda v: v >= 1, ">= 1"),
    ("eval.max_new_tokens", lambda v: v >= 2, ">= 2 (the first token comes from the prefill, not a verify step)"),
    ("eval.chat_prompts", lambda v: v >= 1, ">= 1"),
    ("eval.humaneval_prompts", lambda v: 1 <= v <= 164, "in [1, 164] (HumanEval has 164 problems)"),
    ("eval.max_prompt_tokens", lambda v: v >= 0, ">= 0 (0 = no prompt budget)"),
    ("eval.timed_prompts", lambda v: v >= 0, ">= 0 (0 = every prompt is decoded for real)"),
    ("eval.batch_size", lambda v: v >= 1, ">= 1"),
    ("eval.timing_repeats", lambda v: v >= 1, ">= 1 (each prompt's greedy and speculative runs are timed this often)"),
    ("eval.served_prompts", lambda v: v >= 0, ">= 0 (0 = no served table)"),
    ("eval.served_max_new_tokens", lambda v: v >= 2, ">= 2"),
    ("eval.temperatures", lambda v: len(v) > 0 and len(set(v)) == len(v) and all(t >= 0 for t in v),
     "a non-empty list of distinct numbers >= 0 (0 = greedy; a repeat would decode every prompt twice)"),
    ("eval.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("eval.seeds", lambda v: len(v) > 0 and len(set(v)) == len(v) and all(0 <= s < _SEED_MAX for s in v),
     "a non-empty list of distinct integers in [0, 2**63)"),
    ("eval.tree_topk", lambda v: v >= 1, ">= 1"),
    ("eval.tree_num_steps", lambda v: v >= 1, ">= 1"),
    ("serve.engine", lambda v: v in ("llamacpp", "none"),
     "'llamacpp' (llama-server serves each drafter in the eval) or 'none'"),
    ("serve.threads", lambda v: v >= 1, ">= 1"),
]


def _base_url(v: str) -> bool:
    """``http(s)://host[:port]`` with at most a ``/`` after it (eyas.data.serving appends ``/v1/...``)."""
    try:
        u = urllib.parse.urlsplit(v)
        u.port  # noqa: B018 - raises ValueError on a port that is not a number in [0, 65535]
    except ValueError:
        return False
    return (u.scheme in ("http", "https") and bool(u.hostname) and u.path in ("", "/") and not u.query
            and not u.fragment and not any(c.isspace() for c in v))


# checked only when self-distill runs through a server ('distill.backend: server')
_SERVER_RANGES = [
    ("distill.server.api", lambda v: v in ("vllm", "sglang", "llamacpp"), "'vllm', 'sglang' or 'llamacpp'"),
    ("distill.server.url", _base_url,
     "an http:// or https:// base URL with a host and no path, e.g. http://127.0.0.1:8000 (not .../v1: "
     "eyas appends /v1/completions, /generate or /completion)"),
    ("distill.server.model", lambda v: v != "", "the served model's name (GET /v1/models)"),
    ("distill.server.revision", lambda v: v.strip() != "",
     "the served weights' revision (a hub commit sha or a weights hash): DVC reruns self-distill when it changes"),
    ("distill.server.concurrency", lambda v: 1 <= v <= 1024, "in [1, 1024] (one thread per request in flight)"),
    ("distill.server.timeout", lambda v: math.isfinite(v) and v > 0, "a finite number > 0 (seconds)"),
]


def _check_ranges(params: "Params", source: str) -> None:
    flat = flatten(params)
    server = params.distill.enabled and params.distill.backend == "server"
    for key, ok, what in _RANGES + (_SERVER_RANGES if server else []):
        if not ok(flat[key]):
            suffix = " when 'distill.backend' is 'server'" if key.startswith("distill.server.") else ""
            raise ParamsError(f"{source}: '{key}' must be {what}{suffix}, got {flat[key]!r}")
    f, v = params.train_finetune, params.vocab.draft_vocab_size
    if v >= 2 and f.gate_margin >= math.log(v):
        raise ParamsError(f"{source}: 'train_finetune.gate_margin' ({f.gate_margin}) must be < "
                          f"ln('vocab.draft_vocab_size') = ln({v}) = {math.log(v):.3f}: a margin past chance flags "
                          f"every drafter")
    e = params.eval
    if e.tree_topk > params.vocab.draft_vocab_size:
        raise ParamsError(f"{source}: 'eval.tree_topk' ({e.tree_topk}) must be <= 'vocab.draft_vocab_size' "
                          f"({params.vocab.draft_vocab_size}): each tree node expands the drafter's top-k draft tokens")
    most = e.tree_topk + (e.tree_num_steps - 1) * e.tree_topk ** 2
    if not 2 <= e.tree_num_draft_tokens <= most + 1:
        raise ParamsError(f"{source}: 'eval.tree_num_draft_tokens' must be in [2, {most + 1}] (the root and up to "
                          f"tree_topk + (tree_num_steps - 1) * tree_topk**2 candidates), got {e.tree_num_draft_tokens}")
    d, length = params.distill, params.extract.max_length
    if d.enabled and d.max_new_tokens >= length:
        raise ParamsError(f"{source}: 'distill.max_new_tokens' ({d.max_new_tokens}) must be < "
                          f"'extract.max_length' ({length}): the reply must fit a sample")
    if d.enabled and d.max_prompt_tokens and d.max_prompt_tokens + d.max_new_tokens > length:
        raise ParamsError(f"{source}: 'distill.max_prompt_tokens' ({d.max_prompt_tokens}) + 'distill.max_new_tokens' "
                          f"({d.max_new_tokens}) must be <= 'extract.max_length' ({length}): extract would cut the "
                          f"target's reply off the longest prompts (0 = extract.max_length - max_new_tokens)")
    data = params.data
    held_out = data.val + data.test + data.publish
    if data.max_conversations and held_out >= data.max_conversations:
        raise ParamsError(f"{source}: 'data.max_conversations' ({data.max_conversations}) must be > 'data.val' + "
                          f"'data.test' + 'data.publish' ({data.val} + {data.test} + {data.publish} = {held_out}): "
                          f"no conversation would be left to train on")
    _check_synth(params, source)
    if params.target.path == "embedded" and params.target.gguf_file is not None:
        raise ParamsError(f"{source}: 'target.gguf_file' must be null when 'target.path' is 'embedded' (the "
                          f"embedded target names its own GGUF file), got {params.target.gguf_file!r}")
    src = params.remap.source
    if not (src == STAND_IN or (src.strip() and Path(src).is_dir())):
        raise ParamsError(
            f"{source}: 'remap.source' must be a local drafter directory (finetune/dvc.yaml's remap depends on it: "
            f"DVC hashes it and reruns remap when it changes) or {STAND_IN!r} (the stand-in, published/dvc.yaml), "
            f"got {src!r}: no such directory. A drafter on the Hugging Face Hub is not a path DVC can hash: "
            f"download it first, `hf download ORG/NAME --revision <commit sha> --local-dir models/published` "
            f"(and `dvc add models/published`, so DVC keeps it and queued experiments see it), then set "
            f"'remap.source: models/published'")


def _check_synth(params: "Params", source: str) -> None:
    """``data.synth``'s checks across keys (only when it is on)."""
    s, d, data = params.data.synth, params.distill, params.data
    if not s.prompts:
        return
    if not d.enabled or not {"train", "val"} <= set(d.splits):
        raise ParamsError(f"{source}: 'data.synth.prompts' ({s.prompts}) > 0 needs 'distill.enabled' true and "
                          f"'distill.splits' holding train and val (now {d.enabled}, {d.splits}): synthesized "
                          f"conversations have no replies until self-distill writes them")
    if s.min_prompt_tokens > s.max_prompt_tokens:
        raise ParamsError(f"{source}: 'data.synth.min_prompt_tokens' ({s.min_prompt_tokens}) must be <= "
                          f"'data.synth.max_prompt_tokens' ({s.max_prompt_tokens})")
    if s.code_share > 0 and not s.code_system_prompts:
        raise ParamsError(f"{source}: 'data.synth.code_system_prompts' must not be empty when "
                          f"'data.synth.code_share' ({s.code_share}) > 0")
    if s.mode == "only" and s.prompts <= data.val:
        raise ParamsError(f"{source}: 'data.synth.prompts' ({s.prompts}) must be > 'data.val' ({data.val}) with "
                          f"'data.synth.mode' only: val takes the first data.val of them, train the rest")


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate ``params.yaml`` (keys it leaves out come from :data:`DEFAULTS_FILE`).

    Raises:
        ParamsError: the file is missing, is not YAML, or fails :func:`parse_params`; an error about
            a key the file sets ends with its line (``(line 12 of params.yaml)``).
    """
    path = Path(path)
    raw = _read_yaml(path)
    try:
        return _parse_file(raw, path)
    except ParamsError as e:  # the schema names the keys; say where the file writes them
        where = key_lines(str(e).removeprefix(f"{path}: "), path.read_text(encoding="utf-8"))
        if where:
            e.args = (f"{e} ({where} of {path.name})", *e.args[1:])
        raise


def key_lines(message: str, text: str) -> str:
    """Where the YAML ``text`` writes the keys a params error ``message`` names (each quoted,
    ``'train.epochs'``): ``"line 12"`` for one key, ``"'a.b' line 3, 'c.d' line 9"`` for several,
    ``""`` when the text sets none of them (a default, or not YAML). The keys are those named before
    the value the message reports (``..., got ['lr']``): what it quotes from there on is no key."""
    message = re.split(r",\s+got ", message, maxsplit=1)[0]
    names = list(dict.fromkeys(re.findall(r"'([A-Za-z_][\w.\[\]-]*)'", message)))
    lines = {k: line for k in names if (line := yaml12.key_line(text, k))}
    if len(lines) == 1:
        return f"line {next(iter(lines.values()))}"
    return ", ".join(f"'{k}' line {line}" for k, line in lines.items())


def _parse_file(raw: dict, path: Path) -> Params:
    try:
        return parse_params(raw, str(path))
    except UnknownKeyError as e:
        stray = [k for k in e.keys if not _in_committed(path, k)]
        if not stray:
            raise
        raise UnknownKeyError(
            f"{e} -- {', '.join(repr(k) for k in stray)} is not in the committed {path.name} (git HEAD): "
            f"probably left by `dvc exp run -S +{stray[0]}=...` (DVC writes -S values into {path.name} "
            f"before the stage runs and does not take them out when it fails). Remove the key, or "
            f"`git checkout -- {path.name}` to restore the committed file", e.keys) from None


def _in_committed(path: Path, key: str) -> bool:
    """Whether dotted ``key`` is in git HEAD's version of ``path`` (True when git cannot tell)."""
    try:
        out = subprocess.run(["git", "show", f"HEAD:./{path.name}"], cwd=path.resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return True
    if out.returncode != 0:
        return True
    try:
        node = yaml12.load(out.stdout, f"git HEAD:{path.name}")
    except yaml12.YamlError:
        return True
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten a params dataclass (or dict) to the dotted keys ``dvc exp show`` uses."""
    if dataclasses.is_dataclass(obj):
        obj = dataclasses.asdict(obj)
    out: dict[str, Any] = {}
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def params_hash(obj: Any) -> str:
    """A short, stable hash of resolved params (sha256 of the sorted flat JSON), for run tags."""
    blob = json.dumps(flatten(obj), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]
