"""``train.backend``: the kernel choices of the TTT unroll, as ``params.yaml`` writes them.

The schema only: what each choice means, and the :class:`eyas.drafter.backend.Backend` the training
entry points build from it (``Backend.of``), are eyas/drafter/backend.py's. Kept apart from
:mod:`eyas.params.train` so that an edit here reruns only the stages that read ``train``.
"""

from __future__ import annotations

from dataclasses import dataclass

# as eyas.drafter.backend.ATTENTION (tests/drafter/test_backend.py holds them equal)
ATTENTION = ("auto", "flex", "dense")


@dataclass(frozen=True, kw_only=True)
class KernelChoices:
    """``train.backend``'s keys (eyas/drafter/backend.py says what each one picks).

    Raises:
        ValueError: ``attention`` is not one of :data:`ATTENTION` (the loader names the key).
    """

    attention: str
    compile: bool
    compile_layers: bool
    triton: bool
    cuda_graphs: bool

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
