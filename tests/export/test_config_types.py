"""A drafter ``config.json`` whose values have the wrong JSON type (``"8"``, ``null``, ``true`` for a
size, a list for the whole file) is refused by every load path (``load_drafter``, ``eyas inspect``
of a checkpoint, ``eyas inspect`` of a GGUF against its checkpoint) with a message naming the file,
the key, the value and the type expected (eyas/export/engine_keys.py's ``kind`` column, checked by
eyas.export.engine_keys.read_config); a features manifest and a model.safetensors that cannot be read
are named too. Each case starts from a drafter that loads (the control), so the message is the
edit's."""

import json
import shutil

import pytest

from eyas.cli import main
from eyas.export import engine_keys
from eyas.export.eagle import ExportError
from eyas.export.inspector import inspect_checkpoint, inspect_gguf
from eyas.export.load import load_drafter
from eyas.export.speculators import write_speculators
from tests.export.test_gguf import _manifest, _tiny_drafter, _write_gguf
from tests.export.test_inspector import make_drafter

# config edit -> the message after "<path>/config.json: "
CASES = {
    "hidden_size_null": ({"hidden_size": None}, "hidden_size is null, expected an integer > 0"),
    "hidden_size_string": ({"hidden_size": "8"}, 'hidden_size is "8" (a string), expected an integer > 0'),
    "draft_vocab_true": ({"draft_vocab_size": True},
                         "draft_vocab_size is true (a boolean), expected an integer > 0"),
    "heads_zero": ({"num_attention_heads": 0}, "num_attention_heads is 0 (an integer), expected an integer > 0"),
    "eps_string": ({"rms_norm_eps": "1e-5"}, 'rms_norm_eps is "1e-5" (a string), expected a number > 0'),
    "flag_string": ({"norm_before_residual": "false"},
                    'norm_before_residual is "false" (a string), expected true or false'),
    "ids_mixed": ({"eagle_aux_hidden_state_layer_ids": [2, "4", 5]},
                  'eagle_aux_hidden_state_layer_ids is [2, "4", 5] (a list), expected a list of integers'),
    "ids_bools": ({"eagle_aux_hidden_state_layer_ids": [True, 4, 5]},
                  "eagle_aux_hidden_state_layer_ids is [true, 4, 5] (a list), expected a list of integers"),
    "eagle_config_list": ({"eagle_config": [1]}, "eagle_config is [1] (a list), expected a JSON object"),
    "eyas_record_list": ({"eyas": [8]}, "eyas is [8] (a list), expected a JSON object"),
    "target_layers_string": ({"eyas": {"num_target_layers": "8"}},
                             'eyas.num_target_layers is "8" (a string), expected an integer > 0'),
    "architectures_string": ({"architectures": "LlamaForCausalLMEagle3"},
                             'architectures is "LlamaForCausalLMEagle3" (a string), expected a list of strings'),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = _tiny_drafter(tmp_path_factory.mktemp("types") / "good")
    assert inspect_checkpoint(d)["errors"] == [] and load_drafter(d).config.hidden_size == 8  # the control
    return d


def _variant(good, tmp_path, name, changes):
    d = tmp_path / name
    shutil.copytree(good, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_wrong_type_is_refused_by_every_load_path_naming_file_and_key(good, tmp_path, name, capsys):
    changes, msg = CASES[name]
    d = _variant(good, tmp_path, name, changes)
    want = f"{d / 'config.json'}: {msg}"
    with pytest.raises(ExportError) as e:
        load_drafter(d)
    assert str(e.value) == want
    with pytest.raises(ExportError) as e:
        inspect_checkpoint(d)
    assert str(e.value) == want
    gg = _write_gguf(tmp_path / "d.gguf")
    with pytest.raises(ExportError) as e:
        inspect_gguf(gg, drafter_dir=d, num_target_layers=8)
    assert str(e.value) == want
    assert main(["inspect", str(d)]) == 2
    assert want in capsys.readouterr().err


def test_every_wrong_value_is_named_at_once_and_a_speculators_layer_config_is_checked(good, tmp_path):
    d = _variant(good, tmp_path, "two", {"hidden_size": "8", "vocab_size": None})
    with pytest.raises(ExportError) as e:
        load_drafter(d)
    assert str(e.value) == (f"{d / 'config.json'}: hidden_size is \"8\" (a string), expected an integer > 0; "
                            f"vocab_size is null, expected an integer > 0")
    s = tmp_path / "s"
    write_speculators(make_drafter(), s)
    assert load_drafter(s).config.hidden_size == 8  # the control: the speculators layout loads
    cfg = json.loads((s / "config.json").read_text())
    cfg["transformer_layer_config"]["intermediate_size"] = 16.0
    (s / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="transformer_layer_config.intermediate_size is 16.0 \\(a number\\), "
                                          "expected an integer > 0"):
        load_drafter(s)
    cfg["transformer_layer_config"] = "llama"
    (s / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match='transformer_layer_config is "llama" \\(a string\\), expected a JSON object'):
        inspect_checkpoint(s)


def test_null_means_absent_for_keys_a_drafter_can_be_built_without(good, tmp_path):
    d = _variant(good, tmp_path, "nulls", {"rope_scaling": None, "sliding_window": None, "head_dim": None,
                                           "eagle_config": None, "draft_vocab_size": None})
    assert engine_keys.type_problems(json.loads((d / "config.json").read_text())) == []


def test_the_whole_file_and_the_manifest_must_be_json_objects(good, tmp_path, capsys):
    d = tmp_path / "list"
    shutil.copytree(good, d)
    (d / "config.json").write_text("[1, 2]")
    want = f"{d / 'config.json'}: the top level is an array ([1, 2]), expected a JSON object"
    for load in (load_drafter, inspect_checkpoint):
        with pytest.raises(ValueError) as e:
            load(d)
        assert str(e.value) == want
    f = _manifest(tmp_path / "f", [2, 4, 5], num_layers=8)
    assert inspect_checkpoint(good, features=f)["errors"] == []  # the control: the same manifest as an object
    f.write_text(json.dumps([json.loads(f.read_text())]))
    with pytest.raises(ValueError) as e:
        inspect_checkpoint(good, features=f)
    assert str(e.value).startswith(f"{f}: the top level is an array ([{{")
    assert main(["inspect", str(good), "--features", str(f)]) == 2
    assert f"{f}: the top level is an array" in capsys.readouterr().err
    _manifest(tmp_path / "f", ["2", 4, 5], num_layers=8)
    with pytest.raises(ValueError) as e:
        inspect_checkpoint(good, features=f)
    assert str(e.value) == f'{f}: aux_layers is ["2", 4, 5], expected a list of integers'


def test_a_truncated_model_safetensors_is_named(good, tmp_path):
    d = tmp_path / "cut"
    shutil.copytree(good, d)
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:200])
    for load in (load_drafter, inspect_checkpoint):
        with pytest.raises(ValueError, match=f"^{w}: not a readable safetensors file"):
            load(d)
    with pytest.raises(ValueError, match=f"^{w}: not a readable safetensors file"):
        inspect_gguf(_write_gguf(tmp_path / "d.gguf"), drafter_dir=d, num_target_layers=8)


def test_every_row_of_the_table_has_a_type():
    assert all(k.kind in engine_keys._IS for k in engine_keys.ENGINE_KEYS)
    assert {k.key for k in engine_keys.ENGINE_KEYS if k.required} == {
        "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"}
    assert engine_keys.has_type(True, engine_keys.POS_INT) is False  # JSON true is not an integer
    assert engine_keys.has_type(1, engine_keys.POS_INT) is True
