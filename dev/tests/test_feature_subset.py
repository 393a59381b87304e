"""dev/bench/feature_subset.py: every n-th shard of a feature split, read back as a store the
train stages open (the scaling table's smaller training sets)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.features import FeatureStore, ShardWriter
from eyas.training.batches import PackedLoader

SCRIPT = Path(__file__).resolve().parents[2] / "dev" / "bench" / "feature_subset.py"
sys.path.insert(0, str(SCRIPT.parent))
from feature_subset import subset  # noqa: E402


def _store(root: Path, lengths: list[int], shard_samples: int) -> list[dict]:
    """A float32 feature split of samples with the given lengths; returns the samples written."""
    g = torch.Generator().manual_seed(0)
    w, samples = ShardWriter(root, shard_samples=shard_samples, dtype=torch.float32), []
    for n in lengths:
        s = {"input_ids": torch.randint(0, 50, (n,), generator=g), "loss_mask": (torch.rand(n, generator=g) > 0.4),
             "aux_hidden": torch.randn(n, 2 * 4, generator=g), "final_hidden": torch.randn(n, 4, generator=g),
             "target_argmax": torch.randint(0, 50, (n,), generator=g)}
        w.add(s["input_ids"], s["loss_mask"], s["aux_hidden"], s["final_hidden"], s["target_argmax"])
        samples.append(s)
    w.finish(aux_layers=[1, 2], hidden_size=4, vocab_size=50, fingerprint={"stage": "extract", "params": {}})
    return samples


def test_every_nth_shard_whole_and_counted(tmp_path):
    lengths = [3, 5, 2, 7, 4, 6, 1, 8, 2, 3]  # shard_samples 2: 5 shards
    samples = _store(tmp_path / "train", lengths, shard_samples=2)
    m = subset(tmp_path / "train", tmp_path / "half" / "train", every=2)
    # shards 0, 2, 4 = samples 0-1, 4-5, 8-9, counted by hand from the lengths and masks above
    kept = [0, 1, 4, 5, 8, 9]
    assert [s["file"] for s in m["shards"]] == ["shard-00000.safetensors", "shard-00002.safetensors",
                                               "shard-00004.safetensors"]
    assert m["num_samples"] == 6 and m["num_tokens"] == sum(lengths[i] for i in kept) == 3 + 5 + 4 + 6 + 2 + 3
    assert m["supervised_tokens"] == sum(int(samples[i]["loss_mask"].sum()) for i in kept)
    assert m["subset"]["every"] == 2 and m["subset"]["num_tokens_of_source"] == sum(lengths)
    assert m["fingerprint"] == {"stage": "extract", "params": {}}  # what the train stages check, kept
    store = FeatureStore.open(tmp_path / "half" / "train")
    got = list(store.iter_samples())
    assert len(got) == len(kept)
    for i, s in zip(kept, got, strict=True):
        assert torch.equal(s["input_ids"], samples[i]["input_ids"].to(s["input_ids"].dtype))
        assert torch.equal(s["aux_hidden"], samples[i]["aux_hidden"])
    # the training loader reads it like any split: each kept sample once per epoch, lengths as written
    loader = PackedLoader(store, batch_tokens=16, seed=0)
    planned = sorted(loader.lengths[si][i] for batch in loader.plan(0) for row in batch for si, i in row)
    assert planned == sorted(lengths[i] for i in kept)


def test_every_one_is_the_whole_split_and_bad_arguments_are_named(tmp_path):
    _store(tmp_path / "train", [3, 5, 2], shard_samples=1)
    whole = subset(tmp_path / "train", tmp_path / "all", every=1)
    assert whole["num_tokens"] == 10 and len(whole["shards"]) == 3
    with pytest.raises(SystemExit, match=r"--every 4: must be 1\.\.3"):
        subset(tmp_path / "train", tmp_path / "x", every=4)
    with pytest.raises(SystemExit, match=r"--every 0"):
        subset(tmp_path / "train", tmp_path / "x", every=0)
    with pytest.raises(SystemExit, match="all: exists"):
        subset(tmp_path / "train", tmp_path / "all", every=1)
    with pytest.raises(SystemExit, match="no manifest"):
        subset(tmp_path / "nothing", tmp_path / "y", every=1)
    # an output inside the split (or holding it) would land among its shards or swallow it
    for out in (tmp_path / "train" / "half", tmp_path / "train" / ".." / "train" / "q", tmp_path):
        with pytest.raises(SystemExit, match="inside the split .* or holding it"):
            subset(tmp_path / "train", out, every=1)
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["manifest.json"] + [
        f"shard-0000{i}.safetensors" for i in range(3)]
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_broken_source_is_named_and_leaves_nothing(tmp_path):
    """A shard that is cut short, linked, missing or of another length than the manifest says, and a
    manifest that is not one: each named, and no output (nor its .tmp) left behind."""
    def fresh(name):
        root = tmp_path / name
        _store(root, [3, 5, 2, 4], shard_samples=1)
        return root

    cut = fresh("cut")
    (cut / "shard-00002.safetensors").write_bytes((cut / "shard-00002.safetensors").read_bytes()[:100])
    linked = fresh("linked")
    os.rename(linked / "shard-00002.safetensors", tmp_path / "elsewhere.safetensors")
    os.symlink("../elsewhere.safetensors", linked / "shard-00002.safetensors")
    missing = fresh("missing")
    (missing / "shard-00002.safetensors").unlink()
    miscounted = fresh("miscounted")
    m = json.loads((miscounted / "manifest.json").read_text())
    m["shards"][2]["tokens"] = 999
    (miscounted / "manifest.json").write_text(json.dumps(m))
    foreign = fresh("foreign")
    m = json.loads((foreign / "manifest.json").read_text())
    del m["shards"][1]["file"]
    (foreign / "manifest.json").write_text(json.dumps(m))
    for src, msg in [(cut, r"shard-00002.safetensors: cannot read its loss_mask"),
                     (linked, r"shard-00002.safetensors: a symbolic link"),
                     (missing, r"shard-00002.safetensors: listed in the manifest but missing"),
                     (miscounted, r"shard-00002.safetensors: 2 tokens, the manifest .* says 999"),
                     (foreign, r"manifest.json: not a feature manifest")]:
        out = tmp_path / "o" / src.name
        with pytest.raises(SystemExit, match=msg):
            subset(src, out, every=2)
        assert not (tmp_path / "o").exists(), src.name  # nor the directory made for it
    # the negative control: the same source, unbroken, subsets fine
    assert subset(fresh("whole"), tmp_path / "ok", every=2)["num_tokens"] == 3 + 2


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if "split" not in p.relative_to(root).parts)


def test_an_output_that_is_a_symbolic_link_is_refused_and_nothing_is_made(tmp_path):
    """A link as the output (dangling or not), or as its .tmp: one line naming it, nothing written."""
    _store(tmp_path / "split", [3, 5, 2, 4], shard_samples=1)
    (tmp_path / "dir").mkdir()
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    os.symlink(tmp_path / "dir", tmp_path / "to_dir")
    os.symlink(tmp_path / "nowhere", tmp_path / "sub.tmp")
    for out, link in [("dangling", "dangling"), ("to_dir", "to_dir"), ("sub", "sub.tmp")]:
        with pytest.raises(SystemExit) as e:
            subset(tmp_path / "split", tmp_path / out, every=2)
        assert str(e.value) == f"{tmp_path / link}: a symbolic link (to {os.readlink(tmp_path / link)}); give a new " \
                               f"directory"
        assert _leftovers(tmp_path) == ["dangling", "dir", "sub.tmp", "to_dir"]
    # the negative control: a new directory, there or under the link's target, is written
    assert subset(tmp_path / "split", tmp_path / "to_dir" / "half", every=2)["num_tokens"] == 3 + 2
    assert sorted(p.name for p in (tmp_path / "dir" / "half").iterdir()) == [
        "manifest.json", "shard-00000.safetensors", "shard-00002.safetensors"]


def test_a_failure_after_the_directories_are_made_removes_them(tmp_path):
    """A shard that fails its check, an output under a file: the temporary directory and every parent
    made for it removed, the existing ones kept."""
    src = tmp_path / "split"
    _store(src, [3, 5, 2, 4], shard_samples=1)
    (src / "shard-00002.safetensors").write_bytes(b"not a shard")
    (tmp_path / "keep").mkdir()
    with pytest.raises(SystemExit, match=r"shard-00002.safetensors: cannot read its loss_mask"):
        subset(src, tmp_path / "keep" / "a" / "b" / "half", every=2)
    assert _leftovers(tmp_path) == ["keep"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as e:
        subset(src, tmp_path / "file" / "half", every=1)
    assert str(e.value) == f"{tmp_path / 'file' / 'half.tmp'}: cannot write the subset (Not a directory)"
    assert _leftovers(tmp_path) == ["file", "keep"]


@pytest.mark.parametrize("text, message", [
    (b'{"format_version": 1, "shards": [}', r"{m}: not valid JSON \(line 1\): Expecting value"),
    (b'[1, 2]', r"{m}: the top level is an array \(\[1, 2\]\), expected a JSON object"),
    (b'{"caf\xe9": 1}', r"{m}: not UTF-8 text \(byte 5\)"),
    (b'{"format_version": 1}', r"{m}: not a feature manifest: no shards list \(a feature manifest lists its shards "
                               r"as \{{file, samples, tokens\}}\)"),
    (b'{"shards": {"file": "x"}}', r"{m}: not a feature manifest: no shards list"),
    (b'{"shards": [{"file": "x", "samples": 1}]}',
     r"{m}: not a feature manifest: shards\[0\] is \{{'file': 'x', 'samples': 1\}} \(a feature manifest"),
    (b'{"shards": ["x"]}', r"{m}: not a feature manifest: shards\[0\] is 'x'"),
    (b'{"shards": []}', r"{m}: format_version None != \d+"),
])
def test_a_broken_manifest_is_one_line_naming_it(tmp_path, text, message):
    src = tmp_path / "split"
    _store(src, [3, 5], shard_samples=1)
    (src / "manifest.json").write_bytes(text)
    want = message.format(m=str(src / "manifest.json"))
    with pytest.raises(SystemExit, match=rf"^{want}") as e:
        subset(src, tmp_path / "out", every=1)
    assert "\n" not in str(e.value)
    assert _leftovers(tmp_path) == []
    # and from the command line: that line, no traceback
    r = subprocess.run([sys.executable, str(SCRIPT),
                        str(src), str(tmp_path / "out"), "--every", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == "" and r.stderr == str(e.value) + "\n"


def test_a_manifest_aux_layers_of_another_type_is_named(tmp_path):
    src = tmp_path / "split"
    _store(src, [3, 5], shard_samples=1)
    m = json.loads((src / "manifest.json").read_text())
    (src / "manifest.json").write_text(json.dumps({**m, "aux_layers": 5}))
    with pytest.raises(SystemExit, match=rf"^{src / 'manifest.json'}: not a feature manifest \(argument of type "
                                         r"'int' is not iterable\)$"):
        subset(src, tmp_path / "out", every=1)


@pytest.mark.parametrize("name", ["sub/shard-00001.safetensors", "/abs/shard-00001.safetensors",
                                  "../shard-00001.safetensors", ".."])
def test_a_shard_outside_the_manifests_directory_is_named_as_such(tmp_path, name):
    """A shard listed with a directory in its name (present there, so the store itself opens) is
    refused for what it is, not blamed on the file system; the negative control, flat, subsets."""
    src = tmp_path / "split"
    _store(src, [3, 5, 2], shard_samples=1)
    m = json.loads((src / "manifest.json").read_text())
    if name.startswith("sub/"):
        (src / "sub").mkdir()
        os.rename(src / "shard-00001.safetensors", src / name)
    m["shards"][1]["file"] = name
    (src / "manifest.json").write_text(json.dumps(m))
    if name.startswith("sub/"):
        assert FeatureStore.open(src).manifest["shards"][1]["file"] == name  # a store the train stages open
    with pytest.raises(SystemExit) as e:
        subset(src, tmp_path / "out", every=1)
    assert str(e.value) == (f"{src / 'manifest.json'}: shards[1] file {name!r} is not a file name: a split holds its "
                            f"shards beside its manifest, and so does the subset")
    assert "file system" not in str(e.value) and _leftovers(tmp_path) == []
    m["shards"][1]["file"] = "shard-00001.safetensors"
    if name.startswith("sub/"):
        os.rename(src / name, src / "shard-00001.safetensors")
    (src / "manifest.json").write_text(json.dumps(m))
    assert subset(src, tmp_path / "out", every=1)["num_tokens"] == 10


@pytest.mark.parametrize("out", ["", ".", "..", "/", "x/.."])
def test_an_output_path_that_names_no_new_directory_is_one_line(tmp_path, monkeypatch, out):
    """'' (Path('') is '.'), '.', '..', '/': no name for the new directory (was a ValueError traceback
    from Path.with_name); the negative control, a name, subsets."""
    src = tmp_path / "split"
    _store(src, [3, 5], shard_samples=1)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        subset(src, out, every=1)
    assert str(e.value) == f"output {out!r}: give the path of a new directory for the subset, e.g. half/split"
    assert _leftovers(tmp_path) == []
    assert subset(src, "half", every=1)["num_tokens"] == 8


def test_an_output_path_the_file_system_refuses_is_one_line_and_leaves_nothing(tmp_path):
    """A 300-character name (ENAMETOOLONG, was a traceback before any directory was made), there or
    under a directory it would make; the negative control, 200 characters, subsets."""
    src = tmp_path / "split"
    _store(src, [3, 5], shard_samples=1)
    name = "a" * 300
    for out, named in ((tmp_path / name, tmp_path / name), (tmp_path / "new" / name, tmp_path / "new" / f"{name}.tmp")):
        with pytest.raises(SystemExit) as e:
            subset(src, out, every=1)
        assert str(e.value) == f"{named}: cannot write the subset (File name too long)"
        assert _leftovers(tmp_path) == []
    assert subset(src, tmp_path / "new" / ("a" * 200), every=1)["num_tokens"] == 8
    r = subprocess.run([sys.executable, str(SCRIPT),
                        str(src), "", "--every", "1"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (1, "", "output '': give the path of a new directory for the subset, "
                                                          "e.g. half/split\n")


@pytest.mark.parametrize("key, value", [("samples", -100), ("samples", True), ("tokens", False), ("tokens", -3)])
def test_a_shard_count_that_is_negative_or_a_bool_is_named(tmp_path, key, value):
    """JSON's true is an int to isinstance; a negative count would be summed into num_samples."""
    src = tmp_path / "split"
    _store(src, [3, 5], shard_samples=1)
    m = json.loads((src / "manifest.json").read_text())
    good = m["shards"][1][key]
    m["shards"][1][key] = value
    (src / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SystemExit) as e:
        subset(src, tmp_path / "out", every=1)
    assert str(e.value) == f"{src / 'manifest.json'}: shards[1] {key} is {value!r}, not a count (an int >= 0)"
    assert _leftovers(tmp_path) == []
    m["shards"][1][key] = good  # the negative control: the count as extracted
    (src / "manifest.json").write_text(json.dumps(m))
    assert subset(src, tmp_path / "out", every=1)["num_samples"] == 2


def test_a_shard_listed_twice_is_named(tmp_path):
    """Was only "cannot hard-link (File exists)" on the second link."""
    src = tmp_path / "split"
    _store(src, [3, 5, 2], shard_samples=1)
    m = json.loads((src / "manifest.json").read_text())
    m["shards"][2] = dict(m["shards"][0])
    (src / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SystemExit) as e:
        subset(src, tmp_path / "out", every=1)
    assert str(e.value) == (f"{src / 'manifest.json'}: shards[2] file 'shard-00000.safetensors' is listed twice "
                            f"(shards[0] too)")
    assert _leftovers(tmp_path) == []
    m["shards"] = m["shards"][:2]  # the negative control: each once
    (src / "manifest.json").write_text(json.dumps(m))
    assert subset(src, tmp_path / "out", every=1)["num_tokens"] == 8
