"""The drafter: the EAGLE-3 model and the kernels its TTT unroll runs.

Owns the model (:mod:`eyas.drafter.model`: :class:`~eyas.drafter.model.Eagle3Drafter`,
:class:`~eyas.drafter.model.DrafterConfig`), TTT attention (:mod:`eyas.drafter.attention`), the
Triton kernels (:mod:`eyas.drafter.kernels`), the kernel choice (:mod:`eyas.drafter.backend`:
:class:`~eyas.drafter.backend.Backend`), the torch.compile registry (:mod:`eyas.drafter.compiling`)
and the head's loss (:mod:`eyas.drafter.head_loss`). It imports the ground, :mod:`eyas.target` and
:mod:`eyas.vocab`. This ``__init__`` re-exports nothing: :mod:`eyas.drafter.backend` imports no torch,
and the params schema that reads it stays free of torch.
"""
