"""The pipeline: what ties the stages into one reproducible DVC workflow.

Owns the pipeline files and the code deps of each DVC stage (:mod:`eyas.pipeline.dvcfiles`,
:mod:`eyas.pipeline.stage_deps`, ``python3 -m eyas.pipeline.stage_deps``), params presets
(:mod:`eyas.pipeline.preset`, ``eyas preset``), fingerprints of what an artifact was built from
(:mod:`eyas.pipeline.provenance`), resumable parts of a long stage (:mod:`eyas.pipeline.resume`), one
run of a stage at a time per workspace (:mod:`eyas.pipeline.runlock`) and a team's DVC remote
(:mod:`eyas.pipeline.team_remote`, ``eyas remote``). MLflow runs and ``eyas compare`` are
:mod:`eyas.tracking`, above it. This ``__init__`` re-exports nothing.
"""
