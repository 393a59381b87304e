"""A smaller training set from an extracted one, for a scaling table: every n-th shard of a feature split.

    python3 benchmarks/feature_subset.py data/features/train /elsewhere/data/features/train --every 4

The output directory gets hard links to shards ``0, n, 2n, ...`` of the source (no bytes copied; the
source and the output must be on one file system) and a ``manifest.json`` that lists only those,
with ``num_samples``, ``num_tokens`` and ``supervised_tokens`` summed over them and ``subset`` saying
what it was taken from. Everything else in the manifest (the fingerprint the train stages check,
aux layers, storage dtype) is the source's, so ``train-scratch`` trains on it as on the whole split.

Extraction sorts a split's samples by length before it shards them (stages/extract.py), so the shards
are length buckets: a strided subset keeps about 1/n of the samples of every length (and so of chat and
of the shorter code prompts alike), where a prefix would keep the shortest alone. The finer
``extract.shard_samples``, the closer each share is to 1/n. The manifest's other counts
(``truncated_samples``, ``skipped_template``, ...) stay the whole split's.

Raises (as SystemExit with the file named): no manifest (extraction incomplete), n < 1 or larger
than the shard count, an output directory that already exists, an output on another file system.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # eyas from this checkout
from eyas.features import MANIFEST  # noqa: E402
from eyas.io import read_json, write_json  # noqa: E402


def subset(src: Path, out: Path, every: int) -> dict:
    """Write ``out`` as shards ``0, every, 2 * every, ...`` of the feature split ``src``; returns
    the new manifest. Raises SystemExit naming the file or argument at fault."""
    if not (src / MANIFEST).is_file():
        raise SystemExit(f"{src / MANIFEST}: no manifest (the extraction is incomplete or this is not a feature split)")
    m = read_json(src / MANIFEST)
    shards = m["shards"]
    if not 1 <= every <= len(shards):
        raise SystemExit(f"--every {every}: must be 1..{len(shards)} (the shards of {src})")
    if out.exists():
        raise SystemExit(f"{out}: exists; remove it first (a subset is written whole or not at all)")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        raise SystemExit(f"{tmp}: a leftover of an interrupted run; remove it first")
    tmp.mkdir(parents=True)
    keep = shards[::every]
    supervised = 0
    for s in keep:
        try:
            os.link(src / s["file"], tmp / s["file"])
        except OSError as e:  # another file system, or no hard links there
            shutil.rmtree(tmp)
            raise SystemExit(f"{src / s['file']} -> {tmp}: cannot hard-link ({e.strerror}): the output must be on "
                             f"the source's file system") from None
        with safe_open(str(src / s["file"]), framework="pt") as f:  # the manifest's shards do not count it
            supervised += int(f.get_tensor("loss_mask").sum())
    new = {**m, "shards": keep,
           "num_samples": sum(s["samples"] for s in keep), "num_tokens": sum(s["tokens"] for s in keep),
           "supervised_tokens": supervised,
           "subset": {"of": str(src), "every": every, "shards": f"{len(keep)} of {len(shards)}",
                      "num_tokens_of_source": m["num_tokens"]}}
    write_json(tmp / MANIFEST, new)
    tmp.rename(out)
    return new


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="a feature split, e.g. data/features/train")
    ap.add_argument("out", type=Path, help="the subset's directory (must not exist)")
    ap.add_argument("--every", type=int, required=True, help="keep shards 0, n, 2n, ...")
    a = ap.parse_args(argv)
    m = subset(a.src, a.out, a.every)
    print(f"feature_subset: {a.out}: {m['subset']['shards']} shards, {m['num_samples']} samples, "
          f"{m['num_tokens']} tokens ({m['num_tokens'] / m['subset']['num_tokens_of_source']:.3f} of {a.src})")


if __name__ == "__main__":
    main()
