"""Self-distill through an inference engine that already hosts the target (``distill.backend: server``).

At scale nobody regenerates replies with HF ``generate``: SpecForge regenerates through SGLang,
vLLM's speculators through vLLM. This client sends each planned prompt (:func:`eyas.data.distill.plan_prompts`)
to an engine **as token ids** (the ids eyas rendered with the target's chat template: nothing is
re-tokenized) and keeps **the token ids the engine generated** and its stop reason, greedy
(temperature 0, no penalties), ``distill.server.concurrency`` requests in flight (the engine batches
them). The protocol is chosen explicitly by ``distill.server.api`` (no auto-detection):

===========  ==========================  =================================  ==================================
api          request                     reply ids                          stop reason
===========  ==========================  =================================  ==================================
``vllm``     ``POST /v1/completions``    ``choices[0].token_ids``           ``choices[0].finish_reason``
             ``prompt: [ids]``,          (``return_token_ids: true``,       ``"stop"`` / ``"length"``
             ``return_token_ids: true``  vllm-project/vllm PR #22587,
                                         ``entrypoints/openai/protocol.py``)
``sglang``   ``POST /generate``          ``output_ids``                     ``meta_info.finish_reason.type``
             ``input_ids: [ids]``        (sgl-project/sglang                ``"stop"`` / ``"length"``
                                         ``managers/tokenizer_manager.py``)
``llamacpp`` ``POST /completion``        ``tokens`` (``return_tokens:       ``stop_type``: ``"eos"`` (stop),
             ``prompt: [ids]``           true``, ggml-org/llama.cpp         ``"limit"`` (length), ``"word"``
                                         ``tools/server/README.md``)        (refused: eyas sends no stop words)
===========  ==========================  =================================  ==================================

Every reply is checked against the target's stop set (:func:`eyas.target.model.stop_token_ids`) so that
what the drafter trains on is what :func:`eyas.data.distill.generate_batch` would have kept: the ids up
to and including the first stop id, ``finish_reason "stop"`` iff the last id is a stop id. An
engine that reports ``stop`` without a stop id at the end (e.g. a stop set that differs from the
target's, or an engine that drops the stop token), a ``length`` reply shorter than
``max_new_tokens`` (the engine's context cut it), a reply longer than ``max_new_tokens`` (the
engine ignored the budget), a reply with no ids, or an id outside the target's vocabulary
(``[0, len(tokenizer))``: e.g. an engine hosting another model, or one whose embedding is padded
past the tokenizer) is refused with an error naming the conversation id and the URL.

The engine's model identity: :func:`hosted_models` reads ``GET /v1/models`` (vLLM, SGLang and
llama-server all answer it) and the stage refuses to run unless ``distill.server.model`` is among
the ids it lists; ``distill.server.model`` and ``distill.server.revision`` are params of
self-distill, so naming another model or revision reruns the stage (DVC), and the journal of
finished replies is keyed by them (a resumed run never mixes two models' replies).

Errors (:class:`RemoteError`): every failure of a request, each naming the URL (and, from
:func:`regenerate_remote`, the conversation id): the server down (connection refused), a
timeout, an HTTP 4xx/5xx (the body's first 300 characters are quoted), a reply cut off mid-body, a
port that does not speak HTTP, an invalid URL, a body that is not a JSON object, a field of the
protocol missing or null, an id eyas cannot train on. The first failure cancels the requests not
yet sent; replies already received are in the journal (:class:`eyas.data.distill.Journal`), so a rerun
sends only the rest.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from eyas.data.distill import Journal, build_rows

__all__ = ["APIS", "RemoteError", "request_for", "parse_reply", "check_reply", "hosted_models",
           "generate_one", "generate_ids", "regenerate_remote"]

APIS = ("vllm", "sglang", "llamacpp")


class RemoteError(RuntimeError):
    """The engine could not be reached, failed a request, or returned a reply eyas cannot train on."""


def request_for(api: str, model: str, prompt_ids: list[int], max_new_tokens: int,
                stop_ids: list[int], *, temperature: float = 0.0, top_p: float = 1.0,
                seed: int = 0) -> tuple[str, dict]:
    """The (path, JSON body) of one greedy (or sampled) request in ``api``'s protocol (module table).

    Greedy means temperature 0 with repetition, frequency and presence penalties off: vLLM applies
    the model's ``generation_config.json`` sampling defaults to fields a request leaves out
    (``--generation-config auto``), so they are all sent. ``stop_ids`` go as ``stop_token_ids``
    (vLLM, SGLang); llama-server stops at the model's end-of-generation tokens (its GGUF metadata),
    and :func:`check_reply` refuses a stop outside the target's set.

    ``temperature`` > 0 samples instead (synthesized prompts, eyas.data.synth): that temperature and
    nucleus ``top_p``, every other truncation off (top-k, min-p: vLLM ``top_k: -1``, llama-server
    ``top_k: 0``, ``min_p: 0``, whose defaults are 40 and 0.05), penalties off, and the request's
    ``seed`` (vLLM ``seed``, llama-server ``seed``; SGLang's ``/generate`` takes none, so its samples
    are not reproducible).

    Raises:
        ValueError: ``api`` is not one of :data:`APIS`.
    """
    greedy = {"temperature": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    sampled = temperature > 0
    if sampled:
        greedy = {**greedy, "temperature": temperature, "min_p": 0.0}
    if api == "vllm":
        extra = {"top_k": -1, "seed": seed} if sampled else {}
        return "/v1/completions", {"model": model, "prompt": prompt_ids, "max_tokens": max_new_tokens,
                                   "n": 1, "stream": False, "return_token_ids": True,
                                   "stop_token_ids": list(stop_ids), "top_p": top_p if sampled else 1.0,
                                   **greedy, **extra}
    if api == "sglang":
        extra = {"top_k": -1} if sampled else {}
        return "/generate", {"model": model, "input_ids": prompt_ids, "stream": False,
                             "sampling_params": {"max_new_tokens": max_new_tokens,
                                                 "stop_token_ids": list(stop_ids),
                                                 "top_p": top_p if sampled else 1.0, **greedy, **extra}}
    if api == "llamacpp":
        # top_k 1: argmax; cache_prompt false: the README warns a reused KV cache can change the logits
        pick = ({"top_k": 0, "top_p": top_p, "min_p": 0.0, "seed": seed, "temperature": temperature}
                if sampled else {"top_k": 1, "temperature": 0.0})
        return "/completion", {"model": model, "prompt": prompt_ids, "n_predict": max_new_tokens,
                               "return_tokens": True, "cache_prompt": False, "stream": False,
                               "repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                               **pick}
    raise ValueError(f"distill.server.api must be one of {APIS}, got {api!r}")


def _field(api: str, payload, path: tuple) -> object:
    """``payload[path[0]][path[1]]...``, or :class:`RemoteError` naming the first step that is
    missing or null (``choices[0]``, ``meta_info.finish_reason``)."""
    node, name = payload, ""
    for step in path:
        if isinstance(step, int):
            name += f"[{step}]"
            found = isinstance(node, list) and 0 <= step < len(node)
        else:
            name += f".{step}" if name else step
            found = isinstance(node, dict) and step in node
        if not found or node[step] is None:
            raise RemoteError(f"the reply's field `{name}` is {'null' if found else 'missing'} ({api} protocol): "
                              f"{json.dumps(payload)[:300]}")
        node = node[step]
    return node


def parse_reply(api: str, payload: dict) -> tuple[list[int], str]:
    """``(reply ids, finish reason)`` from one response body; the reason is ``"stop"`` or
    ``"length"`` (the OpenAI API's names, as eyas records them).

    Raises:
        RemoteError: a field the protocol defines is missing or null (the message names it, e.g.
            ``choices[0]``), the ids are not a list of ints (``true``/``false`` are not ids), or
            the engine stopped for a reason eyas does not train on (``abort``, a stop word).
    """
    if api == "vllm":
        choice = _field(api, payload, ("choices", 0))
        if not isinstance(choice, dict) or choice.get("token_ids") is None:
            raise RemoteError("the reply has no `choices[0].token_ids`: the server ignored return_token_ids "
                              f"(vLLM >= 0.10.2 returns them, PR #22587): {json.dumps(payload)[:300]}")
        ids, reason = choice["token_ids"], _field(api, payload, ("choices", 0, "finish_reason"))
    elif api == "sglang":
        ids = _field(api, payload, ("output_ids",))
        reason = _field(api, payload, ("meta_info", "finish_reason", "type"))
    elif api == "llamacpp":
        ids, st = _field(api, payload, ("tokens",)), _field(api, payload, ("stop_type",))
        reason = {"eos": "stop", "limit": "length"}.get(st, st) if isinstance(st, str) else st
    else:
        raise ValueError(f"distill.server.api must be one of {APIS}, got {api!r}")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise RemoteError(f"the reply's token ids are not a list of ints: {json.dumps(ids)[:200]}")
    if reason not in ("stop", "length"):
        raise RemoteError(f"the engine ended the reply with {reason!r}; eyas trains only on replies that "
                          "end at a stop token or at the token budget")
    return ids, reason


def check_reply(ids: list[int], reason: str, stop_ids, max_new_tokens: int, vocab_size: int) -> list[int]:
    """The reply eyas keeps (:func:`eyas.data.distill.generate_batch`'s contract), or an error.

    Every id must be in the target's vocabulary ``[0, vocab_size)`` (``len(tokenizer)``: an id past
    it decodes to nothing and indexes past the embedding in extract), and the reply at most
    ``max_new_tokens`` long. The ids kept: up to and including the first stop id (an engine that
    kept going after a stop id generated greedily what HF ``generate`` would have cut there). Then
    ``reason`` must agree: ``"stop"`` iff the kept reply ends in a stop id, and a ``"length"`` reply
    holds exactly ``max_new_tokens`` ids.

    Raises:
        RemoteError: an empty reply, one longer than ``max_new_tokens``, an id outside the
            vocabulary (the id and its position are named), a ``stop`` without a stop id at the
            end, or a ``length`` reply of another length (the engine's context limit cut it).
    """
    stop = set(stop_ids)
    if not ids:
        raise RemoteError("the engine returned no tokens")
    if len(ids) > max_new_tokens:
        raise RemoteError(f"the reply is {len(ids)} tokens, longer than distill.max_new_tokens {max_new_tokens}: "
                          "the engine ignored the token budget")
    bad = next(((j, t) for j, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RemoteError(f"the reply's id {bad[1]} (position {bad[0]}) is outside the target's vocabulary "
                          f"[0, {vocab_size}): the engine hosts another model or tokenizer?")
    cut = next((j for j, t in enumerate(ids) if t in stop), None)
    if cut is not None:
        return ids[: cut + 1]
    if reason == "stop":
        raise RemoteError(f"the engine reported 'stop' but the reply ends in id {ids[-1]}, not one of the "
                          f"target's stop ids {sorted(stop)}: the engine's stop set differs from the target's")
    if len(ids) != max_new_tokens:
        raise RemoteError(f"the engine cut the reply at {len(ids)} < distill.max_new_tokens {max_new_tokens} "
                          "tokens (its context length?)")
    return ids


def http_json(url: str, body: dict | None, timeout: float) -> dict:
    """The JSON object ``url`` answers (GET, or POST of ``body``); every failure is a
    :class:`RemoteError` naming ``url`` (and the exception's type and message)."""
    data = None if body is None else json.dumps(body).encode()
    try:
        req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        try:
            detail = e.read().decode("utf-8", "replace")[:300]
        except (OSError, http.client.HTTPException) as unread:
            detail = f"(the body could not be read: {type(unread).__name__}: {unread})"
        raise RemoteError(f"{url}: HTTP {e.code} {e.reason}: {detail}") from None
    except (TimeoutError, socket.timeout):
        raise RemoteError(f"{url}: no reply within distill.server.timeout {timeout} s") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, (TimeoutError, socket.timeout)):
            raise RemoteError(f"{url}: no reply within distill.server.timeout {timeout} s") from None
        raise RemoteError(f"{url}: cannot reach the server ({e.reason}); is it running?") from None
    except (OSError, http.client.HTTPException, ValueError, OverflowError) as e:
        # a reply cut off mid-body (IncompleteRead), a port that does not speak HTTP (BadStatusLine),
        # an invalid URL (InvalidURL, a ValueError), a reset connection, a timeout past time_t
        raise RemoteError(f"{url}: the request failed ({type(e).__name__}: {e})") from None
    try:
        out = json.loads(raw)
    except ValueError:  # JSONDecodeError, or UnicodeDecodeError of a body in no UTF encoding
        raise RemoteError(f"{url}: the reply is not JSON: {raw[:200]!r}") from None
    if not isinstance(out, dict):
        raise RemoteError(f"{url}: the reply is not a JSON object: {raw[:200]!r}")
    return out


def hosted_models(url: str, timeout: float = 30.0) -> list[dict]:
    """``GET {url}/v1/models``'s ``data`` (OpenAI's model list; vLLM, SGLang and llama-server
    answer it): one dict per hosted model, ``id`` its name (vLLM: ``--served-model-name``, else the
    model path; llama-server: ``--alias``, else the GGUF path).

    Raises:
        RemoteError: the server cannot be reached, fails, or returns no list of objects.
    """
    out = http_json(url.rstrip("/") + "/v1/models", None, timeout)
    data = out.get("data")
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise RemoteError(f"{url}/v1/models: no 'data' list of objects in {json.dumps(out)[:200]}")
    return data


def generate_one(server, prompt_ids: list[int], max_new_tokens: int, stop_ids, vocab_size: int, *,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[int]:
    """One prompt's reply ids through the engine (:func:`request_for`, :func:`parse_reply`,
    :func:`check_reply`). ``server``: params ``distill.server`` (``api``, ``url``, ``model``,
    ``timeout``); ``vocab_size``: the target's (``len(tokenizer)``); ``temperature`` 0: greedy, > 0:
    sampled (:func:`request_for`). Raises :class:`RemoteError` naming the URL."""
    path, body = request_for(server.api, server.model, prompt_ids, max_new_tokens, stop_ids,
                             temperature=temperature, top_p=top_p, seed=seed)
    url = server.url.rstrip("/") + path
    payload = http_json(url, body, server.timeout)
    try:
        return check_reply(*parse_reply(server.api, payload), stop_ids, max_new_tokens, vocab_size)
    except RemoteError as e:
        raise RemoteError(f"{url}: {e}") from None


def generate_ids(server, prompts_ids: list[list[int]], max_new_tokens: int, stop_ids, vocab_size: int, *,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[list[int]]:
    """Each prompt's reply ids through the engine, ``server.concurrency`` requests in flight
    (:func:`generate_one`; prompt ``k`` sampled with seed ``seed + k``), in input order.

    Raises:
        RemoteError: the first failed request, naming its index, the URL and the cause; the
            requests still queued are cancelled.
    """
    pool = ThreadPoolExecutor(max_workers=server.concurrency)
    futures = [pool.submit(generate_one, server, ids, max_new_tokens, stop_ids, vocab_size,
                           temperature=temperature, top_p=top_p, seed=seed + k) for k, ids in enumerate(prompts_ids)]
    try:
        out = []
        for k, f in enumerate(futures):
            try:
                out.append(f.result())
            except Exception as e:  # every failure of a request becomes one RemoteError
                why = str(e) if isinstance(e, RemoteError) else f"{server.url}: {type(e).__name__}: {e}"
                raise RemoteError(f"prompt {k}: {why}") from e
        return out
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def regenerate_remote(server, tokenizer, stop_ids, items: list[dict], *, max_new_tokens: int,
                          journal: Journal | None = None, progress=None) -> tuple[list[dict], dict]:
    """:func:`eyas.data.distill.regenerate` through an engine: the target's greedy reply to each planned
    prompt, ``server.concurrency`` requests in flight.

    Args:
        server: params ``distill.server``.
        tokenizer: the target's tokenizer (the rows' decoded ``content``, for reading only; its
            ``len`` bounds the ids a reply may hold).
        stop_ids: the target's stop set (:func:`eyas.target.model.stop_token_ids`).
        items: ``{"id", "messages", "prompt_ids"}`` from :func:`eyas.data.distill.plan_prompts`.
        max_new_tokens: reply budget.
        journal: replies of an earlier, killed run are taken from it; each new reply is appended as
            it arrives, so a failure loses none that finished.
        progress: optional callable ``(done, total)``.
    Returns:
        ``(rows, stats)`` as :func:`eyas.data.distill.regenerate` (``batch_size`` replaced by
        ``concurrency``).
    Raises:
        RemoteError: the first failed request (any exception a request raises), naming the
            prompt's conversation id, the URL and the cause; the requests still queued are
            cancelled, never sent (those in flight finish and are journaled).
    """
    gen: dict[int, list[int]] = {}
    for k, it in enumerate(items):
        ids = None if journal is None else journal.get(it["prompt_ids"])
        if ids is not None:
            gen[k] = ids
    resumed = len(gen)
    todo = [k for k in range(len(items)) if k not in gen]
    new_tokens, failure, vocab_size = 0, None, len(tokenizer)
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=server.concurrency)
    try:
        pending = {pool.submit(generate_one, server, items[k]["prompt_ids"], max_new_tokens, stop_ids,
                               vocab_size): k for k in todo}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                k = pending.pop(f)
                try:
                    ids = f.result()
                except Exception as e:  # every failure of a request becomes one RemoteError
                    if failure is None:
                        why = str(e) if isinstance(e, RemoteError) else f"{server.url}: {type(e).__name__}: {e}"
                        failure = RemoteError(f"self-distill prompt {items[k]['id']!r}: {why}")
                        failure.__cause__ = e
                        for other in pending:
                            other.cancel()
                    continue
                gen[k] = ids
                new_tokens += len(ids)
                if journal is not None:
                    journal.add([(items[k]["prompt_ids"], ids)])
                if progress is not None:
                    progress(len(gen), len(items))
            pending = {f: k for f, k in pending.items() if not f.cancelled()}
    finally:  # an exception of our own (the journal's disk) must not send the queue either
        pool.shutdown(wait=True, cancel_futures=True)
    seconds = time.perf_counter() - t0
    if failure is not None:
        raise failure
    rows, stats = build_rows(tokenizer, stop_ids, items, [gen[k] for k in range(len(items))])
    stats.update(resumed=resumed, seconds=round(seconds, 2) if todo else 0.0,
                 tokens_per_second=round(new_tokens / seconds, 1) if todo and seconds > 0 else None,
                 max_new_tokens=max_new_tokens, concurrency=server.concurrency)
    return rows, stats
