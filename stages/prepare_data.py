"""DVC stage `prepare-data`: load conversations, split them, write the splits and metrics.

Reads params `data.*` and `seed`; writes `data/conversations/{train,val,test,publish}.jsonl` and
`metrics/prepare_data.json`, and logs the counts as the stage's MLflow child run.
`data.code_prompts` code conversations (eyas.data.code) are added to train and val after the split;
when it is > 0, the metrics' `code` section holds, per package (import name), the usable functions
it gave (`code.<package>.usable`) and why the others were skipped. Run from the repository root:
`python -m stages.prepare_data`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eyas.data.code import add_to_splits, code_conversations
from eyas.data.conversations import load_conversations, split_conversations, write_jsonl
from eyas.pipeline.tracking import start_stage_run
from eyas.training.params import flatten, load_params

OUT_DIR = Path("data/conversations")
METRICS = Path("metrics/prepare_data.json")


def main() -> None:
    p = load_params()
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
    """Load, split and write the conversations of params ``p``; write and return the metrics."""
    d = p.data
    convs, stats = load_conversations(d.source, on_bad_line=d.on_bad_line)
    splits = split_conversations(convs, val=d.val, test=d.test, publish=d.publish,
                                 max_conversations=d.max_conversations, seed=p.seed)
    code, code_stats = code_conversations(d.code_prompts, p.seed)
    code_ids = {c["id"] for c in code}
    splits = add_to_splits(splits, code)
    code_stats["conversations"] = {k: sum(c["id"] in code_ids for c in v) for k, v in splits.items()}
    for name, rows in splits.items():
        write_jsonl(OUT_DIR / f"{name}.jsonl", rows)

    metrics = {
        "source": d.source,
        "stats": stats,
        "conversations": {k: len(v) for k, v in splits.items()},
        "messages": {k: sum(len(c["messages"]) for c in v) for k, v in splits.items()},
        "code": code_stats,
    }
    METRICS.parent.mkdir(parents=True, exist_ok=True)
    tmp = METRICS.with_name(METRICS.name + ".tmp")
    tmp.write_text(json.dumps(metrics, sort_keys=True, indent=2) + "\n")
    os.replace(tmp, METRICS)
    return metrics


if __name__ == "__main__":
    main()
