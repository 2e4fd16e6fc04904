"""The Gluon prefill kernel for Hopper (kernels/prefill_gluon.py): no interpreter runs Gluon, so on CPU its sm_90
code is compiled and read (the MMA waits that make the overlap, shared memory, no spills); on an H200 its output is
checked against the torch reference of kernels.prefill_new_kv on varlen batches of fresh prompts."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from kernels.prefill_gluon import gluon, gluon_available, prefill_attention_gluon
from tests.kernels.helpers import DEVICE, rel_err, run_without_interpreter, tolerance

needs_gluon = pytest.mark.skipif(gluon is None, reason="needs a Triton with Gluon")

# Compiles the kernel for sm_90 (no GPU) and prints its TTGIR, PTX, shared memory and ptxas's register / spill
# report: argv = constexprs (JSON), block_n, "ws" for kernels.prefill_gluon_ws's kernel.
_COMPILE = """
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from kernels.prefill_gluon import _prefill_gluon_kernel
from kernels.prefill_gluon_ws import LAUNCH_MAXNREG, _prefill_gluon_ws_kernel

constexprs, block_n, ws = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "ws"
kernel = _prefill_gluon_ws_kernel if ws else _prefill_gluon_kernel
options = {"num_warps": 4, "maxnreg": LAUNCH_MAXNREG} if ws else {"num_warps": constexprs["ROWS"] // 16}
desc = f"tensordesc<bf16[{block_n}, 128],{gl.NVMMASharedLayout.get_default_for([block_n, 128], gl.bfloat16)!r}>"
types = {"q_ptr": "*bf16", "out_ptr": "*bf16", "query_start_loc_ptr": "*i32", "k_desc": desc, "v_desc": desc,
         "scale_log2": "fp32"}
names = kernel.arg_names
signature = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in names}
aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if a.endswith("_ptr") or a.startswith("stride")}
compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32),
                          options=options)
with tempfile.TemporaryDirectory() as tmp:
    with open(os.path.join(tmp, "k.ptx"), "w") as f:
        f.write(compiled.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    report = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.path.join(tmp, "k.o")],
                            capture_output=True, text=True, check=True).stderr
print(json.dumps({"ttgir": compiled.asm["ttgir"], "ptx": compiled.asm["ptx"], "shared": compiled.metadata.shared,
                  "ptxas": report}))
