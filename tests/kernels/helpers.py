"""Shared builders for the kernel tests: random paged caches whose unused slots hold NaN, random 4-bit weights."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.int4_dequant import pack_int4, unpack_int4

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = Path(__file__).resolve().parents[2]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere fails."""
    assert not torch.isnan(out).any(), "output holds NaN (an element was not written or a hidden slot was read)"
    ref64 = ref.double()
    return float((out.double() - ref64).norm() / ref64.norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 1e-2


def capture_graph(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn`` warmed up on a side stream (as ``torch.cuda.graph`` wants), then captured: the graph and the
    tensor its replays write."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def paged_cache(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    spare_blocks: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` and shuffled block tables
    ``[num_seqs, max_blocks + 1]`` (int32, padded with 0). Every slot no sequence owns is NaN, so a kernel
    that reads past a length or outside its table poisons its output."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq, default=0) + 1, dtype=torch.int32)
    used = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        ids = perm[used : used + nb]
        used += nb
        table[i, :nb] = ids.to(torch.int32)
        live = torch.randn(2, nb * block_size, num_kv_heads, head_dim, generator=gen)[:, :n]  # [2, n, Hkv, D]
        flat = cache[:, ids].reshape(2, nb * block_size, num_kv_heads, head_dim)  # [2, nb * bs, Hkv, D]
        flat[:, :n] = live.to(dtype)
        cache[:, ids] = flat.reshape(2, nb, block_size, num_kv_heads, head_dim)
    return cache.to(DEVICE), table.to(DEVICE)


def int4_weights(
    k: int, n: int, group_size: int, act_order: bool, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """codes [K, N], qweight, scales and zeros [groups, N], g_idx [K] or None (``kernels.int4_dequant``'s layout)."""
    codes = torch.randint(0, 16, (k, n), generator=gen)
    num_groups = k // group_size
    scales = (0.01 + 0.05 * torch.rand(num_groups, n, generator=gen)).to(dtype)
    zeros = torch.randint(0, 16, (num_groups, n), generator=gen).to(torch.uint8)
    g_idx = (torch.argsort(torch.randperm(k, generator=gen)) // group_size).to(torch.int32) if act_order else None
    return codes, pack_int4(codes), scales, zeros, g_idx


# Compiles a split-K kernel for sm_90 (no GPU needed) with the launcher's specialization of 16-aligned
# pointers and sizes, and prints its TTGIR: argv = kernel ("gemv" | "dot" | "stream" | "dense"), constexprs (JSON),
# num_warps.
_COMPILE_SM90 = """
import json, sys
from kernels.int4_gemm import _int4_gemm_kernel
from kernels.int4_gemv import _int4_gemv_kernel
from kernels.int4_gemv_stream import _int4_gemv_stream_kernel
from kernels.gemv import _gemv_kernel
from loadtest.sass_census import compile_sm90

kernels = {"gemv": _int4_gemv_kernel, "dot": _int4_gemm_kernel, "dense": _gemv_kernel, "stream": _int4_gemv_stream_kernel}
kernel = kernels[sys.argv[1]]
fused_norm_off = {"NORMED": False, "PARTS": 1, "ADD_RESIDUAL": False, "PDL": False,
                  "TRIGGER": False, "X_WORDS": False}  # the dense GEMV's fused_norm switches, no PDL, bf16 x loads
constexprs = {**{a: v for a, v in fused_norm_off.items() if a in kernel.arg_names}, **json.loads(sys.argv[2])}
print(compile_sm90(kernel, constexprs, int(sys.argv[3])).asm["ttgir"])
"""


def ttgir_sm90(kernel: str, constexprs: dict[str, object], num_warps: int) -> str:
    """The TTGIR of ``kernel`` ("gemv" | "dot" | "stream", the int4 GEMMs; "dense", ``kernels.gemv``) compiled for sm_90;
    the dense GEMV's ``kernels.fused_norm`` switches and PDL default to off."""
    return run_without_interpreter(_COMPILE_SM90, kernel, json.dumps(constexprs), str(num_warps))


def packed_int4(
    k: int, n: int, group_size: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random packed codes ``[K // 8, N]``, scales and zeros (no g_idx) on DEVICE, for the Gluon GEMMs' tests."""
    codes = torch.randint(0, 16, (k, n), generator=gen)
    groups = k // group_size
    scales = (0.01 + 0.05 * torch.rand(groups, n, generator=gen)).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), generator=gen).to(torch.uint8)
    return pack_int4(codes).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


def dequantized_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(c - z) s`` rounded to the scales' dtype, ``[K, N]`` (what the reference multiplies)."""
    groups = torch.arange(qweight.shape[0] * 8, device=qweight.device) // group_size
    codes = unpack_int4(qweight).float()
    return ((codes - zeros.float()[groups]) * scales.float()[groups]).to(scales.dtype)


# The end of a compile script: ``compiled`` (a triton.compile result for sm_90) through the wheel's ptxas, whose
# report it prints, and cuobjdump, whose SASS it leaves in ``sass``.
PTXAS_REPORT = """
from loadtest.sass_census import ptxas_sass
report, sass = ptxas_sass(compiled)
print(report)
"""


# Compiles a Gluon int4 GEMM kernel (argv: its module, its name, constexprs as JSON; W_LAYOUT made from them) for
# sm_90 and prints ptxas's report, then one "griddepcontrol" per such PTX instruction and one "HGMMA" per warpgroup
# MMA in the SASS.
_COMPILE_GLUON_SM90 = (
    """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kernels.int4_gemv_mma import words_layout

kernel = getattr(importlib.import_module(sys.argv[1]), sys.argv[2])
c = json.loads(sys.argv[3])
c["W_LAYOUT"] = words_layout(c["BLOCK_K"] // 32, c["BLOCK_N"], c["num_warps"])
half = "*bf16" if c["IS_BF16"] else "*fp16"
types = {"qw_ptr": "*i32", "z_ptr": "*u8", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "base": "fp32", "x_ptr": half,
         "out_ptr": half, "s_ptr": half}
names = kernel.arg_names
signature = {a: "constexpr" if a in c else types.get(a, "i32") for a in names}
aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if a.endswith("_ptr") or a.startswith("stride") or a in ("N", "K", "K_PER_SPLIT")}
compiled = triton.compile(GluonASTSource(kernel, signature, c, aligned), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": c["num_warps"]})
"""
    + PTXAS_REPORT
    + """
print("griddepcontrol" * compiled.asm["ptx"].count("griddepcontrol"))
print("HGMMA" * sass.count("HGMMA"))
"""
)


def gluon_sm90(module: str, kernel: str, constexprs: dict[str, object]) -> str:
    """:data:`_COMPILE_GLUON_SM90`'s report for ``module.kernel`` compiled with ``constexprs`` (``num_warps``
    among them)."""
    return run_without_interpreter(_COMPILE_GLUON_SM90, module, kernel, json.dumps(constexprs))


# Runs each script it reads (one JSON line: source and argv) as ``python -c source argv...`` would, and answers
# with its stdout (or the traceback) on one JSON line.
_RUNNER = """
import contextlib, io, json, sys, traceback
replies = sys.stdout
for line in sys.stdin:
    request = json.loads(line)
    sys.argv = ["-c", *request["argv"]]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(request["source"], "<string>", "exec"), {"__name__": "__main__"})
        reply = {"stdout": out.getvalue()}
    except BaseException:
        reply = {"error": traceback.format_exc()}
    replies.write(json.dumps(reply) + "\\n")
    replies.flush()
"""
_runner: subprocess.Popen[str] | None = None


def run_without_interpreter(source: str, *argv: str) -> str:
    """The stdout of ``python -c source *argv`` with TRITON_INTERPRET=0 (real Triton compiles, for sm_90 here: no
    GPU needed), raising with the script's traceback if it fails. The scripts run one after another in one process
    of their own, started on the first call: what Python, torch and Triton take to start (~1.2 s) is paid once
    for the session's dozen compiles, not per script."""
    global _runner
    if _runner is None or _runner.poll() is not None:
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        _runner = subprocess.Popen(
            [sys.executable, "-c", _RUNNER], cwd=ROOT, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        atexit.register(_stop_runner, _runner)
    assert _runner.stdin is not None and _runner.stdout is not None
    _runner.stdin.write(json.dumps({"source": source, "argv": list(argv)}) + "\n")
    _runner.stdin.flush()
    line = _runner.stdout.readline()
    assert line, f"the script runner exited ({_runner.wait()})"
    reply = json.loads(line)
    if "error" in reply:
        raise RuntimeError(f"the script failed without the interpreter:\n{reply['error']}")
    return str(reply["stdout"])


def _stop_runner(runner: subprocess.Popen[str]) -> None:
    if runner.stdin is not None:
        runner.stdin.close()
    try:
        runner.wait(10)
    except subprocess.TimeoutExpired:
        runner.kill()
        runner.wait()
