"""Online training (``train.mode: online``): the target computes the aux hidden states batch by
batch while the drafter trains; nothing per-token but the token ids reaches the disk.

Why: the feature store costs ``(n_aux + 1) * H * 2`` bytes per token in bf16 (eyas/features.py):
32 KiB for an 8B target, about 56 KiB for a 1T MoE target with H = 7168, so 100K conversations of
2K tokens are ~12 TB. SpecForge (``sgl-project/SpecForge``: its online mode runs the target beside
the drafter) and speculators (``vllm-project/speculators``: online, offline or hybrid data) train
online for this reason.

The DAG is the offline one. With ``train.mode: online``, ``extract`` writes a *token store*: the
same shards and manifest with ``input_ids``, ``loss_mask`` and ``offsets`` only (manifest
``"contents": "tokens"``, 5 bytes per token), so ``build-vocab`` counts tokens as before and DVC
still sees the target and its params through ``extract`` (its manifest records the target's
identity, the params and the storage dtype: a change reruns the train stages). The train stages
get their batches from :class:`OnlineLoader` instead of :class:`eyas.training.batches.PackedLoader`:

- the same plan (PackedLoader's packing, order and seed, inherited), so batch ``i`` of epoch ``e``
  holds the same samples in the same rows as offline, and resuming at (epoch, batch) after a
  ``kill -9`` is exact: each batch's hidden states depend on its own samples only;
- for each batch, a *capture* computes its samples' aux hidden states, final hidden state and the
  target's argmax (:class:`TargetCapture`: the target in this process), rounded to the storage
  dtype the manifest names (bf16 as extract stores them; fp8: quantised and dequantised as
  :func:`eyas.features.quantize_fp8` / ``read_tensors`` do), then packs them with
  :func:`eyas.training.batches.pack`. The drafter therefore sees the features an offline run would read, up to
  the target's own run-to-run numerics (its batches are grouped differently).

Where the target runs: in the training process. The stages load it on the training device (a
rank's GPU under torchrun, so DDP/FSDP ranks each run their own target copy on their own
batches); :class:`TargetCapture` takes any loaded target, so a caller may place it on another GPU
of the host. The capture of batch i+1 is launched before the drafter's step on batch i
(:class:`OnlineLoader`, ``ahead``): CUDA runs it asynchronously, so with the target on another GPU
the two can overlap (dev/bench/bench_online.py measures both placements). In-process was chosen
because it needs no server, no transport and no second launcher, keeps a single seed and data
position for resume, and an 8B target (16 GB bf16) fits beside a drafter on one H200.
A separate capture process (SpecForge's layout, needed when the target spans many GPUs, as a 1T
MoE does: docs/scale.md) slots in as another *capture*: any callable taking a list of samples
(``{"input_ids": [T], "loss_mask": [T]}``) and returning their features in the same order
(:class:`Capture`), e.g. a client of a capture server that keeps the batch order.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator, Protocol

import torch

from eyas.features import FEATURES, FP8, TOKENS, FeatureError, FeatureStore, dequantize_fp8, quantize_fp8
from eyas.training.batches import PackedLoader, pack

TOKEN_KEYS = ("input_ids", "loss_mask")


class Capture(Protocol):
    """The source of hidden states for :class:`OnlineLoader`: in this process
    (:class:`TargetCapture`) or a client of a separate capture process."""

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """``samples[i]``: ``input_ids`` [T_i] int, ``loss_mask`` [T_i] -> per sample, in order,
        ``aux_hidden`` [T_i, n_aux*H] and ``final_hidden`` [T_i, H] (the storage dtype),
        ``target_argmax`` [T_i] int64; on any one device."""
        ...


def round_to_storage(aux: torch.Tensor, final: torch.Tensor, n_aux: int, storage_dtype: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states as an offline run reads them back from a feature store.

    Args:
        aux: [N, n_aux*H], final: [N, H], float (the target's dtype, any device).
        storage_dtype: the manifest's ``storage_dtype`` (``extract.dtype``): ``bfloat16``,
            ``float16``, ``float32`` (a cast) or ``float8_e4m3fn`` (aux quantised per token and
            layer and dequantised to bfloat16, final in bfloat16: eyas/features.py).
    Returns:
        (aux, final) in the dtype the feature store's reader returns.
    Raises:
        FeatureError: an unknown storage dtype.
    """
    dtype = getattr(torch, storage_dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise FeatureError(f"token store: unknown storage_dtype {storage_dtype!r}")
    if dtype == FP8:
        q, scale = quantize_fp8(aux, n_aux)
        return dequantize_fp8(q, scale), final.to(torch.bfloat16)
    return aux.to(dtype), final.to(dtype)


class TargetCapture:
    """:class:`Capture` by the target in this process (eyas/target/model.py ``Target.capture``).

    A batch's samples are sorted by length (longest first) and run in micro-batches of at most
    ``max_tokens`` padded tokens (at least one sample each), so padding stays small and the
    target's activations stay bounded by a training batch's size.
    """

    def __init__(self, target, aux_layers: list[int], storage_dtype: str, max_tokens: int, ahead: int = 1):
        """Args:
            target: a loaded :class:`eyas.target.model.Target` (on the device it should run on).
            aux_layers: HF ``hidden_states`` indices (the manifest's ``aux_layers``).
            storage_dtype: the manifest's ``storage_dtype`` (:func:`round_to_storage`).
            max_tokens: padded tokens per target forward (``train.batch_tokens`` in the stages).
            ahead: batches :class:`OnlineLoader` captures before the one it hands out (0: on
                demand); results do not depend on it.
        """
        self.target, self.aux_layers, self.storage_dtype = target, list(aux_layers), storage_dtype
        self.max_tokens, self.ahead = max_tokens, ahead

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """Hidden states of ``samples`` (each ``input_ids``: int64 ``[T_i]``, ``T_i >= 1``) as the
        store would hold them. Raises FeatureError for a sample with no tokens (its batch position)."""
        empty = [i for i, s in enumerate(samples) if len(s["input_ids"]) < 1]
        if empty:
            raise FeatureError(f"online capture: sample(s) at batch position(s) {empty} have no tokens "
                               f"(a zero-length sample has no hidden states to capture)")
        dev = self.target.device
        order = sorted(range(len(samples)), key=lambda i: -len(samples[i]["input_ids"]))
        out: list = [None] * len(samples)
        i = 0
        while i < len(order):
            T = len(samples[order[i]]["input_ids"])
            chunk = order[i: i + max(1, self.max_tokens // T)]
            i += len(chunk)
            ids = torch.zeros(len(chunk), T, dtype=torch.int64)
            att = torch.zeros(len(chunk), T, dtype=torch.int64)
            for j, s in enumerate(chunk):
                n = len(samples[s]["input_ids"])
                ids[j, :n] = samples[s]["input_ids"]
                att[j, :n] = 1
            cap = self.target.capture(ids.to(dev), att.to(dev), self.aux_layers)
            B, _, D = cap["aux_hidden"].shape
            aux, final = round_to_storage(cap["aux_hidden"].reshape(B * T, D),
                                          cap["final_hidden"].reshape(B * T, -1),
                                          len(self.aux_layers), self.storage_dtype)
            aux, final = aux.view(B, T, D), final.view(B, T, -1)
            for j, s in enumerate(chunk):
                n = len(samples[s]["input_ids"])
                out[s] = {"aux_hidden": aux[j, :n], "final_hidden": final[j, :n],
                          "target_argmax": cap["target_argmax"][j, :n]}
        return out


class OnlineLoader(PackedLoader):
    """:class:`eyas.training.batches.PackedLoader` over a token store, with each batch's hidden states from a
    :class:`Capture` (module docstring). Same ``plan``, ``num_batches``, ``row_tokens`` and
    ``rows_per_batch``; :meth:`batches` yields the same :class:`eyas.training.batches.Batch` fields (hidden
    states on the capture's device, tokens on the CPU; ``Batch.to`` moves them).

    Lookahead (``ahead`` batches): the capture of batch i+1 is launched before batch i is handed
    to the trainer. On CUDA the target's kernels run asynchronously, so with the target on another
    GPU they run while the drafter trains on batch i (PyTorch orders the cross-device copy in
    ``Batch.to`` after them); on the drafter's GPU they queue ahead of its step, and the host-side
    launch work overlaps the GPU's. One thread launches everything: no second thread can disturb
    the training step's CUDA graph capture (eyas.training.loop.GraphedTTT).
    """

    # no background thread (eyas.training.batches.prefetch): the capture runs the target, and GPU work
    # from a second thread could land in the training step's graph capture; ``ahead`` overlaps it instead
    prefetch_depth = 0

    def __init__(self, store: FeatureStore, batch_tokens: int, seed: int, shuffle: bool = True, *,
                 capture: Capture, ahead: int | None = None):
        """Args:
            store: a token store (``contents`` :data:`eyas.features.TOKENS`).
            capture: computes the hidden states of a batch's samples.
            ahead: batches captured before the one handed out (0: on demand); default the
                capture's ``ahead`` attribute, else 1.
        Raises:
            FeatureError: ``store`` holds hidden states already (use PackedLoader).
        """
        if store.contents != TOKENS:
            raise FeatureError(f"{store.root}: holds {store.contents}, not a token store; OnlineLoader "
                               f"computes hidden states for token stores only (train.mode: online)")
        super().__init__(store, batch_tokens, seed, shuffle)
        self.capture = capture
        self.ahead = getattr(capture, "ahead", 1) if ahead is None else ahead

    def batches(self, epoch: int, start: int = 0, rank: int = 0, world: int = 1,
                even: bool = True) -> Iterator:
        """As :meth:`eyas.training.batches.PackedLoader.batches`: the batches of ``epoch`` from index ``start``
        (this rank's share when ``world`` > 1), their hidden states captured on the fly."""
        loaded: dict[int, dict] = {}
        pending: deque = deque()
        for plan_rows in self.rank_plans(epoch, rank, world, even)[start:]:
            samples = [self.sample(loaded, si, i, TOKEN_KEYS) for refs in plan_rows for si, i in refs]
            pending.append((plan_rows, samples, self.capture(samples)))
            if len(pending) > self.ahead:
                yield _packed(*pending.popleft())
        while pending:
            yield _packed(*pending.popleft())


def _packed(plan_rows: list, samples: list[dict], feats: list[dict]):
    """:func:`eyas.training.batches.pack` of one batch: its token samples joined with their captured features."""
    it = iter(s | f for s, f in zip(samples, feats, strict=True))
    rows = [[next(it) for _ in refs] for refs in plan_rows]
    return pack(rows, [r for refs in plan_rows for r in refs])


def loader_for(store: FeatureStore, batch_tokens: int, seed: int, shuffle: bool = True,
               capture: Capture | None = None) -> PackedLoader:
    """The loader a training stage reads ``store`` with: :class:`eyas.training.batches.PackedLoader` for a
    feature store, :class:`OnlineLoader` with ``capture`` for a token store.

    Raises:
        FeatureError: a token store without a capture, or a capture for a feature store (naming
            the store and what to do).
    """
    if store.contents == TOKENS:
        if capture is None:
            raise FeatureError(f"{store.root}: a token store (extract ran with train.mode: online) has no "
                               f"hidden states; train it online (eyas.training.online.capture_for) or rerun "
                               f"`dvc repro extract` with train.mode: offline")
        return OnlineLoader(store, batch_tokens, seed, shuffle, capture=capture)
    if capture is not None:
        raise FeatureError(f"{store.root}: holds stored hidden states (train.mode: offline) but a capture was "
                           f"given; rerun `dvc repro extract` with train.mode: online to train online")
    return PackedLoader(store, batch_tokens, seed, shuffle)


def capture_for(p, store: FeatureStore, device=None) -> TargetCapture | None:
    """What a train stage needs to read ``store``: None for a feature store; for a token store the
    target (params ``target``) loaded on this rank's device, checked against the target the store
    was made for, as a :class:`TargetCapture` with the store's aux layers and storage dtype.

    Raises:
        FeatureError: ``train.mode`` disagrees with what ``store`` holds; params ``target`` names
            another path, GGUF file or revision than the store's (checked before the target
            loads); or the target loaded now differs from the store's (file hash, shapes): rerun
            extract.
    """
    want = TOKENS if p.train.mode == "online" else FEATURES
    if store.contents != want:
        raise FeatureError(f"{store.root}: holds {store.contents} but train.mode is {p.train.mode}: rerun "
                           f"`dvc repro extract` (train.mode decides what extract stores)")
    if want == FEATURES:
        return None
    from eyas.target.model import declared_identity, load_target, pick_device
    from eyas.training.distributed import init_distributed

    t = p.target
    made_for = store.manifest.get("target", {})
    declared = declared_identity(t.path, t.gguf_file, t.revision)
    for k, v in declared.items():  # what params fix: refuse before the weights load
        if made_for.get(k) != v:
            raise FeatureError(f"{store.root / 'manifest.json'}: the token store was made for target {k} = "
                               f"{made_for.get(k)!r}, params target.{k} gives {v!r}: rerun `dvc repro extract` "
                               f"(or set target back)")
    _, _, dev = init_distributed(device or pick_device())
    target = load_target(t.path, t.gguf_file, t.dtype, t.trust_remote_code, device=dev, revision=t.revision)
    for k in ("file_sha256", "num_layers", "hidden_size", "vocab_size"):  # what only the loaded target tells
        if made_for.get(k) != target.identity.get(k):
            raise FeatureError(f"{store.root / 'manifest.json'}: the token store was made for target {k} = "
                               f"{made_for.get(k)!r}, the target loaded now has {target.identity.get(k)!r}: "
                               f"rerun `dvc repro extract`")
    # ahead=0: with the target on the drafter's own GPU, capturing on demand measured faster than one
    # batch ahead (dev/results/online_h200.json).
    return TargetCapture(target, store.manifest["aux_layers"], store.manifest["storage_dtype"],
                         p.train.batch_tokens, ahead=0)
