"""kernels.l2_prefetch: both prefetch kernels compile for sm_90 with the instruction they exist for (CPU, no GPU
needed: the interpreter cannot run inline PTX); its checks refuse bad arguments; on a GPU the prefetch runs on
tensors of any size, eagerly and on a side stream inside a CUDA graph, and leaves every byte as it was."""

from __future__ import annotations

import pytest
import torch

from kernels.l2_prefetch import MODES, prefetch_l2
from tests.kernels.helpers import capture_graph, run_without_interpreter

_PTX_SM90 = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.l2_prefetch import _prefetch_kernel

bulk = sys.argv[1] == "bulk"
constexprs = {"STEP": 8192 if bulk else 128, "PER_PROGRAM": 32, "BULK": bulk}
signature = {"ptr": "*u8", "nbytes": "i64", **{a: "constexpr" for a in constexprs}}
compiled = triton.compile(ASTSource(_prefetch_kernel, signature, constexprs, {(0,): [["tt.divisibility", 16]]}),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
assert compiled.asm["cubin"]  # ptxas accepted it
print(compiled.asm["ptx"])
"""


@pytest.mark.parametrize(
    ("mode", "instruction"),
    [("bulk", "cp.async.bulk.prefetch.L2.global"), ("line", "prefetch.global.L2::evict_last")],
)
def test_compiles_for_sm90_with_its_prefetch(mode: str, instruction: str) -> None:
    ptx = run_without_interpreter(_PTX_SM90, mode)
    assert instruction in ptx
    assert "st.global" not in ptx  # it writes nothing


def test_bad_arguments_are_refused() -> None:
    t = torch.zeros(64)
    with pytest.raises(ValueError, match="mode must be one of"):
        prefetch_l2(t, mode="all")
    with pytest.raises(ValueError, match="CUDA tensor"):
        prefetch_l2(t)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="contiguous"):
            prefetch_l2(torch.zeros(8, 8, device="cuda").t())
        with pytest.raises(ValueError, match="multiple of 16"):
            prefetch_l2(torch.zeros(8, device="cuda"), chunk=24)
    assert set(MODES) == {"bulk", "line"}


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("shape", "dtype", "max_bytes"),
    [((4096, 4096), torch.bfloat16, None), ((512, 6144), torch.int32, 3 << 20), ((37,), torch.uint8, None)],
)
def test_prefetch_leaves_the_bytes_and_asks_for_what_it_says(
    mode: str, shape: tuple[int, ...], dtype: torch.dtype, max_bytes: int | None
) -> None:
    t = torch.randint(0, 100, shape, device="cuda").to(dtype)
    before = t.clone()
    asked = prefetch_l2(t, max_bytes, mode=mode)
    nbytes = min(t.numel() * t.element_size(), max_bytes or 1 << 62)
    assert asked == (nbytes - nbytes % 16 if mode == "bulk" else nbytes)
    torch.cuda.synchronize()
    assert torch.equal(t, before)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_prefetch_on_a_side_stream_in_a_cuda_graph(mode: str) -> None:
    """prefetch_bench's side mode: a branch forked before a kernel and joined at the end, captured and replayed."""
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def step() -> torch.Tensor:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            prefetch_l2(w, mode=mode)
        y = torch.nn.functional.linear(x, w)
        torch.cuda.current_stream().wait_stream(side)
        return y

    graph, y = capture_graph(step)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.nn.functional.linear(x, w))