"""


def _compiled(constexprs: dict[str, object], block_n: int, ws: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(run_without_interpreter(_COMPILE, json.dumps(constexprs), str(block_n),
                                                             "ws" if ws else "plain"))  # fmt: skip
    out["waits"] = [line.split("pendings = ")[1].split()[0].rstrip("},") for line in out["ttgir"].splitlines()
                    if "warp_group_dot_wait" in line]  # fmt: skip
    return out


_OVERLAP = ["0", "1", "0", "0"]  # the diagonal tile's Q K^T alone; in the loop (1, 0); the last P V (0)
_SERIALIZED = "C7514"  # ptxas: "wgmma.mma_async instructions are serialized" (the overlap lost)


@needs_gluon
@pytest.mark.parametrize(("rows", "block_n"), [(128, 128), (128, 64), (64, 64)])
def test_sm90_code_overlaps_the_mmas_and_fits(rows: int, block_n: int) -> None:
    """The waits as written: the diagonal tile's Q K^T waited for alone (0 pending), then in the loop tile i's
    Q K^T with tile i - 1's P V still pending (1) and that P V after tile i's softmax (0), then the last P V (0).
    No MMA is in flight across the loop's back edge, so ptxas keeps them asynchronous (no C7514). Three K/V stages
    and Q fit the H200's 227 KiB per block (64 rows and 64-key tiles: two blocks in an SM's 228 KiB, 1 KiB of it
    reserved per block), and nothing spills."""
    out = _compiled({"GROUP": 4, "HEAD_DIM": 128, "NUM_STAGES": 3, "ROWS": rows, "HEAD_MAJOR": False}, block_n)
    assert out["waits"] == _OVERLAP, out["waits"]
    assert out["ttgir"].count("warp_group_dot ") == 4, "Q K^T before and in the loop, P V in the loop and after"
    assert _SERIALIZED not in out["ptxas"], out["ptxas"]
    assert out["shared"] <= 227 * 1024
    if rows == 64 and block_n == 64:
        assert 2 * (out["shared"] + 1024) <= 228 * 1024, out["shared"]
    assert "0 bytes spill stores" in out["ptxas"] and "0 bytes stack frame" in out["ptxas"], out["ptxas"]


@needs_gluon
@pytest.mark.parametrize("block_n", [128, 64])
def test_sm90_warp_specialized_code_has_two_consumers_and_a_producer(block_n: int) -> None:
    """kernels.prefill_gluon_ws: each consumer partition keeps the overlap's waits, the registers are moved
    between partitions (setmaxnreg: the producer warp down to 24), and nothing spills."""
    out = _compiled({"GROUP": 4, "HEAD_DIM": 128, "NUM_STAGES": 3, "HEAD_MAJOR": True}, block_n, ws=True)
    assert out["waits"] == _OVERLAP * 2, out["waits"]
    assert "ttg.warp_specialize" in out["ttgir"]
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in out["ptx"]
    assert _SERIALIZED not in out["ptxas"], out["ptxas"]
    assert out["shared"] <= 227 * 1024
    assert "0 bytes spill stores" in out["ptxas"] and "0 bytes stack frame" in out["ptxas"], out["ptxas"]


def test_refuses_what_it_cannot_run() -> None:
    q = torch.zeros(8, 4, 128, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.zeros(8, 1, 128, dtype=torch.bfloat16, device=DEVICE)
    qsl = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    if not gluon_available(q):
        with pytest.raises(ValueError, match="sm_90"):
            prefill_attention_gluon(q, kv, kv, qsl, 0.1)
        return
    with pytest.raises(ValueError, match="num_stages"):
        prefill_attention_gluon(q, kv, kv, qsl, 0.1, num_stages=1)
    with pytest.raises(ValueError, match="power of two"):
        prefill_attention_gluon(torch.zeros_like(q[:, :3]), kv, kv, qsl, 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs sm_90")
@pytest.mark.parametrize(
    ("dtype", "group", "head_dim", "block_n", "rows", "ws", "head_major"),
    [
        (torch.bfloat16, 4, 128, 128, 128, False, False), (torch.float16, 8, 128, 64, 128, False, True),
        (torch.bfloat16, 1, 64, 128, 128, False, False), (torch.bfloat16, 4, 128, 64, 64, False, True),
        (torch.bfloat16, 4, 128, 128, 128, True, False), (torch.float16, 2, 64, 64, 128, True, False),
        (torch.bfloat16, 4, 128, 128, 128, True, True),
    ],
)  # fmt: skip
def test_matches_the_reference_on_varlen_fresh_prompts(
    dtype: torch.dtype,
    group: int,
    head_dim: int,
    block_n: int,
    rows: int,
    ws: bool,
    head_major: bool,
    gen: torch.Generator,
) -> None:
    """Prompts shorter than a query tile, across several key tiles, ending mid-tile and at the tensor's end (the
    last tile's rows past it read as zeros by TMA), the 8B shape's 4k, and key tiles that run into the next prompt."""
    from kernels.prefill_new_kv import prefill_attention_new_kv_ref

    lens = [1, 37, 300, 4096, 129, 1000]
    kv_heads, n = 8, sum(lens)
    qkv = torch.randn(n, (group + 2) * kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([group * kv_heads, kv_heads, kv_heads], dim=1)  # views of one projection, as the layer's
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    blocks = -(-max(lens) // 16)
    cache = torch.zeros(2, blocks * len(lens), 16, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    tables = torch.arange(blocks * len(lens), dtype=torch.int32, device=DEVICE).view(len(lens), blocks)
    out = prefill_attention_gluon(
        q, k, v, qsl, 0.088, block_n=block_n, rows=rows, warp_specialize=ws, head_major=head_major
    )
    ref = prefill_attention_new_kv_ref(q, k, v, cache, tables, qsl, seq_lens, 0.088)
    assert not out.isnan().any() and rel_err(out, ref) < tolerance(dtype), f"seed {gen.initial_seed()}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs sm_90")
@pytest.mark.parametrize(("group", "lead"), [(4, 0), (1, 0), (4, 20)])
def test_engine_step_splits_fresh_prompts_from_the_rest(group: int, lead: int, gen: torch.Generator) -> None:
    """engine.attention.paged_attention on a prefill step (decode rows, a 1-token prompt, chunks after a cached
    prefix, fresh prompts before and after them): the trailing fresh prompts (engine.inputs.fresh_suffix) through
    the Gluon kernel, the sequences before them through prefill_new_kv, into one output equal to the reference;
    without the split (fresh None, as in the prefill graphs) prefill_new_kv alone gives the same. ``lead``
    decode rows first: through the decode kernel (engine.attention.DECODE_ROWS_MIN), three kernels in all."""
    import dataclasses

    import numpy as np

    import engine.attention as attention
    from engine.inputs import fresh_suffix, leading_decode_rows
    from kernels.paged_attention import paged_decode_attention
    from kernels.prefill_new_kv import prefill_attention_new_kv_ref

    rows = [(300, 1), (0, 700), (0, 1), (129, 260), (2000, 1), (64, 64), (0, 2), (0, 131), (0, 1500)]  # (cached, new)
    rows = [(37 * i + 5, 1) for i in range(lead)] + rows
    kv_heads, head_dim, block = 8, 128, 16
    lens = [c + q for c, q in rows]
    n = sum(q for _, q in rows)
    blocks = -(-max(lens) // block)
    cache = torch.randn(2, blocks * len(rows), block, kv_heads, head_dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    tables = torch.randperm(blocks * len(rows), generator=gen).to(torch.int32).view(len(rows), blocks).to(DEVICE)
    q = torch.randn(n, group * kv_heads, head_dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    new_kv = torch.randn(2, n, kv_heads, head_dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    starts = np.concatenate([[0], np.cumsum([q for _, q in rows])]).astype(np.int32)
    fresh = fresh_suffix(starts, np.array(lens))
    f = 6 + lead
    assert fresh == (f, int(starts[f]))
    qsl = torch.from_numpy(starts).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    for i, (c, q_len) in enumerate(rows):  # this step's K/V in the cache too, as write_kv leaves it
        pos = torch.arange(c, c + q_len, device=DEVICE)
        slots = (tables[i].long()[pos // block], pos % block)
        cache[0][slots], cache[1][slots] = new_kv[0, starts[i] : starts[i + 1]], new_kv[1, starts[i] : starts[i + 1]]
    decode_rows = leading_decode_rows(starts)
    assert decode_rows == lead + 1  # the rows list starts with a decode row of its own
    meta = attention.AttentionMetadata(
        torch.zeros(0), qsl, seq_lens, tables, 1500, max(lens), "triton", fresh, decode_rows=decode_rows
    )
    ref = prefill_attention_new_kv_ref(q, new_kv[0], new_kv[1], cache, tables, qsl, seq_lens, 0.088)
    out = attention.paged_attention(q, cache, meta, 0.088, None, new_kv)
    assert not out.isnan().any() and rel_err(out, ref) < tolerance(torch.bfloat16), f"seed {gen.initial_seed()}"
    alone = attention.paged_attention(
        q, cache, dataclasses.replace(meta, fresh=None, decode_rows=0), 0.088, None, new_kv
    )
    assert rel_err(alone, ref) < tolerance(torch.bfloat16)
    only = attention.paged_attention(q[starts[f] :], cache, dataclasses.replace(
        meta, query_start_loc=qsl[f:] - starts[f], seq_lens=seq_lens[f:], block_tables=tables[f:], fresh=(0, 0),
        decode_rows=0,
    ), 0.088, None, new_kv[:, starts[f] :])  # fmt: skip
    assert torch.equal(only, out[starts[f] :]), "the Gluon kernel's rows depend on the rows before them"
    if lead:
        decoded = paged_decode_attention(q[:lead], cache, tables[:lead], seq_lens[:lead], 0.088)
        assert torch.equal(out[:lead], decoded), "the leading decode rows did not take the decode kernel"
