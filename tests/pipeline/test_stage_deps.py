"""Cached means correct: the pipeline files' deps cannot drift from the code, and the input matrix.

- Every pipeline file (eyas/pipeline/dvcfiles.py: the default DAG ``dvc.yaml``, and
  ``published/dvc.yaml`` and ``finetune/dvc.yaml`` for the fine-tune comparison) lists, per stage,
  exactly the eyas/stages modules its command can import (eyas/pipeline/stage_deps.py), and the
  params each fingerprinting stage records are its file's.
- The input matrix, one test per row, with the real DVC on a copy of these pipelines whose outputs
  are placeholders committed with ``dvc commit``: changing one input (a code module, a params
  section, the target's tokenizer / chat template / config, the data source, the drafter that
  ``remap.source`` names) makes exactly the stages that read it out of date (``dvc status``, every
  file's stages). Stages further down rerun only when an output they read changes, which DVC
  decides by the output's hash.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eyas.pipeline import dvcfiles, provenance, stage_deps

ROOT = Path(__file__).resolve().parents[2]
STAGES = dvcfiles.stages(ROOT)
DERIVED = stage_deps.derived_deps(ROOT, STAGES)
EVALS = {"eval-accept-len@scratch", "eval-accept-len@finetune"}
# train.mode: online runs the target in the training stages (eyas/training/online.py)
TARGET_READERS = {"synthesize-prompts", "self-distill", "extract", "stand-in-drafter", "remap", "train-scratch",
                  "train-finetune", "target-gguf"} | EVALS
EXPORTS = {"export-gguf@scratch", "export-gguf@finetune"}  # they read target.dtype, not the target's files


def test_dvc_yaml_code_deps_are_the_imports():
    assert {"stand-in-drafter", "remap", "train-finetune", "eval-accept-len@finetune"} <= set(STAGES)  # every file
    diff = stage_deps.differences(ROOT, STAGES)
    assert not diff, f"the pipeline files' code deps differ from what the stages import ({diff}); " \
                     f"`python3 -m eyas.pipeline.stage_deps` prints them"


def test_the_pipeline_files_are_every_dvc_yaml_of_the_repository():
    """DVC reads every dvc.yaml in the repository; eyas' list (stage deps, MLflow's parent summary,
    `eyas compare --metrics`, scripts/run_dag.py) must be the same set, or a stage would escape them."""
    tracked = subprocess.run(["git", "ls-files", "--", "dvc.yaml", "*/dvc.yaml"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert sorted(tracked) == sorted(dvcfiles.PIPELINES)
    root = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    assert [name for name in dvcfiles.expand(root) if name != "identify-inputs"] == [
        "synthesize-prompts", "prepare-data", "self-distill", "extract", "build-vocab", "train-scratch", "target-gguf",
        "export-gguf@scratch", "eval-accept-len@scratch"]  # the default DAG: scratch only


def test_a_module_reached_only_through_an_import_is_caught(tmp_path):
    """A new module imported (lazily, inside a function) by a module build-vocab imports: the
    check names it as missing from build-vocab's deps."""
    for name in ("eyas", "stages"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "eyas/newmod.py").write_text("X = 1\n")
    with open(tmp_path / "eyas/vocab/mapping.py", "a") as f:
        f.write("\n\ndef _late():\n    from eyas.newmod import X\n    return X\n")
    diff = stage_deps.differences(tmp_path, STAGES)
    assert diff["build-vocab"] == {"missing": ["eyas/newmod.py"], "extra": []}
    assert "eyas/newmod.py" in diff["train-scratch"]["missing"]
    assert "prepare-data" not in diff


def test_fingerprint_params_are_dvc_yaml_params():
    for name, sections in provenance.STAGE_PARAMS.items():
        assert STAGES[name]["params"] == sections, name


# ------------------------------------------------------------------------------- the input matrix

