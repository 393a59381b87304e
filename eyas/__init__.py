"""eyas: a DVC + MLflow workflow for training EAGLE-3 speculative-decoding drafters.

Packages by concept, lowest first; a module imports only from its own package or from those
before it (``tests/test_import_graph.py``): the ground (:mod:`eyas.io`: atomic files, hashes;
:mod:`eyas.features`: the feature store; :mod:`eyas.yaml12`: params YAML read as DVC reads it),
:mod:`eyas.target`, :mod:`eyas.data`, :mod:`eyas.vocab`, :mod:`eyas.drafter`, :mod:`eyas.training`,
:mod:`eyas.export`, :mod:`eyas.eval`, :mod:`eyas.pipeline`; :mod:`eyas.cli` sits on top.
"""
