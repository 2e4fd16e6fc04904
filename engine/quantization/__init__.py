"""4-bit weight-only quantization (W4A16) of AWQ, GPTQ and compressed-tensors checkpoints.

Its own package rather than more of ``engine/layers``: the checkpoint formats (config parsing, packed
layouts, zero-point conventions) change with the tools that write them, while the layers only ask for
"the matmul of this layer"; the kernels are ``kernels.int4_gemm`` and ``kernels.int4_dequant``. Importing
the package (and ``config``) needs no torch, so ``engine.config`` can validate ``--quantization`` on API
nodes.
"""

from engine.quantization.config import QUANTIZATION_METHODS, Int4Config, parse_quantization

__all__ = ["QUANTIZATION_METHODS", "Int4Config", "parse_quantization"]
