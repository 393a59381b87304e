"""llama.cpp's wall-clock speedup with an eyas drafter at a target shape, on each backend (CUDA, CPU).

    python3 benchmarks/bench_engine.py --shape embedded      # the embedded SmolLM2-135M target, F32 GGUF
    python3 benchmarks/bench_engine.py --shape 1b            # a random Llama-3.2-1B-shaped target, BF16 GGUF
    python3 benchmarks/bench_engine.py --shape 8b            # a random Llama-3.1-8B-shaped target, BF16 GGUF
    python3 benchmarks/bench_engine.py --shape tiny --backends cpu   # minutes on a CPU: the script's own check

-> ``engine_<shape>_<device>.json`` in the working directory (``<device>``: ``h100``, ``h200``, ... from the
GPU's name, ``cpu`` without one; ``--out`` names another path).

The target: ``embedded`` is eyas' embedded SmolLM2-135M-Instruct (its Q4_1 GGUF de-quantised to fp32, served
as an F32 GGUF of the same weights, as tests/eval/test_llamacpp.py does); ``tiny``, ``1b`` and ``8b`` are a
``LlamaForCausalLM`` with random weights (seed ``--seed``, transformers' own initialisation) of that shape
(``1b``: Llama-3.2-1B's: hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, tied embeddings;
``8b``: Llama-3.1-8B's: hidden 4096, 32 layers, 32/8 heads, intermediate 14336; both rope_theta 500000
without Llama 3.1's rope scaling, which a context of a few hundred tokens never reaches) with the embedded
target's tokenizer and chat template (so its vocabulary, 49152, not Llama 3's 128256). Two departures from
transformers' initialisation make its greedy replies vary, as a real target's do: the head is not tied to
the embedding (1b: Llama-3.2-1B ties it; the head's cost is the same), and the token embeddings are drawn
with std ``--embed-std`` (1.0), not 0.02, so the residual stream carries the token. With transformers'
own initialisation every reply is one token repeated (or a short loop), which any drafter predicts.
Its weights are
made in the GGUF's precision (``--outtype``: bf16 for 1b/8b, f32 for tiny) and the GGUF holds them
exactly; eyas runs them in fp32 (generation, capture, its chain oracle), the nearest it gets to
llama.cpp, which keeps activations in fp32.

The drafter is trained through eyas' own library calls, as tests/eval/test_llamacpp.py's fixture trains
one: the target's greedy replies (eyas.data.distill.generate_batch) to the first ``--prompts`` HumanEval
problems (each asked as the eval asks it), their aux hidden states (layers [2, L/2, L-3]) in a
FeatureStore, a draft vocabulary from their tokens (eyas.vocab.mapping.build_mapping), TTT training
(eyas.training.loop.train_drafter, ``--epochs`` passes at ``--ttt`` steps; eager kernels: no compile time
in a short run), eyas' export (save_drafter) and llama.cpp's converter with the target's directory.
The drafter learns these prompts' replies: its acceptance is no quality figure; what the engine spends
per step at this shape, and so its speedup at the acceptance reached, is. A random ``1b`` or ``8b`` target's
replies are close to random tokens with near-tied top logits: its drafter learns little (acceptance near 1),
and a backend whose verify batch runs other kernels than its one-token decode (llama.cpp's CUDA build on BF16
weights) may flip a near tie, so ``lossless`` can read false there with no fault in the drafter. Its figure is
the engine's cost per step (plain ms per token, draft and verify ms per step) at that shape.

Then each backend of ``--backends`` available here (``cuda``: llama-server-cuda and a GPU; ``cpu``:
llama-server with ``--threads`` threads) serves the same GGUFs at batch 1
(eyas.eval.llamacpp.serve_benchmark): the target alone, then with the drafter at each k of ``--k-sweep``
(the CPU at ``--cpu-k-sweep``, on the first ``--cpu-prompts`` prompts: an 8B target decodes a few tokens a
second there). Per backend: tokens/s with and without the drafter, speedup, plain ms per token, draft and
verify ms per step at each k, the engine's recommended k, lossless, and the agreement of its per-prompt
counts with eyas' exact chain oracle (eyas.eval.oracle on eyas' greedy outputs;
eyas.eval.llamacpp.agreement, at ``--k``). Between the backends, on the prompts both served: equal
outputs, equal verify steps and their pooled acceptance (the kind of ggml-org/llama.cpp#26750: one GGUF
accepting differently on two backends).

``--work DIR`` keeps the pair and eyas' figures on it (``made.json``); run again with the same arguments, the
script serves the kept pair without making it again (other arguments, or a ``made.json`` or GGUF it cannot read,
are refused, the directory untouched), and ``--backends`` with no backend only makes it: the pair can be made while a build is under way, and served by the build once it is done.

One summary line per figure is printed; the JSON holds every figure and each phase's seconds. A backend whose
agreement with eyas fails (``ok`` false) makes the script exit non-zero after the JSON is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import device_tag, write_result  # noqa: E402
from eyas.data.conversations import code_user_turn, humaneval_problems  # noqa: E402
from eyas.data.distill import generate_batch  # noqa: E402
from eyas.eval.evaluate import fit_benchmarks  # noqa: E402
from eyas.eval.llamacpp import EngineError, agreement, build_info, serve_benchmark, server_binary  # noqa: E402
from eyas.eval.oracle import accepted_draft_counts, per_prompt_walks, walk_metrics  # noqa: E402
from eyas.export.eagle import save_drafter  # noqa: E402
from eyas.export.gguf import convert, write_target_dir  # noqa: E402
from eyas.features import FeatureStore, ShardWriter  # noqa: E402
from eyas.io import read_json  # noqa: E402
from eyas.params.full import default_params  # noqa: E402
from eyas.target.model import Target, load_target, load_tokenizer_and_config  # noqa: E402
from eyas.tracking.runs import Tracker  # noqa: E402
from eyas.training.loop import new_drafter, train_drafter  # noqa: E402
from eyas.vocab.mapping import build_mapping, count_tokens  # noqa: E402

LLAMA = {"rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "hidden_act": "silu", "initializer_range": 0.02}
SHAPES = {
    "tiny": {**LLAMA, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4,
             "num_key_value_heads": 2, "tie_word_embeddings": False, "rope_theta": 10000.0},
    "1b": {**LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": False, "rope_theta": 500000.0},
    "8b": {**LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
           "rope_theta": 500000.0},
}
"""The random targets' LlamaConfig keys (vocabulary, BOS/EOS: the embedded tokenizer's). The head is never
tied: a random target whose head is its embedding answers every prompt with one repeated token."""

DEFAULTS = {  # per shape: GGUF type, prompts, reply tokens, CPU prompts, training passes, draft vocabulary
    "tiny": {"outtype": "f32", "prompts": 8, "max_new_tokens": 32, "cpu_prompts": 8, "epochs": 20, "draft_vocab": 512},
    "embedded": {"outtype": "f32", "prompts": 16, "max_new_tokens": 96, "cpu_prompts": 8, "epochs": 60,
                 "draft_vocab": 2048},
    "1b": {"outtype": "bf16", "prompts": 16, "max_new_tokens": 96, "cpu_prompts": 2, "epochs": 60,
           "draft_vocab": 8192},
    "8b": {"outtype": "bf16", "prompts": 16, "max_new_tokens": 96, "cpu_prompts": 2, "epochs": 60,
           "draft_vocab": 32000},
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def make_target(shape: str, outtype: str, seed: int, dev: torch.device, embed_std: float = 1.0) -> Target:
    """The target of ``shape`` on ``dev`` in ``outtype``'s dtype (the GGUF's weights, exactly); a random one
    has its token embeddings drawn with std ``embed_std`` (module docstring)."""
    if shape == "embedded":  # fp32 (arguments refuses another --outtype)
        return load_target("embedded", device=dev)
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok, base = load_tokenizer_and_config()
    cfg = LlamaConfig(vocab_size=base.vocab_size, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                      pad_token_id=getattr(base, "pad_token_id", None), **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg)
        torch.nn.init.normal_(model.get_input_embeddings().weight, std=embed_std)
        model = model.to(DTYPES[outtype]).eval()
    model.generation_config = GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
    identity = {"path": f"random {shape} (benchmarks/bench_engine.py)", "seed": seed, "class": type(model).__name__,
                "num_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                "gguf_file": None, "revision": None, "file_sha256": None}
    return Target(model, tok, identity, 1.0)


def prompts_for(tok, n: int) -> list[list[int]]:
    """The first ``n`` HumanEval problems as the eval asks them (eyas.eval.evaluate.fit_benchmarks)."""
    chats = [[code_user_turn(p["prompt"])] for p in humaneval_problems()[:n]]
    return fit_benchmarks(tok, {"humaneval": chats}, 0)["humaneval"][0]


def have_backend(backend: str) -> str | None:
    """None when ``backend`` can serve here, else why not."""
    try:
        server_binary(backend)
    except EngineError as e:
        return str(e)
    if backend == "cuda" and not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def fmt(v, spec: str) -> str:
    """``v`` formatted, ``-`` for None (a figure the engine could not give)."""
    return "-" if v is None else format(v, spec)


def between_backends(a: list[dict], b: list[dict]) -> dict:
    """Two backends' per-prompt counts (eyas.eval.llamacpp.request_metrics) on the same prompts: how many
    have equal outputs, and of those how many have equal verify steps and accepted drafts, with the pooled
    acceptance length (new tokens / verify steps) of each over those prompts."""
    n = min(len(a), len(b))
    same = [i for i in range(n) if a[i]["output_sha256"] == b[i]["output_sha256"]]

    def pooled(rows):
        steps = sum(r["verify_steps"] for r in rows)
        return sum(r["new_tokens"] for r in rows) / steps if steps else None

    return {"prompts": n, "equal_outputs": len(same),
            "equal_verify_steps": sum(a[i]["verify_steps"] == b[i]["verify_steps"] for i in same),
            "equal_accepted": sum(a[i]["accepted"] == b[i]["accepted"] for i in same),
            "accept_len": [pooled([a[i] for i in same]), pooled([b[i] for i in same])],
            "differing_prompts": [{"prompt": i, "verify_steps": [a[i]["verify_steps"], b[i]["verify_steps"]]}
                                  for i in same if a[i]["verify_steps"] != b[i]["verify_steps"]]}


def pair_args(a) -> dict:
    """The arguments that make the target-drafter pair (a kept ``--work`` is served again only with these)."""
    return {k: getattr(a, k) for k in ("shape", "outtype", "seed", "embed_std", "prompts", "max_new_tokens", "epochs",
                                       "ttt", "draft_vocab", "k", "k_sweep", "cpu_k_sweep")}


# what make_pair's made.json holds (the keys main reads back)
MADE_KEYS = ("args", "params", "prompts", "new_tokens_eyas", "drafter", "eyas_accept_len", "eyas_per_prompt", "seconds")


def kept_pair(work: Path, a) -> dict:
    """The pair an earlier run made in ``work`` with the same arguments (:func:`pair_args`): ``made.json``'s content,
    with ``target.gguf`` and ``drafter.gguf`` beside it.

    Raises:
        SystemExit: ``made.json`` is unreadable or not JSON, is not an object, lacks one of :data:`MADE_KEYS`, was
            made with other arguments, or a GGUF is missing; the file and the key named, nothing in ``work``
            changed (delete the directory, or give another ``--work``, to make the pair again).
    """
    kept, again = work / "made.json", f"delete {work} or give another --work to make the pair again"
    try:
        made = read_json(kept)
    except (ValueError, OSError) as err:
        raise SystemExit(f"{err}: not a pair this script kept; {again}") from None
    missing = [k for k in MADE_KEYS if k not in made]
    if missing:
        raise SystemExit(f"{kept}: lacks {missing}: not a pair this script kept; {again}")
    if made["args"] != pair_args(a):
        raise SystemExit(f"{kept}: made with {made['args']}, not {pair_args(a)}: another --work, or the same arguments")
    gone = [f for f in ("target.gguf", "drafter.gguf") if not (work / f).is_file()]
    if gone:
        raise SystemExit(f"{kept}: its {' and '.join(gone)} not in {work}; {again}")
    return made


def make_pair(a, work: Path) -> dict:
    """Make the target and its drafter in ``work`` (target.gguf, drafter.gguf; module docstring) and eyas' own
    figures on them: the prompts (token ids), eyas' acceptance length per k and its per-prompt walks at ``a.k``
    (eyas.eval.oracle), the drafter's training figures and each phase's seconds."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    secs: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        secs[name] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()

    target = make_target(a.shape, a.outtype, a.seed, dev, a.embed_std)
    n_params = sum(p.numel() for p in target.model.parameters())
    tdir = write_target_dir(target.model, target.tokenizer, work / "target", weights=True)
    pool = ThreadPoolExecutor(1)  # the converter runs on the CPU while the GPU generates, captures, trains
    target_job = pool.submit(convert, tdir, work / "target.gguf", outtype=a.outtype)
    if a.outtype != "f32":  # eyas' side in fp32 on the GGUF's weights (the embedded target is fp32 already:
        target.model.float()  # transformers refuses .float() on a model it de-quantised)
    lap("target_seconds")
    prompts = prompts_for(target.tokenizer, a.prompts)
    stop_ids = target.stop_ids
    outputs = generate_batch(target.model, prompts, a.max_new_tokens, getattr(target.tokenizer, "pad_token_id", None) or 0,
                             stop_ids)
    lap("generate_seconds")
    aux = [2, target.num_layers // 2, target.num_layers - 3]
    w = ShardWriter(work / "features", shard_samples=64, dtype=torch.float32)
    for p, y in zip(prompts, outputs):
        ids = torch.tensor(p + y)
        mask = torch.zeros(len(ids), dtype=torch.uint8)
        mask[len(p):] = 1
        cap = target.capture(ids[None].to(dev), torch.ones(1, len(ids), dtype=torch.int64, device=dev), aux)
        w.add(ids, mask, cap["aux_hidden"][0].float().cpu(), cap["final_hidden"][0].float().cpu(),
              cap["target_argmax"][0].cpu())
    c = target.config
    w.finish(aux_layers=aux, num_layers=target.num_layers, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
             target=target.identity, max_length=max(len(p) + len(y) for p, y in zip(prompts, outputs)),
             target_config=target.config_summary())
    store = FeatureStore.open(work / "features")
    ids, mask = store.token_stats()
    mapping, vinfo = build_mapping(count_tokens(ids, mask, c.vocab_size), min(a.draft_vocab, c.vocab_size),
                                   order="target_id", fill_counts=count_tokens(ids, torch.ones_like(mask), c.vocab_size))
    lap("capture_seconds")
    head = target.head_weights()
    drafter = new_drafter(store.manifest, mapping, head["embed_tokens"], seed=a.seed, lm_head=head["lm_head"])
    base = default_params().train
    tp = dataclasses.replace(base, ttt_length=a.ttt, batch_tokens=512, epochs=a.epochs, eval_every=10 ** 6,
                             warmup_ratio=0.0, checkpoint_every=0, grad_clip=1.0, max_steps=0,
                             backend=dataclasses.replace(base.backend, attention="dense", compile=False,
                                                         compile_layers=False, cuda_graphs=False))
    tr = train_drafter(drafter, train_store=store, val_store=store, lm_head=head["lm_head"], tp=tp, lr=3e-3,
                       seed=a.seed, tracker=Tracker(), device=dev)
    drafter.eval()
    save_drafter(drafter, work / "drafter")
    drafter_job = pool.submit(convert, work / "drafter", work / "drafter.gguf", outtype=a.outtype,
                              target_model_dir=tdir)
    lap("train_seconds")
    # eyas' chain oracle at the largest k: a k-chain is the first k drafts of a longer one, and each walk
    # takes min(count, k) at every step (eyas.eval.oracle.chain_walk)
    ks = sorted(set(a.k_sweep) | set(a.cpu_k_sweep) | {a.k})
    with torch.no_grad():
        counts = [accepted_draft_counts(target, drafter, p, y, num_draft_tokens=ks[-1], aux_layer_ids=aux)
                  for p, y in zip(prompts, outputs)]
    eyas_accept = {str(k): walk_metrics(counts, outputs, k)["accept_len"] for k in ks}
    eyas_per_prompt = per_prompt_walks(counts, outputs, a.k)
    lap("eyas_oracle_seconds")
    target_job.result()
    drafter_job.result()
    pool.shutdown()
    (tdir / "model.safetensors").unlink()
    del target, drafter, head
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the GPU's memory to llama.cpp
    lap("convert_wait_seconds")
    made = {"args": pair_args(a), "params": n_params, "prompts": prompts, "new_tokens_eyas": sum(len(y) for y in outputs),
            "drafter": {"aux_layers": aux, "draft_vocab": mapping.draft_vocab_size, "coverage": vinfo.get("coverage"),
                        "ttt_length": a.ttt, "epochs": a.epochs, "steps": tr.steps, "train_tokens": tr.train_tokens,
                        "train_seconds": round(tr.seconds, 1), "final_val": tr.final_val},
            "eyas_accept_len": eyas_accept, "eyas_per_prompt": eyas_per_prompt, "seconds": secs}
    print(f"engine {a.shape}: {n_params / 1e6:.1f}M params, {a.outtype} GGUF, {len(prompts)} prompts x "
          f"{a.max_new_tokens} tokens; drafter {tr.steps} steps, val acc_0 {tr.final_val.get('acc_0')}; eyas accept "
          f"{', '.join(f'k={k} {v:.2f}' for k, v in eyas_accept.items())}", flush=True)
    return made


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``) parsed, each shape's defaults filled in.

    Raises:
        SystemExit: argparse's refusal; a k, a count (prompts, tokens, passes, TTT steps, draft vocabulary,
            threads) below 1 or more prompts than HumanEval has; an ``--embed-std`` that is not a finite
            number > 0 or is given for the embedded target, or another ``--outtype`` than f32 for it; an
            ``--out`` that is a directory or lies under a file. Each before anything is made."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["tiny", "embedded", *[s for s in SHAPES if s != "tiny"]], required=True)
    ap.add_argument("--backends", nargs="*", choices=["cuda", "cpu"], default=["cuda", "cpu"],
                    help="each that is available here serves (cuda: llama-server-cuda and a GPU); none: only make "
                         "the pair in --work")
    ap.add_argument("--k", type=int, default=default_params().eval.num_draft_tokens,
                    help="the k of the agreement with eyas (params eval.num_draft_tokens)")
    ap.add_argument("--k-sweep", type=int, nargs="*", default=[1, 2, 3, 4, 5, 6, 7, 8])
    ap.add_argument("--cpu-k-sweep", type=int, nargs="*", default=[],
                    help="the CPU backend's sweep (default none: --k alone)")
    ap.add_argument("--prompts", type=int, help="HumanEval problems (default per shape)")
    ap.add_argument("--cpu-prompts", type=int, help="the first prompts the CPU backend serves (default per shape)")
    ap.add_argument("--max-new-tokens", type=int, help="tokens per reply (default per shape)")
    ap.add_argument("--outtype", choices=sorted(DTYPES), help="the target's and drafter's GGUF type (default per shape)")
    ap.add_argument("--epochs", type=int, help="training passes over the replies (default per shape)")
    ap.add_argument("--ttt", type=int, default=default_params().train.ttt_length, help="TTT steps (params train.ttt_length)")
    ap.add_argument("--draft-vocab", type=int, help="draft vocabulary size (default per shape)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="the CPU backend's threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--embed-std", type=float, help="a random target's token embedding std (default 1.0)")
    ap.add_argument("--work", type=Path, help="keep the GGUFs, drafter and logs here (default: a temporary directory)")
    ap.add_argument("--out", help="the result file's path (default engine_<shape>_<device>.json)")
    a = ap.parse_args(argv)
    for key, v in DEFAULTS[a.shape].items():
        if getattr(a, key) is None:
            setattr(a, key, v)
    if a.k < 1 or any(k < 1 for k in a.k_sweep + a.cpu_k_sweep):
        raise SystemExit(f"--k {a.k}, --k-sweep {a.k_sweep}, --cpu-k-sweep {a.cpu_k_sweep}: every k must be >= 1")
    low = [f"--{key.replace('_', '-')} {getattr(a, key)}" for key in ("prompts", "cpu_prompts", "max_new_tokens",
                                                                      "epochs", "ttt", "draft_vocab", "threads")
           if getattr(a, key) < 1]
    if low:
        raise SystemExit(f"{', '.join(low)}: must be >= 1")
    if a.prompts > len(humaneval_problems()):
        raise SystemExit(f"--prompts {a.prompts}: HumanEval has {len(humaneval_problems())} problems")
    if a.shape == "embedded":
        if a.embed_std is not None:
            raise SystemExit("--embed-std: only a random target has one (--shape tiny, 1b or 8b)")
        if a.outtype != "f32":
            raise SystemExit("--shape embedded: its weights are de-quantised to fp32; serve them as --outtype f32")
    a.embed_std = 1.0 if a.embed_std is None else a.embed_std
    if not (math.isfinite(a.embed_std) and a.embed_std > 0):
        raise SystemExit(f"--embed-std {a.embed_std}: a random target's embedding std is a finite number > 0")
    if a.out is not None:  # refused now, not after the serving it would hold
        out = Path(a.out).absolute()
        if out.is_dir():
            raise SystemExit(f"--out {a.out}: a directory, not a result file")
        above = next(p for p in out.parents if p.exists())
        if not above.is_dir():
            raise SystemExit(f"--out {a.out}: {above} is not a directory")
    return a


def main() -> None:
    a = arguments()
    backends, skipped = [], {}
    for b in a.backends:
        why = have_backend(b)
        (skipped.__setitem__(b, why) if why else backends.append(b))
    for b, why in skipped.items():
        print(f"engine {a.shape}: backend {b} skipped: {why}", flush=True)
    if a.backends and not backends:
        raise SystemExit(f"--backends {a.backends}: none can serve here ({skipped})")
    if not a.backends and a.work is None:
        raise SystemExit("--backends with none: only makes the pair, which needs --work to keep it")
    work = a.work or Path(tempfile.mkdtemp(prefix=f"bench_engine_{a.shape}_"))
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file in its place, or under it
        raise SystemExit(f"--work {work}: not a directory ({err})") from None
    kept = work / "made.json"
    if kept.exists():  # a pair made earlier with these arguments: serve it again
        made = kept_pair(work, a)
        print(f"engine {a.shape}: the pair kept in {work} (made in {made['seconds']})", flush=True)
    else:
        made = make_pair(a, work)
        write_result(kept, made)
    if not backends:
        print(f"engine {a.shape}: the pair is in {work}; --backends serves it", flush=True)
        return
    secs: dict[str, float] = {}
    t = time.perf_counter()
    prompts, eyas_per_prompt = made["prompts"], made["eyas_per_prompt"]

    def lap(name: str) -> None:
        nonlocal t
        secs[name] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()

    served: dict[str, dict] = {}
    for b in backends:
        n = len(prompts) if b == "cuda" else min(a.cpu_prompts, len(prompts))
        sweep = a.k_sweep if b == "cuda" else a.cpu_k_sweep
        e = serve_benchmark(work / "target.gguf", work / "drafter.gguf", prompts[:n], k=a.k,
                            max_new_tokens=a.max_new_tokens, threads=a.threads, backend=b, k_sweep=sweep,
                            log_dir=work / f"logs_{b}")
        ag = agreement(e["per_prompt"], eyas_per_prompt[:n])
        served[b] = {**e, "prompts": n, "agreement": ag}
        print(f"engine {a.shape} {b} k={a.k}: {fmt(e['tokens_per_second'], '.1f')} tok/s with the drafter vs "
              f"{fmt(e['tokens_per_second_plain'], '.1f')} plain ({fmt(e['speedup'], '.2f')}x), accept "
              f"{fmt(e['accept_len'], '.2f')} (eyas "
              f"{ag['accept_len_eyas']}), lossless {e['lossless']}; agreement {ag['ok']}: {ag['exact']}/{ag['compared']} "
              f"exact of {n} ({e['device']})", flush=True)
        print(f"engine {a.shape} {b} breakdown k={a.k}: plain {fmt(e['plain_ms_per_token'], '.2f')} ms/token, draft "
              f"{fmt(e['draft_ms_per_step'], '.2f')} ms/step, verify {fmt(e['verify_ms_per_step'], '.2f')} ms/step",
              flush=True)
        if "k_sweep" in e:
            rows = e["k_sweep"]["rows"]
            print(f"engine {a.shape} {b} sweep: " + "; ".join(
                f"k={k} {fmt(r['speedup'], '.2f')}x accept {fmt(r['accept_len'], '.2f')} draft {fmt(r['draft_ms_per_step'], '.2f')} "
                f"verify {fmt(r['verify_ms_per_step'], '.2f')} ms" for k, r in rows.items())
                + f"; recommended k={e['k_sweep']['recommended_k']}", flush=True)
    cross = None
    if "cuda" in served and "cpu" in served:
        cross = between_backends(served["cuda"]["per_prompt"], served["cpu"]["per_prompt"])
        print(f"engine {a.shape} cuda-vs-cpu k={a.k}: {cross['equal_outputs']}/{cross['prompts']} equal outputs, "
              f"{cross['equal_verify_steps']} of them with equal verify steps; accept {cross['accept_len']}", flush=True)
    lap("serve_seconds")
    doc = {"shape": a.shape, "config": SHAPES.get(a.shape, "embedded SmolLM2-135M-Instruct"),
           "params": made["params"], "outtype": a.outtype, "seed": a.seed,
           "embed_std": None if a.shape == "embedded" else a.embed_std, "prompts": len(prompts),
           "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": a.max_new_tokens,
           "new_tokens_eyas": made["new_tokens_eyas"], "k": a.k, "drafter": made["drafter"],
           "eyas_accept_len": made["eyas_accept_len"], "backends": served, "skipped_backends": skipped,
           "builds": {b: build_info(b) for b in backends}, "cuda_vs_cpu": cross,
           "recommended_k": {b: s["k_sweep"]["recommended_k"] for b, s in served.items() if "k_sweep" in s},
           "seconds": {**made["seconds"], **secs}, "threads": a.threads, "work": str(work) if a.work else None}
    out = a.out or f"engine_{a.shape}_{device_tag()}.json"
    print(f"engine {a.shape}: wrote {write_result(out, doc)}; seconds {secs}", flush=True)
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)
    off = {b: s["agreement"] for b, s in served.items() if s["agreement"]["ok"] is False}
    if off:  # the figures stay in the result file; the run is no check passed
        raise SystemExit(f"engine {a.shape}: llama.cpp's per-prompt counts disagree with eyas' on "
                         + "; ".join(f"{b} ({g['exact']} of {g['compared']} exact, {len(g['outside_tolerance'])} outside "
                                     f"the tolerance: {g['tolerance']})" for b, g in off.items()))


if __name__ == "__main__":
    main()
