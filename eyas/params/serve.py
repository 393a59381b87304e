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
    # 'auto': llama.cpp's CUDA build (scripts/build_llama_server.sh --cuda) where torch sees a GPU, else the CPU
    # build; 'cpu' / 'cuda': that build (eyas.eval.llamacpp.resolve_backend)
    device: str
    k_sweep: list[int]  # the engine's wall-clock sweep: each k served apart at batch 1; [] = eval.num_draft_tokens only


SCHEMA = ServeParams
RANGES = [
    ("serve.engine", lambda v: v in ("llamacpp", "none"),
     "'llamacpp' (llama-server serves each drafter in the eval) or 'none'"),
    ("serve.threads", lambda v: v >= 1, ">= 1"),
    ("serve.device", lambda v: v in ("auto", "cpu", "cuda"),
     "'auto' (the CUDA build where torch sees a GPU, else the CPU build), 'cpu' or 'cuda'"),
    ("serve.k_sweep", lambda v: len(set(v)) == len(v) and all(1 <= k <= 32 for k in v),
     "a list of distinct integers in [1, 32] ([] = no sweep)"),
]
