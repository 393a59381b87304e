"""DVC stage `train-scratch`: TTT-train an EAGLE-3 drafter from random initialisation.

Reads params `lr` (top level, so `dvc exp run -S lr=5e-5` reruns this stage and the stages after
it), `seed`, `train`, `target` (train.mode: online: the target runs here, eyas/training/online.py);
reads `data/features/`, `models/vocab/`, `data/inputs/target.json`; writes `models/scratch/`
(servable checkpoint), `metrics/train_scratch.json`, `plots/train_scratch/`.
Run: `python -m stages.train_scratch`.
"""

from __future__ import annotations

from pathlib import Path

from eyas.features import FeatureStore
from eyas.params import target as target_schema
from eyas.params import train as train_schema
from eyas.params.schema import load_sections
from eyas.pipeline.provenance import check, record
from eyas.pipeline.resume import code_digest
from eyas.pipeline.runlock import hold
from eyas.target.model import pick_device
from eyas.tracking.runs import start_stage_run
from eyas.training.loop import new_drafter, train_drafter
from eyas.training.online import capture_for
from eyas.vocab.mapping import load_mapping
from stages.common import FEATURES, VOCAB, checkpoint_dir, target_head
from stages.training import finish_training


def main() -> None:
    hold("train-scratch")  # one run of this stage at a time in this workspace (eyas/pipeline/runlock.py)
    p = load_sections(target_schema, train_schema)
    with start_stage_run("train-scratch", p) as tracker:
        inputs = [FEATURES / "train", FEATURES / "val", VOCAB]
        for a in inputs:  # refuse stale upstream outputs, naming the stage to rerun
            check(a, p, reader="train-scratch")
        fp = record("train-scratch", p, inputs)
        train, val = FeatureStore.open(FEATURES / "train"), FeatureStore.open(FEATURES / "val")
        mapping, _ = load_mapping(VOCAB)
        head = target_head()
        drafter = new_drafter(train.manifest, mapping, head["embed_tokens"], p.seed, mapping_source=str(VOCAB),
                              lm_head=head["lm_head"])
        result = train_drafter(drafter, train_store=train, val_store=val, lm_head=head["lm_head"],
                               tp=p.train, lr=p.lr, seed=p.seed, tracker=tracker,
                               device=pick_device(), checkpoint_dir=checkpoint_dir("train-scratch"),
                               capture=capture_for(p, train), code=code_digest("stages.train_scratch"))
        m = finish_training("train-scratch", drafter, result, Path("models/scratch"), tracker,
                            fingerprint=fp)
        print(f"train-scratch: val {m.get('val')}")


if __name__ == "__main__":
    main()
