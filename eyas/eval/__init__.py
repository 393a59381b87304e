"""Evaluation: speculative decoding with the target, and what its numbers mean.

The front door is :func:`eyas.eval.evaluate.evaluate_drafter` (one drafter on every benchmark, part
by part: what stage eval-accept-len calls). Owns chain drafting with greedy verification
(:mod:`eyas.eval.speculative`), speculative sampling (:mod:`eyas.eval.sampling`), static-tree
drafting (:mod:`eyas.eval.tree`), the decoding-modes table of chain vs tree vs sampled acceptance
(:mod:`eyas.eval.modes`: :func:`~eyas.eval.modes.evaluate_modes`), one benchmark's acceptance
metrics (:mod:`eyas.eval.acceptance`: :func:`~eyas.eval.acceptance.evaluate_benchmark`), the exact
chain oracle (:mod:`eyas.eval.oracle`), the checks that say when a result is not one
(:mod:`eyas.eval.checks`) and serving by a real engine, llama.cpp (:mod:`eyas.eval.llamacpp`:
:func:`~eyas.eval.llamacpp.serve_benchmark`). It imports every package below it. This ``__init__``
re-exports nothing.
"""
