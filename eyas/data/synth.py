"""Synthesized prompts: user turns the target writes itself (Magpie), a data source (``data.synth``).

Magpie (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing", arXiv 2406.08464; github.com/magpie-align/magpie): an aligned model given its chat template up
to the user turn (``<|im_start|>user\\n`` for ChatML, after the system prompt the template writes) continues
it with a user request, up to its end-of-turn token. The text is a prompt in the target's own
distribution, which a drafter of that target is asked to draft for. For more than one turn the target
answers (greedy, as self-distill does) and then writes the next user turn the same way. Code requests
come the same way under a code system prompt (``data.synth.code_system_prompts``).

The user turns are sampled (``data.synth.temperature``, ``top_p``), each batch of prompts from its own
seed (derived from ``data.synth.seed``, the round, the turn and the batch), so a rerun with the same
decode on the same kind of device draws the same turns. Through the target itself (``distill.backend:
hf``) both kinds of turn run :func:`eyas.data.distill.generate_batch`: on CUDA the graphed static-cache
decode, each sampled token drawn after the graph's step from its logits as transformers' ``generate`` samples
(:func:`eyas.target.graphed.decode_batch`); on a CPU transformers' ``generate``. Through an engine
(``server``, :func:`eyas.data.remote.generate_ids`) vLLM and llama-server sample with the seed; SGLang
takes none.

Every user turn passes, in this order (the first failure is the reason it is counted under, in
``stats["dropped"]``):

- ``truncated``: no end-of-turn token within ``max_prompt_tokens`` (the request was cut);
- ``special_token``: a special token (``<|im_start|>``, ...) before the end-of-turn token;
- ``too_short``: fewer than ``min_prompt_tokens`` tokens, or only whitespace;
- ``round_trip``: the text does not survive the target's tokenizer (``decode(encode(text)) != text``,
  or a U+FFFD replacement character: bytes cut mid-character);
- ``language``: no letters, or fewer than ``min_ascii_letters`` of its letters (``str.isalpha``) are
  ASCII (a heuristic for English, the language of the eval prompts);
- ``overlap_chat`` / ``overlap_humaneval``: it copies an eval prompt (:class:`Overlap`: the user turns of
  the chat test split, the HumanEval prompts as the eval sends them);
- ``near_duplicate`` (first turns only): its word-3-gram Jaccard with a prompt already kept is >=
  ``near_dup`` (:class:`NearDupIndex`; exact duplicates included).

A conversation whose first turn fails is dropped; one whose later turn fails keeps the turns before
it. Generation runs in rounds until ``prompts`` conversations survive (each round asks for the missing
ones divided by the survival rate so far); after ``max_rounds`` rounds :class:`SynthError` names how
many survived and why the others did not. Each round is saved as it finishes (``work_dir``), so a
rerun with the same :func:`synthesize` arguments (``max_rounds`` aside) reuses the rounds done.

Each conversation ends with an empty assistant turn: self-distill (``distill.enabled``, train and val)
writes the reply, as it does for every source. Conversation ids are ``synth-chat-<n>`` and
``synth-code-<n>`` (``n``: the order kept, from 0).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import zlib
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np

from eyas.data.conversations import DataError, code_user_turn, render_prompt
from eyas.io import write_json

__all__ = ["SynthError", "SHINGLE_WORDS", "shingles", "jaccard", "NearDupIndex", "Overlap", "user_prefix",
           "clean_turn", "synthesize", "TOPIC_SENTENCE", "DROP_REASONS"]

SHINGLE_WORDS = 3
"""Words per shingle (a word n-gram) in the near-duplicate and overlap tests."""
TOPIC_SENTENCE = "The user asks about {topic}."
"""Appended (after a space) to a conversation's system prompt when ``data.synth.topics`` is set."""
DROP_REASONS = ("truncated", "special_token", "too_short", "round_trip", "language", "overlap_chat",
                "overlap_humaneval", "near_duplicate")
