"""The draft vocabulary: which target tokens the drafter's head predicts.

Owns the d2t / t2d mapping (:mod:`eyas.vocab.mapping`: :class:`~eyas.vocab.mapping.VocabMapping`,
:func:`~eyas.vocab.mapping.build_mapping`, :func:`~eyas.vocab.mapping.load_mapping`) and moving a
pretrained drafter onto a new mapping (:mod:`eyas.vocab.remap`:
:func:`~eyas.vocab.remap.remap_lm_head`). It imports the ground and :mod:`eyas.target`. This
``__init__`` re-exports nothing.
"""
