"""The torch.compile registry: one compiled function per piece of the TTT hot path.

Each piece (the decoder layer's halves ``pre``/``post``, ``flex`` attention, the diagonal
``merge``, ``head_norm``, the head loss passes and their backward ``scale``) is compiled once per
process, on first use, and shared by every TTT step and every batch of the same shape. Whether a
piece is compiled at all is the caller's :class:`eyas.drafter.backend.Backend` (``compile``,
``compile_layers``). Callers use it on CUDA only.
"""

from __future__ import annotations

import torch

from eyas.drafter.backend import Backend

# the decoder layer's halves around attention (eyas.drafter.model.Eagle3Drafter.ttt_step): compile_layers
LAYER_PIECES = ("pre", "post")
_compiled_fns: dict = {}


def compiled(backend: Backend, name: str, fn, dynamic: bool | None = False):
    """``fn`` through ``torch.compile(fn, dynamic=dynamic)``, made on the first call for ``name`` and
    reused after (the first ``fn`` given a name keeps it); ``fn`` itself when ``backend.compile``
    is off, or for the layer halves (:data:`LAYER_PIECES`) when ``backend.compile_layers`` is off.
    Shapes are fixed per batch shape, so ``dynamic=False`` by default; ``None`` lets torch.compile
    mark dims dynamic on recompiles."""
    if not backend.compile or (name in LAYER_PIECES and not backend.compile_layers):
        return fn
    if name not in _compiled_fns:
        _compiled_fns[name] = torch.compile(fn, dynamic=dynamic)
    return _compiled_fns[name]
