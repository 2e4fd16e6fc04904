"""The Llama family in plain PyTorch on the paged KV cache: Llama 2/3, Mistral, Qwen2 (q/k/v bias) and
Qwen3 (per-head RMSNorm on q and k before rope). Tensor parallelism lives in the layers.

Module names mirror HF's (``model.layers.N.self_attn...``) except the fused projections ``qkv_proj``
and ``mlp.gate_up_proj``; ``load_weights`` maps HF names onto them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, NamedTuple

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
from kernels.fused_norm import NormIn

# Decode steps of at most this many tokens carry each layer's input RMSNorm on the GEMVs around it (kernels.fused_norm:
# the down projection before adds the residual and sums squares, qkv_proj normalizes as it loads), on these devices
# (tests add "cpu": the same seam on the torch references), for dense (fp16 / bf16) weights. H200, 8B shape, batch-1
# TPOT, one process each, alternating (gpu_session.sh fn, 81c5c22): bf16 4.267 / 4.273 / 4.272 ms with it against
# 4.313 / 4.313 / 4.310 without (-1.0 %); the post-attention norm carried by o_proj and a GEMV gate_up as well:
# 4.272-4.276 (gate_up leaves cuBLAS for nothing), that one alone 4.309-4.317. 4-bit weights never carry the norm:
# it lost on the H200 every time (normalizing as loaded 2.532 ms against 2.525 without; normalizing late, both norms
# of a layer, 2.375 / 2.376 against 2.332 / 2.328, Sessions 31-32), and was removed. PAGEDSERVE_FUSED_NORM=0 turns
# it off. A model whose down_proj or qkv_proj would not run the GEMV at batch 1 (a weight past
# kernels.gemv_plan.GEMV_MAX_WEIGHT_ELEMS, a bias, TP > 1) keeps the norm's launch.
FUSED_NORM_MAX_M = 1
FUSED_NORM_DEVICES = ("cuda",)
FUSED_NORM = os.environ.get("PAGEDSERVE_FUSED_NORM") != "0"  # dense weights only
FUSED_NORM_DTYPES = (torch.float16, torch.bfloat16)  # the dense GEMV's

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
        return self.o_proj(self.attend(positions, self.qkv_proj(hidden), meta))  # [T, hidden]

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The projected ``qkv`` -> the attention's output ``[T, heads * D]``, o_proj's input."""
        q, k, v = self.qkv_proj.split(qkv)  # [T, heads, D], [T, kv_heads, D] x2
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(positions, q, k, v, meta)  # rope, K/V into the cache, attention: [T, heads, D]
        return out.reshape(out.shape[0], -1)


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
        self,
        positions: torch.Tensor,
        stream: Stream,
        meta: AttentionMetadata,
        fuse_norm: bool = False,
        next_norm: RMSNorm | None = None,
    ) -> Stream:
        """One layer on the residual stream. With ``fuse_norm``, the norm after this layer (``next_norm``: the next
        layer's input norm, or the model's final one) rides on the GEMVs around it (``kernels.fused_norm``):
        down_proj adds the residual and sums squares, the next qkv_proj normalizes."""
        attn, mlp = self.self_attn, self.mlp
        x, residual, norm = stream
        if norm is not None:  # x is the stream after the residual add, whose norm the projection applies
            residual, qkv = x, attn.qkv_proj.forward_normed(norm)
        else:
            if residual is None:  # the first layer: the embedding is the residual
                residual, x = x, self.input_layernorm(x)
            else:
                x, residual = self.input_layernorm(x, residual)
            qkv = attn.qkv_proj(x)
        out = attn.attend(positions, qkv, meta)
        x, residual = self.post_attention_layernorm(attn.o_proj(out), residual)
        gate_up = mlp.gate_up_proj(x)
        if not fuse_norm:
            return Stream(mlp.down_proj.forward_gated(gate_up, mlp.act_fn), residual, None)
        assert next_norm is not None
        norm = mlp.down_proj.forward_residual(gate_up, residual, mlp.act_fn, next_norm)
        return Stream(norm.h, norm.h, norm)


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
        # the norm after each layer (the next one's input norm, the final one), for the GEMVs that carry it
        self.next_norms = [*(layer.input_layernorm for layer in self.layers[1:]), self.norm]
        self.parallel = parallel
        self.fuse_norm = FUSED_NORM and quant is None  # 4-bit weights never carry the norm
        self.cuda_fuse_norm: bool | None = None  # decided at the first CUDA step that may fuse

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        stream = Stream(hidden, None, None)
        fuse_norm = self._fuses_norm(hidden)
        for layer, next_norm in zip(self.layers, self.next_norms, strict=True):
            stream = layer(positions, stream, meta, fuse_norm, next_norm)
        x, residual, norm = stream
        out = self.norm(x) if norm is not None or residual is None else self.norm(x, residual)[0]
        assert isinstance(out, torch.Tensor)
        return out

    def _fuses_norm(self, hidden: torch.Tensor) -> bool:
        """Whether this step's input norms ride on the GEMVs (``FUSED_NORM_MAX_M`` and ``FUSED_NORM`` say when)."""
        if not self.fuse_norm or hidden.shape[0] > FUSED_NORM_MAX_M or self.parallel.world_size > 1:
            return False
        if hidden.device.type not in FUSED_NORM_DEVICES:
            return False
        if not hidden.is_cuda:
            return True  # tests: the seam on the torch references
        if hidden.dtype not in FUSED_NORM_DTYPES:
            return False
        if self.cuda_fuse_norm is None:  # decided once: the shapes do not change
            m = hidden.shape[0]
            self.cuda_fuse_norm = all(self._carry_norms(layer, m) for layer in self.layers)
        return self.cuda_fuse_norm

    @staticmethod
    def _carry_norms(layer: nn.Module, m: int) -> bool:
        """Whether ``layer``'s down_proj and qkv_proj run GEMVs that carry the norm between them at ``m`` rows
        (else the fused path would only add launches: a torch sum of squares no norm reads)."""
        assert isinstance(layer, LlamaDecoderLayer)
        down = layer.mlp.down_proj
        return down.fusable and down.carries_norm(m, gated=True) and layer.self_attn.qkv_proj.carries_norm(m)


class Stream(NamedTuple):
    """The residual stream between layers: ``x`` the last layer's output and ``residual`` the stream before it
    is added (None in the first layer: the embedding is both); with ``norm``, ``x`` is already the sum and
    ``norm`` the next projection's input to normalize (with its partial sums of squares)."""

    x: torch.Tensor
    residual: torch.Tensor | None
    norm: NormIn | None


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
