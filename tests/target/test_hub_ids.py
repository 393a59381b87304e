"""Hub ids that have the ``org/name`` shape but break huggingface_hub's rules (eyas/target/hub.py).

``validate_repo_id`` runs before any download, so these need no network and no cache: each is
refused with the module's error naming the params key, never a raw ``HFValidationError``. As
``remap.source`` (a directory DVC hashes) a hub id is refused by the params schema.
"""

from __future__ import annotations

import pytest

from eyas.params.full import ParamsError, parse_params
from eyas.target.hub import HubError, is_hub_id, snapshot
from eyas.target.model import TargetError, load_tokenizer_and_config

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
