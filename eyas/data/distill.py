"""Self-distillation: regenerate assistant turns with the target itself (greedy).

EAGLE-3 (and SpecForge, the peers) train the drafter on the target's OWN responses: acceptance is
measured against the target's greedy output, and a human-written reply is off that distribution.
Each regenerated sample is a prompt (:func:`eyas.data.conversations.prompt_messages`: the history up to and
including a user turn) and one assistant turn the target writes greedily. ``turns`` picks the
prompts of a conversation (:func:`turn_prompts`):

- ``"last"``: one sample per conversation, the prompt before its last assistant turn (the same
  context the eval's chat prompts carry);
- ``"all"``: one sample per assistant turn that has a user turn before it (the history before it,
  human-written, as in the eval's prompts). A chitchat conversation holds 16.6 assistant turns on
  average, so this multiplies the samples by ~16 for the same conversations.

A prompt token budget (:func:`fit_prompt`) drops the earliest turns of long prompts, so that
prompt + reply fit in extract's ``max_length`` and the generated reply is not truncated away.

**The drafter trains on exactly the ids the target generated.** Each sample records
``prompt_ids`` (the rendered prompt, ending in the assistant header), ``reply_ids`` (the greedy
continuation up to and including the first stop id, :func:`eyas.target.model.stop_token_ids`) and
``finish_reason`` (``"stop"`` or ``"length"``, the OpenAI API's names, which vLLM and SGLang
return). Extract uses these ids as they are, instead of re-rendering decoded text: decoding and
re-tokenizing changes ids (``strip()`` turns ``' Sure'`` into ``'Sure'``, a literal
``<|im_end|>`` written as ordinary pieces becomes the control token), and the chat template
would append an end-of-turn token to a reply cut at the budget, teaching the drafter a stop the
target never made. The decoded ``content`` is kept for reading only.

The core works on token ids (:func:`generate_batch`), so it is testable on a tokenizer-free tiny
model: prompts are LEFT-padded into a batch (with the attention mask, so pads are invisible) and
decoded greedily, on a CPU by transformers' ``generate``, on CUDA by a static KV cache whose one-token
steps replay a CUDA graph (:func:`eyas.target.graphed.decode_batch`; ``generate`` there is bound by
kernel launches); the result must equal unbatched greedy decoding
(:func:`eyas.eval.speculative.greedy_generate`) token for token. A sampled call (the user turns of
synthesized prompts, :mod:`eyas.data.synth`) takes the same decodes: on CUDA the graphed one, each
token drawn outside the graph from the step's logits as transformers' ``generate`` samples.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from jinja2.exceptions import TemplateError, TemplateSyntaxError, UndefinedError

from eyas.data.conversations import DataError, prompt_messages, render_prompt
from eyas.io import write_text

__all__ = ["generate_batch", "fit_prompt", "turn_prompts", "plan_prompts", "regenerate", "build_rows",
           "Journal", "TURNS"]

TURNS = ("last", "all")


def _trim(ids: list[int], stop_ids) -> list[int]:
    """Generated ids up to and including the first stop id (HF pads finished rows)."""
    for j, t in enumerate(ids):
        if t in stop_ids:
            return ids[: j + 1]
    return ids


@torch.no_grad()
def generate_batch(model, prompts_ids: list[list[int]], max_new_tokens: int, pad_id: int,
                   stop_ids, cache_implementation: str | None = None, decode: str = "auto", *,
                   temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[list[int]]:
    """Greedy (or sampled) continuations of several prompts in ONE batch (left padding + attention mask).

    Args:
        model: a transformers causal LM (or ``eyas.target.model.Target``).
        prompts_ids: non-empty token-id lists (lengths may differ).
        max_new_tokens: the most tokens generated per prompt (>= 1).
        pad_id: the id written into pad positions (masked out; any id works, the tokenizer's
            pad or EOS by convention).
        stop_ids: the ids that end a reply (:func:`eyas.target.model.stop_token_ids`; HF ``generate``
            takes a list as ``eos_token_id``); empty: none, every row runs ``max_new_tokens`` (the
            model's own ``generation_config`` eos is not used either way).
        cache_implementation: with the ``"dynamic"`` decode, transformers'
            ``GenerationConfig.cache_implementation``: None, its default dynamic KV cache;
            ``"static"``, a cache preallocated to prompt + ``max_new_tokens`` whose decode step
            transformers compiles on CUDA (dev/bench/bench_generate.py compares them).
        decode: :func:`eyas.target.graphed.choose`: ``"auto"`` (the default) is ``"graphed"`` on
            CUDA (:func:`eyas.target.graphed.decode_batch`: a static KV cache, each decode step
            replayed from a CUDA graph) and ``"dynamic"`` (transformers' ``generate``) elsewhere;
            ``"static"`` is the graphed loop without graphs (any device). Greedy and sampled alike.
        temperature: 0 (the default): greedy, what self-distill runs; > 0: sampled at this
            temperature with nucleus ``top_p`` in (0, 1] (top-k off), as synthesized prompts are
            written (eyas.data.synth), the way transformers' ``generate`` samples (``do_sample``;
            ``TemperatureLogitsWarper`` then ``TopPLogitsWarper``, ``src/transformers/generation/
            logits_process.py``, then ``torch.multinomial``): ``"static"``/``"graphed"`` draw with a
            ``torch.Generator`` on the target's device seeded with ``seed``
            (:func:`eyas.target.graphed.decode_batch`); ``"dynamic"`` seeds the global generator
            with ``seed`` (``torch.manual_seed``) and runs ``generate``. On a CPU both give the same
            tokens (up to the rounding of the logits).
    Returns:
        per prompt, in input order, the generated ids (prompt excluded), up to and including the
        first stop id when one was generated:
        the same contract as :func:`eyas.eval.speculative.greedy_generate`.
    Raises:
        ValueError: ``stop_ids`` is None (say ``[]`` for none), an empty prompt, an id outside the target's
            vocabulary (in a prompt, or ``pad_id``), ``max_new_tokens`` < 1, an unknown ``decode`` (or one the
            target cannot run, :func:`eyas.target.graphed.choose`), ``cache_implementation`` with a decode
            other than ``"dynamic"``, ``temperature`` < 0 or NaN, a sampled call (``temperature`` > 0) with
            ``top_p`` outside (0, 1], a ``seed`` outside :data:`eyas.target.graphed.SEED_RANGE`; each
            naming the argument and its value (:func:`eyas.target.graphed.check_batch_args`).
        eyas.target.graphed.GraphCaptureError: the CUDA graph capture failed.
    """
    from eyas.target import graphed
    from eyas.target.model import Target

    model = model.model if isinstance(model, Target) else model
    if decode not in graphed.DECODES:
        raise ValueError(f"generate_batch: decode {decode!r} is not one of {graphed.DECODES}")
    stop_ids = graphed.check_batch_args(model, prompts_ids, max_new_tokens, pad_id, stop_ids, temperature=temperature,
                                        top_p=top_p, seed=seed, caller="generate_batch")
    if cache_implementation is not None and decode != "dynamic":
        raise ValueError(f"generate_batch: cache_implementation {cache_implementation!r} is transformers' "
                         f"generate's (decode 'dynamic'), not decode {decode!r}'s")
    if not prompts_ids:
        return []
    mode = graphed.choose(model, decode)
    if mode != "dynamic":
        return graphed.decode_batch(model, prompts_ids, max_new_tokens, pad_id, stop_ids, graphs=mode == "graphed",
                                    temperature=temperature, top_p=top_p, seed=seed)
    return _generate_dynamic(model, prompts_ids, max_new_tokens, pad_id, stop_ids, cache_implementation,
                             temperature=temperature, top_p=top_p, seed=seed)


def _generate_dynamic(model, prompts_ids: list[list[int]], max_new_tokens: int, pad_id: int, stop_ids: list[int],
                      cache_implementation: str | None, *, temperature: float, top_p: float,
                      seed: int) -> list[list[int]]:
    """:func:`generate_batch`'s ``"dynamic"`` decode: transformers' ``generate`` on the prompts left-padded
    into one int64 [batch, longest prompt] batch with its attention mask, greedy or (``temperature`` > 0)
    sampled; per prompt the generated ids cut after the first stop id (:func:`_trim`)."""
    from transformers import GenerationConfig

    T = max(len(p) for p in prompts_ids)
    ids = torch.full((len(prompts_ids), T), pad_id, dtype=torch.int64)
    att = torch.zeros((len(prompts_ids), T), dtype=torch.int64)
    for i, p in enumerate(prompts_ids):
        ids[i, T - len(p):] = torch.tensor(p)
        att[i, T - len(p):] = 1
    dev = next(model.parameters()).device
    # a fresh config, not the model's generation_config: no repetition penalty, no min_length, ...
    # exactly argmax decoding (what eval's greedy reference does), or sampling with temperature and top_p alone
    # an int temperature as its float (transformers' TemperatureLogitsWarper refuses an int)
    sampled = ({"do_sample": True, "temperature": float(temperature), "top_p": top_p, "top_k": 0}
               if temperature > 0 else {})
    gc = GenerationConfig(**{"do_sample": False, **sampled}, num_beams=1, max_new_tokens=max_new_tokens,
                          pad_token_id=pad_id, eos_token_id=list(stop_ids) or None,
                          cache_implementation=cache_implementation)
    if sampled:
        torch.manual_seed(int(seed))
    # generate fills the fields a passed config leaves unset from the model's own generation_config
    # (transformers generation/utils.py, _prepare_generation_config): its eos would stop a row that
    # `stop_ids` does not stop, and the pads after it would come back as tokens; a blank one meanwhile
    saved, model.generation_config = model.generation_config, GenerationConfig()
    try:
        out = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), generation_config=gc)
    finally:
        model.generation_config = saved
    gen = out[:, T:].tolist()
    stop = set(stop_ids)
    return [_trim(g, stop) for g in gen]


def fit_prompt(tokenizer, messages: list[dict], max_tokens: int | None) -> tuple[list[dict], list[int]] | None:
    """Drop the earliest turns of a prompt until it renders to <= ``max_tokens`` ids.

    Leading system messages are kept and the kept turns start at a user turn: the earliest such
    start that fits, or the whole prompt when it fits. The rendered length falls as the start moves
    right, so the search runs from the LAST user turn leftwards in doubling steps, then bisects
    between the last start that fits and the first that does not: a long history (hundreds of
    turns, ``distill.turns: all``) is never rendered whole unless its whole fits. Returns
    ``(messages, ids)``, or None when even the last user turn alone does not fit.
    ``max_tokens`` None: no budget.
    """
    if max_tokens is None:
        return messages, render_prompt(tokenizer, messages)
    n_sys = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    # candidate starts, left to right: the whole prompt, then each later user turn
    starts = [n_sys] + [i for i in range(n_sys + 1, len(messages)) if messages[i]["role"] == "user"]

    def render(k: int) -> tuple[list[dict], list[int]]:
        msgs = messages if k == 0 else messages[:n_sys] + messages[starts[k]:]
        return msgs, render_prompt(tokenizer, msgs)

    best, step, hi = None, 1, len(starts)  # starts[hi:] fit (best: the leftmost of them)
    while True:
        k = max(hi - step, 0)
        cand = render(k)
        if len(cand[1]) > max_tokens:
            lo = k + 1  # starts[:lo] do not fit
            break
        best, hi = cand, k
        if k == 0:
            return best
        step *= 2
    while lo < hi:  # the leftmost fitting start lies in starts[lo:hi + 1]
        mid = (lo + hi) // 2
        cand = render(mid)
        if len(cand[1]) <= max_tokens:
            best, hi = cand, mid
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


def turn_prompts(messages: list[dict], turns: str) -> list[tuple[int, list[dict]]]:
    """The prompts self-distill answers in one conversation, as ``(index of the assistant turn
    in messages, prompt messages)``: ``turns="last"``, the prompt before the last assistant turn
    (at most one); ``"all"``, the prompt before every assistant turn that has a user turn before
    it, in order. A prompt is :func:`eyas.data.conversations.prompt_messages` of the messages up to that turn.

    Raises:
        ValueError: ``turns`` is not one of :data:`TURNS`.
    """
    if turns not in TURNS:
        raise ValueError(f"distill.turns must be one of {TURNS}, got {turns!r}")
    idx = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
    if turns == "last":
        idx = idx[-1:]
    out = []
    for j in idx:
        msgs = prompt_messages(messages[: j + 1])
        if msgs:
            out.append((j, msgs))
    return out


def plan_prompts(tokenizer, conversations: list[dict], *, turns: str, max_prompt_tokens: int | None,
                 on_bad_line: str = "error") -> tuple[list[dict], dict]:
    """Render every prompt self-distill will answer, with the tokenizer only (before the target's
    weights load, so a template that refuses a conversation fails in seconds, not after the load).

    Args:
        tokenizer: the target's tokenizer (chat template).
        conversations: ``{"id", "messages"}`` (eyas.data.conversations format).
        turns: ``"last"`` or ``"all"`` (:func:`turn_prompts`).
        max_prompt_tokens: prompt budget (:func:`fit_prompt`); None: no budget.
        on_bad_line: ``"error"`` or ``"skip"`` (``data.on_bad_line``): what to do when the chat
            template raises on a conversation (e.g. a Gemma-style template refusing a system turn
            or two user turns in a row).
    Returns:
        ``(items, stats)``: items in conversation order, each ``{"id", "messages",
        "prompt_ids"}`` (``id`` is the conversation id for ``turns="last"`` and
        ``"<id>#<turn index>"`` for ``"all"``); stats ``conversations``, ``prompts``,
        ``prompts_shortened``, ``dropped_no_prompt`` (conversations), ``dropped_long_prompt``
        (prompts whose last user turn alone exceeds the budget), ``skipped_template`` and
        ``skipped_template_ids`` (conversations the template refused).
    Raises:
        eyas.data.conversations.DataError: the template refused a conversation and ``on_bad_line`` is
            ``"error"``; the message names the conversation id and the template's error.
        jinja2.exceptions.TemplateSyntaxError, jinja2.exceptions.UndefinedError: the template itself is
            broken (not a refusal of one conversation); raised as is, whatever ``on_bad_line``.
    """
    if on_bad_line not in ("error", "skip"):
        raise DataError(f"on_bad_line must be 'error' or 'skip', got {on_bad_line!r}")
    items: list[dict] = []
    stats = {"conversations": len(conversations), "prompts": 0, "prompts_shortened": 0,
             "dropped_no_prompt": 0, "dropped_long_prompt": 0, "skipped_template": 0,
             "skipped_template_ids": []}
    for c in conversations:
        prompts = turn_prompts(c["messages"], turns)
        if not prompts:
            stats["dropped_no_prompt"] += 1
            continue
        try:
            # the longest prompt whole, once: a template that refuses any turn of the conversation refuses
            # it, whatever part of each prompt the budget keeps (fit_prompt renders only what it needs)
            render_prompt(tokenizer, prompts[-1][1])
            fits = [(j, msgs, fit_prompt(tokenizer, msgs, max_prompt_tokens)) for j, msgs in prompts]
        except (TemplateSyntaxError, UndefinedError):  # a broken template, not a refusal: every conversation
            raise  # would be skipped by it
        except (TemplateError, ValueError) as e:  # a template's raise_exception (transformers raises jinja2's
            # TemplateError); ValueError: refusals raised outside jinja (transformers without a chat template)
            if on_bad_line == "error":
                raise DataError(f"conversation {c['id']!r}: the chat template refused it "
                                f"({type(e).__name__}: {e}); set data.on_bad_line: skip to skip "
                                "and count such conversations") from None
            stats["skipped_template"] += 1
            stats["skipped_template_ids"].append(c["id"])
            continue
        for j, msgs, fit in fits:
            if fit is None:
                stats["dropped_long_prompt"] += 1
                continue
            stats["prompts_shortened"] += len(fit[0]) < len(msgs)
            items.append({"id": c["id"] if turns == "last" else f"{c['id']}#{j}",
                          "messages": fit[0], "prompt_ids": fit[1]})
    stats["prompts"] = len(items)
    return items, stats


def regenerate(target, items: list[dict], *, max_new_tokens: int, batch_size: int,
               progress=None, journal: Journal | None = None) -> tuple[list[dict], dict]:
    """The target's greedy reply to each planned prompt (:func:`plan_prompts`).

    Args:
        target: ``eyas.target.model.Target``; its :attr:`~eyas.target.model.Target.stop_ids` end a reply.
        items: ``{"id", "messages", "prompt_ids"}`` from :func:`plan_prompts`.
        max_new_tokens: generation budget per reply; a reply that hits it is kept as it was cut
            (``finish_reason: "length"``: no end-of-turn token is added, so the drafter is not
            taught a stop the target never made).
        batch_size: prompts per ``generate`` call; prompts are sorted by length first.
        progress: optional callable ``(done, total)`` after each batch.
        journal: replies already made by an earlier, killed run are taken from it, and new ones
            are appended to it per batch (:class:`Journal`). A resumed prompt is generated in a
            batch of different composition; batched greedy decoding equals unbatched (module
            docstring), up to the floating-point effects of padding on a GPU.
    Returns:
        ``(rows, stats)``: rows in item order, each ``{"id", "messages": prompt messages +
        [{"role": "assistant", "content": decoded reply}], "prompt_ids": [int], "reply_ids":
        [int], "finish_reason": "stop" | "length"}``; replies with no text (decoded with
        ``skip_special_tokens=True``, stripped) are dropped and counted. ``stats``:
        ``prompts``, ``prompt_tokens``, ``generated_tokens`` (stop ids counted, resumed replies
        included), ``resumed``, ``seconds`` (this run's generation only), ``tokens_per_second``
        (this run's), ``truncated`` (``finish_reason: "length"``), ``dropped_empty``, ``kept``,
        ``stop_ids``, ``decode`` (:func:`generate_batch`'s choice, :func:`eyas.target.graphed.choose`:
        ``"graphed"`` on CUDA, ``"dynamic"`` elsewhere).
    """
    from eyas.target import graphed

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tok = target.tokenizer
    stop_ids = target.stop_ids
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (stop_ids[0] if stop_ids else 0)
    order = sorted(range(len(items)), key=lambda k: len(items[k]["prompt_ids"]))  # little padding
    gen: dict[int, list[int]] = {}
    seconds, new_tokens, resumed = 0.0, 0, 0
    for b in range(0, len(order), batch_size):
        chunk = order[b:b + batch_size]
        for k in chunk:
            ids = None if journal is None else journal.get(items[k]["prompt_ids"])
            if ids is not None:
                gen[k] = ids
                resumed += 1
        todo = [k for k in chunk if k not in gen]
        if todo:
            t0 = time.perf_counter()
            outs = generate_batch(target.model, [items[k]["prompt_ids"] for k in todo], max_new_tokens,
                                  pad_id, stop_ids)
            seconds += time.perf_counter() - t0
            new_tokens += sum(len(o) for o in outs)
            gen.update(zip(todo, outs))
            if journal is not None:
                journal.add([(items[k]["prompt_ids"], o) for k, o in zip(todo, outs)])
        if progress is not None:
            progress(min(b + batch_size, len(order)), len(order))

    rows, stats = build_rows(tok, stop_ids, items, [gen[k] for k in range(len(items))])
    stats.update(resumed=resumed, seconds=round(seconds, 2),
                 tokens_per_second=round(new_tokens / seconds, 1) if seconds > 0 else None,
                 max_new_tokens=max_new_tokens, batch_size=batch_size, decode=graphed.choose(target.model))
    return rows, stats


def build_rows(tokenizer, stop_ids, items: list[dict], replies: list[list[int]]) -> tuple[list[dict], dict]:
    """Self-distill rows from planned prompts and the target's reply ids (any backend).

    Args:
        tokenizer: the target's tokenizer (decodes ``content`` for reading only).
        stop_ids: the target's stop set; a reply is ``finish_reason: "stop"`` iff it ends in one.
        items: ``{"id", "messages", "prompt_ids"}`` (:func:`plan_prompts`).
        replies: per item, in item order, its reply ids (up to and including the first stop id).
    Returns:
        ``(rows, stats)``: rows as :func:`regenerate` documents (empty-text replies dropped);
        stats ``prompts``, ``prompt_tokens``, ``generated_tokens``, ``truncated``,
        ``dropped_empty``, ``kept``, ``stop_ids``.
    """
    rows, dropped_empty, truncated, n_tokens = [], 0, 0, 0
    for it, ids in zip(items, replies, strict=True):
        n_tokens += len(ids)
        stopped = bool(ids) and ids[-1] in stop_ids
        truncated += not stopped
        text = tokenizer.decode(ids, skip_special_tokens=True).strip()
        if not text:
            dropped_empty += 1
            continue
        rows.append({"id": it["id"], "messages": it["messages"] + [{"role": "assistant", "content": text}],
                     "prompt_ids": it["prompt_ids"], "reply_ids": ids,
                     "finish_reason": "stop" if stopped else "length"})
    stats = {
        "prompts": len(items),
        "prompt_tokens": sum(len(it["prompt_ids"]) for it in items),
        "generated_tokens": n_tokens,
        "truncated": int(truncated),
        "dropped_empty": dropped_empty,
        "kept": len(rows),
        "stop_ids": list(stop_ids),
    }
    return rows, stats
