"""The params schema: unknown keys and wrong types fail with the key's path; '5e-05' is a float."""

import pytest
import yaml

from eyas.config import ParamsError, flatten, load_params, params_hash, parse_params


def test_repo_params_yaml_is_valid():
    p = load_params("params.yaml")
    assert isinstance(p.lr, float) and p.train.ttt_length >= 1


def test_dvc_written_float_string_is_read_as_float(tmp_path):
    # `dvc exp run -S lr=5e-5` writes `lr: 5e-05`, which PyYAML (YAML 1.1) reads as a string
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
    ({"train": {"grad_clip": -1.0}}, "'train.grad_clip' must be > 0"),
    ({"train": {"strategy": "zero3"}}, "'train.strategy' must be 'ddp' or 'fsdp'"),
    ({"extract": {"dtype": "int8"}}, "'extract.dtype' must be one of"),
    ({"data": {"val": 0}}, "'data.val' must be >= 1"),
    ({"eval": {"humaneval_prompts": 200}}, r"'eval.humaneval_prompts' must be in \[1, 164\]"),
    ({"lr": "nan"}, r"'lr' must be in \(0, 1\)"),
    ({"eval": {"temperatures": [0.7, -1.0]}}, r"'eval.temperatures' must be a non-empty list of numbers >= 0"),
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


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ParamsError, match="no such params file"):
        load_params(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(bad)


def test_flatten_and_hash():
    p = parse_params({"lr": 1e-4, "extract": {"aux_layers": [1, 2, 3]}})
    flat = flatten(p)
    assert flat["lr"] == 1e-4 and flat["extract.aux_layers"] == [1, 2, 3]
    assert flat["train.ttt_length"] == p.train.ttt_length
    assert params_hash(p) == params_hash(parse_params({"lr": 1e-4, "extract": {"aux_layers": [1, 2, 3]}}))
    assert params_hash(p) != params_hash(parse_params({"lr": 2e-4}))
