"""The Llama family in plain PyTorch on the paged KV cache: Llama 2/3, Mistral, Qwen2 (q/k/v bias) and
Qwen3 (per-head RMSNorm on q and k before rope). Tensor parallelism lives in the layers.

Module names mirror HF's (``model.layers.N.self_attn...``) except the fused projections ``qkv_proj``
and ``mlp.gate_up_proj``; ``load_weights`` maps HF names onto them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.layers import (
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from engine.layers.linear import QuantMethod
from engine.layers.weights import WeightSource, get_weight_loader
from engine.parallel import ParallelState
from engine.quantization.config import Int4Config
from engine.quantization.formats import param_name
from engine.quantization.int4_linear import Int4LinearMethod

# HF checkpoint name fragment -> (our fused module name fragment, shard id)
_STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _sliding_window(config: Any, layer_idx: int) -> int | None:
    """The layer's window when the config enables one (Mistral: all layers; Qwen2/3: per ``layer_types``)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return int(window)


class LlamaAttention(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, rotary: RotaryEmbedding, parallel: ParallelState, quant: QuantMethod | None
    ) -> None:
        super().__init__()
        head_dim = _head_dim(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, num_kv_heads, qkv_bias, parallel, quant
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, o_bias, parallel, quant
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
            scale=head_dim**-0.5,
            rotary=rotary,
            sliding_window=_sliding_window(config, layer_idx),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))  # [T, heads, D], [T, kv_heads, D] x2
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(positions, q, k, v, meta)  # rope, K/V into the cache, attention: [T, heads, D]
        return self.o_proj(out.reshape(out.shape[0], -1))  # [T, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, parallel: ParallelState, quant: QuantMethod | None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias, parallel, quant)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, parallel, quant)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_gated(self.gate_up_proj(x), self.act_fn)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_idx: int, rotary: RotaryEmbedding, parallel: ParallelState, quant: QuantMethod | None
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary, parallel, quant)
        self.mlp = LlamaMLP(config, parallel, quant)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, parallel: ParallelState, quant: QuantMethod | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        # One cos/sin cache shared by every layer.
        self.rotary_emb = RotaryEmbedding(config, _head_dim(config), config.max_position_embeddings)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary_emb, parallel, quant) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """The model interface the ModelRunner uses: ``forward``, ``compute_logits``, ``attention_layers``,
    ``load_weights``. With ``quant_config`` every decoder projection holds 4-bit weights (embeddings, norms
    and the LM head stay dense)."""

    def __init__(self, config: Any, parallel: ParallelState, quant_config: Int4Config | None = None) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.quant_config = quant_config
        self.model = LlamaModel(config, parallel, Int4LinearMethod(quant_config) if quant_config else None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 on every rank."""
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Load HF-named tensors (full tensors or lazy slices); raises on unknown names and on
        parameters left unloaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, source in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # the embedding, already shared
            if self.quant_config is not None:
                renamed = param_name(self.quant_config, hf_name)  # CT's weight_packed -> qweight, ...
                if renamed is None:
                    continue
                hf_name = renamed
            name, shard_id = hf_name, None
            for hf_part, our_part, sid in _STACKED_PARAMS:
                if hf_part in hf_name:
                    name, shard_id = hf_name.replace(hf_part, our_part), sid
                    break
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no matching parameter in {type(self).__name__}")
            param = params[name]
            loader = get_weight_loader(param)
            if shard_id is None:
                loader(param, source)
            else:
                loader(param, source, shard_id)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(sorted(missing))}")


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
