"""DVC stage `build-vocab`: the draft vocabulary (d2t/t2d) from the train split's assistant tokens
(the most frequent; when they hold fewer distinct ids than the draft vocab, the split's other most
frequent tokens fill the rest: eyas.vocab.mapping.build_mapping).

Reads params `vocab`; reads `data/features/train/`; writes `models/vocab/` (vocab.safetensors with
d2t, t2d, counts; vocab.json) and `metrics/vocab.json`. Run: `python -m stages.build_vocab`.
"""

from __future__ import annotations

import torch

from eyas.features import FeatureStore
from eyas.io import write_json
from eyas.params import target as target_schema
from eyas.params import vocab as vocab_schema
from eyas.params.schema import load_sections
from eyas.pipeline.provenance import check, record
from eyas.pipeline.runlock import hold
from eyas.tracking.runs import start_stage_run
from eyas.vocab.mapping import build_mapping, count_tokens, save_mapping, validate_mapping
from stages.common import FEATURES, METRICS, VOCAB


def main() -> None:
    hold("build-vocab")  # one run of this stage at a time in this workspace (eyas/pipeline/runlock.py)
    p = load_sections(target_schema, vocab_schema)
    with start_stage_run("build-vocab", p) as tracker:
        check(FEATURES / "train", p, reader="build-vocab")
        fp = record("build-vocab", p, [FEATURES / "train"])
        store = FeatureStore.open(FEATURES / "train")
        ids, mask = store.token_stats()
        counts = count_tokens(ids, mask, store.manifest["vocab_size"])
        # a draft vocab larger than the assistant tokens' distinct ids is filled with the data's
        # other most frequent tokens (the prompts'), which train.loss_tokens: all also supervises
        every = count_tokens(ids, torch.ones_like(mask), store.manifest["vocab_size"])
        mapping, info = build_mapping(counts, p.vocab.draft_vocab_size, order="target_id", fill_counts=every)
        validate_mapping(mapping.d2t, mapping.t2d, mapping.vocab_size, p.vocab.draft_vocab_size,
                         source="build-vocab")
        info["features_manifest"] = {"num_tokens": store.manifest["num_tokens"],
                                     "target": store.manifest["target"]}
        info["fingerprint"] = fp  # checked by train-scratch and remap (eyas/pipeline/provenance.py)
        save_mapping(VOCAB, mapping, counts, info)
        metrics = {k: info[k] for k in ("coverage", "distinct_tokens", "filled", "padded", "draft_vocab_size",
                                        "assistant_tokens")}
        write_json(METRICS / "vocab.json", metrics)
        tracker.log_metrics({k: float(v) for k, v in metrics.items()})
        tracker.log_dict(info, "vocab_report.json")
        print(f"build-vocab: {metrics}")


if __name__ == "__main__":
    main()
