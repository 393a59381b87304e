"""The EAGLE-3 drafter: one Llama decoder layer over [embedding ; fused target features].

Architecture and tensor names follow the checkpoint SGLang and vLLM load as
``LlamaForCausalLMEagle3`` (eagle3-facts.md §1.1-1.3; SpecForge
``modeling/draft/llama3_eagle.py``; SGLang ``models/llama_eagle3.py``):

- ``fc``: Linear(n_aux * target_hidden -> H), applied to the concatenated aux hidden states of the
  target (first draft step only; later steps feed back the drafter's own H-wide hidden state).
- ``midlayer``: a decoder layer whose attention input is ``cat([input_layernorm(embed),
  hidden_norm(h)])`` (2H wide, embedding FIRST) and whose residual is the un-normed ``h``.
- ``norm`` then ``lm_head`` [draft_vocab, H] give draft logits; the PRE-norm layer output is the
  hidden state fed back to the next draft step (as SGLang does).
- ``d2t`` [draft_vocab] int64 offsets (target = draft + d2t[draft]) and ``t2d`` [vocab] bool.
- The token embedding is the target's, frozen, and not saved (SGLang always swaps in the
  target's; vLLM shares it when the checkpoint has none).

Two attention modes share the weights: :meth:`Eagle3Drafter.ttt_step` (training-time test,
packed sequences, causal over the target-fed step plus a diagonal over earlier draft steps) and
:meth:`Eagle3Drafter.decode` (incremental decoding with a KV cache, for speculative decoding).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from eyas import layers as layer_ids


@dataclass
class DrafterConfig:
    """Shapes of an EAGLE-3 drafter. ``vocab_size`` is the TARGET vocab; ``aux_layer_ids`` are HF
    ``output_hidden_states`` indices (see eyas/layers.py), ``None`` meaning the EAGLE-3 default."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    num_target_layers: int
    aux_layer_ids: list[int] | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    torch_dtype: str = "float32"
    extra: dict = field(default_factory=dict)

    @property
    def num_aux(self) -> int:
        return len(self.resolved_aux_layers())

    def resolved_aux_layers(self) -> list[int]:
        """HF hidden_states indices the drafter's ``fc`` expects, in concatenation order."""
        return layer_ids.resolve(self.aux_layer_ids, self.num_target_layers)

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int, aux_layer_ids=None) -> "DrafterConfig":
        """A drafter shaped like one layer of ``target_config`` (a transformers PretrainedConfig,
        or a namespace of the feature manifest's ``target_config``)."""
        tc = target_config
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") or getattr(tc, "rope_theta", None) or 10000.0
        return cls(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", tc.num_attention_heads),
            head_dim=head_dim,
            vocab_size=tc.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=tc.hidden_size,
            num_target_layers=tc.num_hidden_layers,
            aux_layer_ids=layer_ids.normalise(aux_layer_ids, tc.num_hidden_layers),
            rms_norm_eps=float(tc.rms_norm_eps),
            rope_theta=float(theta),
            max_position_embeddings=int(tc.max_position_embeddings),
        )

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple:
    """cos/sin for integer ``positions`` (any shape) -> two tensors [*positions.shape, head_dim]
    (HF Llama / neox "rotate half" layout, which SGLang and vLLM use for Llama)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [B, T, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, 2H] -> q [B, nh, T, hd], k/v [B, nkv, T, hd], RoPE applied at ``positions``."""
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        rep = self.c.num_attention_heads // self.c.num_key_value_heads
        return t.repeat_interleave(rep, dim=1) if rep > 1 else t

    def out(self, o: torch.Tensor) -> torch.Tensor:
        B, nh, T, hd = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, nh * hd))


