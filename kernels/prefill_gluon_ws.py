"""The Gluon prefill kernel of ``kernels.prefill_gluon`` warp-specialized as FlashAttention-3 is: one warp issues
the K/V loads (TMA), and the 128-row query tile is two consumer partitions of one warpgroup each (rows 0-63 and
64-127), which the warp schedulers run independently, so one's softmax can overlap the other's MMAs (FA3's
ping-pong, here unforced), and neither stops for a refill. The consumers free a K/V stage by an arrival each on
its ``empty`` barrier; the producer waits for both before loading the stage again. The engine's default
(``prefill_attention_gluon(warp_specialize=True)``): 584-587 / 637-647 TFLOP/s at 4k / 8k causal on the H200
against 440 / 473 for one partition of two warpgroups.
"""

from __future__ import annotations

from kernels.prefill_gluon import SHAPE_ARGS, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from kernels.prefill_gluon import _cta_barrier, _load_tile, _locate, attend, load_q, program_tile

    # registers a thread of the consumer worker and of the producer get (maxnreg LAUNCH_MAXNREG over 12 warps:
    # the default consumer gets what is left, 240 too)
    CONSUMER_REGS = gl.constexpr(240)
    PRODUCER_REGS = gl.constexpr(24)
    LAUNCH_MAXNREG = 168

    @gluon.jit
    def _consume_low(args):
        """Rows 0-63 (the default partition)."""
        (q_smem, k_smem, v_smem, ready, empty, k_desc, v_desc, out_ptr, scale_log2, q_start, q_len, q_tile_start,
         kvh, num_tiles, stride_ot, stride_oh, GROUP, NUM_STAGES) = args  # fmt: skip
        if num_tiles > 0:
            attend(q_smem.slice(0, 64), k_smem, v_smem, ready, empty, k_desc, v_desc, out_ptr, scale_log2, q_start,
                   q_len, q_tile_start, kvh, num_tiles, stride_ot, stride_oh, GROUP, NUM_STAGES, 0, True)  # fmt: skip

    @gluon.jit
    def _consume_high(args):
        """Rows 64-127 (a worker partition of 4 warps)."""
        (q_smem, k_smem, v_smem, ready, empty, k_desc, v_desc, out_ptr, scale_log2, q_start, q_len, q_tile_start,
         kvh, num_tiles, stride_ot, stride_oh, GROUP, NUM_STAGES) = args  # fmt: skip
        if num_tiles > 0:
            attend(q_smem.slice(64, 64), k_smem, v_smem, ready, empty, k_desc, v_desc, out_ptr, scale_log2,
                   q_start, q_len, q_tile_start, kvh, num_tiles, stride_ot, stride_oh, GROUP, NUM_STAGES, 64,
                   True)  # fmt: skip

    @gluon.jit
    def _produce(args):
        """The K/V tiles in order, each into its stage once both consumers freed the tile NUM_STAGES before."""
        (q_smem, k_smem, v_smem, ready, empty, k_desc, v_desc, out_ptr, scale_log2, q_start, q_len, q_tile_start,
         kvh, num_tiles, stride_ot, stride_oh, GROUP, NUM_STAGES) = args  # fmt: skip
        HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
        for i in range(0, num_tiles):
            if i >= NUM_STAGES:
                mbarrier.wait(empty.index(i % NUM_STAGES), (i // NUM_STAGES - 1) & 1)
            _load_tile(k_desc, v_desc, k_smem, v_smem, ready, i, num_tiles, q_start, kvh * HEAD_DIM, NUM_STAGES)

    @gluon.jit(do_not_specialize=SHAPE_ARGS)
    def _prefill_gluon_ws_kernel(
        q_ptr, k_desc, v_desc, out_ptr, query_start_loc_ptr, seq0, tok0, num_seqs, scale_log2,
        stride_qt, stride_qh, stride_ot, stride_oh,
        GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, HEAD_MAJOR: gl.constexpr,
    ):  # fmt: skip
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        BLOCK_Q: gl.constexpr = 128 // GROUP
        tile, kvh = program_tile(HEAD_MAJOR)
        q_start, q_len, q_tile_start = _locate(tile, query_start_loc_ptr, seq0, tok0, num_seqs, BLOCK_Q)
        q_smem = load_q(q_ptr, q_start, q_len, q_tile_start, kvh, stride_qt, stride_qh, GROUP, HEAD_DIM, 128, 4)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival from each consumer
        fence_async_shared()
        _cta_barrier()  # Q and the barriers before any partition starts
        # an idle program of the grid's bound: no tiles
        num_tiles = gl.where(q_tile_start < q_len, gl.cdiv(gl.minimum(q_tile_start + BLOCK_Q, q_len), BLOCK_N), 0)
        args = (q_smem, k_smem, v_smem, ready, empty, k_desc, v_desc, out_ptr, scale_log2, q_start, q_len,
                q_tile_start, kvh, num_tiles, stride_ot, stride_oh, GROUP, NUM_STAGES)  # fmt: skip
        gl.warp_specialize([(_consume_low, (args,)), (_consume_high, (args,)), (_produce, (args,))], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip
