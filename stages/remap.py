"""DVC stage `remap` (finetune/dvc.yaml): move a pretrained drafter's lm_head onto the new vocab mapping.

Reads params `seed`, `remap`, `train` (TTT settings for the step-0 check; train.mode: online runs the
target here, eyas/training/online.py), `target`; reads the drafter directory `remap.source` (a DVC
dependency: the stand-in's `models/stand_in` by default, or a published drafter downloaded beside
it), `models/vocab/`, `data/features/`, `data/inputs/target.json`; writes `models/remapped/` and
`metrics/remap.json` (compatibility report and step-0 val loss/acc: the source under its own
mapping, the naive load that keeps rows in place, and the remapped drafter, also in
`models/remapped/remap_report.json` for train-finetune's step-0 gate; `positions_from_target`:
the source's context length / RoPE fields replaced by the target's, eyas.vocab.remap.adopt_target_positions).
A source with an embedding of its own (not the target's, or of another width) is refused, naming the
tensor and the engines that read it (eyas.export.own_tensors.check_source).
Run: `python -m stages.remap`.
"""

from __future__ import annotations

import copy
from pathlib import Path

from eyas.drafter.backend import Backend
from eyas.drafter.model import Eagle3Drafter
from eyas.export.eagle import save_drafter
from eyas.export.load import load_drafter
from eyas.export.own_tensors import OwnTensorError, check_source
from eyas.features import FeatureStore, check_compatible
from eyas.io import write_json
from eyas.params import remap as remap_schema
from eyas.params import target as target_schema
from eyas.params import train as train_schema
from eyas.params.schema import load_sections
from eyas.pipeline.provenance import FILE as FINGERPRINT
from eyas.pipeline.provenance import check, record
from eyas.pipeline.runlock import hold
from eyas.target.model import pick_device
from eyas.tracking.runs import start_stage_run
from eyas.training.batches import head_rows_for
from eyas.training.online import capture_for, loader_for
from eyas.training.unroll import TTTUnroll, evaluate
from eyas.vocab.mapping import VocabMapping, load_mapping
from eyas.vocab.remap import adopt_target_positions, naive_lm_head, remap_lm_head
from stages.common import FEATURES, METRICS, VOCAB, target_head

OUT = Path("models/remapped")


def with_vocab(src: Eagle3Drafter, mapping: VocabMapping, lm_head) -> Eagle3Drafter:
    """A copy of ``src`` with a new draft vocab (``mapping``) and lm_head rows ``lm_head``."""
    cfg = copy.deepcopy(src.config)
    cfg.draft_vocab_size = mapping.draft_vocab_size
    out = Eagle3Drafter(cfg)
    state = {k: v for k, v in src.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    out.load_state_dict(state, strict=False)
    out.lm_head.weight.data.copy_(lm_head)
    out.set_vocab(mapping.d2t, mapping.t2d)
    return out


def main() -> None:
    hold("remap")  # one run of this stage at a time in this workspace (eyas/pipeline/runlock.py)
    p = load_sections(target_schema, remap_schema, train_schema)
    with start_stage_run("remap", p) as tracker:
        source = Path(p.remap.source)  # a directory (eyas.params.remap checks it)
        inputs = [FEATURES / "val", VOCAB, source]
        for a in inputs:  # refuse stale upstream outputs, naming the stage to rerun
            check(a, p, reader="remap")
        fp = record("remap", p, inputs)
        val = FeatureStore.open(FEATURES / "val")
        m = val.manifest
        src = load_drafter(source, num_target_layers=m["num_layers"])
        check_compatible(m, aux_layers=src.config.resolved_aux_layers(), hidden_size=src.config.target_hidden_size,
                         vocab_size=src.config.vocab_size, source=f"drafter {p.remap.source}")
        # the source's context length and RoPE belong to ITS target: take this target's (eyas/vocab/remap.py)
        positions = adopt_target_positions(src.config, m["target_config"])
        for msg in positions:
            print(f"remap: WARNING source drafter {p.remap.source}: {msg}")
        head = target_head()
        try:  # a source with its own embedding (or another width) would lose it to the target's
            check_source(source, src.config.hidden_size, head["embed_tokens"])
        except OwnTensorError as e:
            raise SystemExit(f"remap: {e}") from None
        src.set_embedding(head["embed_tokens"])
        new_map, counts = load_mapping(VOCAB)
        old_map = VocabMapping(src.d2t.clone(), src.t2d.clone())
        rows, report = remap_lm_head(src.lm_head.weight.data, old_map, new_map, head["lm_head"], counts, p.seed)
        shared_frac = report["shared_tokens"] / new_map.draft_vocab_size
        report["shared_fraction"] = shared_frac
        if shared_frac < p.remap.min_shared_fraction:
            raise SystemExit(f"remap: the source drafter shares only {report['shared_tokens']} of "
                             f"{new_map.draft_vocab_size} draft tokens ({shared_frac:.1%} < "
                             f"remap.min_shared_fraction {p.remap.min_shared_fraction}); it was built for "
                             f"another target or data. Train from scratch or lower the threshold.")
        remapped = with_vocab(src, new_map, rows)
        naive = with_vocab(src, new_map, naive_lm_head(src.lm_head.weight.data, new_map.draft_vocab_size))

        dev = pick_device()
        loader = loader_for(val, p.train.batch_tokens, p.seed, shuffle=False, capture=capture_for(p, val, dev))
        step0 = {}
        for name, d in (("source_own_mapping", src), ("naive_rows_in_place", naive), ("remapped", remapped)):
            d.to(dev)
            unroll = TTTUnroll(d, head_rows_for(head["lm_head"], d).to(dev), p.train.ttt_length,
                               p.train.step_decay, Backend.of(p.train.backend))
            r = evaluate(unroll, loader, dev)
            step0[name] = {"loss_0": r["loss_0"], "acc_0": r["acc_0"]}
        # step0_val travels with the drafter: train-finetune's step-0 gate tells a mapping fault from others by it
        save_drafter(remapped.cpu(), OUT, extra_files={"remap_report.json": {**report, "step0_val": step0},
                                                       FINGERPRINT: fp})
        metrics = {**report, "step0_val": step0, "source": p.remap.source, "positions_from_target": positions,
                   "compatibility": {"vocab_size": m["vocab_size"], "target_hidden_size": m["hidden_size"],
                                     "aux_layers": m["aux_layers"], "ok": True}}
        write_json(METRICS / "remap.json", metrics)
        tracker.log_metrics({**{f"{n}/{k}": v for n, r in step0.items() for k, v in r.items()},
                             **{k: float(v) for k, v in report.items() if isinstance(v, (int, float))}})
        tracker.log_dict(metrics, "remap_report.json")
        print(f"remap: {report}\nstep-0 val: {step0}")


if __name__ == "__main__":
    main()
