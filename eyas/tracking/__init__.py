"""Tracking: every stage's MLflow run, and the runs read back.

Owns the stage runs and their parent (:mod:`eyas.tracking.runs`:
:func:`~eyas.tracking.runs.start_stage_run`; what a store outage keeps in a spool, sent later by
:func:`~eyas.tracking.runs.sync_spools` or ``python3 -m eyas.tracking.runs sync``), a team's MLflow
store, system metrics, the parent's summary and logged models (:mod:`eyas.tracking.team`), figures
(:mod:`eyas.tracking.plots`) and ``eyas compare`` (:mod:`eyas.tracking.compare`). It sits above
:mod:`eyas.pipeline` (it reads the pipeline files). This ``__init__`` re-exports nothing.
"""
