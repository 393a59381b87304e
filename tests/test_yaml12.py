"""Params files read as DVC reads them: every scalar on which YAML 1.1 (PyYAML) and YAML 1.2 (DVC's
ruamel.yaml) disagree gets DVC's value in the stage's typed params, in a preset, in ``eyas.preset
--write`` and in ``train.nproc``; DVC's own parser (``dvc.utils.serialize.parse_yaml``) is the oracle."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from dvc.utils.serialize import parse_yaml

from eyas import launch, preset, yaml12
from eyas.config import ParamsError, load_params

ROOT = Path(__file__).resolve().parents[1]

# text -> (DVC's value, PyYAML's value): each row is a scalar the two readings disagree on
DISAGREE = {
    "050": (50, 40),             # YAML 1.1 octal
    "5e-5": (5e-5, "5e-5"),      # YAML 1.1 needs a dot in a float
    "0o12": (10, "0o12"),        # YAML 1.2 octal
    "1:30": ("1:30", 90),        # YAML 1.1 base 60
    "on": ("on", True),          # YAML 1.1 boolean
}


@pytest.mark.parametrize("text", DISAGREE)
def test_the_disagreements_are_real_and_eyas_takes_dvcs_side(text):
    dvc_value, pyyaml_value = DISAGREE[text]
    doc = f"k: {text}\n"
    assert yaml.safe_load(doc)["k"] == pyyaml_value  # the reading eyas used to make
    assert parse_yaml(doc, "params.yaml")["k"] == dvc_value
    assert yaml12.load(doc, "params.yaml")["k"] == dvc_value
    assert yaml12.load(yaml12.dump({"k": dvc_value}), "dumped") == {"k": dvc_value}
    assert parse_yaml(yaml12.dump({"k": dvc_value}), "dumped") == {"k": dvc_value}


def test_a_stage_runs_with_the_values_dvc_hashed(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("lr: 5e-5\ndata:\n  max_conversations: 0240\neval:\n  max_new_tokens: 0o20\n")
    dvc_view = parse_yaml(f.read_text(), str(f))
    p = load_params(f)
    assert (p.lr, p.data.max_conversations, p.eval.max_new_tokens) == (5e-5, 240, 16)
    d = dvc_view
    assert (d["lr"], d["data"]["max_conversations"], d["eval"]["max_new_tokens"]) == (5e-5, 240, 16)


def test_a_duplicate_key_is_refused_with_its_line(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("lr: 1.0e-4\ntrain:\n  epochs: 2\n  epochs: 3\n")  # PyYAML keeps 3 silently
    assert yaml.safe_load(f.read_text())["train"]["epochs"] == 3
    with pytest.raises(ParamsError, match=rf"(?s)^{f}: not valid YAML: .*duplicate key \"epochs\".*line 4"):
        load_params(f)


def test_a_preset_and_its_written_params_keep_dvcs_values(tmp_path):
    base = tmp_path / "params.yaml"
    base.write_text((ROOT / "params.yaml").read_text())
    pre = tmp_path / "p.yaml"
    pre.write_text("data:\n  max_conversations: 0300\ntrain:\n  epochs: 0o3\n")
    assert preset.load_preset(pre) == {"data": {"max_conversations": 300}, "train": {"epochs": 3}}
    out = tmp_path / "merged.yaml"
    assert preset.main([str(pre), "--params", str(base), "--write", str(out)]) == 0
    p = load_params(out)
    assert (p.data.max_conversations, p.train.epochs) == (300, 3)
    assert parse_yaml(out.read_text(), str(out))["data"]["max_conversations"] == 300


def test_nproc_is_read_as_dvc_reads_it(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("train:\n  nproc: 010\n")
    assert launch.nproc_from_params(f) == 10 == parse_yaml(f.read_text(), str(f))["train"]["nproc"]