_SENTINEL = "\u2063EYAS_SYNTH_USER\u2063"  # stands for the user text while the template renders the prefix
_P = 4294967291  # the largest prime below 2**32: (a * h + b) % _P of 32-bit a, b, h fits in uint64
_MIN_WHOLE = 6  # overlap: a benchmark text of >= this many shingles that a candidate contains also counts


class SynthError(DataError):
    """Synthesis could not reach the asked number of prompts, or the template has no user turn."""


# ---------------------------------------------------------------------------------------------
# near-duplicates and overlap


def shingles(text: str) -> frozenset[str]:
    """The word :data:`SHINGLE_WORDS`-grams of ``text`` (words: ``\\w+`` runs, lowercased), each
    joined by a space; a text of fewer words is one shingle of all of them; no words: empty."""
    words = re.findall(r"\w+", text.lower())
    if len(words) < SHINGLE_WORDS:
        return frozenset([" ".join(words)]) if words else frozenset()
    return frozenset(" ".join(words[i:i + SHINGLE_WORDS]) for i in range(len(words) - SHINGLE_WORDS + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    """``|a & b| / |a | b|`` (0.0 for two empty sets)."""
    union = len(a | b)
    return len(a & b) / union if union else 0.0


class NearDupIndex:
    """The shingle sets kept so far, and whether a new one is a near-duplicate of one of them.

    Candidates come from MinHash locality-sensitive hashing (Broder 1997, "On the resemblance and
    containment of documents"; the banding of Leskovec, Rajaraman & Ullman, "Mining of Massive
    Datasets", ch. 3, as ekzhu/datasketch ``MinHashLSH`` does): 128 hash functions ``(a * crc32(s) + b)
    mod p`` in 64 bands of 2 rows, so a pair at Jaccard ``J`` shares a band with probability ``1 - (1 -
    J**2)**64`` (0.9976 at 0.3, 1 - 1e-8 at 0.5). Each candidate is then checked by its exact Jaccard
    (:func:`jaccard`): nothing is dropped that is not a near-duplicate; a near-duplicate below 0.3 may be
    missed.
    """

    PERMS, ROWS = 128, 2

    def __init__(self, threshold: float):
        if not 0 < threshold <= 1:
            raise ValueError(f"near-duplicate threshold must be in (0, 1], got {threshold}")
        self.threshold = threshold
        rng = np.random.default_rng(20240611)  # fixed: the index is the same in every run
        self._a = rng.integers(1, _P, self.PERMS, dtype=np.uint64)
        self._b = rng.integers(0, _P, self.PERMS, dtype=np.uint64)
        self._bands: list[dict[bytes, list[int]]] = [{} for _ in range(self.PERMS // self.ROWS)]
        self.sets: list[frozenset] = []

    def _keys(self, sh: frozenset) -> list[bytes]:
        h = np.fromiter((zlib.crc32(s.encode("utf-8")) for s in sh), dtype=np.uint64, count=len(sh))
        sig = ((h[:, None] * self._a[None, :] + self._b[None, :]) % np.uint64(_P)).min(axis=0)
        return [sig[i * self.ROWS:(i + 1) * self.ROWS].tobytes() for i in range(len(self._bands))]

    def find(self, sh: frozenset) -> int | None:
        """The index of a kept set whose Jaccard with ``sh`` is >= the threshold, or None (always
        None for an empty ``sh``)."""
        if not sh:
            return None
        seen: set[int] = set()
        for band, key in zip(self._bands, self._keys(sh)):
            for i in band.get(key, ()):
                if i not in seen:
                    seen.add(i)
                    if jaccard(sh, self.sets[i]) >= self.threshold:
                        return i
        return None

    def add(self, sh: frozenset) -> None:
        """Keep ``sh`` (an empty set is kept but never found)."""
        i = len(self.sets)
        self.sets.append(sh)
        if sh:
            for band, key in zip(self._bands, self._keys(sh)):
                band.setdefault(key, []).append(i)


class Overlap:
    """Eval prompts a synthesized prompt must not copy.

    A candidate with shingle set ``A`` overlaps a benchmark text ``B`` when ``|A & B| / |A| >=
    threshold`` (that share of the candidate is the benchmark's), or when ``B`` holds at least 6
    shingles (8 words) and ``|A & B| / |B| >= threshold`` (the candidate contains most of a
    benchmark prompt). Exact: every benchmark text sharing a shingle is checked (an inverted index).

    Args:
        texts: ``{label: [benchmark text, ...]}``; :meth:`hit` returns the label.
        threshold: in (0, 1].
    """

    def __init__(self, texts: dict[str, list[str]], threshold: float):
        if not 0 < threshold <= 1:
            raise ValueError(f"overlap threshold must be in (0, 1], got {threshold}")
        self.threshold = threshold
        self._labels: list[str] = []
        self._sizes: list[int] = []
        self._index: dict[str, list[int]] = {}
        for label, items in texts.items():
            for t in items:
                sh = shingles(t)
                if not sh:
                    continue
                j = len(self._labels)
                self._labels.append(label)
                self._sizes.append(len(sh))
                for s in sh:
                    self._index.setdefault(s, []).append(j)

    def __len__(self) -> int:
        return len(self._labels)

    def hit(self, sh: frozenset) -> str | None:
        """The label of a benchmark text ``sh`` overlaps (the first in insertion order), or None."""
        if not sh:
            return None
        shared = Counter(j for s in sh for j in self._index.get(s, ()))
        for j in sorted(shared):
            c = shared[j]
            if c / len(sh) >= self.threshold or (self._sizes[j] >= _MIN_WHOLE and c / self._sizes[j] >= self.threshold):
                return self._labels[j]
        return None


def benchmark_texts(test_conversations: list[dict], humaneval: list[dict]) -> dict[str, list[str]]:
    """The eval prompts' texts: ``chat``, every user turn of the test split (the eval sends a
    conversation's history up to its last user turn); ``humaneval``, each problem's user turn as the
    eval sends it (:func:`eyas.data.conversations.code_user_turn`), all 164 of them."""
    return {"chat": [m["content"] for c in test_conversations for m in c["messages"] if m["role"] == "user"],
            "humaneval": [code_user_turn(p["prompt"])["content"] for p in humaneval]}


# ---------------------------------------------------------------------------------------------
# one user turn


def user_prefix(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered by the target's chat template, then the header of a new
    user turn, and nothing of its text (``...<|im_start|>user\\n`` for ChatML): what Magpie gives
    the model. Found by rendering a placeholder user turn and cutting the text where it starts, so it
    is the template's own (default system prompt, BOS, header) for any template.

    Raises:
        SynthError: the template has no chat template, refuses the messages (naming them), or does
            not write the user text as given.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise SynthError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template: "
                         "synthesized prompts need an instruct/chat target")
    try:
        text = tokenizer.apply_chat_template(messages + [{"role": "user", "content": _SENTINEL}],
                                             tokenize=False, add_generation_prompt=False)
    except Exception as e:  # noqa: BLE001  jinja's TemplateError, a template's raise_exception
        raise SynthError(f"the chat template refused {[m['role'] for m in messages] + ['user']} "
                         f"({type(e).__name__}: {e}): check data.synth.system_prompts") from None
    cut = text.find(_SENTINEL)
    if cut < 0:
        raise SynthError("the chat template does not write a user turn's text as given: no user prefix to continue")
    return list(tokenizer(text[:cut], add_special_tokens=False)["input_ids"])


def clean_turn(tokenizer, ids: list[int], stop_ids, *, min_tokens: int, min_ascii_letters: float,
               special_ids) -> tuple[str | None, str | None]:
    """A generated user turn's text, or why it is dropped (module docstring, the first five reasons).

    Args:
        ids: the generated ids, up to and including the first stop id when one came.
        stop_ids: the target's end-of-turn ids.
        min_tokens: the fewest ids (the stop id not counted).
        min_ascii_letters: the least share of ASCII among its letters, in [0, 1].
        special_ids: the tokenizer's special ids (``all_special_ids``).
    Returns:
        ``(text, None)`` (the decoded text, stripped) or ``(None, reason)``.
    """
    if not ids or ids[-1] not in stop_ids:
        return None, "truncated"
    body = ids[:-1]
    if any(t in special_ids for t in body):
        return None, "special_token"
    text = tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False).strip()
    if len(body) < min_tokens or not text:
        return None, "too_short"
    again = tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"], skip_special_tokens=False,
                             clean_up_tokenization_spaces=False)
    if "\ufffd" in text or again != text:
        return None, "round_trip"
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) / len(letters) < min_ascii_letters:
        return None, "language"
    return text, None


# ---------------------------------------------------------------------------------------------
# rounds

Generate = Callable[..., list[list[int]]]
"""``generate(prompts_ids, max_new_tokens, *, temperature, top_p, seed) -> ids per prompt`` (each up to
and including the first stop id): :func:`eyas.data.distill.generate_batch` or
:func:`eyas.data.remote.generate_ids` with the target bound; ``temperature`` 0 is greedy."""


def _seed(*parts) -> int:
    """A 63-bit seed from ``parts`` (sha256: stable across processes, unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:8], "big") >> 1


def _draw(rng: random.Random, s) -> tuple[str, list[dict]]:
    """One conversation's kind (``chat`` / ``code``) and starting messages (its system turn, if any)."""
    code = s.code_share > 0 and rng.random() < s.code_share
    system = rng.choice(s.code_system_prompts if code else s.system_prompts)
    if s.topics:
        system = f"{system} {TOPIC_SENTENCE.format(topic=rng.choice(s.topics))}".strip()
    return ("code" if code else "chat"), ([{"role": "system", "content": system}] if system else [])


def _batched(generate: Generate, prompts: list[list[int]], batch_size: int, max_new_tokens: int, *,
             temperature: float, top_p: float, seed_parts: tuple) -> tuple[list[list[int]], int]:
    """``generate`` over ``prompts`` in batches of ``batch_size`` (each batch its own seed, from
    ``seed_parts`` and its index); returns the ids in input order and the ids generated."""
    out: list[list[int]] = []
    for b in range(0, len(prompts), batch_size):
        out += generate(prompts[b:b + batch_size], max_new_tokens, temperature=temperature, top_p=top_p,
                        seed=_seed(*seed_parts, b))
    return out, sum(len(o) for o in out)


def _round(generate, tokenizer, stop_ids, s, *, ask: int, rnd: int, reply_tokens: int, batch_size: int,
           overlap: Overlap, index: NearDupIndex, special_ids: set[int]) -> tuple[list[dict], dict]:
    """One round: ``ask`` conversations drawn and written turn by turn; returns the survivors
    (``{"kind", "messages"}``, each ending in a user turn) and the round's counts."""
    rng = random.Random(_seed(s.seed, "draw", rnd))
    convs = [dict(zip(("kind", "messages"), _draw(rng, s))) for _ in range(ask)]
    stats = {"generated": ask, "dropped": Counter(), "later_turns_dropped": 0, "user_tokens": 0,
             "reply_tokens": 0}
    alive = list(range(ask))
    for turn in range(s.turns):
        prompts = [user_prefix(tokenizer, convs[k]["messages"]) for k in alive]
        outs, n = _batched(generate, prompts, batch_size, s.max_prompt_tokens, temperature=s.temperature,
                           top_p=s.top_p, seed_parts=(s.seed, "user", rnd, turn))
        stats["user_tokens"] += n
        survivors = []
        for k, ids in zip(alive, outs):
            text, why = clean_turn(tokenizer, ids, stop_ids, min_tokens=s.min_prompt_tokens,
                                   min_ascii_letters=s.min_ascii_letters, special_ids=special_ids)
            sh = shingles(text) if text is not None else frozenset()
            if why is None:
                hit = overlap.hit(sh)
                why = f"overlap_{hit}" if hit else None
            if why is None and turn == 0 and index.find(sh) is not None:
                why = "near_duplicate"
            if why is not None:
                if turn == 0:
                    stats["dropped"][why] += 1
                else:  # the turns before it stay: drop its history's last reply
                    stats["later_turns_dropped"] += 1
                    convs[k]["messages"].pop()
                continue
            if turn == 0:
                index.add(sh)
            convs[k]["messages"].append({"role": "user", "content": text})
            survivors.append(k)
        alive = survivors
        if turn == s.turns - 1 or not alive:
            break
        prompts = [render_prompt(tokenizer, convs[k]["messages"]) for k in alive]
        outs, n = _batched(generate, prompts, batch_size, reply_tokens, temperature=0.0, top_p=1.0,
                           seed_parts=(s.seed, "reply", rnd, turn))
        stats["reply_tokens"] += n
        going = []
        for k, ids in zip(alive, outs):
            reply = tokenizer.decode(ids, skip_special_tokens=True).strip()
            if reply:
                convs[k]["messages"].append({"role": "assistant", "content": reply})
                going.append(k)
        alive = going
    kept = [c for c in convs if any(m["role"] == "user" for m in c["messages"])]
    stats["dropped"] = dict(stats["dropped"])
    return kept, stats


def _round_file(work_dir: Path | None, rnd: int) -> Path | None:
    return None if work_dir is None else Path(work_dir) / f"round_{rnd:03d}.json"


def synthesize(generate: Generate, tokenizer, stop_ids, s, *, benchmarks: dict[str, list[str]],
               reply_tokens: int, batch_size: int, resume_key: dict, work_dir: Path | None = None,
               progress=None) -> tuple[list[dict], dict]:
    """``s.prompts`` conversations whose user turns the target wrote (module docstring).

    Args:
        generate: the target's decode (:data:`Generate`).
        tokenizer: the target's tokenizer (chat template).
        stop_ids: the target's stop set (:func:`eyas.target.model.stop_token_ids`).
        s: params ``data.synth``.
        benchmarks: the eval prompts to keep out (:func:`benchmark_texts`).
        reply_tokens: the budget of the target's replies between user turns (``distill.max_new_tokens``).
        batch_size: prompts per ``generate`` call.
        resume_key: what the rounds depend on besides ``s`` (target, backend, ...): saved rounds
            with another key, or other ``s`` (``max_rounds`` aside), are not reused.
        work_dir: where each round is saved as it finishes (None: nowhere).
        progress: optional callable ``(kept, asked, round)`` after each round.
    Returns:
        ``(conversations, stats)``: ``s.prompts`` conversations ``{"id", "messages"}`` in the order
        kept, each ending with an empty assistant turn; stats ``rounds``, ``generated``
        (conversations drawn), ``dropped`` (first turns, per reason of :data:`DROP_REASONS`),
        ``later_turns_dropped``, ``surplus`` (survivors past ``s.prompts`` in the last round),
        ``kept`` per kind, ``user_tokens`` / ``reply_tokens`` (ids generated, stop ids included,
        dropped ones too), ``kept_user_tokens`` (the kept user turns' text, re-tokenized),
        ``benchmark_texts`` per label, ``resumed_rounds``.
    Raises:
        SynthError: fewer than ``s.prompts`` survived ``s.max_rounds`` rounds (how many, and the
            drop counts, are named); the rounds done are saved in ``work_dir``.
    """
    params = {k: v for k, v in vars(s).items() if k != "max_rounds"}
    key = {"params": params, **resume_key, "reply_tokens": reply_tokens, "batch_size": batch_size,
           "benchmarks": hashlib.sha256(json.dumps(benchmarks, sort_keys=True).encode()).hexdigest()}
    overlap = Overlap(benchmarks, s.overlap)
    index = NearDupIndex(s.near_dup)
    special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    kept: list[dict] = []
    totals = {"rounds": 0, "generated": 0, "dropped": Counter(), "later_turns_dropped": 0, "user_tokens": 0,
              "reply_tokens": 0, "resumed_rounds": 0}
    for rnd in range(s.max_rounds):
        missing = s.prompts - len(kept)
        if missing <= 0:
            break
        rate = len(kept) / totals["generated"] if totals["generated"] else 0.8
        ask = max(math.ceil(round(missing * 1.1 / max(rate, 0.1), 6)), 1)  # round: no float fuzz past an integer
        path = _round_file(work_dir, rnd)
        saved = _saved_round(path, key, ask, index)
        if saved is not None:
            got, stats = saved
            totals["resumed_rounds"] += 1
        else:
            got, stats = _round(generate, tokenizer, stop_ids, s, ask=ask, rnd=rnd, reply_tokens=reply_tokens,
                                batch_size=batch_size, overlap=overlap, index=index, special_ids=special_ids)
            if path is not None:
                write_json(path, {"key": key, "ask": ask, "conversations": got, "stats": stats})
        kept += got
        totals["rounds"] += 1
        for k in ("generated", "later_turns_dropped", "user_tokens", "reply_tokens"):
            totals[k] += stats[k]
        totals["dropped"].update(stats["dropped"])
        if progress is not None:
            progress(len(kept), s.prompts, rnd)
    return _finish(kept, totals, s, tokenizer, benchmarks)


def _saved_round(path: Path | None, key: dict, ask: int, index: NearDupIndex) -> tuple[list[dict], dict] | None:
    """The round saved at ``path`` as ``(conversations, stats)`` when it was made under ``key`` asking
    for ``ask`` conversations, its first user turns added to ``index`` as the round left it; None when
    there is none or it was made otherwise.

    Raises:
        json.JSONDecodeError: the file is not JSON.
    """
    saved = json.loads(path.read_text()) if path is not None and path.is_file() else None
    if saved is None or saved.get("key") != key or saved.get("ask") != ask:
        return None
    got = saved["conversations"]
    for c in got:  # the index as the round left it
        first = next(m["content"] for m in c["messages"] if m["role"] == "user")
        index.add(shingles(first))
    return got, saved["stats"]


def _finish(kept: list[dict], totals: dict, s, tokenizer, benchmarks: dict[str, list[str]]) -> tuple[list[dict], dict]:
    """:func:`synthesize`'s result from the conversations the rounds kept and their ``totals``: the first
    ``s.prompts``, named ``synth-<kind>-<n>`` and ending with an empty assistant turn, and the stats.

    Raises:
        SynthError: fewer than ``s.prompts`` were kept (how many, and the drop counts, are named).
    """
    dropped = {r: totals["dropped"].get(r, 0) for r in DROP_REASONS}
    if len(kept) < s.prompts:
        raise SynthError(
            f"data.synth.prompts: {len(kept)} of {s.prompts} synthesized prompts survived the filters after "
            f"{totals['rounds']} rounds (data.synth.max_rounds) of {totals['generated']} drawn; dropped {dropped}. "
            "Raise data.synth.max_rounds (the rounds done are kept for a rerun) or data.synth.temperature, "
            "add data.synth.system_prompts or topics, loosen data.synth.near_dup, min_prompt_tokens or "
            "max_prompt_tokens, or ask for fewer")
    surplus = len(kept) - s.prompts
    kept = kept[:s.prompts]
    counters = Counter()
    out = []
    for c in kept:
        out.append({"id": f"synth-{c['kind']}-{counters[c['kind']]:06d}",
                     "messages": c["messages"] + [{"role": "assistant", "content": ""}]})
        counters[c["kind"]] += 1
    users = [m["content"] for c in kept for m in c["messages"] if m["role"] == "user"]
    stats = {**totals, "dropped": dropped, "surplus": surplus, "kept": {"chat": counters["chat"],
                                                                         "code": counters["code"]},
             "kept_user_turns": len(users),
             "kept_user_tokens": sum(len(tokenizer(u, add_special_tokens=False)["input_ids"]) for u in users),
             "benchmark_texts": {k: len(v) for k, v in benchmarks.items()}}
    return out, stats
