"""The EAGLE-3 drafter: one Llama decoder layer over [embedding ; fused target features].

Architecture and tensor names follow the checkpoint SGLang and vLLM load as
``LlamaForCausalLMEagle3`` (``sgl-project/SpecForge: specforge/modeling/draft/llama3_eagle.py``;
``sgl-project/sglang: python/sglang/srt/models/llama_eagle3.py``; ``vllm-project/vllm:
vllm/model_executor/models/llama_eagle3.py``):

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
TTT attention itself (dense reference, flex attention on CUDA) is eyas/drafter/attention.py; which kernels
run is the caller's :class:`eyas.drafter.backend.Backend`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from eyas.drafter.attention import dense_ttt_attention, expand_kv, flex_ttt_attention
from eyas.drafter.backend import REFERENCE, Backend
from eyas.drafter.compiling import compiled
from eyas.target import hf_config, rope
from eyas.target import layers as layer_ids


@dataclass
class DrafterConfig:
    """Shapes of an EAGLE-3 drafter. ``vocab_size`` is the TARGET vocab; ``aux_layer_ids`` are HF
    ``output_hidden_states`` indices (see eyas/target/layers.py), ``None`` meaning the EAGLE-3 default."""

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
    # RoPE scaling in eyas/target/rope.py's normal form (None = plain RoPE; e.g. Llama-3.1's
    # {"rope_type": "llama3", "factor": 8.0, ...}); honoured by rope_cos_sin
    rope_scaling: dict | None = None

    @property
    def num_aux(self) -> int:
        return len(self.resolved_aux_layers())

    def resolved_aux_layers(self) -> list[int]:
        """HF hidden_states indices the drafter's ``fc`` expects, in concatenation order."""
        return layer_ids.resolve(self.aux_layer_ids, self.num_target_layers)

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int, aux_layer_ids=None) -> "DrafterConfig":
        """A drafter shaped like one layer of ``target_config`` (a transformers PretrainedConfig,
        or a namespace of the feature manifest's ``target_config``).

        Raises:
            eyas.target.model.TargetError: the target config has no ``rms_norm_eps`` (a LayerNorm target
                such as Cohere), naming the key it has.
            eyas.target.rope.RopeError: a RoPE scaling eyas does not implement."""
        from eyas.target.model import rms_norm_eps

        tc = target_config
        theta, scaling = rope.normalise(tc, source="target config")
        return cls(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=hf_config.num_key_value_heads(tc),
            head_dim=hf_config.head_dim(tc),
            vocab_size=tc.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=tc.hidden_size,
            num_target_layers=tc.num_hidden_layers,
            aux_layer_ids=layer_ids.normalise(aux_layer_ids, tc.num_hidden_layers),
            rms_norm_eps=rms_norm_eps(tc),
            rope_theta=float(theta),
            max_position_embeddings=int(tc.max_position_embeddings),
            rope_scaling=scaling,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, scaled by ``weight`` after casting back to x's dtype
    (HF Llama's order): x [..., D], weight [D] -> [..., D]."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype,
                 scaling: dict | None = None) -> tuple:
    """cos/sin for integer ``positions`` (any shape) -> two tensors [*positions.shape, head_dim]
    (HF Llama / neox "rotate half" layout, which SGLang and vLLM use for Llama). ``scaling``: the
    RoPE scaling in eyas/target/rope.py's normal form (``default``, ``linear``, ``llama3``; all three
    have attention factor 1, so cos/sin are not rescaled).

    Raises:
        eyas.target.rope.RopeError: an unsupported ``rope_type``."""
    inv_freq = rope.inv_freq(head_dim, theta, scaling, device=positions.device)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [B, T, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    """The attention projections (parameters only; the math is :func:`layer_pre`/:func:`layer_post`)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class Mlp(nn.Module):
    """The SwiGLU projections (parameters only; the math is :func:`layer_post`)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class LayerWeights(NamedTuple):
    """The decoder layer's weights as one forward pass uses them (:meth:`MidLayer.weights`):
    q/k/v stacked into one matrix and gate/up into another (one GEMM each instead of three and
    two), the matrices optionally cast once. Norm weights stay in their own dtype.

    A snapshot for one forward pass (a TTT unroll, one sequence's decode calls): ``qkv`` and
    ``gate_up`` are copies, so rebuild it after the parameters change (optimizer step,
    ``load_state_dict``), and build it under the grad mode it is used in."""

    input_norm: torch.Tensor   # [H]
    hidden_norm: torch.Tensor  # [H]
    qkv: torch.Tensor          # [(nh + 2 * nkv) * hd, 2H]: q rows, then k, then v
    o: torch.Tensor            # [H, nh * hd]
    post_norm: torch.Tensor    # [H]
    gate_up: torch.Tensor      # [2I, H]: gate rows, then up
    down: torch.Tensor         # [H, I]


class MidLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Mlp(c)

    def weights(self, dtype: torch.dtype | None = None) -> LayerWeights:
        """The weights of one forward pass (differentiable: gradients reach the parameters).

        ``dtype`` (e.g. bf16 under autocast) casts the matrices ONCE for a whole TTT unroll:
        autocast inside a torch.compile'd region would cast every weight at each of the unroll's
        steps. As with eager autocast's cast cache, each step's weight gradients are then summed
        in ``dtype`` before the one cast back to the parameter's dtype."""
        a, m = self.self_attn, self.mlp

        def w(lin: nn.Linear) -> torch.Tensor:
            return lin.weight if dtype is None else lin.weight.to(dtype)

        return LayerWeights(self.input_layernorm.weight, self.hidden_norm.weight,
                            torch.cat([w(a.q_proj), w(a.k_proj), w(a.v_proj)]), w(a.o_proj),
                            self.post_attention_layernorm.weight, torch.cat([w(m.gate_proj), w(m.up_proj)]),
                            w(m.down_proj))


def layer_pre(w: LayerWeights, c: DrafterConfig, embeds: torch.Tensor, hidden: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder layer up to attention: embeds/hidden [B, T, H] -> q [B, nh, T, hd] and
    k, v [B, nkv, T, hd], RoPE applied with ``cos``/``sin`` [B, T, hd] float32
    (:func:`rope_cos_sin` of the positions; made outside so that a compiled graph does not
    re-evaluate pow/cos/sin for every element of every head, forward and backward). The attention
    input is ``cat([input_layernorm(embeds), hidden_norm(hidden)])``: embedding FIRST (EAGLE,
    SpecForge, SGLang and vLLM agree)."""
    B, T, _ = hidden.shape
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    x = torch.cat([rms_norm(embeds, w.input_norm, c.rms_norm_eps), rms_norm(hidden, w.hidden_norm, c.rms_norm_eps)],
                  dim=-1)
    q, k, v = F.linear(x, w.qkv).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q = q.reshape(B, T, nh, hd).transpose(1, 2)
    k = k.reshape(B, T, nkv, hd).transpose(1, 2)
    v = v.reshape(B, T, nkv, hd).transpose(1, 2)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating, ``silu(gate) * up``, of the gate_up GEMM's output ``gate_up`` [..., 2I]
    (gate in the first I columns, up in the last I: :class:`LayerWeights`) -> [..., I]. The torch
    definition; :func:`eyas.drafter.kernels.swiglu` is its CUDA kernel."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def layer_post(w: LayerWeights, c: DrafterConfig, hidden: torch.Tensor, o: torch.Tensor,
               gating=swiglu) -> torch.Tensor:
    """The decoder layer after attention: o [B, nh, T, hd] -> output [B, T, H]. The residual is
    the UN-normed ``hidden`` [B, T, H]; the MLP is SwiGLU ``down(silu(gate(x)) * up(x))``, its
    gating computed by ``gating`` (:func:`swiglu` or its kernel)."""
    B, nh, T, hd = o.shape
    h = hidden + F.linear(o.transpose(1, 2).reshape(B, T, nh * hd), w.o)
    return h + F.linear(gating(F.linear(rms_norm(h, w.post_norm, c.rms_norm_eps), w.gate_up)), w.down)


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

    def logits(self, hidden: torch.Tensor, head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Pre-norm hidden [..., H] -> draft logits [..., draft_vocab] (``lm_head(norm(h))``);
        ``head_weight``: the lm_head weight [draft_vocab, H] already cast (TTT casts it once)."""
        return F.linear(self.norm(hidden), self.lm_head.weight if head_weight is None else head_weight)

    # --- training-time test -------------------------------------------------------------
    def ttt_step(self, hidden, input_ids, positions, doc_ids, cache: list,
                 weights: LayerWeights | None = None, backend: Backend = REFERENCE) -> torch.Tensor:
        """One TTT step over packed sequences.

        Args:
            hidden: [B, T, H] float: fc(aux) at step 0, the previous step's output afterwards.
            input_ids: [B, T] int64 target ids whose embeddings enter this step.
            positions: [B, T] int64 RoPE positions (already advanced by the step index).
            doc_ids: [B, T] int64 document of each packed token; attention never crosses them.
            cache: list of (k, v) from earlier steps of this TTT unroll; appended to in place.
            weights: ``self.midlayer.weights(...)``, built once per unroll by the caller; ``None``
                builds them here.
            backend: the kernels (eyas/drafter/backend.py): on CUDA, flex attention and compiled layer
                halves (eyas/drafter/attention.py) or the dense reference, which CPU always runs.
        Returns:
            [B, T, H] pre-norm hidden state. Query t attends causally (same document) to step-0
            keys and, from steps 1..k, only to the keys at its own index t: the keys a chain draft
            would have at serving time.
        """
        c = self.config
        w = self.midlayer.weights() if weights is None else weights
        embeds = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, torch.float32, c.rope_scaling)
        if backend.flex_attention(hidden, c.head_dim):
            # CUDA: the layer around attention (norms, GEMMs, RoPE, SiLU*up, residuals) runs
            # through two torch.compile'd graphs shared by every TTT step, the SwiGLU gating as
            # a Triton kernel inside the second when the backend has them; attention is
            # flex_ttt_attention (its block mask is built once per batch)
            q, k, v = compiled(backend, "pre", layer_pre)(w, c, embeds, hidden, cos, sin)
            cache.append((k, v))
            o = flex_ttt_attention(q, cache, doc_ids, backend)
            if backend.triton_kernels(hidden):
                from eyas.drafter.kernels import swiglu as gating
            else:
                gating = swiglu
            return compiled(backend, "post", layer_post)(w, c, hidden, o, gating)
        q, k, v = layer_pre(w, c, embeds, hidden, cos, sin)
        cache.append((k, v))
        return layer_post(w, c, hidden, dense_ttt_attention(q, cache, doc_ids))

    # --- incremental decoding -----------------------------------------------------------
    def decode(self, hidden, input_ids, positions, kv: "KVCache",
               weights: LayerWeights | None = None) -> torch.Tensor:
        """Causal decoding over a KV cache (speculative decoding).

        Args:
            hidden: [1, n, n_aux*target_hidden] target features (passed through ``fc``) or
                [1, n, H] the drafter's own previous output (``fc`` skipped, as in SGLang).
            input_ids: [1, n] int64; positions: [1, n] int64 absolute positions.
            kv: the drafter's cache; the new keys/values are appended.
            weights: ``self.midlayer.weights()``, reused across calls while the weights do not
                change; ``None`` builds them here.
        Returns: [1, n, H] pre-norm hidden states.
        """
        c = self.config
        if hidden.shape[-1] != c.hidden_size:
            hidden = self.fc(hidden)
        w = self.midlayer.weights() if weights is None else weights
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, torch.float32, c.rope_scaling)
        q, k, v = layer_pre(w, c, self.embed_tokens(input_ids), hidden, cos, sin)
        k, v = kv.append(k, v)
        n, total = q.shape[2], k.shape[2]
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
        rep = c.num_attention_heads // c.num_key_value_heads
        o = F.scaled_dot_product_attention(q, expand_kv(k, rep), expand_kv(v, rep), attn_mask=mask)
        return layer_post(w, c, hidden, o)

    def state_dict_for_export(self) -> dict[str, torch.Tensor]:
        """The tensors of the served checkpoint: everything but the (target's) embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens")}


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
