"""The ``eyas`` command line (``pyproject.toml``: ``eyas = "eyas.cli:main"``).

Subcommands:
    eyas inspect PATH [--vocab DIR] [--features M] [--num-target-layers N] [--target T [--target-gguf F]] [--json]
        What a drafter checkpoint is and what SGLang / vLLM / speculators / llama.cpp would do with it
        (eyas/export/inspector.py); with --target (a hub id, a local HF dir, "embedded", a .gguf file or a
        feature manifest) also its context length, RoPE, vocab, hidden size and aux layers
        against the target's; with --features (the feature manifest it was trained on) the target
        layers llama.cpp's converter would write against the manifest's aux layers.
    eyas inspect DRAFTER.gguf [--drafter DIR] [--features M] [--vocab DIR] [--num-target-layers N] [--target T]
        What llama.cpp will load from an EAGLE-3 drafter GGUF (target layers and what each captures,
        d2t, norm flags, vocab; eyas/export/gguf.py), checked against the checkpoint it was
        converted from (--drafter), the features it was trained on (--features) and the vocab (--vocab).
        Exit status 1 when the checkpoint (or GGUF) has errors for serving, 2 when it cannot be read,
        else 0.
    eyas engine-keys
        The table of every config key SGLang, vLLM or llama.cpp reads for an EAGLE-3 drafter, where,
        and what eyas does with it (eyas/export/engine_keys.py), as Markdown.
    eyas compare [--experiment NAME] [--limit N] [--all-params] [--out FILE.md] [--tracking-uri URI]
    eyas compare --metrics DIR [DIR ...]   committed results side by side (metrics/ vs dev/records/h200/)
        The latest pipeline runs (DVC experiments) side by side from MLflow: key params, val acc_0,
        accept_len per benchmark and the n-gram floor, as Markdown (eyas/tracking/compare.py). Exit status
        2 when there is no store or no such experiment, 1 when it holds no pipeline run, else 0.
    eyas preset PRESET [--params FILE] [--write FILE]
        A params preset (presets/*.yaml) as ``dvc exp run -S`` overrides, or merged into a params file
        (eyas/pipeline/preset.py; also ``python -m eyas.pipeline.preset``). Exit status 2 on a bad preset.
    eyas remote check|push|pull [-r NAME] [--run-cache] [-C DIR]
        A team's DVC remote checked before ``dvc push`` / ``dvc pull`` (eyas/pipeline/team_remote.py; also
        ``python3 -m eyas.pipeline.team_remote``). Exit status 2 when the remote cannot be used.
    eyas push DIR --repo ORG/NAME [--target T [--target-gguf F]] [--revision BRANCH] [--public] [--dry-run]
        Publish an exported drafter (config.json + model.safetensors, checked loadable first and, with
        --target, against that target as `eyas inspect --target` checks it) to a Hugging Face Hub
        model repo (eyas/export/push.py); prints the plan (files, bytes, sha256) and, unless --dry-run, the
        commit. Exit status 2 when the repo id is invalid, the directory is not a servable drafter
        (for that target), or the hub refuses, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys


def _inspect(args) -> int:
    from pathlib import Path

    from eyas.export.inspector import inspect_checkpoint, inspect_gguf, render, render_gguf, target_summary

    is_gguf = _is_gguf(Path(args.path))
    if args.drafter is not None and not is_gguf:
        sys.stderr.write(f"eyas inspect: error: --drafter names the checkpoint a .gguf PATH was converted from; "
                         f"{args.path} is not a .gguf file\n")
        return 2
    if args.drafter is not None and not Path(args.drafter).is_dir():
        sys.stderr.write(f"eyas inspect: error: --drafter {args.drafter} is not a directory: give the checkpoint "
                         f"directory (config.json + model.safetensors) the .gguf was converted from\n")
        return 2

    try:
        target = None if args.target is None else target_summary(args.target, args.target_gguf)
    except Exception as e:  # noqa: BLE001 -- an unreadable target is a refusal (exit 2), never a traceback
        sys.stderr.write(f"eyas inspect: error: cannot read the target {args.target}: {type(e).__name__}: {e}\n")
        return 2
    try:
        if is_gguf:
            report = inspect_gguf(args.path, drafter_dir=args.drafter, vocab_dir=args.vocab, features=args.features,
                                  num_target_layers=args.num_target_layers, target=target)
        else:
            report = inspect_checkpoint(args.path, vocab_dir=args.vocab, num_target_layers=args.num_target_layers,
                                        target=target, features=args.features)
    except Exception as e:  # noqa: BLE001 -- anything unreadable is "cannot inspect" (exit 2), never a traceback
        sys.stderr.write(f"eyas inspect: error: cannot read {args.path}: {type(e).__name__}: {e}\n")
        return 2
    text = (render_gguf if is_gguf else render)(report)
    sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n" if args.json else text)
    return 1 if report["errors"] else 0


def _is_gguf(path) -> bool:
    """A ``.gguf`` name in any case, or a file that starts with GGUF's magic (``b"GGUF"``)."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:  # a directory, no such file: a checkpoint PATH, whose reader names what is missing
        return False


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a layer count)."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return v


def _engine_keys(args) -> int:
    from eyas.export.engine_keys import table_markdown

    sys.stdout.write(table_markdown())
    return 0


def _preset(argv: list[str]) -> int:
    from eyas.pipeline import preset

    return preset.main(argv, prog="eyas preset")


