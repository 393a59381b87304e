"""GGUF files for llama.cpp: an eyas drafter as llama.cpp's ``eagle3`` architecture, and the target
at the precision eyas evaluates it, both written by llama.cpp's own converter.

The converter is ``convert_hf_to_gguf.py`` of the llama.cpp sources vendored in the PyPI sdist of
``llama-cpp-python`` that ``scripts/build_llama_server.sh`` also builds ``llama-server`` from
(installed beside it under ``<python data dir>/share/eyas/llama.cpp``), so the file layout is the
engine's own (ggml-org/llama.cpp ``conversion/llama.py``, EAGLE-3 support from PR #18039): eyas
re-implements none of it. The drafter conversion reads the target's ``config.json`` and tokenizer
through ``--target-model-dir`` (:func:`write_target_dir` writes them for any target eyas loads).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from safetensors.torch import save_file

from eyas.files import write_json

CONVERTER = Path(sysconfig.get_path("data"), "share", "eyas", "llama.cpp", "convert_hf_to_gguf.py")
"""llama.cpp's converter as ``scripts/build_llama_server.sh`` installs it."""


OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
"""The converter's ``--outtype`` for each ``target.dtype``: the precision eyas evaluates at."""


class GGUFExportError(RuntimeError):
    """The converter is missing or failed; the message names the input and the converter's last lines."""


def write_target_dir(model, tokenizer, out: Path, weights: bool = False) -> Path:
    """Write the target's ``config.json`` and tokenizer files (transformers ``save_pretrained``) into
    ``out``: what the converter's ``--target-model-dir`` reads for an EAGLE-3 drafter (the vocab,
    the layer count, the hidden size). With ``weights`` also the model's weights as safetensors, in
    the dtype the model holds (the input of :func:`convert` for the target itself; a tied lm_head is left
    out, and the converter ties it again).

    Args:
        model: a transformers causal LM (``eyas.target.Target.model``).
        tokenizer: its tokenizer (``Target.tokenizer``).
        out: a directory; created, files in it overwritten.
    Returns:
        ``out``.
    """
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # a GGUF source: the weights written here are de-quantised
    cfg["architectures"] = [type(model).__name__]  # the converter picks its model class by it
    write_json(out / "config.json", cfg)
    tokenizer.save_pretrained(out)
    if weights:  # transformers will not save_pretrained a model it de-quantised from a GGUF
        state = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):  # the converter ties a missing lm_head
            state.pop("lm_head.weight", None)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def convert(model_dir: Path, out: Path, outtype: str = "f32", target_model_dir: Path | None = None) -> Path:
    """Run llama.cpp's converter on an HF-layout directory and write ``out`` atomically (a
    ``.part`` file renamed when the converter succeeds).

    Args:
        model_dir: a drafter directory (eyas' eagle layout or the speculators layout: both are read
            by ``conversion/llama.py``) or a target written by :func:`write_target_dir`.
        out: the GGUF file to write.
        outtype: the converter's ``--outtype`` (``f32``, ``f16``, ``bf16``, ``q8_0``).
        target_model_dir: required for a drafter (the converter's ``--target-model-dir``).
    Returns:
        ``out``.
    Raises:
        GGUFExportError: the converter is not installed (run ``bash scripts/build_llama_server.sh``),
            or it exited non-zero (the message names ``model_dir`` and holds its last output lines).
    """
    if not CONVERTER.is_file():
        raise GGUFExportError(f"llama.cpp's converter is not installed at {CONVERTER}: "
                              "run `bash scripts/build_llama_server.sh`")
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    cmd = [sys.executable, str(CONVERTER), str(model_dir), "--outfile", str(part), "--outtype", outtype]
    if target_model_dir is not None:
        cmd += ["--target-model-dir", str(target_model_dir)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if r.returncode != 0 or not part.is_file():
        part.unlink(missing_ok=True)
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        raise GGUFExportError(f"{model_dir}: llama.cpp's converter exited {r.returncode}:\n{tail}")
    os.replace(part, out)
    return out
