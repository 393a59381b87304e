"""DVC stage `train-finetune` (finetune/dvc.yaml): TTT fine-tuning of the remapped pretrained drafter.

Reads params `seed`, `train`, `train_finetune` (its `lr` among them), `target` (train.mode: online:
the target runs here, eyas/training/online.py); reads `data/features/`, `models/remapped/`,
`data/inputs/target.json`; writes `models/finetune/`, `metrics/train_finetune.json`,
`plots/train_finetune/`. Before the first update a step-0 gate stops a run whose val accuracy is at
chance or under the floor (eyas.training.loop.step0_gate), naming the vocab mapping as a cause only
when remap's step-0 figures (`models/remapped/remap_report.json` step0_val) do not clear it.
Run: `python -m stages.train_finetune`.
"""

from __future__ import annotations

from pathlib import Path

from eyas.export.load import load_drafter
from eyas.features import FeatureStore, check_compatible
from eyas.io import read_json
from eyas.params import target as target_schema
from eyas.params import train as train_schema
from eyas.params import train_finetune as train_finetune_schema
from eyas.params.schema import load_sections
from eyas.pipeline.provenance import check, record
from eyas.pipeline.resume import code_digest
from eyas.pipeline.runlock import hold
from eyas.target.model import pick_device
from eyas.tracking.runs import start_stage_run
from eyas.training.loop import step0_gate, train_drafter
from eyas.training.online import capture_for
from stages.common import FEATURES, checkpoint_dir, target_head
from stages.training import finish_training


def main() -> None:
    hold("train-finetune")  # one run of this stage at a time in this workspace (eyas/pipeline/runlock.py)
    p = load_sections(target_schema, train_schema, train_finetune_schema)
    f = p.train_finetune
    with start_stage_run("train-finetune", p) as tracker:
        inputs = [FEATURES / "train", FEATURES / "val", Path("models/remapped")]
        for a in inputs:  # refuse stale upstream outputs, naming the stage to rerun
            check(a, p, reader="train-finetune")
        fp = record("train-finetune", p, inputs)
        train, val = FeatureStore.open(FEATURES / "train"), FeatureStore.open(FEATURES / "val")
        drafter = load_drafter("models/remapped", num_target_layers=train.manifest["num_layers"])
        c = drafter.config
        check_compatible(train.manifest, aux_layers=c.resolved_aux_layers(), hidden_size=c.target_hidden_size,
                         vocab_size=c.vocab_size, source="models/remapped")
        head = target_head()
        drafter.set_embedding(head["embed_tokens"])
        remap_report = read_json(Path("models/remapped/remap_report.json"))  # remap's step-0 figures, same val
        gate = step0_gate(c.draft_vocab_size, f.gate_margin, f.gate_min_acc, f.gate_override, tracker,
                          remap_step0=remap_report.get("step0_val"))
        result = train_drafter(drafter, train_store=train, val_store=val, lm_head=head["lm_head"],
                               tp=p.train, lr=f.lr, seed=p.seed, tracker=tracker, device=pick_device(),
                               gate=gate, checkpoint_dir=checkpoint_dir("train-finetune"),
                               capture=capture_for(p, train), code=code_digest("stages.train_finetune"))
        m = finish_training("train-finetune", drafter, result, Path("models/finetune"), tracker,
                            fingerprint=fp)
        print(f"train-finetune: val {m.get('val')}")


if __name__ == "__main__":
    main()
