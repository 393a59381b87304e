"""The params schema, one module per section of ``params.yaml``: the ground floor every stage reads.

:mod:`eyas.params.schema` reads and checks a params file (types, defaults from the repository's
``params.yaml``, errors naming the key and its line); each section's module (``target``, ``data``,
``distill``, ``extract``, ``vocab``, ``stand_in``, ``remap``, ``train`` with its kernel choices
(``train.backend``), ``train_finetune``, ``eval``, ``serve``) holds that section's dataclass and value checks.
A stage loads the sections it reads (:func:`eyas.params.schema.load_sections`), so its code deps,
derived from its imports (eyas/pipeline/stage_deps.py), hold only their schemas: an edit to the
eval's schema reruns only the eval. :mod:`eyas.params.full` loads every section (tools, tests, and
identify-inputs, which checks the whole file first on every ``dvc repro``). This ``__init__`` imports
nothing, so importing one section does not import the others.
"""
