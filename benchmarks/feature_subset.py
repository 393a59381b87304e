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

Raises (as SystemExit with the file named, nothing of the output left): no manifest (extraction
incomplete) or one that is not a feature manifest, a listed shard missing, unreadable, a symbolic link
or of another token count than the manifest says, n < 1 or larger than the shard count, an output
directory that already exists, an output on another file system.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # eyas from this checkout
from eyas.features import MANIFEST, FeatureError, FeatureStore  # noqa: E402
from eyas.io import write_json  # noqa: E402


def subset(src: Path, out: Path, every: int) -> dict:
    """Write ``out`` as shards ``0, every, 2 * every, ...`` of the feature split ``src``; returns
    the new manifest. Raises SystemExit naming the file or argument at fault; nothing of ``out`` is
    left behind then."""
    try:  # the manifest as the train stages read it (eyas.features.FeatureStore.open): format, shards there
        m = FeatureStore.open(src).manifest
        shards = m["shards"]
        for s in shards:
            if not (isinstance(s["file"], str) and isinstance(s["samples"], int) and isinstance(s["tokens"], int)):
                raise TypeError(f"shard entry {s!r}")
    except FeatureError as e:
        raise SystemExit(str(e)) from None
    except (KeyError, TypeError) as e:  # a hand-edited or foreign manifest
        raise SystemExit(f"{src / MANIFEST}: not a feature manifest ({type(e).__name__}: {e}): shards is a list of "
                         f"{{file, samples, tokens}}") from None
    if sum(s["tokens"] for s in shards) < 1:
        raise SystemExit(f"{src / MANIFEST}: the split holds no tokens")
    if not 1 <= every <= len(shards):
        raise SystemExit(f"--every {every}: must be 1..{len(shards)} (the shards of {src})")
    if out.resolve().is_relative_to(src.resolve()) or src.resolve().is_relative_to(out.resolve()):
        raise SystemExit(f"{out}: inside the split {src} or holding it; write the subset beside it")
    if out.exists():
        raise SystemExit(f"{out}: exists; remove it first (a subset is written whole or not at all)")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        raise SystemExit(f"{tmp}: a leftover of an interrupted run; remove it first")
    keep = shards[::every]
    for s in keep:  # a link would be hard-linked as a link (a relative one then points nowhere from out)
        if (src / s["file"]).is_symlink():
            raise SystemExit(f"{src / s['file']}: a symbolic link; give the split that holds the shard files")
    tmp.mkdir(parents=True)
    supervised = 0
    try:
        for s in keep:
            f_src = src / s["file"]
            try:
                os.link(f_src, tmp / s["file"])
            except OSError as e:  # another file system, or no hard links there
                raise SystemExit(f"{f_src} -> {tmp}: cannot hard-link ({e.strerror}): the output must be on "
                                 f"the source's file system") from None
            try:
                with safe_open(str(f_src), framework="pt") as f:  # the manifest's shards do not count it
                    mask = f.get_tensor("loss_mask")
            except Exception as e:  # safetensors raises its own SafetensorError (a header, a missing tensor)
                raise SystemExit(f"{f_src}: cannot read its loss_mask ({e})") from None
            if mask.numel() != s["tokens"]:
                raise SystemExit(f"{f_src}: {mask.numel()} tokens, the manifest {src / MANIFEST} says {s['tokens']}")
            supervised += int(mask.sum())
        new = {**m, "shards": keep,
               "num_samples": sum(s["samples"] for s in keep), "num_tokens": sum(s["tokens"] for s in keep),
               "supervised_tokens": supervised,
               "subset": {"of": str(src), "every": every, "shards": f"{len(keep)} of {len(shards)}",
                          "num_tokens_of_source": sum(s["tokens"] for s in shards)}}
        write_json(tmp / MANIFEST, new)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
