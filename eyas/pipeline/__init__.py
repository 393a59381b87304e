"""The pipeline: what ties the stages into one reproducible DVC + MLflow workflow.

Owns params presets (:mod:`eyas.pipeline.preset`), fingerprints of what an artifact was built from
(:mod:`eyas.pipeline.provenance`), the code deps of each DVC stage (:mod:`eyas.pipeline.stage_deps`,
``python3 -m eyas.pipeline.stage_deps``), MLflow runs and the metrics files DVC reads
(:mod:`eyas.pipeline.tracking`: :func:`~eyas.pipeline.tracking.start_stage_run`), figures
(:mod:`eyas.pipeline.plots`), ``eyas compare`` (:mod:`eyas.pipeline.compare`) and resumable parts of
a long stage (:mod:`eyas.pipeline.resume`). It may import from every other package. This
``__init__`` re-exports nothing.
"""
