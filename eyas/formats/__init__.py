"""Drafter checkpoint formats: what is written, what is read, and the HF config fields both use.

- :mod:`eyas.formats.hf_config`: the one reader of Hugging Face config fields (``head_dim``,
  ``num_key_value_heads``, ``rope_theta``) and the one-layer LlamaConfig fields both layouts write.
- :mod:`eyas.formats.eagle`: the layout SGLang and vLLM load (``LlamaForCausalLMEagle3``,
  ``midlayer.*``; EAGLE and SpecForge write it too): :func:`~eyas.formats.eagle.save_drafter`.
- :mod:`eyas.formats.speculators`: the speculators (vLLM) layout (``Eagle3Speculator``,
  ``layers.0.*``): read and written.
- :mod:`eyas.formats.load`: :func:`~eyas.formats.load.load_drafter`, either layout, detected.

Imports run one way (hf_config <- eagle, speculators <- load): no cycle.
"""
