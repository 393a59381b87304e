"""Which kernels the TTT unroll runs: one explicit, frozen choice made at the entry point.

A :class:`Backend` is built once from ``params.yaml``'s ``train.backend`` (its schema,
:class:`eyas.params.train.KernelChoices`: :meth:`Backend.of`) by the stage that trains or evaluates,
and passed down to
everything that picks a kernel: :func:`eyas.training.loop.train_drafter` and :class:`eyas.training.unroll.TTTUnroll`
(and through it :meth:`eyas.drafter.model.Eagle3Drafter.ttt_step`, :func:`eyas.drafter.attention.flex_ttt_attention`
and :func:`eyas.drafter.head_loss.head_loss`). Nothing reads the environment for these choices. Code that
needs one fixed choice names it: :data:`REFERENCE` is plain torch everywhere (the exact chain
oracle of eyas/eval/oracle.py runs it, and it is what a library call that names no backend gets).

On CPU every choice is the same: dense attention, eager torch, no Triton, no CUDA graphs (the
reference definitions the CPU tests check). On CUDA:

- ``attention``: ``auto`` runs TTT attention through block-sparse ``flex_attention``
  (:func:`eyas.drafter.attention.flex_ttt_attention`) where it can run (head_dim >= 16, a torch that has
  it) and the dense reference otherwise; ``flex`` requires it (:class:`BackendError` where it
  cannot run); ``dense`` always runs the reference.
- ``compile``: torch.compile the hot pieces (layer halves, flex attention, the diagonal merge,
  head norm and loss; one compiled function per piece: :func:`eyas.drafter.compiling.compiled`). ``false`` runs
  plain eager torch everywhere: no Triton kernels and no CUDA graphs either, whatever their flags
  say (the debugging mode).
- ``compile_layers``: with ``compile``, also compile the decoder layer's two halves around
  attention (``false``: those stay eager; an ablation, dev/README.md).
- ``triton``: the Triton kernels of :mod:`eyas.drafter.kernels` for the head loss, the diagonal
  merge and the SwiGLU gating, when Triton is importable (``false``: their torch definitions,
  compiled).
- ``cuda_graphs``: replay each training step's forward + backward as one CUDA graph
  (:class:`eyas.training.loop.GraphedTTT`) in a single process (DDP's and FSDP's hooks are not
  captured, so ``train.nproc`` > 1 trains without).

This module imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ATTENTION = ("auto", "flex", "dense")


class BackendError(ValueError):
    """A backend value is not one of the allowed ones, or a required kernel cannot run here."""


@dataclass(frozen=True, kw_only=True)
class Backend:
    """The kernel choices of the TTT unroll (module docstring). No defaults here: the values
    come from ``params.yaml``'s ``train.backend`` (or are named, as :data:`REFERENCE`).

    Raises:
        BackendError: ``attention`` is not one of :data:`ATTENTION`.
    """

    attention: str
    compile: bool
    compile_layers: bool
    triton: bool
    cuda_graphs: bool

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise BackendError(f"attention must be one of {ATTENTION}, got {self.attention!r}")

    @classmethod
    def of(cls, choices) -> "Backend":
        """The backend of ``choices``: params' ``train.backend`` (an :class:`eyas.params.train.KernelChoices`)
        or a Backend (returned as is); read field by field, so the schema and this class name the same
        five choices (tests/drafter/test_backend.py holds them equal).

        Raises:
            BackendError: ``attention`` is not one of :data:`ATTENTION`.
        """
        if isinstance(choices, cls):
            return choices
        return cls(**{f.name: getattr(choices, f.name) for f in dataclasses.fields(cls)})

    def flex_attention(self, x, head_dim: int) -> bool:
        """Whether TTT attention runs through :func:`eyas.drafter.attention.flex_ttt_attention` for an
        input ``x`` (any tensor of the step: its device decides) with ``head_dim``.

        Raises:
            BackendError: ``attention: flex`` on CUDA where flex_attention cannot run (head_dim
                < 16, flex_attention's minimum, or a torch without it).
        """
        if x.device.type != "cuda" or self.attention == "dense":
            return False
        why = None
        if head_dim < 16:
            why = f"head_dim {head_dim} < 16 (flex_attention's minimum)"
        else:
            try:
                import torch.nn.attention.flex_attention  # noqa: F401
            except ImportError:
                why = "this torch has no torch.nn.attention.flex_attention"
        if why is None:
            return True
        if self.attention == "flex":
            raise BackendError(f"train.backend.attention is 'flex', but flex attention cannot run: {why}; "
                               f"set it to 'auto' or 'dense'")
        return False

    def triton_kernels(self, x) -> bool:
        """Whether the head loss, the diagonal merge and the SwiGLU gating run as
        :mod:`eyas.drafter.kernels`'s kernels for an input ``x``: on CUDA, with ``compile`` and
        ``triton`` on and Triton importable."""
        if x.device.type != "cuda" or not (self.compile and self.triton):
            return False
        import importlib.util

        return importlib.util.find_spec("triton") is not None

    def graphs(self, device, world: int = 1) -> bool:
        """Whether training replays CUDA graphs (:class:`eyas.training.loop.GraphedTTT`) on ``device``
        (a ``torch.device`` or its string) with ``world`` processes: on CUDA, one process, with
        ``compile`` and ``cuda_graphs`` on."""
        kind = device if isinstance(device, str) else device.type
        return kind.split(":")[0] == "cuda" and world == 1 and self.compile and self.cuda_graphs


# plain torch on every device: dense attention, nothing compiled, no Triton, no CUDA graphs. The
# chain oracle's TTT unroll (eyas/eval/oracle.py) runs one sequence per length, where flex
# attention and the compiled layers would recompile each time.
REFERENCE = Backend(attention="dense", compile=False, compile_layers=False, triton=False, cuda_graphs=False)
