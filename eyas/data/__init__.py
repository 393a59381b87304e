"""Training data: the conversations a drafter is trained and evaluated on.

Owns conversation sources, splits and chat-template rendering (:mod:`eyas.data.conversations`:
:func:`~eyas.data.conversations.load_conversations`, :func:`~eyas.data.conversations.read_jsonl`),
code prompts (:mod:`eyas.data.code`: :func:`~eyas.data.code.code_conversations`),
self-distillation by the target (:mod:`eyas.data.distill`: :func:`~eyas.data.distill.regenerate`)
and its backend through an inference engine that hosts the target (``distill.backend: server``,
:mod:`eyas.data.remote`: :func:`~eyas.data.remote.regenerate_remote`).
It imports the ground and :mod:`eyas.target`. This ``__init__`` re-exports nothing.
"""
