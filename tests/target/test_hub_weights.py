"""Which weight files a hub snapshot fetches (eyas/target/hub.py ``weight_files``): the ones transformers
loads, never a second copy in another layout. Pure over a repository's file list and its index, so
no network and no cache are needed; the layouts are those of real repositories."""

from __future__ import annotations

import pytest
from huggingface_hub.utils import filter_repo_objects

from eyas.target.hub import HubError, weight_files

META = [".gitattributes", "README.md", "config.json", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json"]
# mistralai/Mistral-7B-Instruct-v0.3: HF shards plus mistral-inference's consolidated copy
MISTRAL_SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
MISTRAL = META + MISTRAL_SHARDS + ["consolidated.safetensors", "model.safetensors.index.json", "params.json",
                                   "tokenizer.model", "tokenizer.model.v3"]
MISTRAL_INDEX = {"metadata": {}, "weight_map": {
    "lm_head.weight": MISTRAL_SHARDS[2], "model.embed_tokens.weight": MISTRAL_SHARDS[0],
    "model.layers.0.mlp.down_proj.weight": MISTRAL_SHARDS[0], "model.layers.15.mlp.up_proj.weight": MISTRAL_SHARDS[1],
    "model.layers.16.self_attn.q_proj.weight": MISTRAL_SHARDS[1], "model.norm.weight": MISTRAL_SHARDS[2]}}
# openai/gpt-oss-20b: HF shards plus the original checkpoint under original/ (and a Metal one)
GPT_OSS_SHARDS = [f"model-0000{i}-of-00002.safetensors" for i in (0, 1, 2)]
GPT_OSS = META + GPT_OSS_SHARDS + ["chat_template.jinja", "model.safetensors.index.json", "original/config.json",
                                   "original/dtypes.json", "original/model.safetensors", "metal/model.bin"]
GPT_OSS_INDEX = {"weight_map": {"model.embed_tokens.weight": GPT_OSS_SHARDS[0],
                                "model.layers.0.mlp.experts.gate_up_proj_blocks": GPT_OSS_SHARDS[1],
                                "model.layers.23.self_attn.sinks": GPT_OSS_SHARDS[2],
                                "lm_head.weight": GPT_OSS_SHARDS[2]}}


@pytest.mark.parametrize("files, index, loaded, duplicate", [
    (MISTRAL, MISTRAL_INDEX, MISTRAL_SHARDS, "consolidated.safetensors"),
    (GPT_OSS, GPT_OSS_INDEX, GPT_OSS_SHARDS, "original/model.safetensors"),
])
def test_only_the_shards_the_index_names_are_fetched(files, index, loaded, duplicate):
    assert weight_files(files, index) == loaded
    # negative control: a *.safetensors glob (huggingface_hub's own filter) takes the copy too
    globbed = list(filter_repo_objects(files, allow_patterns=["*.safetensors"]))
    assert duplicate in globbed and set(globbed) == set(loaded) | {duplicate}


def test_a_single_file_is_fetched_alone_and_wins_over_an_index_as_in_transformers():
    assert weight_files(META + ["model.safetensors"], None) == ["model.safetensors"]
    # transformers checks model.safetensors before the index (modeling_utils.py)
    assert weight_files(MISTRAL + ["model.safetensors"], MISTRAL_INDEX) == ["model.safetensors"]


@pytest.mark.parametrize("files, index, message", [
    (META + ["consolidated.safetensors", "params.json"], None,
     r"neither model\.safetensors nor .*not load: \['consolidated\.safetensors'\]"),
    (META + ["pytorch_model.bin"], None, r"pickled .*\.bin.*: \['pytorch_model\.bin'\]"),
    ([f for f in MISTRAL if f != MISTRAL_SHARDS[1]], MISTRAL_INDEX,
     r"weight_map names \['model-00002-of-00003\.safetensors'\], which are not among"),
    (MISTRAL, {"metadata": {}}, r"no 'weight_map'"),
])
def test_a_repository_without_loadable_weights_is_refused_naming_the_files(files, index, message):
    with pytest.raises(HubError, match=message):
        weight_files(files, index)
