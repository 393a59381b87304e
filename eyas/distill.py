"""Self-distillation: regenerate assistant turns with the target itself (greedy).

EAGLE-3 (and SpecForge, the peers) train the drafter on the target's OWN responses: acceptance is
measured against the target's greedy output, and a human-written reply is off that distribution.
:func:`regenerate` keeps each conversation's prompt (:func:`eyas.data.prompt_messages`: up to and
including the last user turn before the last assistant turn) and replaces everything after it with
one assistant turn the target writes greedily. Earlier assistant turns inside the prompt stay as
they were (mode ``"last_turn"``, the same context the eval prompts carry). A prompt token budget
(:func:`fit_prompt`) drops the earliest turns of long prompts, so that prompt + reply fit in
extract's ``max_length`` and the generated reply is not truncated away.

The core works on token ids (:func:`generate_batch`), so it is testable on a tokenizer-free tiny
model: prompts are LEFT-padded into a batch (with the attention mask, so pads are invisible) and
``model.generate`` decodes greedily; the result must equal unbatched greedy decoding
(:func:`eyas.speculative.greedy_generate`) token for token.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from eyas.data import prompt_messages, render_prompt
from eyas.io import write_text

__all__ = ["generate_batch", "fit_prompt", "regenerate", "Journal", "MODES"]

MODES = ("last_turn",)


def _trim(ids: list[int], eos_id: int | None, pad_id: int) -> list[int]:
    """Generated ids up to and including the first EOS (HF pads finished rows with ``pad_id``)."""
    if eos_id is not None and eos_id in ids:
        return ids[: ids.index(eos_id) + 1]
    return ids


@torch.no_grad()
def generate_batch(model, prompts_ids: list[list[int]], max_new_tokens: int, pad_id: int,
                   eos_id: int | None) -> list[list[int]]:
    """Greedy continuations of several prompts in ONE batch (left padding + attention mask).

    Args:
        model: a transformers causal LM (or ``eyas.target.Target``).
        prompts_ids: non-empty token-id lists (lengths may differ).
        max_new_tokens: the most tokens generated per prompt (>= 1).
        pad_id: the id written into pad positions (masked out; any id works, the tokenizer's
            pad or EOS by convention).
        eos_id: end-of-sequence id or None (then every row runs ``max_new_tokens``).
    Returns:
        per prompt, in input order, the generated ids (prompt excluded), EOS included when hit:
        the same contract as :func:`eyas.speculative.greedy_generate`.
    """
    from transformers import GenerationConfig

    from eyas.target import Target

    model = model.model if isinstance(model, Target) else model
    if not prompts_ids:
        return []
    if any(len(p) == 0 for p in prompts_ids):
        raise ValueError("generate_batch: empty prompt")
    if max_new_tokens < 1:
        raise ValueError(f"generate_batch: max_new_tokens must be >= 1, got {max_new_tokens}")
    T = max(len(p) for p in prompts_ids)
    ids = torch.full((len(prompts_ids), T), pad_id, dtype=torch.int64)
    att = torch.zeros((len(prompts_ids), T), dtype=torch.int64)
    for i, p in enumerate(prompts_ids):
        ids[i, T - len(p):] = torch.tensor(p)
        att[i, T - len(p):] = 1
    dev = next(model.parameters()).device
    # a fresh config, not the model's generation_config: no sampling, no repetition penalty, no
    # min_length, ... exactly argmax decoding (what eval's greedy reference does)
    gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                          pad_token_id=pad_id, eos_token_id=eos_id)
    out = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), generation_config=gc)
    gen = out[:, T:].tolist()
    return [_trim(g, eos_id, pad_id) for g in gen]


def fit_prompt(tokenizer, messages: list[dict], max_tokens: int | None) -> tuple[list[dict], list[int]] | None:
    """Drop the earliest turns of a prompt until it renders to <= ``max_tokens`` ids.

    Leading system messages are kept and the kept turns start at a user turn: the earliest such
    start that fits (bisection; the rendered length falls as the start moves right). Returns
    ``(messages, ids)``, or None when even the last user turn alone does not fit.
    ``max_tokens`` None: no budget.
    """
    ids = render_prompt(tokenizer, messages)
    if max_tokens is None or len(ids) <= max_tokens:
        return messages, ids
    n_sys = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    starts = [i for i in range(n_sys + 1, len(messages)) if messages[i]["role"] == "user"]
    lo, hi, best = 0, len(starts) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        msgs = messages[:n_sys] + messages[starts[mid]:]
        mid_ids = render_prompt(tokenizer, msgs)
        if len(mid_ids) <= max_tokens:
            best, hi = (msgs, mid_ids), mid - 1
        else:
            lo = mid + 1
    return best


class Journal:
    """The replies of a self-distill split as they finish, so that a killed stage, rerun, skips
    every prompt already answered (hours of generation on a large target).

    An append-only JSONL file: the first line ``{"resume_key": {...}}`` (what the replies depend
    on besides the prompt: target, dtype, reply budget), then one ``{"prompt": sha256 of the
    prompt ids, "ids": [reply ids]}`` per reply, flushed and fsync'd per batch. Opening it keeps
    the replies of a file with the same resume key (a torn last line, from a kill mid-write, is
    dropped) and starts afresh otherwise; either way the file is rewritten atomically first.
    """

    def __init__(self, path: str | os.PathLike, resume_key: dict):
        self.path = Path(path)
        self.done: dict[str, list[int]] = {}
        lines = self.path.read_text(encoding="utf-8").splitlines() if self.path.exists() else []
        if lines and _json_or_none(lines[0]) == {"resume_key": resume_key}:
            for line in lines[1:]:
                rec = _json_or_none(line)
                if not isinstance(rec, dict) or "prompt" not in rec or "ids" not in rec:
                    break  # torn tail: everything after it is lost anyway
                self.done[rec["prompt"]] = rec["ids"]
        write_text(self.path, "".join(json.dumps(x) + "\n" for x in
                                      [{"resume_key": resume_key}] +
                                      [{"prompt": k, "ids": v} for k, v in self.done.items()]))
        self._f = open(self.path, "a", encoding="utf-8")

    @staticmethod
    def key(prompt_ids: list[int]) -> str:
        return hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()

    def get(self, prompt_ids: list[int]) -> list[int] | None:
        """The journaled reply ids of a prompt, or None."""
        return self.done.get(self.key(prompt_ids))

    def add(self, pairs: list[tuple[list[int], list[int]]]) -> None:
        """Append (prompt ids, reply ids) pairs durably."""
        for prompt_ids, ids in pairs:
            self.done[self.key(prompt_ids)] = ids
            self._f.write(json.dumps({"prompt": self.key(prompt_ids), "ids": ids}) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def remove(self) -> None:
        """Close and delete the journal (its split's output is written)."""
        self._f.close()
        self.path.unlink(missing_ok=True)


def _json_or_none(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def regenerate(target, conversations: list[dict], *, max_new_tokens: int, batch_size: int,
               mode: str = "last_turn", max_prompt_tokens: int | None = None,
               progress=None, journal: Journal | None = None) -> tuple[list[dict], dict]:
    """Replace each conversation's last assistant turn with the target's greedy reply.

    Args:
        target: ``eyas.target.Target`` with a chat-template tokenizer.
        conversations: ``{"id", "messages"}`` (eyas.data format).
        max_new_tokens: generation budget per reply; a reply that hits it is kept (truncated,
            counted; it has no end-of-turn token, so the drafter is not taught to stop there).
        batch_size: prompts per ``generate`` call; prompts are sorted by length first.
        mode: ``"last_turn"`` only (see the module doc).
        max_prompt_tokens: prompt budget (:func:`fit_prompt`): earlier turns are dropped so the
            rendered prompt fits; set it to ``extract.max_length - max_new_tokens`` so the
            generated reply survives extract's truncation. None: no budget.
        progress: optional callable ``(done, total)`` after each batch.
        journal: replies already made by an earlier, killed run are taken from it, and new ones
            are appended to it per batch (:class:`Journal`). A resumed prompt is generated in a
            batch of different composition; batched greedy decoding equals unbatched (module
            docstring), up to the floating-point effects of padding on a GPU.
    Returns:
        ``(new_conversations, stats)``: input order, ids unchanged, each ``prompt messages``
        (after the budget) ``+ [{"role": "assistant", "content": reply}]`` (reply decoded with
        ``skip_special_tokens=True`` and stripped). Conversations without a prompt (no user turn
        before an assistant turn), whose last user turn alone exceeds the budget, and empty
        replies are dropped and counted. ``stats``: ``conversations``, ``prompts``,
        ``prompt_tokens``, ``prompts_shortened``, ``generated_tokens`` (EOS counted, resumed
        replies included), ``resumed`` (replies taken from the journal), ``seconds`` (this run's
        generation only), ``tokens_per_second`` (this run's), ``truncated`` (hit
        ``max_new_tokens`` without EOS), ``dropped_no_prompt``, ``dropped_long_prompt``,
        ``dropped_empty``, ``kept``.
    """
    if mode not in MODES:
        raise ValueError(f"distill mode must be one of {MODES}, got {mode!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tok = target.tokenizer
    eos_id = tok.eos_token_id
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (eos_id if eos_id is not None else 0)

    items = []  # (index, prompt messages, prompt ids)
    dropped_no_prompt = dropped_long = shortened = 0
    for i, c in enumerate(conversations):
        msgs = prompt_messages(c["messages"])
        if not msgs:
            dropped_no_prompt += 1
            continue
        fit = fit_prompt(tok, msgs, max_prompt_tokens)
        if fit is None:
            dropped_long += 1
            continue
        shortened += len(fit[0]) < len(msgs)
        items.append((i, *fit))
    order = sorted(range(len(items)), key=lambda k: len(items[k][2]))  # little padding per batch
    gen: dict[int, list[int]] = {}
    seconds, new_tokens, resumed = 0.0, 0, 0
    for b in range(0, len(order), batch_size):
        chunk = order[b:b + batch_size]
        for k in chunk:
            ids = None if journal is None else journal.get(items[k][2])
            if ids is not None:
                gen[k] = ids
                resumed += 1
        todo = [k for k in chunk if k not in gen]
        if todo:
            t0 = time.perf_counter()
            outs = generate_batch(target.model, [items[k][2] for k in todo], max_new_tokens, pad_id, eos_id)
            seconds += time.perf_counter() - t0
            new_tokens += sum(len(o) for o in outs)
            gen.update(zip(todo, outs))
            if journal is not None:
                journal.add([(items[k][2], o) for k, o in zip(todo, outs)])
        if progress is not None:
            progress(min(b + batch_size, len(order)), len(order))

    new, dropped_empty, truncated, n_tokens = {}, 0, 0, 0
    for k, (i, msgs, _) in enumerate(items):
        ids = gen[k]
        n_tokens += len(ids)
        truncated += len(ids) >= max_new_tokens and (eos_id is None or ids[-1] != eos_id)
        text = tok.decode(ids, skip_special_tokens=True).strip()
        if not text:
            dropped_empty += 1
            continue
        new[i] = {**conversations[i], "messages": msgs + [{"role": "assistant", "content": text}]}
    out = [new[i] for i in sorted(new)]
    stats = {
        "mode": mode,
        "conversations": len(conversations),
        "prompts": len(items),
        "prompt_tokens": sum(len(it[2]) for it in items),
        "generated_tokens": n_tokens,
        "resumed": resumed,
        "seconds": round(seconds, 2),
        "tokens_per_second": round(new_tokens / seconds, 1) if seconds > 0 else None,
        "prompts_shortened": shortened,
        "truncated": int(truncated),
        "dropped_no_prompt": dropped_no_prompt,
        "dropped_long_prompt": dropped_long,
        "dropped_empty": dropped_empty,
        "kept": len(out),
        "max_new_tokens": max_new_tokens,
        "max_prompt_tokens": max_prompt_tokens,
        "batch_size": batch_size,
    }
    return out, stats
