"""A smaller training set from an extracted one, for a scaling table: every n-th shard of a feature split.

    python3 dev/bench/feature_subset.py data/features/train /elsewhere/data/features/train --every 4

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
incomplete), one that is not JSON or not a feature manifest (shards of {file, samples, tokens}, each
file a name beside the manifest listed once, samples and tokens counts: ints >= 0), a listed shard
missing, unreadable, a symbolic link or of another token count than the manifest says, n < 1 or
larger than the shard count, an output path that names no new directory ('', '.', '..'), an output
directory that already exists or is a symbolic link, one the file system refuses (a name too long),
an output on another file system.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import sys
from pathlib import Path

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # eyas from this checkout
from eyas.features import MANIFEST, FeatureError, FeatureStore  # noqa: E402
from eyas.io import read_json, write_json  # noqa: E402


def subset(src: Path, out: str | Path, every: int) -> dict:
    """Write ``out`` as shards ``0, every, 2 * every, ...`` of the feature split ``src``; returns
    the new manifest. Raises SystemExit naming the file or argument at fault; nothing of ``out`` is
    left behind then (nor the directories made for it)."""
    if not str(out) or Path(out).name in ("", ".."):  # '', '.', '/', 'a/..': no name to give the new directory
        raise SystemExit(f"output {str(out)!r}: give the path of a new directory for the subset, e.g. half/{src.name}")
    out = Path(out)
    m = _manifest(src)
    shards = m["shards"]
    if sum(s["tokens"] for s in shards) < 1:
        raise SystemExit(f"{src / MANIFEST}: the split holds no tokens")
    if not 1 <= every <= len(shards):
        raise SystemExit(f"--every {every}: must be 1..{len(shards)} (the shards of {src})")
    keep = shards[::every]
    for s in keep:  # a link would be hard-linked as a link (a relative one then points nowhere from out)
        if (src / s["file"]).is_symlink():
            raise SystemExit(f"{src / s['file']}: a symbolic link; give the split that holds the shard files")
    tmp = out.with_name(out.name + ".tmp")
    made: list[Path] = []  # the directories made, removed again on failure
    try:  # from here an OSError (a name too long, a file where a directory belongs) is one line naming the path
        if out.resolve().is_relative_to(src.resolve()) or src.resolve().is_relative_to(out.resolve()):
            raise SystemExit(f"{out}: inside the split {src} or holding it; write the subset beside it")
        for path, why in ((out, "remove it first (a subset is written whole or not at all)"),
                          (tmp, "a leftover of an interrupted run; remove it first")):
            if path.is_symlink():
                raise SystemExit(f"{path}: a symbolic link (to {os.readlink(path)}); give a new directory")
            if path.exists():
                raise SystemExit(f"{path}: exists; {why}")
        made = [d for d in (tmp, *tmp.parents) if not os.path.lexists(d)]
        tmp.mkdir(parents=True)
        supervised = 0
        for s in keep:
            f_src = src / s["file"]
            try:
                os.link(f_src, tmp / s["file"])
            except OSError as e:
                why = ": the output must be on the source's file system" if e.errno == errno.EXDEV else ""
                raise SystemExit(f"{f_src} -> {tmp / s['file']}: cannot hard-link ({e.strerror}){why}") from None
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
        tmp.rename(out)
    except OSError as e:  # checking the output's path, making the directories, writing the manifest, the rename
        _remove(made)
        raise SystemExit(f"{e.filename2 or e.filename or out}: cannot write the subset ({e.strerror or e})") from None
    except BaseException:
        _remove(made)
        raise
    return new


def _remove(made: list[Path]) -> None:
    """Remove the directories ``subset`` made (``made[0]``, the temporary one, with its contents), if any."""
    if made:
        shutil.rmtree(made[0], ignore_errors=True)
    for d in made[1:]:
        with contextlib.suppress(OSError):
            d.rmdir()


def _manifest(src: Path) -> dict:
    """The split's manifest as the train stages open it (:meth:`eyas.features.FeatureStore.open`), its
    shard list checked. Raises SystemExit naming the manifest and what is wrong with it."""
    path = src / MANIFEST
    try:
        if path.is_file():  # before FeatureStore.open, which would trip over a malformed one
            m = read_json(path)
            if not isinstance(m.get("shards"), list):
                raise SystemExit(f"{path}: not a feature manifest: no shards list ({_SHAPE})")
            first: dict[str, int] = {}  # each shard file's first index in the list
            for i, s in enumerate(m["shards"]):
                if not (isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("samples"), int)
                        and isinstance(s.get("tokens"), int)):
                    raise SystemExit(f"{path}: not a feature manifest: shards[{i}] is {s!r} ({_SHAPE})")
                for count in ("samples", "tokens"):  # bool is an int to isinstance
                    if isinstance(s[count], bool) or s[count] < 0:
                        raise SystemExit(f"{path}: shards[{i}] {count} is {s[count]!r}, not a count (an int >= 0)")
                if s["file"] in ("", ".", "..") or Path(s["file"]).name != s["file"]:
                    raise SystemExit(f"{path}: shards[{i}] file {s['file']!r} is not a file name: a split holds "
                                     f"its shards beside its manifest, and so does the subset")
                if (j := first.setdefault(s["file"], i)) != i:
                    raise SystemExit(f"{path}: shards[{i}] file {s['file']!r} is listed twice (shards[{j}] too)")
        return FeatureStore.open(src).manifest
    except UnicodeDecodeError as e:
        raise SystemExit(f"{path}: not UTF-8 text (byte {e.start})") from None
    except (FeatureError, ValueError) as e:  # each names the file (read_json: not JSON, not a JSON object)
        raise SystemExit(str(e)) from None
    except OSError as e:
        raise SystemExit(f"{path}: cannot read the manifest ({e.strerror})") from None
    except TypeError as e:  # a key of another type than FeatureStore.open reads it as (aux_layers: 5)
        raise SystemExit(f"{path}: not a feature manifest ({e})") from None


_SHAPE = "a feature manifest lists its shards as {file, samples, tokens}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="a feature split, e.g. data/features/train")
    ap.add_argument("out", help="the subset's directory (must not exist)")
    ap.add_argument("--every", type=int, required=True, help="keep shards 0, n, 2n, ...")
    a = ap.parse_args(argv)
    m = subset(a.src, a.out, a.every)
    print(f"feature_subset: {a.out}: {m['subset']['shards']} shards, {m['num_samples']} samples, "
          f"{m['num_tokens']} tokens ({m['num_tokens'] / m['subset']['num_tokens_of_source']:.3f} of {a.src})")


if __name__ == "__main__":
    main()