PARAM_ROWS = {  # section: (key to change, new value, the stages that read it)
    "lr": ("lr", 1.0e-4, {"train-scratch"}),
    "seed": ("seed", 7, {"synthesize-prompts", "prepare-data", "stand-in-drafter", "remap", "train-scratch",
                         "train-finetune"}),
    "target": ("target.dtype", "bfloat16", TARGET_READERS | EXPORTS),
    "data": ("data.val", 3, {"synthesize-prompts", "prepare-data"}),  # synthesis keeps out of the test split
    "data.synth": ("data.synth.prompts", 5, {"synthesize-prompts", "prepare-data"}),
    "data.code_prompts": ("data.code_prompts", 5, {"prepare-data"}),
    "distill": ("distill.batch_size", 3, {"synthesize-prompts", "self-distill"}),  # a batch is a sampling seed
    "distill.turns": ("distill.turns", "all", {"self-distill"}),
    "extract": ("extract.max_length", 200, {"self-distill", "extract"}),  # self-distill's prompt budget
    "vocab": ("vocab.draft_vocab_size", 32, {"build-vocab"}),
    "stand_in": ("stand_in.epochs", 1, {"stand-in-drafter"}),
    "remap": ("remap.min_shared_fraction", 0.2, {"remap"}),
    "train": ("train.ttt_length", 2, {"stand-in-drafter", "remap", "train-scratch", "train-finetune"}),
    "train.backend": ("train.backend.attention", "dense", {"stand-in-drafter", "remap", "train-scratch",
                                                          "train-finetune"}),
    "train_finetune": ("train_finetune.gate_margin", 0.1, {"train-finetune"}),
    "train_finetune.lr": ("train_finetune.lr", 1.0e-4, {"train-finetune"}),
    "eval": ("eval.chat_prompts", 1, EVALS),
    "serve": ("serve.threads", 3, EVALS),
    "serve.engine": ("serve.engine", "none", EVALS | {"target-gguf"}),
}
TARGET_ROWS = {"tokenizer": "tokenizer.json", "chat_template": "chat_template.jinja", "config": "config.json"}
CODE_ROWS = sorted(str(p.relative_to(ROOT)) for d in ("eyas", "stages") for p in (ROOT / d).rglob("*.py")
                   if p.name != "__init__.py")


def _outs(st: dict) -> list[str]:
    out = []
    for key in ("outs", "metrics", "plots"):
        for o in st.get(key, []):
            out.append(o if isinstance(o, str) else next(iter(o)))
    return out


def _env(repo: Path) -> dict:
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_"))},
            "PYTHONPATH": str(repo), "EYAS_TRACKING": "off"}


def _dvc(repo: Path, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=_env(repo), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"dvc {args}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    """This pipeline in a fresh git + DVC repo, a local target dir and a JSONL data source, every
    stage's outputs placeholders recorded in dvc.lock (`dvc commit`), identify-inputs run for real."""
    repo = tmp_path_factory.mktemp("matrix")
    for name in ("eyas", "stages"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "scripts").mkdir()
    for name in (*dvcfiles.PIPELINES, "scripts/build_llama_server.sh"):  # the script pins llama.cpp's converter
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, repo / name)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["target"]["path"] = "./target"
    params["data"]["source"] = "./source.jsonl"
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (repo / "target").mkdir()
    for f in TARGET_ROWS.values():
        (repo / "target" / f).write_text(json.dumps({"file": f}) + "\n")
    (repo / "source.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    _dvc(repo, "init", "-q")
    _dvc(repo, "repro", "-s", "identify-inputs")
    for name, st in STAGES.items():
        for o in _outs(st):
            p = repo / o
            if name == "identify-inputs":
                continue
            if Path(o).suffix:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text("{}\n")
            else:
                p.mkdir(parents=True, exist_ok=True)
                (p / "placeholder").write_text(name)
    _dvc(repo, "commit", "-f", "-q")
    assert _changed(repo) == set(), "a freshly committed pipeline is up to date"
    return repo


def _changed(repo: Path) -> set[str]:
    """Stages `dvc status` reports out of date (identify-inputs is always_changed: left out)."""
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        st = r.status()
    return {name.split(":")[-1] for name in st} - {"identify-inputs"}


@pytest.mark.slow
@pytest.mark.parametrize("module", CODE_ROWS)
def test_matrix_code_module(pipeline, module):
    f = pipeline / module
    before = f.read_text()
    try:
        f.write_text(before + "\n# an edit\n")
        want = {s for s, files in DERIVED.items() if module in files} - {"identify-inputs"}
        assert _changed(pipeline) == want
    finally:
        f.write_text(before)


@pytest.mark.slow
@pytest.mark.parametrize("section", sorted(PARAM_ROWS))
def test_matrix_params_section(pipeline, section):
    key, value, want = PARAM_ROWS[section]
    f = pipeline / "params.yaml"
    before = f.read_text()
    p = yaml.safe_load(before)
    node = p
    *parents, last = key.split(".")
    for k in parents:
        node = node[k]
    assert node[last] != value
    node[last] = value
    try:
        f.write_text(yaml.safe_dump(p, sort_keys=False))
        assert _changed(pipeline) == want
    finally:
        f.write_text(before)


# a section's schema reruns only the stages that read the section (identify-inputs, which checks the whole
# file and runs on every `dvc repro`, aside): the eval's schema only the evals, train's (with the kernel
# choices, train.backend) only the stages that read `train` (extract reads train.mode)
SCHEMA_ROWS = {
    "eyas/params/eval.py": EVALS,
    "eyas/params/train.py": {"extract", "stand-in-drafter", "remap", "train-scratch", "train-finetune"},
    "eyas/params/vocab.py": {"build-vocab"},
}


@pytest.mark.parametrize("module", sorted(SCHEMA_ROWS))
def test_a_section_schema_is_a_dep_of_only_the_stages_that_read_it(module):
    declared = stage_deps.declared_code_deps(STAGES)
    assert {s for s, files in declared.items() if module in files} == SCHEMA_ROWS[module] | {"identify-inputs"}


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(SCHEMA_ROWS))
def test_matrix_section_schema(pipeline, module):
    """The real DVC: an edit to one section's schema puts only its readers out of date."""
    f = pipeline / module
    before = f.read_text()
    try:
        f.write_text(before + "\n# an edit\n")
        assert _changed(pipeline) == SCHEMA_ROWS[module]
    finally:
        f.write_text(before)


