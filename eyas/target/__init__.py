"""The target: the model a drafter learns from, and the conventions read off it.

Owns loading and running the target (:mod:`eyas.target.model`: :func:`~eyas.target.model.load_target`,
:func:`~eyas.target.model.load_tokenizer_and_config`), Hugging Face Hub ids (:mod:`eyas.target.hub`:
:func:`~eyas.target.hub.snapshot`), the aux layer-id conventions (:mod:`eyas.target.layers`), RoPE
settings (:mod:`eyas.target.rope`), the one reader of HF config fields
(:mod:`eyas.target.hf_config`) and the target's decode over a static KV cache replayed from CUDA graphs
(:mod:`eyas.target.graphed`). It imports only the ground (:mod:`eyas.io`, :mod:`eyas.features`).
This ``__init__`` re-exports nothing: importing one light module here (``layers``, ``rope``) does not
load torch and transformers.
"""
