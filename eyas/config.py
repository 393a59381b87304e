"""Typed parameters: the schema of ``params.yaml``.

Every section of ``params.yaml`` is a dataclass below; defaults live here, in one visible place.
:func:`load_params` rejects unknown keys and wrong types with the key's dotted path, before any
compute. PyYAML reads ``5e-05`` (the form ``dvc exp run -S lr=5e-5`` writes) as a string; a float
field accepts such a string when it parses as a float (YAML 1.2 would read it as a float).

Booleans are read as DVC reads them: DVC parses ``params.yaml`` as YAML 1.2 (ruamel.yaml), where only
``true``/``false`` are booleans, and ``dvc exp run -S flag=yes`` writes ``flag: yes``, which DVC
then records as the string ``"yes"``. PyYAML follows YAML 1.1, where ``yes``/``no``/``on``/``off``
are booleans too; :func:`load_params` uses YAML 1.2's boolean rule, so ``yes`` is a string for eyas
as well, and a bool field refuses it (one reading, never a silent disagreement).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import subprocess
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ParamsError(ValueError):
    """A params file is malformed: the message names the file and the key's dotted path."""


class UnknownKeyError(ParamsError):
    """A params file holds keys the schema does not know (``keys``: their dotted paths)."""

    def __init__(self, msg: str, keys: list[str]):
        super().__init__(msg)
        self.keys = keys


class _Yaml12Bools(yaml.SafeLoader):
    """PyYAML's SafeLoader with YAML 1.2's booleans: only true/false (any case form YAML 1.2 core
    allows); yes/no/on/off stay strings, as DVC (ruamel.yaml, YAML 1.2) reads them."""


_Yaml12Bools.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Yaml12Bools.add_implicit_resolver("tag:yaml.org,2002:bool",
                                   re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


@dataclass
class TargetParams:
    path: str = "embedded"
    gguf_file: str | None = None
    revision: str | None = None    # hub ids: the commit (or tag) to load; pins the target for DVC
    trust_remote_code: bool = False
    dtype: str = "float32"


@dataclass
class DataParams:
    source: str = "chitchat"
    max_conversations: int = 1400
    val: int = 60
    test: int = 40
    publish: int = 300
    on_bad_line: str = "error"
    code_prompts: int = 0          # code conversations added to train + val (eyas.code_data); 0 = off


@dataclass
class DistillParams:
    """Self-distillation (stage self-distill): the target regenerates assistant turns."""
    enabled: bool = True           # false: copy the splits unchanged (the DAG stays the same)
    turns: str = "last"            # 'last': the last assistant turn; 'all': every one (eyas.distill)
    max_new_tokens: int = 96       # generation budget per reply (eval.max_new_tokens by default)
    batch_size: int = 16           # prompts per generate() call (left padding, sorted by length)
    max_prompt_tokens: int = 0     # drop earliest turns beyond this; 0 = extract.max_length - max_new_tokens
    splits: list[str] = field(default_factory=lambda: ["train", "val", "publish"])


@dataclass
class ExtractParams:
    max_length: int = 512
    aux_layers: list[int] | None = None
    dtype: str = "bfloat16"
    batch_size: int = 4
    shard_samples: int = 256


@dataclass
class VocabParams:
    draft_vocab_size: int = 8192


@dataclass
class StandInParams:
    draft_vocab_size: int = 6144
    order: str = "frequency"
    lr: float = 1e-3
    epochs: int = 2


@dataclass
class RemapParams:
    source: str = "models/stand_in"
    min_shared_fraction: float = 0.5


@dataclass
class TrainParams:
    ttt_length: int = 4
    step_decay: float = 0.8
    batch_tokens: int = 2048
    epochs: int = 2
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    eval_every: int = 100
    max_steps: int = 0
    checkpoint_every: int = 0  # optimizer steps between resumable checkpoints; 0 = none
    nproc: int = 1             # processes under torchrun (eyas.launch); 0 = one per CUDA device
    strategy: str = "ddp"      # data parallelism with nproc > 1: 'ddp' (replicas) or 'fsdp' (FSDP2 shards)


@dataclass
class TrainScratchParams:
    lr: float = 1e-3


@dataclass
class TrainFinetuneParams:
    gate_margin: float = 0.5
    gate_min_acc: float = 0.05
    gate_override: bool = False


@dataclass
class EvalParams:
    num_draft_tokens: int = 4
    max_new_tokens: int = 128
    chat_prompts: int = 20
    humaneval_prompts: int = 20
    timing_repeats: int = 1        # timed greedy + speculative runs per prompt (eyas.speculative.evaluate_prompts)
    max_prompt_tokens: int = 0     # chat: earliest turns of a longer prompt dropped (eyas.distill.fit_prompt); 0 = none
    timed_prompts: int = 0         # prompts per benchmark decoded for real (timed, lossless check); 0 = all
    batch_size: int = 64           # prompts per batched greedy call for the untimed prompts' reference
    # the served table (eyas/served.py): chain vs tree vs sampled on the first served_prompts prompts
    served_prompts: int = 2        # prompts per benchmark decoded for the table; 0 = no table
    served_max_new_tokens: int = 16
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7, 1.0])  # 0 = greedy
    top_p: float = 0.95
    seeds: list[int] = field(default_factory=lambda: [0, 1])  # sampled runs per prompt at each temperature > 0
    tree_topk: int = 4             # SGLang --speculative-eagle-topk (its default: 4)
    tree_num_steps: int = 4        # SGLang --speculative-num-steps (tree depth; its default: 5)
    tree_num_draft_tokens: int = 8  # SGLang --speculative-num-draft-tokens (root counted; its default: 8)


