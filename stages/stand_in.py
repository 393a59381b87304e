"""DVC stage `stand-in-drafter` (published/dvc.yaml): stands in for a PUBLISHED drafter in the
embedded default, for the fine-tune comparison (finetune/dvc.yaml; `dvc repro` does not run it).

It is trained on a disjoint data slice (`publish`) with its own, differently sized vocab whose
draft ids are ordered by frequency, as some published drafters are, so `remap` has real work to do.
Like the EAGLE-3 and SpecForge drafters it stands for, it learns from assistant tokens only
(`train.loss_tokens: assistant` whatever params.yaml says), and its vocab is built from those tokens
alone (no fill from other tokens: eyas.vocab.mapping.build_mapping).
Reads params `seed`, `train`, `stand_in`, `target` (train.mode: online: the target runs here,
eyas/training/online.py); reads `data/features/{publish,val}/`, `data/inputs/target.json`; writes
`models/stand_in/` (servable checkpoint) and `metrics/stand_in.json`.
Run: `python -m stages.stand_in`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from eyas.features import FeatureStore
from eyas.params import stand_in as stand_in_schema
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
from eyas.vocab.mapping import build_mapping, count_tokens
from stages.common import FEATURES, checkpoint_dir, target_head
from stages.training import finish_training


def main() -> None:
    hold("stand-in-drafter")  # one run of this stage at a time in this workspace (eyas/pipeline/runlock.py)
    p = load_sections(target_schema, stand_in_schema, train_schema)
    s = p.stand_in
    with start_stage_run("stand-in-drafter", p) as tracker:
        inputs = [FEATURES / "publish", FEATURES / "val"]
        for a in inputs:  # refuse stale upstream outputs, naming the stage to rerun
            check(a, p, reader="stand-in-drafter")
        fp = record("stand-in-drafter", p, inputs)
        pub, val = FeatureStore.open(FEATURES / "publish"), FeatureStore.open(FEATURES / "val")
        ids, mask = pub.token_stats()
        mapping, info = build_mapping(count_tokens(ids, mask, pub.manifest["vocab_size"]),
                                      s.draft_vocab_size, order=s.order)
        head = target_head()
        drafter = new_drafter(pub.manifest, mapping, head["embed_tokens"], p.seed + 1)
        tp = dataclasses.replace(p.train, epochs=s.epochs, loss_tokens="assistant")  # as published drafters train
        result = train_drafter(drafter, train_store=pub, val_store=val, lm_head=head["lm_head"], tp=tp,
                               lr=s.lr, seed=p.seed + 1, tracker=tracker, device=pick_device(),
                               checkpoint_dir=checkpoint_dir("stand-in"), capture=capture_for(p, pub),
                               code=code_digest("stages.stand_in"))
        # no plots/stand_in/: published/dvc.yaml declares none (the curves are in the MLflow run)
        finish_training("stand-in", drafter, result, Path("models/stand_in"), tracker,
                        extra={"vocab": info}, fingerprint=fp, curves=False)


if __name__ == "__main__":
    main()
