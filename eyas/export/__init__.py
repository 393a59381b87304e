"""Export: drafter checkpoint formats, what each engine reads, and publishing.

Owns the eagle layout SGLang and vLLM load (:mod:`eyas.export.eagle`:
:func:`~eyas.export.eagle.save_drafter`; ``LlamaForCausalLMEagle3``, ``midlayer.*``; EAGLE and
SpecForge write it too), the speculators (vLLM) layout, read and written
(:mod:`eyas.export.speculators`; ``Eagle3Speculator``, ``layers.0.*``), loading either layout,
detected (:mod:`eyas.export.load`: :func:`~eyas.export.load.load_drafter`), GGUF for llama.cpp
(:mod:`eyas.export.gguf`), the config keys each engine reads (:mod:`eyas.export.engine_keys`),
``eyas inspect`` (:mod:`eyas.export.inspector`, its per-engine sections :mod:`eyas.export.engine_report`),
``eyas push`` (:mod:`eyas.export.push`) and the
verifier identity a speculators export records (:mod:`eyas.export.verifier`). The HF config fields
both layouts use are read by :mod:`eyas.target.hf_config`. Imports run one way (eagle <-
speculators <- load): no cycle. This ``__init__`` re-exports nothing.
"""
