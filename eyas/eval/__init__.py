"""Evaluation: speculative decoding with the target, and what its numbers mean.

Owns chain drafting with greedy verification (:mod:`eyas.eval.speculative`), speculative sampling
(:mod:`eyas.eval.sampling`), static-tree drafting (:mod:`eyas.eval.tree`), acceptance as served
(:mod:`eyas.eval.served`: :func:`~eyas.eval.served.evaluate_served`), one benchmark's acceptance
metrics (:mod:`eyas.eval.acceptance`: :func:`~eyas.eval.acceptance.evaluate_benchmark`), the exact
chain oracle (:mod:`eyas.eval.oracle`), the checks that say when a result is not one
(:mod:`eyas.eval.checks`) and serving by a real engine, llama.cpp (:mod:`eyas.eval.llamacpp`:
:func:`~eyas.eval.llamacpp.serve_benchmark`). It imports every package below it. This ``__init__``
re-exports nothing.
"""
