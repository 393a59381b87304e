"""DVC stage `prepare-data`: load conversations, split them, write the splits and metrics.

Reads params `data.*` and `seed`; writes `data/conversations/{train,val,test,publish}.jsonl`, their
fingerprint (`data/conversations/fingerprint.json`: the params and the data source's identity,
checked by self-distill and the eval; eyas/pipeline/provenance.py) and `metrics/prepare_data.json`,
and logs the counts as the stage's MLflow child run.
`data.code_prompts` code conversations (eyas.data.code) are added to train and val after the split;
when it is > 0, the metrics' `code` section holds, per package (import name), the usable functions
it gave (`code.<package>.usable`) and why the others were skipped. With `data.synth.prompts` > 0 the
conversations of stage synthesize-prompts (`data/synth`, checked against its fingerprint) join train
and val too, before the code ones (`data.synth.mode: add`), or are train and val alone (`only`: val
takes the first `data.val` of them); the metrics' `synth` section counts them per split. Run from the
repository root: `python -m stages.prepare_data`.

Bad data or params (a bad source line, an empty train split, an unknown key, ...) end the stage with
one line `prepare-data: error: <message naming the file, line, id or key>` and exit status 1; the
previous splits and metrics are then left as they were.
"""

from __future__ import annotations

from pathlib import Path

from eyas.data.code import add_to_splits, code_conversations
from eyas.data.conversations import DataError, encode_jsonl, load_conversations, read_jsonl, split_conversations
from eyas.io import atomic_dir, atomic_path, write_json
from eyas.params import data as data_schema
from eyas.params import target as target_schema
from eyas.params.schema import ParamsError, flatten, load_sections
from eyas.pipeline.provenance import FILE as FINGERPRINT
from eyas.pipeline.provenance import StaleError, check, record
from eyas.pipeline.runlock import hold
from eyas.tracking.runs import start_stage_run

OUT_DIR = Path("data/conversations")
SYNTH = Path("data/synth")  # stage synthesize-prompts
METRICS = Path("metrics/prepare_data.json")


def main() -> None:
    hold("prepare-data")  # one run of this stage at a time in this workspace (eyas/pipeline/runlock.py)
    try:
        run()
    except (DataError, ParamsError, StaleError) as e:
        raise SystemExit(f"prepare-data: error: {e}") from None


def run() -> None:
    """Load the params, :func:`prepare` under the stage's MLflow run, log and print the counts."""
    p = load_sections(data_schema, target_schema)  # target: data/synth's fingerprint names it
    with start_stage_run("prepare-data", p) as tracker:
        metrics = prepare(p)
        tracker.log_metrics({k: float(v) for k, v in flatten(metrics).items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)})
        tracker.log_dict(metrics, "prepare_data.json")
    code = metrics["code"]["conversations"]
    # code conversations join train and val in proportion (eyas.data.code.add_to_splits): say so,
    # or a val of data.val + its code share reads like a miscount
    sizes = ", ".join(f"{k} {n}" + (f" ({n - code[k]} chat + {code[k]} code)" if code.get(k) else "")
                      for k, n in metrics["conversations"].items())
    print(f"prepare-data: {sizes} from {p.data.source!r}; stats {metrics['stats']}")


def prepare(p) -> dict:
    """Load, split and write the conversations of params ``p``; write and return the metrics.

    Every split is built and encoded in memory first, then all four files are swapped in together
    (:func:`eyas.io.atomic_dir` replaces ``data/conversations``), and the metrics are written
    after them: a DataError leaves the previous splits and metrics untouched.
    """
    d = p.data
    convs, stats = load_conversations(d.source, on_bad_line=d.on_bad_line)
    splits = split_conversations(convs, val=d.val, test=d.test, publish=d.publish,
                                 max_conversations=d.max_conversations, seed=p.seed)
    synth_ids = set()
    if d.synth.prompts:
        splits, synth_ids = add_synth(splits, p)
    code, code_stats = code_conversations(d.code_prompts, p.seed, d.code_packages)
    code_ids = {c["id"] for c in code}
    splits = add_to_splits(splits, code)
    code_stats["conversations"] = {k: sum(c["id"] in code_ids for c in v) for k, v in splits.items()}
    encoded = {name: encode_jsonl(OUT_DIR / f"{name}.jsonl", rows) for name, rows in splits.items()}
    metrics = {
        "source": d.source,
        "stats": stats,
        "conversations": {k: len(v) for k, v in splits.items()},
        "messages": {k: sum(len(c["messages"]) for c in v) for k, v in splits.items()},
        "code": code_stats,
    }
    if d.synth.prompts:
        metrics["synth"] = {k: sum(c["id"] in synth_ids for c in v) for k, v in splits.items()}
    with atomic_dir(OUT_DIR) as tmp:
        for name, data in encoded.items():
            with atomic_path(tmp / f"{name}.jsonl") as f:
                f.write_bytes(data)
        # what the splits were built from, checked by their readers (eyas/pipeline/provenance.py)
        # (a synthesized set by its digest, so a later synthesize-prompts run shows as a change)
        write_json(tmp / FINGERPRINT, record("prepare-data", p, [SYNTH / "conversations.jsonl"] if d.synth.prompts
                                             else [], target=False, source=True))
    write_json(METRICS, metrics)
    return metrics


def add_synth(splits: dict[str, list[dict]], p) -> tuple[dict[str, list[dict]], set[str]]:
    """``splits`` with the synthesized conversations of ``data/synth`` joined to train and val
    (``data.synth.mode: add``, in proportion) or as train and val (``only``), and their ids.

    Raises:
        StaleError: ``data/synth`` was made for other params or another target (its fingerprint).
        DataError: it holds another number of conversations than ``data.synth.prompts``, or an id
            the source uses.
    """
    check(SYNTH, p, "prepare-data")
    path = SYNTH / "conversations.jsonl"
    synth = read_jsonl(path)
    if len(synth) != p.data.synth.prompts:
        raise DataError(f"{path}: {len(synth)} conversations, data.synth.prompts is {p.data.synth.prompts}: "
                        "rerun `dvc repro synthesize-prompts`")
    ids = {c["id"] for c in synth}
    if p.data.synth.mode == "only":
        n = p.data.val
        return {**splits, "val": synth[:n], "train": synth[n:]}, ids
    return add_to_splits(splits, synth, key="data.synth.prompts"), ids


if __name__ == "__main__":
    main()