def _remote(argv: list[str]) -> int:
    from eyas.pipeline import team_remote

    return team_remote.main(argv, prog="eyas remote")


# subcommands whose arguments (--help included) are their module's own: handed over whole
PASSED_ON = {"preset": _preset, "remote": _remote}


def _compare(args) -> int:
    from eyas.tracking.compare import CompareError, compare, write
    from eyas.tracking.compare_dirs import compare_dirs

    try:
        text = (compare_dirs(args.metrics, all_params=args.all_params) if args.metrics else
                compare(args.tracking_uri, args.experiment, args.limit, args.all_params))
        sys.stdout.write(text)
        if args.out:
            sys.stderr.write(f"eyas compare: wrote {write(text, args.out)}\n")
    except CompareError as e:
        sys.stderr.write(f"eyas compare: error: {e}\n")
        return 2
    return 1 if "No pipeline runs found." in text else 0


def _push(args) -> int:
    from eyas.export.inspector import target_summary
    from eyas.export.push import PushError, push

    try:
        target = None if args.target is None else target_summary(args.target, args.target_gguf)
    except Exception as e:  # noqa: BLE001 -- an unreadable target is a refusal (exit 2), never a traceback
        sys.stderr.write(f"eyas push: error: cannot read the target {args.target}: {type(e).__name__}: {e}\n")
        return 2
    try:
        out = push(args.path, args.repo, revision=args.revision, private=not args.public, dry_run=args.dry_run,
                   target=target)
    except PushError as e:
        sys.stderr.write(f"eyas push: error: {e}\n")
        return 2
    for w in out["warnings"]:  # context length or RoPE unlike the target's: the user decides
        sys.stderr.write(f"eyas push: warning: {w}\n")
    sys.stdout.write(json.dumps(out, indent=2) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eyas", description="EAGLE-3 drafter tools")
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="describe a drafter checkpoint (or its llama.cpp GGUF) and how the engines "
                                         "would load it")
    ins.add_argument("path", help="checkpoint directory (config.json + model.safetensors), or a drafter .gguf")
    ins.add_argument("--vocab", default=None, help="a vocab directory (vocab.safetensors) to compare with")
    ins.add_argument("--features", default=None,
                     help="the feature manifest the drafter was trained on (data/features/train): its aux layers "
                          "against the target layers llama.cpp uses")
    ins.add_argument("--drafter", default=None,
                     help="with a .gguf PATH: the checkpoint directory it was converted from, to check against")
    ins.add_argument("--num-target-layers", type=_positive_int, default=None,
                     help="the target's decoder-layer count L (needed when config.json has no eyas record)")
    ins.add_argument("--target", default=None,
                     help="the target to compare with: hub id, local HF dir, 'embedded', a .gguf file, or a "
                          "feature manifest (data/features/train)")
    ins.add_argument("--target-gguf", default=None, help="the GGUF file inside --target's directory")
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.set_defaults(func=_inspect)
    keys = sub.add_parser("engine-keys", help="the config keys SGLang/vLLM/llama.cpp read for an EAGLE-3 drafter, "
                                               "and what eyas does with each (Markdown)")
    keys.set_defaults(func=_engine_keys)
    cmp = sub.add_parser("compare", help="the latest pipeline runs side by side, from MLflow (Markdown)")
    cmp.add_argument("--experiment", default=None,
                     help="MLflow experiment name (default: $MLFLOW_EXPERIMENT_NAME or 'eyas')")
    cmp.add_argument("--limit", type=int, default=8, help="how many latest pipeline runs (0 = all)")
    cmp.add_argument("--all-params", action="store_true",
                     help="a row for every param, also those equal in every column (without it: lr and the "
                          "params that differ between the columns; with --metrics: the recipe keys and those)")
    cmp.add_argument("--out", default=None, help="also write the table to this Markdown file")
    cmp.add_argument("--metrics", nargs="+", default=None, metavar="DIR",
                     help="compare committed metrics directories instead of MLflow runs "
                          "(e.g. --metrics metrics dev/records/h200)")
    cmp.add_argument("--tracking-uri", default=None,
                     help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///<repo root>/mlflow.db)")
    cmp.set_defaults(func=_compare)
    sub.add_parser("preset", add_help=False, help="a params preset as `dvc exp run -S` overrides, or merged into "
                   "params.yaml (eyas preset PRESET [--params F] [--write F]; eyas preset --help)")
    sub.add_parser("remote", add_help=False, help="a team's DVC remote, checked, then pushed or pulled "
                   "(eyas remote check|push|pull [-r NAME] [-C DIR]; eyas remote --help)")
    push = sub.add_parser("push", help="publish an exported drafter to a Hugging Face Hub model repo")
    push.add_argument("path", help="the exported drafter directory (e.g. models/scratch)")
    push.add_argument("--repo", required=True, help="the hub repo id, org/name (created private if missing)")
    push.add_argument("--target", default=None,
                      help="the target the drafter is published for (as eyas inspect --target): checked against it")
    push.add_argument("--target-gguf", default=None, help="the GGUF file inside --target's directory")
    push.add_argument("--revision", default=None, help="the branch to commit to (default main)")
    push.add_argument("--public", action="store_true", help="create the repo public (default private)")
    push.add_argument("--dry-run", action="store_true", help="check and print the plan; upload nothing")
    push.set_defaults(func=_push)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (also used by ``python -m eyas.cli``)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSED_ON:
        return PASSED_ON[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
