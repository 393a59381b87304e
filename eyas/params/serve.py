"""``serve``: the engine that serves each drafter in its eval (eyas/eval/llamacpp.py)."""

from __future__ import annotations

from dataclasses import dataclass

NAME = "serve"


@dataclass(kw_only=True)
class ServeParams:
    # 'llamacpp': eval serves each drafter with llama-server (eyas/eval/llamacpp.py); 'none': no engine block
    engine: str
    threads: int  # llama-server's CPU threads (-t)
    quantized_target: bool  # also serve the target's own GGUF file (the embedded Q4_1), reported apart


SCHEMA = ServeParams
RANGES = [
    ("serve.engine", lambda v: v in ("llamacpp", "none"),
     "'llamacpp' (llama-server serves each drafter in the eval) or 'none'"),
    ("serve.threads", lambda v: v >= 1, ">= 1"),
]
