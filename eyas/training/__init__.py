"""Training: TTT batches, the unroll, the loop and what runs it.

Owns TTT batches and metrics
(:mod:`eyas.training.batches`), the TTT unroll (:mod:`eyas.training.unroll`:
:class:`~eyas.training.unroll.TTTUnroll`), the loop (:mod:`eyas.training.loop`:
:func:`~eyas.training.loop.train_drafter`), the CUDA-graph step (:class:`~eyas.training.loop.GraphedTTT`),
resumable checkpoints (:mod:`eyas.training.checkpoint`), process groups
(:mod:`eyas.training.distributed`), online training (:mod:`eyas.training.online`) and the stage
launcher (:mod:`eyas.training.launch`, ``python -m eyas.training.launch stages.train_scratch``). It
imports the ground and the packages below it (target, data, vocab, drafter). This ``__init__``
re-exports nothing.
"""