class Mlp(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Mlp(c)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # embedding FIRST, then the normed hidden state (EAGLE, SpecForge, SGLang, vLLM agree)
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = hidden + attn_out  # the residual is the UN-normed hidden state
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter. ``embed_tokens`` must be set from the target with :meth:`set_embedding`
    before use; it is frozen and excluded from :meth:`state_dict_for_export`."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(c.num_aux * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in (self.fc, self.lm_head, self.midlayer.mlp.gate_proj, self.midlayer.mlp.up_proj,
                  self.midlayer.mlp.down_proj, self.midlayer.self_attn.q_proj,
                  self.midlayer.self_attn.k_proj, self.midlayer.self_attn.v_proj,
                  self.midlayer.self_attn.o_proj):
            nn.init.normal_(m.weight, std=std)

    def set_embedding(self, weight: torch.Tensor) -> None:
        """Install the target's input embedding [vocab, H] (frozen)."""
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"target embedding has shape {tuple(weight.shape)}, the drafter needs "
                             f"[{self.config.vocab_size}, {self.config.hidden_size}]")
        self.embed_tokens.weight.data = weight.detach().to(self.embed_tokens.weight.dtype).clone()

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids (SGLang: hot_token_id = d2t + arange; target = draft + d2t[draft])."""
        return draft_ids + self.d2t[draft_ids]

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """aux_hidden [B, T, n_aux * target_hidden] -> [B, T, H] through ``fc``."""
        return self.fc(aux_hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [..., H] -> draft logits [..., draft_vocab] (``lm_head(norm(h))``)."""
        return self.lm_head(self.norm(hidden))

    # --- training-time test -------------------------------------------------------------
    def ttt_step(self, hidden, input_ids, positions, doc_ids, cache: list) -> torch.Tensor:
        """One TTT step over packed sequences.

        Args:
            hidden: [B, T, H] float: fc(aux) at step 0, the previous step's output afterwards.
            input_ids: [B, T] int64 target ids whose embeddings enter this step.
            positions: [B, T] int64 RoPE positions (already advanced by the step index).
            doc_ids: [B, T] int64 document of each packed token; attention never crosses them.
            cache: list of (k, v) from earlier steps of this TTT unroll; appended to in place.
        Returns:
            [B, T, H] pre-norm hidden state. Query t attends causally (same document) to step-0
            keys and, from steps 1..k, only to the keys at its own index t: the keys a chain draft
            would have at serving time.
        """
        attn = self.midlayer.self_attn
        if use_flex_attention(hidden):
            # CUDA: the elementwise work around the GEMMs (norms, RoPE, SiLU*up, residuals) runs
            # through two torch.compile'd graphs shared by every TTT step; the block mask's step-0
            # part is built once per batch (ttt_block_mask_cached)
            q, k, v = _layer_fn("pre")(self.midlayer, self.embed_tokens(input_ids), hidden, positions)
            cache.append((k, v))
            o = flex_ttt_attention(q, cache, doc_ids)
            return _layer_fn("post")(self.midlayer, hidden, o)
        x = self.midlayer.attn_input(self.embed_tokens(input_ids), hidden)
        q, k, v = attn.qkv(x, positions)
        cache.append((k, v))
        k0, v0 = attn._expand_kv(cache[0][0]), attn._expand_kv(cache[0][1])
        scale = 1.0 / math.sqrt(self.config.head_dim)
        T = q.shape[2]
        s0 = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [B, nh, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        allowed = causal[None] & (doc_ids[:, :, None] == doc_ids[:, None, :])
        s0 = s0.masked_fill(~allowed[:, None], float("-inf"))
        diag = [(q * attn._expand_kv(kj)).sum(-1, keepdim=True) * scale for kj, _ in cache[1:]]
        scores = torch.cat([s0, *diag], dim=-1).float().softmax(-1).to(q.dtype)
        o = torch.matmul(scores[..., :T], v0)
        for j, (_, vj) in enumerate(cache[1:]):
            o = o + scores[..., T + j : T + j + 1] * attn._expand_kv(vj)
        return self.midlayer.finish(hidden, attn.out(o))

    # --- incremental decoding -----------------------------------------------------------
    def decode(self, hidden, input_ids, positions, kv: "KVCache") -> torch.Tensor:
        """Causal decoding over a KV cache (speculative decoding).

        Args:
            hidden: [1, n, n_aux*target_hidden] target features (passed through ``fc``) or
                [1, n, H] the drafter's own previous output (``fc`` skipped, as in SGLang).
            input_ids: [1, n] int64; positions: [1, n] int64 absolute positions.
            kv: the drafter's cache; the new keys/values are appended.
        Returns: [1, n, H] pre-norm hidden states.
        """
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        attn = self.midlayer.self_attn
        x = self.midlayer.attn_input(self.embed_tokens(input_ids), hidden)
        q, k, v = attn.qkv(x, positions)
        k, v = kv.append(k, v)
        n, total = q.shape[2], k.shape[2]
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
        o = F.scaled_dot_product_attention(q, attn._expand_kv(k), attn._expand_kv(v), attn_mask=mask)
        return self.midlayer.finish(hidden, attn.out(o))

    def state_dict_for_export(self) -> dict[str, torch.Tensor]:
        """The tensors of the served checkpoint: everything but the (target's) embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens")}


# --- TTT attention on CUDA: one block-sparse flex_attention call per step ----------------------
# Keys of step k are [step-0 keys | step-1 keys | ... | step-k keys] (each T long); query t may see
# step-0 key j when j <= t in the same document, and key t of every later step (the diagonal).
# The block mask skips every all-masked 128x128 tile, so the cost is the causal part plus one
# tile per diagonal block: no [T, T] score matrix and no Python loop over diagonal keys.
# The CPU path above is the reference (and what the tests check); EYAS_ATTN=dense forces it.

_flex_fn = None
_flex_broken = False


def use_flex_attention(q: torch.Tensor) -> bool:
    import os

    if _flex_broken or q.device.type != "cuda" or os.environ.get("EYAS_ATTN", "flex") != "flex":
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _layer_pre(layer: "MidLayer", embeds, hidden, positions):
    return layer.self_attn.qkv(layer.attn_input(embeds, hidden), positions)


def _layer_post(layer: "MidLayer", hidden, o):
    return layer.finish(hidden, layer.self_attn.out(o))


_layer_fns: dict = {}


def _layer_fn(name: str):
    """``_layer_pre``/``_layer_post``, through torch.compile unless EYAS_COMPILE=0 or
    EYAS_COMPILE_LAYER=0 (shapes are fixed per batch shape: dynamic=False)."""
    import os

    fn = _layer_pre if name == "pre" else _layer_post
    if os.environ.get("EYAS_COMPILE", "1") == "0" or os.environ.get("EYAS_COMPILE_LAYER", "1") == "0":
        return fn
    if name not in _layer_fns:
        _layer_fns[name] = torch.compile(fn, dynamic=False)
    return _layer_fns[name]


_mask_memo: tuple | None = None  # (weakref to doc_ids, its _version, step-0 BlockMask)


def ttt_block_mask_cached(doc_ids: torch.Tensor, num_steps: int):
    """:func:`ttt_block_mask`, with the step-0 (causal, same-document) part built once per
    ``doc_ids`` tensor and the diagonal blocks of steps 1..n-1 appended as block indices (no
    mask evaluation over the n*T keys). Falls back to a full build when T is not a multiple of
    the block size."""
    global _mask_memo
    import weakref

    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE as BS, BlockMask

    B, T = doc_ids.shape
    if T % BS != 0:
        return ttt_block_mask(doc_ids, num_steps)
    m = _mask_memo
    if m is not None and m[0]() is doc_ids and m[1] == doc_ids._version:
        base = m[2]
    else:
        base = ttt_block_mask(doc_ids, 1)
        _mask_memo = (weakref.ref(doc_ids), doc_ids._version, base)
    n = num_steps
    if n == 1:
        return base
    nb = T // BS
    num, idx = base.kv_num_blocks, base.kv_indices  # [B, 1, nb], [B, 1, nb, nb]
    rows = torch.arange(nb, device=idx.device, dtype=idx.dtype)
    diag = (rows[:, None] + nb * torch.arange(1, n, device=idx.device, dtype=idx.dtype)[None, :])
    diag = diag.expand(*idx.shape[:2], nb, n - 1)
    pad = idx.new_zeros(*idx.shape[:3], n * nb - nb - (n - 1))
    # valid entries first: the n-1 diagonal blocks, then the step-0 partial blocks
    new_idx = torch.cat([diag, idx, pad], dim=-1)
    full_num = full_idx = None
    if base.full_kv_num_blocks is not None:
        full_num = base.full_kv_num_blocks
        full_idx = torch.cat([base.full_kv_indices, base.full_kv_indices.new_zeros(*idx.shape[:3], n * nb - nb)], -1)
    return BlockMask.from_kv_blocks(num + (n - 1), new_idx, full_num, full_idx, BLOCK_SIZE=base.BLOCK_SIZE,
                                    mask_mod=base.mask_mod, seq_lengths=(T, n * T))


def ttt_block_mask(doc_ids: torch.Tensor, num_steps: int):
    """The flex_attention BlockMask of a TTT step with ``num_steps`` key sets of length T."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = doc_ids.shape

    def mask_mod(b, h, q_idx, kv_idx):
        j = kv_idx % T
        first = kv_idx < T
        causal = (j <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, j])
        return (first & causal) | (~first & (j == q_idx))

    return create_block_mask(mask_mod, B, None, T, num_steps * T, device=doc_ids.device, _compile=True)


def flex_ttt_attention(q: torch.Tensor, cache: list, doc_ids: torch.Tensor) -> torch.Tensor:
    """TTT attention of q [B, nh, T, hd] over the cached (k, v) of steps 0..k: [B, nh, T, hd]."""
    global _flex_fn
    from torch.nn.attention.flex_attention import flex_attention

    if _flex_fn is None:
        _flex_fn = torch.compile(flex_attention)
    n = len(cache)
    k = cache[0][0] if n == 1 else torch.cat([kv[0] for kv in cache], dim=2)
    v = cache[0][1] if n == 1 else torch.cat([kv[1] for kv in cache], dim=2)
    v = v.to(q.dtype)
    k = k.to(q.dtype)
    return _flex_fn(q, k, v, block_mask=ttt_block_mask_cached(doc_ids, n),
                    enable_gqa=q.shape[1] != k.shape[1])


class KVCache:
    """A growable key/value cache for :meth:`Eagle3Drafter.decode`; ``crop(n)`` rolls back."""

    def __init__(self):
        self.k = None
        self.v = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, n: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]
