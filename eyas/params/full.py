"""Every section of ``params.yaml`` at once: for tools (``eyas preset``, ``eyas compare``, the
benchmarks), tests, and identify-inputs, which checks the whole file on every ``dvc repro`` before any
other stage runs. A stage that reads a few sections loads only those
(:func:`eyas.params.schema.load_sections`), so its code deps hold only their schemas."""

from __future__ import annotations

from pathlib import Path

from eyas.params import (
    data,
    distill,
    eval,  # the eval section's module, named as the section
    extract,
    remap,
    serve,
    stand_in,
    target,
    train,
    train_finetune,
    vocab,
)
from eyas.params.distill import DistillParams, DistillServerParams
from eyas.params.eval import EvalParams
from eyas.params.extract import ExtractParams
from eyas.params.remap import STAND_IN, RemapParams
from eyas.params.schema import (
    DEFAULTS_FILE,
    FEATURE_SPLITS,
    MAX_EPOCHS,
    ParamsError,
    UnknownKeyError,
    flatten,
    key_lines,
    load_sections,
    params_class,
    params_hash,
    parse_sections,
)
from eyas.params.serve import ServeParams
from eyas.params.stand_in import StandInParams
from eyas.params.target import TargetParams
from eyas.params.train import LOSS_TOKENS, KernelChoices, TrainParams
from eyas.params.train_finetune import TrainFinetuneParams
from eyas.params.vocab import VocabParams

__all__ = ["DEFAULTS_FILE", "FEATURE_SPLITS", "LOSS_TOKENS", "MAX_EPOCHS", "SECTIONS", "STAND_IN", "DataParams",
           "DistillParams", "DistillServerParams", "EvalParams", "ExtractParams", "KernelChoices", "Params",
           "ParamsError", "RemapParams", "ServeParams", "StandInParams", "TargetParams", "TrainFinetuneParams",
           "TrainParams", "UnknownKeyError", "VocabParams", "default_params", "flatten", "key_lines", "load_params",
           "params_hash", "parse_params"]

DataParams = data.DataParams
SECTIONS = (target, data, distill, extract, vocab, stand_in, remap, train, train_finetune, eval, serve)
"""Every section's module, in ``params.yaml``'s order."""
Params = params_class(SECTIONS)
"""``lr``, ``seed`` and every section, typed."""


def parse_params(raw: dict | None, source: str = "params.yaml") -> Params:
    """:func:`eyas.params.schema.parse_sections` of every section; ``parse_params({})`` is the defaults.

    Raises:
        ParamsError: as :func:`~eyas.params.schema.parse_sections`, for any key of the file.
    """
    return parse_sections(raw, source, *SECTIONS)


def load_params(path: str | Path = "params.yaml") -> Params:
    """:func:`eyas.params.schema.load_sections` of every section.

    Raises:
        ParamsError: as :func:`~eyas.params.schema.load_sections`, for any key of the file.
    """
    return load_sections(*SECTIONS, path=path)


def default_params() -> Params:
    """The params of :data:`DEFAULTS_FILE` alone, validated (tests and scripts start from these and
    change fields with ``dataclasses.replace``).

    Raises:
        ParamsError: :data:`DEFAULTS_FILE` is missing, incomplete or invalid.
    """
    return parse_params({}, str(DEFAULTS_FILE))