@dataclass
class Params:
    lr: float = 3e-4
    seed: int = 0
    target: TargetParams = field(default_factory=TargetParams)
    data: DataParams = field(default_factory=DataParams)
    distill: DistillParams = field(default_factory=DistillParams)
    extract: ExtractParams = field(default_factory=ExtractParams)
    vocab: VocabParams = field(default_factory=VocabParams)
    stand_in: StandInParams = field(default_factory=StandInParams)
    remap: RemapParams = field(default_factory=RemapParams)
    train: TrainParams = field(default_factory=TrainParams)
    train_scratch: TrainScratchParams = field(default_factory=TrainScratchParams)
    train_finetune: TrainFinetuneParams = field(default_factory=TrainFinetuneParams)
    eval: EvalParams = field(default_factory=EvalParams)


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
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # '5e-05' as written by `dvc exp run -S`, read by PyYAML
            try:
                return float(value)
            except ValueError:
                pass
        raise ParamsError(f"{source}: '{path}' must be a number, got {value!r}")
    if tp is str:
        if not isinstance(value, str):
            raise ParamsError(f"{source}: '{path}' must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported schema type {tp!r} at {path}")  # a bug in this module


def _build(cls: type, raw: dict, prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        keys = [f"{prefix + '.' if prefix else ''}{k}" for k in unknown]
        where = ", ".join(f"'{k}'" for k in keys)
        raise UnknownKeyError(f"{source}: unknown key {where} (allowed: {', '.join(sorted(names))})", keys)
    kwargs = {
        k: _coerce(v, hints[k], f"{prefix + '.' if prefix else ''}{k}", source)
        for k, v in raw.items()
    }
    return cls(**kwargs)


def parse_params(raw: dict | None, source: str = "params.yaml") -> Params:
    """Validate a raw params mapping against the schema.

    Raises:
        ParamsError: on an unknown key, a wrong type or a value out of range (e.g. an empty
            ``distill.splits``); the message names ``source`` and the key's dotted path (e.g.
            ``params.yaml: 'train.lr' must be a number``).
    """
    params = _build(Params, raw or {}, "", source)
    _check_ranges(params, source)
    return params


_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# feature storage adds fp8: aux hidden states in e4m3 with per-token, per-layer scales (eyas/features.py)
_STORAGE_DTYPES = _FLOAT_DTYPES + ("float8_e4m3fn",)

# (dotted key, test, what it must be): checked after types, before any compute
_RANGES = [
    ("lr", lambda v: 0 < v < 1, "in (0, 1)"),
    ("target.dtype", lambda v: v in _FLOAT_DTYPES, f"one of {_FLOAT_DTYPES}"),
    ("data.max_conversations", lambda v: v >= 0, ">= 0 (0 = all)"),
    ("data.val", lambda v: v >= 1, ">= 1 (val features drive the step-0 gate and val metrics)"),
    ("data.test", lambda v: v >= 1, ">= 1 (eval prompts come from it)"),
    ("data.publish", lambda v: v >= 1, ">= 1 (the stand-in drafter trains on it)"),
    ("data.on_bad_line", lambda v: v in ("error", "skip"), "'error' or 'skip'"),
    ("data.code_prompts", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("distill.max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("distill.batch_size", lambda v: v >= 1, ">= 1"),
    ("distill.turns", lambda v: v in ("last", "all"), "'last' or 'all'"),
    ("distill.max_prompt_tokens", lambda v: v >= 0, ">= 0 (0 = extract.max_length - distill.max_new_tokens)"),
    ("distill.splits", lambda v: len(v) > 0,
     "a non-empty list of splits to regenerate (to regenerate none, set 'distill.enabled: false')"),
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
    ("stand_in.epochs", lambda v: v >= 1, ">= 1"),
    ("remap.min_shared_fraction", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("train.ttt_length", lambda v: v >= 1, ">= 1"),
    ("train.step_decay", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("train.batch_tokens", lambda v: v >= 1, ">= 1"),
    ("train.epochs", lambda v: v >= 1, ">= 1"),
    ("train.warmup_ratio", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("train.weight_decay", lambda v: v >= 0, ">= 0"),
    ("train.grad_clip", lambda v: v > 0, "> 0 (clip_grad_norm_ with <= 0 zeroes or flips the gradient)"),
    ("train.eval_every", lambda v: v >= 1, ">= 1"),
    ("train.strategy", lambda v: v in ("ddp", "fsdp"),
     "'ddp' or 'fsdp' (eyas/distributed.py: DDP replicates the drafter, FSDP2 shards it)"),
    ("train.max_steps", lambda v: v >= 0, ">= 0 (0 = epochs decide)"),
    ("train.checkpoint_every", lambda v: v >= 0, ">= 0 (0 = no checkpoints)"),
    ("train.nproc", lambda v: v >= 0, ">= 0 (0 = one per CUDA device)"),
    ("train_scratch.lr", lambda v: 0 < v < 1, "in (0, 1)"),
    ("train_finetune.gate_min_acc", lambda v: 0 <= v <= 1, "in [0, 1]"),
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
    ("eval.temperatures", lambda v: len(v) > 0 and all(t >= 0 for t in v),
     "a non-empty list of numbers >= 0 (0 = greedy)"),
    ("eval.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("eval.seeds", lambda v: len(v) > 0 and len(set(v)) == len(v), "a non-empty list of distinct integers"),
    ("eval.tree_topk", lambda v: v >= 1, ">= 1"),
    ("eval.tree_num_steps", lambda v: v >= 1, ">= 1"),
]


def _check_ranges(params: "Params", source: str) -> None:
    flat = flatten(params)
    for key, ok, what in _RANGES:
        if not ok(flat[key]):
            raise ParamsError(f"{source}: '{key}' must be {what}, got {flat[key]!r}")
    e = params.eval
    most = e.tree_topk + (e.tree_num_steps - 1) * e.tree_topk ** 2
    if not 2 <= e.tree_num_draft_tokens <= most + 1:
        raise ParamsError(f"{source}: 'eval.tree_num_draft_tokens' must be in [2, {most + 1}] (the root and up to "
                          f"tree_topk + (tree_num_steps - 1) * tree_topk**2 candidates), got {e.tree_num_draft_tokens}")
    if params.distill.enabled and params.distill.max_new_tokens >= params.extract.max_length:
        raise ParamsError(f"{source}: 'distill.max_new_tokens' ({params.distill.max_new_tokens}) must be < "
                          f"'extract.max_length' ({params.extract.max_length}): the reply must fit a sample")


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate ``params.yaml``.

    Raises:
        ParamsError: the file is missing, is not YAML, or fails :func:`parse_params`.
    """
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(), Loader=_Yaml12Bools)
    except FileNotFoundError:
        raise ParamsError(f"{path}: no such params file") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: the top level must be a mapping")
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
        node = yaml.load(out.stdout, Loader=_Yaml12Bools)
    except yaml.YAMLError:
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
