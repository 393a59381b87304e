"""Features at scale: the size estimate and the free-disk check, fp8 aux storage, a DVC remote
(real dvc and git in a temporary project), and the shard bytes: the direct shard writer
(eyas.io.save_safetensors_parts) against the safetensors library (a shard written part by part is
safetensors' own serialisation of the concatenated tensors; ShardWriter's shards read back as the
samples it was given)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eyas.features import (
    FP8,
    FeatureError,
    FeatureStore,
    NonFiniteFeatureError,
    ShardWriter,
    bytes_per_token,
    check_disk_space,
    dequantize_fp8,
    estimate_split_bytes,
    quantize_fp8,
)
from eyas.io import save_safetensors_parts
from eyas.params.full import ParamsError, parse_params
from eyas.training.batches import PackedLoader

sys.path.insert(0, str(Path(__file__).parent))


# --- size estimate ---------------------------------------------------------------------------

def test_bytes_per_token_hand_worked():
    # SmolLM2-135M: 3 aux layers, H = 576; ids + argmax int32 (8 bytes) + mask uint8 (1 byte)
    assert bytes_per_token(3, 576, torch.bfloat16) == 4 * 576 * 2 + 9 == 4617
    assert bytes_per_token(3, 576, torch.float32) == 4 * 576 * 4 + 9 == 9225
    # fp8: 3 * 576 one-byte aux values + 3 float32 scales, final state bf16 (576 * 2)
    assert bytes_per_token(3, 576, FP8) == 3 * 576 + 3 * 4 + 576 * 2 + 9 == 2901


def test_estimate_hand_worked():
    # 3 samples of 10/20/30 tokens in shards of 2 -> 2 shards, offsets 3 + 2 int64 entries
    assert estimate_split_bytes([10, 20, 30], 2, 3, 576, torch.bfloat16) == 60 * 4617 + 8 * 5 == 277060


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
def test_estimate_equals_bytes_written(tmp_path, dtype):
    n_aux, H, lengths = 2, 8, [5, 7, 3]
    g = torch.Generator().manual_seed(0)
    w = ShardWriter(tmp_path / "s", shard_samples=2, dtype=dtype)
    for n in lengths:
        w.add(torch.randint(0, 50, (n,), generator=g), torch.ones(n), torch.randn(n, n_aux * H, generator=g),
              torch.randn(n, H, generator=g), torch.randint(0, 50, (n,), generator=g))
    w.finish(aux_layers=[1, 2])
    est = estimate_split_bytes(lengths, 2, n_aux, H, dtype)
    assert w.bytes_written == est
    on_disk = sum(f.stat().st_size for f in (tmp_path / "s").glob("shard-*.safetensors"))
    assert est < on_disk < est + 2 * 1024  # + two safetensors headers


def test_disk_check_refuses_naming_path_and_bytes(tmp_path):
    out, work = tmp_path / "data/features", tmp_path / ".eyas" / "work" / "extract"  # neither exists yet
    # same filesystem: only the output is checked; 1000 bytes + 10% headroom = 1100
    with pytest.raises(FeatureError) as e:
        check_disk_space(out, 1000, work, 600, headroom=0.1, free_bytes=lambda p: 1099)
    msg = str(e.value)
    assert str(out) in msg and "need 1100 bytes" in msg and "1099 bytes" in msg
    r = check_disk_space(out, 1000, work, 600, headroom=0.1, free_bytes=lambda p: 1100)
    assert r == {"needed": {str(out): 1100}, "free": {str(out): 1100}}
    # the real free figure of this filesystem
    real = check_disk_space(out, 0, work, 0)
    assert real["free"][str(out)] == shutil.disk_usage(tmp_path).free


def test_disk_check_staging_on_another_filesystem(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem (/dev/shm) here")
    work = shm / f"eyas-test-{os.getpid()}"
    free = {str(tmp_path / "f"): 10_000, str(work): 500}
    with pytest.raises(FeatureError, match=f"{work}: not enough disk.*need 660 bytes.*500 bytes"):
        check_disk_space(tmp_path / "f", 1000, work, 600, headroom=0.1, free_bytes=lambda p: free[str(p)])
    free[str(work)] = 660
    r = check_disk_space(tmp_path / "f", 1000, work, 600, headroom=0.1, free_bytes=lambda p: free[str(p)])
    assert r["needed"] == {str(tmp_path / "f"): 1100, str(work): 660}


# --- fp8 aux storage -------------------------------------------------------------------------

def test_quantize_fp8_hand_worked():
    x = torch.tensor([[896.0, 1.0, -3.0, 0.5], [0.0, 0.0, 2.0, 2.0]])
    q, scale = quantize_fp8(x, groups=2)  # H = 2
    assert q.dtype == FP8 and scale.dtype == torch.float32
    # row 0: group 0 amax 896 -> scale 2, q = [448, 0.5]; group 1 amax 3 -> scale 3/448,
    # q = [-448, 74.67] and e4m3 has step 8 in [64, 128): 74.67 -> 72, i.e. 0.5 -> 72 * 3/448
    # row 1: an all-zero group keeps scale 1; [2, 2] -> scale 2/448, q = [448, 448]
    assert torch.allclose(scale, torch.tensor([[2.0, 3 / 448], [1.0, 2 / 448]]))
    assert q.float().tolist() == [[448.0, 0.5, -448.0, 72.0], [0.0, 0.0, 448.0, 448.0]]
    d = dequantize_fp8(q, scale, torch.float32)
    assert torch.allclose(d, torch.tensor([[896.0, 1.0, -3.0, 72 * 3 / 448], [0.0, 0.0, 2.0, 2.0]]))
    with pytest.raises(ValueError, match="not a multiple of 3 groups"):
        quantize_fp8(x, groups=3)


def test_fp8_store_reads_back_dequantised(tmp_path):
    from tests.tiny import tiny_target, write_features

    target = tiny_target()
    ref = write_features(target, tmp_path / "f32", 6, seed=3)  # float32 store: the reference
    w = ShardWriter(tmp_path / "fp8", shard_samples=4, dtype=FP8)
    for s in ref.iter_samples():
        w.add(s["input_ids"], s["loss_mask"], s["aux_hidden"], s["final_hidden"], s["target_argmax"])
    w.finish(**{k: ref.manifest[k] for k in ("aux_layers", "hidden_size", "vocab_size")})
    q = FeatureStore.open(tmp_path / "fp8")
    assert q.manifest["storage_dtype"] == "float8_e4m3fn"
    with safe_open(str(tmp_path / "fp8/shard-00000.safetensors"), framework="pt") as f:
        assert f.get_slice("aux_hidden").get_dtype() == "F8_E4M3"
        assert f.get_slice("final_hidden").get_dtype() == "BF16"
        assert f.get_slice("aux_hidden_scale").get_shape() == [f.get_slice("input_ids").get_shape()[0], 3]
    H = ref.manifest["hidden_size"]
    for a, b in zip(ref.iter_samples(), q.iter_samples(), strict=True):
        assert set(b) == set(a)  # scales never surface
        assert b["aux_hidden"].dtype == torch.bfloat16
        assert torch.equal(b["input_ids"], a["input_ids"]) and torch.equal(b["target_argmax"], a["target_argmax"])
        assert torch.equal(b["final_hidden"], a["final_hidden"].to(torch.bfloat16))
        for i in range(3):  # e4m3 + bf16 rounding: within 2**-4 + 2**-8 of the row's max per value
            x, y = a["aux_hidden"][:, i * H:(i + 1) * H], b["aux_hidden"][:, i * H:(i + 1) * H].float()
            bound = x.abs().amax(-1, keepdim=True) * (2**-4 + 2**-8)
            assert ((y - x).abs() <= bound).all()
            assert (y - x).abs().max() > 0  # it really was quantised
    # the training loader reads the same dequantised values
    batch = next(PackedLoader(q, 10**6, seed=0, shuffle=False).batches(0))
    first = next(q.iter_samples())
    n = len(first["input_ids"])
    assert batch.aux_hidden.dtype == torch.bfloat16
    assert torch.equal(batch.aux_hidden[0, :n], first["aux_hidden"])


def test_extract_dtype_schema():
    assert parse_params({"extract": {"dtype": "float8_e4m3fn"}}).extract.dtype == "float8_e4m3fn"
    with pytest.raises(ParamsError, match=r"'extract.dtype' must be one of .*'float8_e4m3fn'.*got 'float8_e5m2'"):
        parse_params({"extract": {"dtype": "float8_e5m2"}})
    with pytest.raises(ParamsError, match="'target.dtype' must be one of"):  # storage only, not compute
        parse_params({"target": {"dtype": "float8_e4m3fn"}})


# --- a DVC remote: push, clone without the cache, pull ------------------------------------------

def _git(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    r = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"git {' '.join(args)} in {cwd}: {r.stdout}\n{r.stderr}"
    return r.stdout


def _dvc(args: list[str], cwd: Path, monkeypatch) -> None:
    """The real dvc command line, in this process (one import instead of a start-up per call)."""
    from dvc.cli import main

    monkeypatch.chdir(cwd)
    assert main(args) == 0, f"dvc {' '.join(args)} in {cwd} failed"


def test_dvc_remote_push_clone_pull(tmp_path, monkeypatch):
    pytest.importorskip("dvc")
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    proj, remote, clone = tmp_path / "proj", tmp_path / "remote", tmp_path / "clone"
    proj.mkdir()
    _git(["init", "-q"], proj)
    _dvc(["init", "-q"], proj, monkeypatch)
    feats = proj / "data/features/train"
    feats.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    files = {"shard-00000.bin": torch.randint(0, 256, (50_000,), generator=g, dtype=torch.uint8).numpy().tobytes(),
             "manifest.json": b'{"num_samples": 3}\n'}
    for name, data in files.items():
        (feats / name).write_bytes(data)
    _dvc(["add", "-q", "data/features"], proj, monkeypatch)
    _dvc(["remote", "add", "-d", "store", str(remote)], proj, monkeypatch)
    _git(["add", "-A"], proj)
    _git(["commit", "-q", "-m", "features"], proj)
    tracked = _git(["ls-files"], proj).split()
    assert "data/features.dvc" in tracked and not any(t.startswith("data/features/") for t in tracked)
    _dvc(["push", "-q"], proj, monkeypatch)
    assert sum(1 for p in remote.rglob("*") if p.is_file()) >= 3  # 2 files + the directory listing
    _git(["clone", "-q", str(proj), str(clone)], tmp_path)
    assert not (clone / "data/features").exists() and not (clone / ".dvc/cache").exists()
    _dvc(["pull", "-q"], clone, monkeypatch)
    for name, data in files.items():
        assert (clone / "data/features/train" / name).read_bytes() == data


def test_fp8_quantised_before_the_host_copy_writes_the_same_bytes(tmp_path):
    """quantize_capture (what extract does on a GPU, per batch) + add(aux_scale=...) writes the
    bytes the writer's own per-sample quantisation writes; pre-quantised input that does not fit
    (no or wrong scales, another fp8 format, a scale for unquantised states, non-fp8 storage) is
    refused before anything is buffered."""
    from eyas.features import quantize_capture
    from tests.tiny import tiny_target, write_features

    ref = write_features(tiny_target(), tmp_path / "f32", 5, seed=4)
    samples = list(ref.iter_samples())
    batch = {"aux_hidden": torch.stack([s["aux_hidden"] for s in samples])}  # equal lengths: [5, T, 3H]
    pre = quantize_capture(batch, 3)
    assert pre["aux_hidden"].dtype == FP8 and pre["aux_scale"].shape == (5, samples[0]["input_ids"].numel(), 3)
    fields = {k: ref.manifest[k] for k in ("aux_layers", "hidden_size", "vocab_size")}
    for name, scaled in (("own", False), ("pre", True)):
        w = ShardWriter(tmp_path / name, shard_samples=4, dtype=FP8)
        for j, s in enumerate(samples):
            aux = pre["aux_hidden"][j] if scaled else s["aux_hidden"]
            w.add(s["input_ids"], s["loss_mask"], aux, s["final_hidden"], s["target_argmax"],
                  pre["aux_scale"][j] if scaled else None)
        w.finish(**fields)
    for shard in ("shard-00000.safetensors", "shard-00001.safetensors"):
        assert (tmp_path / "own" / shard).read_bytes() == (tmp_path / "pre" / shard).read_bytes()
    s, q, scale = samples[0], pre["aux_hidden"][0], pre["aux_scale"][0]
    bad = [(FP8, q, None, r"needs aux_scale float32 \[\d+, 3\], got None"),
           (FP8, q, scale[:, :2], r"needs aux_scale float32 \[\d+, 3\]"),  # would misplace layer borders
           (FP8, q, scale.double(), "needs aux_scale float32"),
           (FP8, q.to(torch.float8_e5m2), scale, "must be torch.float8_e4m3fn"),
           (FP8, s["aux_hidden"], scale, "must be torch.float8_e4m3fn"),  # a scale for unquantised states
           (torch.bfloat16, q, scale, "for torch.bfloat16 storage")]  # the scale would be dropped
    for storage, aux, sc, msg in bad:
        w = ShardWriter(tmp_path / "bad", shard_samples=4, dtype=storage)
        with pytest.raises(ValueError, match=msg):
            w.add(s["input_ids"], s["loss_mask"], aux, s["final_hidden"], s["target_argmax"], sc)
        assert w.num_samples == 0


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_fp8_storage_refuses_non_finite_aux_states(tmp_path, value):
    """e4m3 cannot hold inf/NaN: its per-token scale would be inf/NaN and the stored row zeros or
    NaN. The writer names the sample, token and aux layer, for both quantisation paths, and the
    samples before it stay written."""
    from eyas.features import quantize_capture
    from tests.tiny import tiny_target, write_features

    ref = write_features(tiny_target(), tmp_path / "ref", 3, seed=5)
    samples = list(ref.iter_samples())
    H = ref.manifest["hidden_size"]
    aux = samples[1]["aux_hidden"].clone()
    aux[4, 2 * H + 7] = value  # token 4, third aux layer
    pre = quantize_capture({"aux_hidden": aux[None]}, 3)
    for scaled in (False, True):
        w = ShardWriter(tmp_path / f"w{scaled}", shard_samples=1, dtype=FP8)
        s = samples[0]
        w.add(s["input_ids"], s["loss_mask"], s["aux_hidden"], s["final_hidden"], s["target_argmax"])
        s = samples[1]
        with pytest.raises(NonFiniteFeatureError, match=r"shard-00001.safetensors, sample 1 \(0 in its shard\): "
                           r"token 4, aux layer 2 of 3: inf/NaN as stored in float8_e4m3fn.*target's own forward"):
            w.add(s["input_ids"], s["loss_mask"], pre["aux_hidden"][0] if scaled else aux, s["final_hidden"],
                  s["target_argmax"], pre["aux_scale"][0] if scaled else None)
        assert w.num_samples == 1 and (tmp_path / f"w{scaled}" / "shard-00000.safetensors").exists()


@pytest.mark.parametrize("where", ["aux", "final"])
def test_float16_overflow_is_refused_naming_split_shard_sample_and_layer(tmp_path, where):
    """A finite activation above float16's largest value (65504) is inf once cast: the writer
    refuses it (naming the split directory, shard, sample, token and layer, and bfloat16 to store
    instead) before it reaches a shard or the training loss; the samples before it stay written.
    Negative control: the same sample stored in bfloat16 or float32 is accepted and holds the
    value, and below 65504 float16 accepts it."""
    from tests.tiny import tiny_target, write_features

    ref = write_features(tiny_target(), tmp_path / "ref", 2, seed=5)
    s0, s1 = list(ref.iter_samples())
    H = ref.manifest["hidden_size"]
    aux, final = s1["aux_hidden"].clone(), s1["final_hidden"].clone()
    if where == "aux":
        aux[0, H + 3] = 65536.0  # token 0 (the BOS position), second aux layer (HF index 4)
        layer = r"aux layer 1 \(HF hidden_states index 4\)"
    else:
        final[0, 3] = -65536.0
        layer = "the final hidden state"
    assert torch.isinf(torch.tensor(65536.0).half())  # independent fact: float16's max is 65504 (2**16 in bf16 exact)
    split = tmp_path / "train"
    w = ShardWriter(split, shard_samples=1, dtype=torch.float16, aux_layers=[2, 4, 5])
    w.add(s0["input_ids"], s0["loss_mask"], s0["aux_hidden"], s0["final_hidden"], s0["target_argmax"])
    with pytest.raises(NonFiniteFeatureError, match=rf"split train\): shard-00001.safetensors, sample 1 .*token 0, "
                                                    rf"{layer}: inf/NaN as stored in float16.*bfloat16"):
        w.add(s1["input_ids"], s1["loss_mask"], aux, final, s1["target_argmax"])
    assert w.num_samples == 1 and (split / "shard-00000.safetensors").exists()
    for dtype in (torch.bfloat16, torch.float32):
        ok = ShardWriter(tmp_path / str(dtype), shard_samples=2, dtype=dtype)  # held in its buffer
        ok.add(s1["input_ids"], s1["loss_mask"], aux, final, s1["target_argmax"])
        got = ok.buf[0]["aux_hidden" if where == "aux" else "final_hidden"]
        assert abs(float(got[0, H + 3] if where == "aux" else got[0, 3])) == 2.0 ** 16
    below = ShardWriter(tmp_path / "below", shard_samples=1, dtype=torch.float16)
    below.add(s1["input_ids"], s1["loss_mask"], aux.clamp(-65504, 65504), final.clamp(-65504, 65504),
              s1["target_argmax"])


# --- shard bytes: the direct writer against safetensors' own serialisation --------------------

def test_parts_bytes_equal_safetensors_of_concatenation(tmp_path):
    g = torch.Generator().manual_seed(0)
    parts = {"aux_hidden": [torch.randn(n, 6, generator=g).bfloat16() for n in (3, 0, 5)],
             "input_ids": [torch.randint(0, 99, (n,), generator=g, dtype=torch.int32) for n in (3, 0, 5)],
             "loss_mask": [torch.rand(n, generator=g) > 0.5 for n in (3, 0, 5)],
             "final_hidden": [torch.randn(n, 2, generator=g) for n in (3, 0, 5)],
             "offsets": [torch.tensor([0, 3, 3, 8])]}
    n = save_safetensors_parts(parts, tmp_path / "a.safetensors")
    whole = {k: torch.cat(v) for k, v in parts.items()}
    save_file(whole, str(tmp_path / "b.safetensors"))
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    # 8 rows x (6 bf16 + 1 int32 + 1 bool + 2 fp32) + 4 int64 offsets
    assert n == 8 * (6 * 2 + 4 + 1 + 2 * 4) + 4 * 8
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary name


def test_parts_must_agree(tmp_path):
    with pytest.raises(ValueError, match="x.safetensors.*'h'"):
        save_safetensors_parts({"h": [torch.zeros(2, 3), torch.zeros(2, 4)]}, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_shard_writer_round_trip(tmp_path):
    g = torch.Generator().manual_seed(1)
    samples = []
    w = ShardWriter(tmp_path / "f", shard_samples=2, dtype=torch.bfloat16)
    for n in (4, 7, 3):
        s = (torch.randint(0, 50, (n,), generator=g), torch.rand(n, generator=g) > 0.3,
             torch.randn(n, 12, generator=g), torch.randn(n, 4, generator=g), torch.randint(0, 50, (n,), generator=g))
        samples.append(s)
        w.add(*s)
    m = w.finish(aux_layers=[1, 2, 3])
    assert [s["samples"] for s in m["shards"]] == [2, 1]
    assert m["supervised_tokens"] == sum(int(s[1].sum()) for s in samples)
    with safe_open(str(tmp_path / "f" / "shard-00000.safetensors"), framework="pt") as f:
        assert f.get_tensor("offsets").tolist() == [0, 4, 11]
        assert torch.equal(f.get_tensor("aux_hidden"), torch.cat([samples[0][2], samples[1][2]]).bfloat16())
        assert torch.equal(f.get_tensor("input_ids"), torch.cat([samples[0][0], samples[1][0]]).int())
    got = list(FeatureStore.open(tmp_path / "f").iter_samples())
    assert torch.equal(got[2]["final_hidden"], samples[2][3].bfloat16())
    assert torch.equal(got[2]["loss_mask"], samples[2][1].to(torch.uint8))
