"""The torch.compile registry: one compiled function per piece of the TTT hot path.

Each piece (the decoder layer's halves ``pre``/``post``, ``flex`` attention, the diagonal
``merge``, ``head_norm``, the head loss passes and their backward ``scale``) is compiled once per
process, on first use, and shared by every TTT step and every batch of the same shape. Whether a
piece is compiled at all is the caller's :class:`eyas.backend.Backend` choice
(:meth:`~eyas.backend.Backend.compiled`).
"""

from __future__ import annotations

import torch

_compiled_fns: dict = {}


def compiled(name: str, fn, dynamic: bool | None = False):
    """``torch.compile(fn, dynamic=dynamic)``, made on the first call for ``name`` and reused
    after (the first ``fn`` given a name keeps it). Shapes are fixed per batch shape, so
    ``dynamic=False`` by default; ``None`` lets torch.compile mark dims dynamic on recompiles."""
    if name not in _compiled_fns:
        _compiled_fns[name] = torch.compile(fn, dynamic=dynamic)
    return _compiled_fns[name]
