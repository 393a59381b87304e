"""The direct shard writer (eyas.io.save_safetensors_parts) against the safetensors library: the
bytes of a shard written part by part equal safetensors' own serialisation of the concatenated
tensors, and ShardWriter's shards read back as the samples it was given."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eyas.features import FeatureStore, ShardWriter
from eyas.io import save_safetensors_parts


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