def _input_row(pipeline: Path, path: Path, want: set[str]) -> None:
    before = path.read_text()
    try:
        path.write_text(before.replace("}", ', "edited": true}'))
        _dvc(pipeline, "repro", "-s", "identify-inputs")  # what `dvc repro` runs first
        assert _changed(pipeline) == want
    finally:
        path.write_text(before)
        _dvc(pipeline, "repro", "-s", "identify-inputs")
    assert _changed(pipeline) == set()


@pytest.mark.slow
@pytest.mark.parametrize("row", sorted(TARGET_ROWS))
def test_matrix_target_file(pipeline, row):
    _input_row(pipeline, pipeline / "target" / TARGET_ROWS[row], TARGET_READERS)


@pytest.mark.slow
def test_matrix_data_source(pipeline):
    _input_row(pipeline, pipeline / "source.jsonl", {"synthesize-prompts", "prepare-data"})


@pytest.mark.slow
def test_matrix_remap_source(pipeline):
    """remap depends on the directory ``remap.source`` names (``${remap.source}`` in finetune/dvc.yaml):
    another drafter there puts remap alone out of date, the stand-in out of it, and a change inside
    that directory does again; the stand-in's own output feeds remap while it is the source."""
    f = pipeline / "params.yaml"
    before = f.read_text()
    drafter = pipeline / "models" / "published"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text('{"a": 1}\n')
    p = yaml.safe_load(before)
    p["remap"]["source"] = "models/published"
    try:
        f.write_text(yaml.safe_dump(p, sort_keys=False))
        assert _changed(pipeline) == {"remap"}
        _dvc(pipeline, "commit", "-f", "-q", "finetune/dvc.yaml:remap")
        assert _changed(pipeline) == set()
        (drafter / "config.json").write_text('{"a": 2}\n')  # a new drafter downloaded there
        assert _changed(pipeline) == {"remap"}
    finally:
        f.write_text(before)
        shutil.rmtree(drafter)
        _dvc(pipeline, "commit", "-f", "-q", "finetune/dvc.yaml:remap")
    assert _changed(pipeline) == set()
    stand_in = pipeline / "models" / "stand_in" / "placeholder"
    was = stand_in.read_text()
    try:
        stand_in.write_text("another stand-in")
        assert _changed(pipeline) == {"stand-in-drafter", "remap"}  # its output changed; remap reads it
    finally:
        stand_in.write_text(was)
    assert _changed(pipeline) == set()


def test_every_metrics_or_plots_file_is_an_output_its_pipeline_declares():
    """A file under metrics/ or plots/ in git is a ``metrics`` or ``plots`` output of a stage of the
    pipeline files (else no stage remakes it, and it goes stale in git), and each stage whose script
    writes TTT curves (``stages.training.finish_training`` with ``curves`` on) declares both
    ``plots/<stage>/{train,val}.tsv``; one that writes none declares none."""
    import ast

    declared = {o for st in STAGES.values() for o in _outs(st)}
    tracked = subprocess.run(["git", "ls-files", "metrics", "plots"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked and [f for f in tracked if f not in declared] == []
    writers = {}
    for f in sorted((ROOT / "stages").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "finish_training":
                curves = next((ast.literal_eval(k.value) for k in node.keywords if k.arg == "curves"), True)
                writers[f"stages.{f.stem}"] = (ast.literal_eval(node.args[0]).replace("-", "_"), curves)
    assert set(writers) == {"stages.train_scratch", "stages.train_finetune", "stages.stand_in"}
    for module, (name, curves) in writers.items():
        stage = next(n for n, st in STAGES.items() if st["cmd"].endswith(f" {module}"))
        plots = {o for o in _outs(STAGES[stage]) if o.startswith(f"plots/{name}/")}
        assert plots == ({f"plots/{name}/train.tsv", f"plots/{name}/val.tsv"} if curves else set()), (stage, plots)
