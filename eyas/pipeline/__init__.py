"""The pipeline: what ties the stages into one reproducible DVC + MLflow workflow.

Owns params presets (:mod:`eyas.pipeline.preset`), fingerprints of what an artifact was built from
(:mod:`eyas.pipeline.provenance`), the code deps of each DVC stage (:mod:`eyas.pipeline.stage_deps`,
``python3 -m eyas.pipeline.stage_deps``), MLflow runs and the metrics files DVC reads
(:mod:`eyas.pipeline.tracking`: :func:`~eyas.pipeline.tracking.start_stage_run`), figures
(:mod:`eyas.pipeline.plots`), ``eyas compare`` (:mod:`eyas.pipeline.compare`), resumable parts of
a long stage (:mod:`eyas.pipeline.resume`) and one run of a stage at a time per workspace
(:mod:`eyas.pipeline.runlock`). It may import from every other package. This
``__init__`` re-exports nothing.
"""
