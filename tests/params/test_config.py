"""The params schema: unknown keys and wrong types fail with the key's path; '5e-05' is a float;
params.yaml is the one source of default values."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml

from eyas.params import full as config
from eyas.params import schema
from eyas.params.full import (
    DEFAULTS_FILE,
    Params,
    ParamsError,
    default_params,
    flatten,
    load_params,
    params_hash,
    parse_params,
)


def test_repo_params_yaml_is_valid():
    p = load_params("params.yaml")
    assert isinstance(p.lr, float) and p.train.ttt_length >= 1


def test_dvc_written_float_string_is_read_as_float(tmp_path):
    # `dvc exp run -S lr=5e-5` writes `lr: 5e-05`: PyYAML (YAML 1.1) reads a string, DVC and eyas a float
    f = tmp_path / "params.yaml"
    f.write_text("lr: 5e-05\ntrain:\n  grad_clip: 1e-1\n")
    assert yaml.safe_load(f.read_text())["lr"] == "5e-05"
    p = load_params(f)
    assert p.lr == 5e-5 and p.train.grad_clip == 0.1


@pytest.mark.parametrize("raw, message", [
    ({"train": {"lr": 1e-3}}, "unknown key 'train.lr'"),
    ({"trian": {}}, "unknown key 'trian'"),
    ({"train": {"epochs": "two"}}, "'train.epochs' must be an integer"),
    ({"train": {"epochs": 2.5}}, "'train.epochs' must be an integer"),
    ({"lr": "fast"}, "'lr' must be a number"),
    ({"extract": {"aux_layers": [1, "x"]}}, r"'extract.aux_layers\[1\]' must be an integer"),
    ({"target": {"trust_remote_code": "yes"}}, "'target.trust_remote_code' must be true or false"),
    ({"eval": 3}, "'eval' must be a mapping"),
    # ranges: caught before any compute (each of these used to fail late or train silently wrong)
    ({"train": {"ttt_length": 0}}, "'train.ttt_length' must be >= 1"),
    ({"train": {"eval_every": 0}}, "'train.eval_every' must be >= 1"),
    # every epoch's batches are planned before the first step: 10**25 epochs stalled at start-up
    ({"train": {"epochs": 10 ** 25}},
     r"^params\.yaml: 'train.epochs' must be in \[1, 1000\] .*, got 10000000000000000000000000$"),
    ({"train": {"epochs": 0}}, r"'train.epochs' must be in \[1, 1000\]"),
    ({"stand_in": {"epochs": 1001}}, r"'stand_in.epochs' must be in \[1, 1000\]"),
    ({"train": {"grad_clip": -1.0}}, "'train.grad_clip' must be > 0"),
    ({"train": {"strategy": "zero3"}}, "'train.strategy' must be 'ddp' or 'fsdp'"),
    ({"extract": {"dtype": "int8"}}, "'extract.dtype' must be one of"),
    ({"data": {"val": 0}}, "'data.val' must be >= 1"),
    ({"eval": {"humaneval_prompts": 200}}, r"'eval.humaneval_prompts' must be in \[1, 164\]"),
    ({"lr": float("nan")}, r"^params\.yaml: 'lr' must be a finite number, got nan$"),
    ({"lr": "5e-5"}, r"^params\.yaml: 'lr' must be a number, got '5e-5'$"),  # quoted: a string to DVC too
    ({"eval": {"temperatures": [0.7, -1.0]}}, r"'eval.temperatures' must be a non-empty list of distinct numbers >= 0"),
    # a repeated temperature decoded every prompt twice and overwrote the same row
    ({"eval": {"temperatures": [0.7, 0.7]}},
     r"^params\.yaml: 'eval.temperatures' must be .*distinct.*, got \[0.7, 0.7\]$"),
    ({"eval": {"temperatures": [0.0, float("inf")]}},
     r"^params\.yaml: 'eval.temperatures\[1\]' must be a finite number"),
    # torch.Generator.manual_seed overflows past a signed 64-bit integer
    ({"eval": {"seeds": [0, 2 ** 64]}}, r"^params\.yaml: 'eval.seeds' must be .* in \[0, 2\*\*63\), got \[0, "),
    ({"eval": {"seeds": [-1]}}, r"'eval.seeds' must be .* in \[0, 2\*\*63\)"),
    ({"seed": 2 ** 63}, r"^params\.yaml: 'seed' must be in \[0, 2\*\*63\), got 9223372036854775808$"),
    ({"eval": {"tree_topk": 4097}, "vocab": {"draft_vocab_size": 4096}},
     r"^params\.yaml: 'eval.tree_topk' \(4097\) must be <= 'vocab.draft_vocab_size' \(4096\)"),
    ({"train": {"weight_decay": float("inf")}},  # YAML's .inf
     r"^params\.yaml: 'train.weight_decay' must be a finite number, got inf$"),
    ({"train": {"grad_clip": -float("inf")}}, r"^params\.yaml: 'train.grad_clip' must be a finite number, got -inf$"),
    ({"train_finetune": {"gate_margin": float("nan")}},
     r"^params\.yaml: 'train_finetune.gate_margin' must be a finite number, got nan$"),
    ({"train_finetune": {"gate_margin": -1.0}}, r"'train_finetune.gate_margin' must be >= 0"),
    # ln(96) = 4.564: a margin at or past chance would flag every drafter (the stage refused it only after upstream ran)
    ({"train_finetune": {"gate_margin": 4.6}, "vocab": {"draft_vocab_size": 96}},
     r"^params\.yaml: 'train_finetune.gate_margin' \(4.6\) must be < ln\('vocab.draft_vocab_size'\) = "
     r"ln\(96\) = 4.564"),
    ({"train_finetune": {"gate_min_acc": 1.0}}, r"'train_finetune.gate_min_acc' must be in \[0, 1\)"),
    # '' is Path('') = the working directory: it passed as a local directory
    ({"target": {"path": ""}}, r"^params\.yaml: 'target.path' must be a non-empty string"),
    ({"data": {"source": " "}}, r"^params\.yaml: 'data.source' must be a non-empty string"),
    ({"remap": {"source": ""}}, r"^params\.yaml: 'remap.source' must be a local drafter directory .*, got ''"),
    ({"remap": {"revision": None}}, r"unknown key 'remap.revision'"),  # hub ids went with it
    ({"train_scratch": {"lr": 1e-3}}, r"unknown key 'train_scratch'"),  # the scratch lr is the top-level lr
    ({"train_finetune": {"lr": 0.0}}, r"'train_finetune.lr' must be in \(0, 1\)"),
    ({"target": {"revision": ""}}, r"'target.revision' must be null \(the hub's main\) or a non-empty"),
    ({"target": {"gguf_file": ""}}, r"'target.gguf_file' must be null or a non-empty"),
    # a mistyped split was refused only inside the self-distill stage
    ({"distill": {"splits": ["train", "trian"]}},
     r"^params\.yaml: 'distill.splits' must be a non-empty list of splits among \['train', 'val', 'publish'\].*"
     r"got \['train', 'trian'\]$"),
    ({"distill": {"splits": ["test"]}}, r"'distill.splits' must be a non-empty list of splits among"),
    ({"eval": {"seeds": [1, 1]}}, r"'eval.seeds' must be a non-empty list of distinct integers"),
    ({"eval": {"top_p": 0.0}}, r"'eval.top_p' must be in \(0, 1\]"),
    ({"eval": {"tree_topk": 2, "tree_num_steps": 2, "tree_num_draft_tokens": 8}},
     r"'eval.tree_num_draft_tokens' must be in \[2, 7\]"),
    ({"extract": {"aux_layers": [3, 2]}}, "unique and ascending"),
    # an empty list regenerated nothing while distill.enabled said otherwise
    ({"distill": {"splits": []}}, r"^params\.yaml: 'distill\.splits' must be a non-empty list .*, got \[\]$"),
    ({"distill": {"max_new_tokens": 600}}, r"'distill.max_new_tokens' \(600\) must be < 'extract.max_length'"),
])
def test_bad_params_name_the_key(raw, message):
    with pytest.raises(ParamsError, match=message):
        parse_params(raw, "params.yaml")


SERVER = {"backend": "server", "server": {"model": "qwen3-8b", "revision": "abc123"}}


def _served(**server) -> dict:
    return {"distill": {**SERVER, "server": {**SERVER["server"], **server}}}


@pytest.mark.parametrize("server, message", [
    ({"timeout": 0.0}, r"'distill\.server\.timeout' must be a finite number > 0"),
    ({"url": "http://127.0.0.1:8000/v1"}, r"'distill\.server\.url' must be an http:// or https:// base URL .*no path"),
    ({"url": "http://"}, r"'distill\.server\.url' must be an http:// or https:// base URL"),
    ({"url": "https://"}, r"'distill\.server\.url' must be"),
    ({"url": "http://exa mple:80"}, r"'distill\.server\.url' must be"),
    ({"url": "127.0.0.1:8000"}, r"'distill\.server\.url' must be"),
    ({"url": "ftp://host:21"}, r"'distill\.server\.url' must be"),
    ({"url": "http://host:99999"}, r"'distill\.server\.url' must be"),
    ({"url": "http://host:8000?x=1"}, r"'distill\.server\.url' must be"),
    ({"concurrency": 0}, r"'distill\.server\.concurrency' must be in \[1, 1024\]"),
    ({"concurrency": 1025}, r"'distill\.server\.concurrency' must be in \[1, 1024\]"),
    ({"revision": ""}, r"'distill\.server\.revision' must be the hosted weights' revision"),
    ({"revision": "  "}, r"'distill\.server\.revision' must be"),
    ({"model": ""}, r"'distill\.server\.model' must be the hosted model's name"),
])
def test_bad_server_params_name_the_key_and_file(tmp_path, server, message):
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump(_served(**server)))
    with pytest.raises(ParamsError, match=rf"^{re.escape(str(f))}: {message}.* when 'distill\.backend' is 'server'"):
        load_params(f)


@pytest.mark.parametrize("timeout", [float("inf"), -float("inf"), float("nan")])
def test_a_non_finite_server_timeout_is_refused_as_every_float_is(tmp_path, timeout):
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump(_served(timeout=timeout)))
    with pytest.raises(ParamsError, match=rf"^{re.escape(str(f))}: 'distill\.server\.timeout' must be a finite number"):
        load_params(f)


def test_server_params_are_checked_only_for_the_server_backend(tmp_path):
    ok = parse_params(_served(url="https://engine.example:443/", concurrency=1024, timeout=1e-3), "p.yaml")
    assert ok.distill.server.url == "https://engine.example:443/" and ok.distill.server.concurrency == 1024
    hf = parse_params({"distill": {"backend": "hf", "server": {"revision": "", "url": "http://h/v1", "timeout": 0}}},
                      "p.yaml")
    assert hf.distill.server.revision == "" and hf.distill.server.url == "http://h/v1"
    off = parse_params({"distill": {"enabled": False, "backend": "server", "server": {"revision": ""}}}, "p.yaml")
    assert off.distill.server.revision == ""


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ParamsError, match="no such params file"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(bad)


@pytest.mark.parametrize("source", ["RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", "models/publishd"])
def test_remap_source_is_a_directory_dvc_can_hash_not_a_hub_id(tmp_path, monkeypatch, source):
    """finetune/dvc.yaml's remap depends on ``${remap.source}``: a hub id (or a missing directory)
    is refused before any compute, saying how to download a hub drafter and point remap.source at it."""
    monkeypatch.chdir(tmp_path)  # relative to the repository root, where the stages run
    with pytest.raises(ParamsError, match=rf"^params\.yaml: 'remap.source' must be a local drafter directory "
                                          rf".*got '{re.escape(source)}': no such directory\. .*`hf download ORG/NAME "
                                          rf"--revision <commit sha> --local-dir models/published`"):
        parse_params({"remap": {"source": source}}, "params.yaml")
    (tmp_path / source).mkdir(parents=True)  # downloaded: a directory like any other
    assert parse_params({"remap": {"source": source}}).remap.source == source
    # the stand-in's directory need not exist: published/dvc.yaml makes it before remap runs
    assert not (tmp_path / "models/stand_in").exists()
    assert parse_params({"remap": {"source": "models/stand_in"}}).remap.source == "models/stand_in"


def test_flatten_and_hash():
    p = parse_params({"lr": 1e-4, "extract": {"aux_layers": [1, 2, 3]}})
    flat = flatten(p)
    assert flat["lr"] == 1e-4 and flat["extract.aux_layers"] == [1, 2, 3]
    assert flat["train.ttt_length"] == p.train.ttt_length
    assert params_hash(p) == params_hash(parse_params({"lr": 1e-4, "extract": {"aux_layers": [1, 2, 3]}}))
    assert params_hash(p) != params_hash(parse_params({"lr": 2e-4}))


# ------------------------------------------------------------ params.yaml: the one source of defaults

def _schema_keys(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every leaf field of the schema under its dotted key (``unread``, the sections a stage did not
    load, is no key of the file)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name == "unread":
            continue
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out[f"{prefix}{f.name}"] = f
            out.update(_schema_keys(tp, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = f
    return out


def _yaml_keys(node: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in node.items():
        out.add(f"{prefix}{k}")
        if isinstance(v, dict):
            out |= _yaml_keys(v, f"{prefix}{k}.")
    return out


def test_no_default_value_outside_params_yaml():
    """A default in a dataclass would be a second source that can drift from params.yaml (about 15
    did before); every field must take its value from params.yaml."""
    with_default = [k for k, f in _schema_keys(Params).items()
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
    assert with_default == [], \
        f"eyas/params/ gives these fields defaults (params.yaml holds them): {with_default}"


def test_repo_params_yaml_sets_every_schema_key_and_no_other():
    assert DEFAULTS_FILE == Path(__file__).resolve().parents[2] / "params.yaml"
    raw = yaml.safe_load(DEFAULTS_FILE.read_text())  # read without eyas.params
    assert _yaml_keys(raw) == set(_schema_keys(Params))
    flat = flatten(default_params())  # the defaults are exactly the file's values
    assert flat == flatten(raw)
    assert flat["train.epochs"] == raw["train"]["epochs"] and flat["eval.chat_prompts"] == raw["eval"]["chat_prompts"]


def test_a_partial_file_takes_the_rest_from_params_yaml(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("train:\n  epochs: 1\neval:\n  chat_prompts: 3\n")
    p, d = load_params(f), default_params()
    assert p.train.epochs == 1 and p.eval.chat_prompts == 3
    assert dataclasses.replace(p.train, epochs=d.train.epochs) == d.train
    assert dataclasses.replace(p.eval, chat_prompts=d.eval.chat_prompts) == d.eval
    assert p.data == d.data and p.lr == d.lr


def test_a_key_missing_from_params_yaml_is_named(tmp_path, monkeypatch):
    raw = yaml.safe_load(DEFAULTS_FILE.read_text())
    del raw["train"]["nproc"], raw["seed"]
    defaults = tmp_path / "params.yaml"
    defaults.write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(schema, "DEFAULTS_FILE", defaults)
    with pytest.raises(ParamsError, match=r"^params.yaml: missing key 'seed'"):
        parse_params({}, "params.yaml")
    with pytest.raises(ParamsError, match=r"missing key 'train.nproc'"):
        parse_params({"seed": 1}, "params.yaml")
    assert parse_params({"seed": 1, "train": {"nproc": 2}}).train.nproc == 2
    monkeypatch.setattr(schema, "DEFAULTS_FILE", tmp_path / "gone.yaml")
    with pytest.raises(ParamsError, match="gone.yaml: no such params file"):
        default_params()


def test_a_stage_that_loads_some_sections_hashes_the_params_as_one_that_loads_all(tmp_path):
    """The MLflow parent run is found by the params hash of whichever stage runs first: a float key
    written as an int (``dvc exp run -S train.grad_clip=1`` writes ``1``) is ``1.0`` where its section
    is loaded and ``1`` as read where it is not; both hash the same, and the loaded values are typed."""
    from eyas.params import data, train
    from eyas.params.schema import load_sections

    f = tmp_path / "params.yaml"
    f.write_text("train:\n  grad_clip: 1\n  step_decay: 1\neval:\n  temperatures: [0, 1]\n")
    some, typed, every = load_sections(data, path=f), load_sections(train, path=f), config.load_params(f)
    assert (typed.train.grad_clip, type(typed.train.grad_clip)) == (1.0, float)
    assert some.unread["train"]["grad_clip"] == 1 and not hasattr(some, "train")
    assert params_hash(some) == params_hash(typed) == params_hash(every)
    assert flatten(some) == flatten(every)  # 1 == 1.0: the same values, every key
