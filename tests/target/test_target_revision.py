"""Every load of the target from ``target.path`` passes ``target.revision`` (the pinned commit).

A load without it reads the hub's ``main`` (tokenizer, chat template, config): prompts rendered with
one revision and weights run at another. The calls are found in the source (eyas/, stages/,
benchmarks/, scripts/) with ``ast``, so a new call site is covered as soon as it is written.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
