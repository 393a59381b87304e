"""The target from the hub (eyas/target/hub.py): ids, weight files, the pinned revision. No network
and no cache: each check runs before any download, or is pure over a repository's file list.

- Hub ids that have the ``org/name`` shape but break huggingface_hub's rules: ``validate_repo_id``
  runs before any download, and each is refused with the module's error naming the params key,
  never a raw ``HFValidationError``. As ``remap.source`` (a directory DVC hashes) a hub id is
  refused by the params schema.
- Which weight files a hub snapshot fetches (``weight_files``): the ones transformers loads, never
  a second copy in another layout; the layouts are those of real repositories.
- Every load of the target from ``target.path`` passes ``target.revision`` (the pinned commit). A
  load without it reads the hub's ``main`` (tokenizer, chat template, config): prompts rendered
  with one revision and weights run at another. The calls are found in the source (eyas/, stages/,
  benchmarks/, scripts/, dev/) with ``ast``, so a new call site is covered as soon as it is written.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from huggingface_hub.utils import filter_repo_objects

from eyas.params.full import ParamsError, parse_params
from eyas.target.hub import HubError, is_hub_id, snapshot, weight_files
from eyas.target.model import TargetError, load_tokenizer_and_config

ROOT = Path(__file__).resolve().parents[2]


# --- hub ids -----------------------------------------------------------------------------------

BAD = [("org/name.git", "cannot end by '.git'"), ("org/na--me", "Cannot have -- or .."),
       ("org/..", "alphanumeric chars")]


@pytest.mark.parametrize("repo_id, why", BAD)
def test_invalid_hub_ids_are_refused_naming_the_key(repo_id, why):
    assert is_hub_id(repo_id)  # the shape passes: huggingface_hub's validator decides
    with pytest.raises(HubError) as e:
        snapshot(repo_id, None, param="target.path")
    msg = str(e.value)
    assert msg.startswith(f"target.path {repo_id!r}: no local directory {repo_id!r}, and not a valid hub id: ")
    assert why in msg
    with pytest.raises(TargetError, match=rf"^target\.path '{repo_id}': no local directory .*{why}"):
        load_tokenizer_and_config(repo_id, revision="abc")
    with pytest.raises(ParamsError, match=r"'remap\.source' must be a local drafter directory .*hf download"):
        parse_params({"remap": {"source": repo_id}})


# --- weight files --------------------------------------------------------------------------------

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


# --- the pinned revision -----------------------------------------------------------------------

LOADERS = {"load_target", "load_tokenizer_and_config", "load_generation_config", "load_tokenizer"}


def _calls_from_target_path() -> list[tuple[str, int, bool]]:
    """(file, line, passes ``revision=`` by keyword) for each loader call whose first argument reads
    ``*.target.path``."""
    out = []
    for d in ("eyas", "stages", "benchmarks", "scripts", "dev"):
        for f in sorted((ROOT / d).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if not isinstance(node, ast.Call):
                    continue
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name not in LOADERS or not node.args:
                    continue
                src = ast.unparse(node.args[0])
                if src.endswith("target.path") or src == "t.path":
                    out.append((str(f.relative_to(ROOT)), node.lineno,
                                any(k.arg == "revision" for k in node.keywords)))
    return out


def test_every_target_load_from_params_passes_the_revision():
    calls = _calls_from_target_path()
    # the stages that load the target are all found (the scan itself works)
    files = {f for f, _, _ in calls}
    assert {"stages/self_distill.py", "stages/extract.py", "stages/eval_accept_len.py",
            "eyas/training/online.py"} <= files
    assert [(f, line) for f, line, has in calls if not has] == []
