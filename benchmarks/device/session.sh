# One device call that runs named stages under a wall-clock budget (the call's limit is 600 s).
#   STAGES="tests muon packed train" BUDGET=570 bash benchmarks/device/session.sh
# Source benchmarks/device/setup.sh first (same call). Every stage writes its log to $OUT; a
# stage gets min(its cap, what is left of BUDGET) seconds, so a slow stage cannot eat the rest.
set -u
start=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
cap() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }
stage() {  # name cap command...
  local name=$1 c; c=$(cap "$2"); shift 2
  if [ "$c" -lt 20 ]; then echo "[$name] skipped: ${c}s left"; return; fi
  echo "[$name] up to ${c}s: $*"
  timeout "$c" "$@" > "$OUT/$name.txt" 2>&1; echo "[$name] rc=$? after $(( $(date +%s) - start ))s"
  tail -n "${TAIL:-6}" "$OUT/$name.txt"
}
# Issue 29 (round 2), one same-run baseline per target. `round2` is every r2 stage in order; a
# device call is capped at 600 s, so a session runs them as several calls (the order and what each
# costs: benchmarks/README.md, "Issue 29 (round 2) on the GPU"), then `benchmarks/train/round2_report.py OUT*/
# bench_train-r2*.json` prints the rows and verdicts. -before: the levers off (the trainer before
# issue 29); -after: LM head on labelled rows, GC control, compile warm-up.
R2="--compile --steps 21 --warmup 4 --records 1500"
R2_AFTER="--loss-rows labelled --gc-control --compile-warmup"
STAGES=${STAGES/round2/r2tests r2vl16 r2vl32 r2muon r2text r2vl7b r2cold}
for s in $STAGES; do
  case $s in
    r2tests) stage gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
      packages/lmms-kernels/tests/test_flce.py packages/lmms-kernels/tests/test_flce_triton.py \
      packages/lmms-kernels/tests/test_warmup.py \
      packages/lmms-optim/tests/test_lowp_adamw.py ;;
    # VL-3B 16k (targets: total MFU >= 55%, LM-only >= 44%); the first case carries the compile
    r2vl16) stage train_r2vl16 280 python3 benchmarks/train/bench_train.py $R2 --case-timeout 270 \
      --tag=-before --json bench_train-r2vl16-before.json --cases vl3b_16k
      stage train_r2vl16b 200 python3 benchmarks/train/bench_train.py $R2 $R2_AFTER \
      --case-timeout 190 --tag=-after --json bench_train-r2vl16-after.json --cases vl3b_16k ;;
    r2vl32) stage train_r2vl32 280 python3 benchmarks/train/bench_train.py $R2 --case-timeout 270 \
      --tag=-before --json bench_train-r2vl32-before.json --cases vl3b_32k
      stage train_r2vl32b 250 python3 benchmarks/train/bench_train.py $R2 $R2_AFTER \
      --case-timeout 240 --tag=-after --json bench_train-r2vl32-after.json --cases vl3b_32k ;;
    # Muon vs AdamW at 32k tokens per step, three interleaved pairs (median of 3, spread); after
    # r2vl32 on the same machine (warm caches), levers on in both
    r2muon) for i in 1 2 3; do
        stage train_r2adamw$i 95 python3 benchmarks/train/bench_train.py --compile --steps 12 \
          --warmup 3 --records 1500 $R2_AFTER --case-timeout 90 --tag=-adamw$i \
          --json bench_train-r2adamw$i.json --cases vl3b_32k
        stage train_r2muon$i 95 python3 benchmarks/train/bench_train.py --compile --steps 12 \
          --warmup 3 --records 1500 $R2_AFTER --case-timeout 90 --tag=-muon$i \
          --json bench_train-r2muon$i.json --cases vl3b_32k_muon
      done ;;
    # text 3B (>= 62%) and 1.5B (>= 58%), before and after
    r2text) stage train_r2text 280 python3 benchmarks/train/bench_train.py $R2 --case-timeout 135 \
      --tag=-before --json bench_train-r2text-before.json --cases text3b_16k text1p5b_16k
      stage train_r2textb 280 python3 benchmarks/train/bench_train.py $R2 $R2_AFTER \
      --case-timeout 135 --tag=-after --json bench_train-r2text-after.json \
      --cases text3b_16k text1p5b_16k ;;
    # VL-7B shape, every parameter trained: fp32 AdamW state (predicted not to fit) then bf16
    # moments (predicted 109 GiB; MFU >= 40%)
    r2vl7b) stage train_r2vl7b 560 python3 benchmarks/train/bench_train.py $R2 $R2_AFTER \
      --case-timeout 270 --tag=-after --json bench_train-r2vl7b.json \
      --cases vl7b_16k_fp32state vl7b_16k ;;
    # cold start: 30 timed steps from empty Inductor/Triton/FA4 caches, without then with the
    # compile warm-up and GC control (target: mean within 3% of the median step)
    r2cold) stage train_r2cold 290 python3 benchmarks/train/bench_train.py --compile --steps 30 \
      --warmup 0 --records 1500 --cold-cache --case-timeout 280 --tag=-coldbefore \
      --json bench_train-r2cold-before.json --cases vl3b_16k
      stage train_r2coldb 290 python3 benchmarks/train/bench_train.py --compile --steps 30 \
      --warmup 0 --records 1500 --cold-cache --gc-control --compile-warmup --case-timeout 280 \
      --tag=-coldafter --json bench_train-r2cold-after.json --cases vl3b_16k ;;
    tests) stage gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
      packages/lmms-optim/tests/test_triton_gpu.py packages/lmms-kernels/tests apps/trainer/tests/test_step.py ;;
    quicktests) stage gpu_tests 100 python3 -m pytest -q -p no:cacheprovider -m gpu \
      packages/lmms-optim/tests/test_triton_gpu.py packages/lmms-kernels/tests/test_aligned_swiglu.py \
      packages/lmms-kernels/tests/test_liger.py apps/trainer/tests/test_step.py ;;
    # GPU tests of kernels, models (packed vs upstream, the VL tower without host syncs) and the
    # trainer (its step's host waits under the profiler), compile tests apart
    kerneltests) stage gpu_tests 210 python3 -m pytest -q -p no:cacheprovider -m gpu \
      packages/lmms-kernels/tests packages/lmms-models/tests/test_gpu_packed.py \
      apps/trainer/tests/test_step.py tests/test_one_process_fsdp.py \
      --ignore packages/lmms-kernels/tests/test_compile_gpu.py ;;
    # 24 backend x head-dim x causal cases compile FA4 variants: 80 s ran 7 of them (2026-12-03),
    # so the traced-padding and compiled-block tests go first and the stage gets 240 s
    compiletest) stage compile_tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu -x \
      "packages/lmms-kernels/tests/test_compile_gpu.py::test_compiled_fa4_pads_head_dims_in_the_trace_gpu" \
      "packages/lmms-kernels/tests/test_compile_gpu.py::test_inductor_compiled_blocks_match_eager_gpu" \
      packages/lmms-kernels/tests/test_compile_gpu.py ;;
    levers) stage packed 330 python3 benchmarks/models/bench_packed.py --tokens 16384 32768 --steps 8 \
      --warmup 2 --variants 0.5:none/fsdp 0.5:none/fsdp/keep full/fsdp/keep 0.5:none/fsdp/compile \
      --variant-tokens 0.5:none/fsdp@16384 0.5:none/fsdp/keep@16384 full/fsdp/keep@32768 \
      0.5:none/fsdp/compile@16384 --baselines --max-variant-s 90 ;;
    issue5) stage packed 260 python3 benchmarks/models/bench_packed.py --tokens 16384 32768 --steps 4 \
      --warmup 2 --variants 0.5:none/fsdp 0.5:none/fsdp/noalign full/fsdp \
      --variant-tokens 0.5:none/fsdp@16384 0.5:none/fsdp/noalign@16384 full/fsdp@32768 \
      --baselines hf-sdpa hf-sdpa-liger --max-variant-s 60 ;;
    muon) stage bench_muon 140 python3 benchmarks/optim/bench_muon.py --write
      cp benchmarks/RESULTS.md "$OUT/RESULTS.muon.md" ;;
    packed) stage packed 190 python3 benchmarks/models/bench_packed.py --tokens 16384 --steps 5 \
      --warmup 2 --variants 0.5:none/fsdp 0.5:none/fsdp/compile --baselines --profile --max-variant-s 60 ;;
    train) stage train ${TRAIN_CAP:-150} python3 benchmarks/train/bench_train.py \
      --cases ${TRAIN_CASES:-vl3b_16k} --steps ${TRAIN_STEPS:-6} --warmup 3 --records 1200 \
      --case-timeout ${CASE_TIMEOUT:-150} ${TRAIN_FLAGS:-} ;;
    # issue 8 in two calls (each case uses its own AC layout, blocks compiled):
    #   STAGES="calib train8text kerneltests baselines"  then  STAGES=train8vl
    # The first VL case carries Inductor's compilation of both towers' blocks (88 s first step
    # with a warm cache, more when cold) before its 24 steps: give each case 240 s. A 16k case
    # took 124-146 s of wall time with a warm cache, so on a cold machine split the four cases
    # over two calls.
    # --profile-steps: one extra step (25, the last) under the profiler, left out of the timed 20, for the
    # host waits (syncs) and the operator table.
    train8vl) stage train 570 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 240 --profile-steps 25 25 \
      --cases vl3b_16k vl3b_16k_muon vl3b_32k vl3b_32k_muon ;;
    # plain transformers on the same VL records (9-11 s a step: few steps). Plain sdpa runs out of
    # memory with a whole 16k pack per batch (2026-12-03), so it accumulates 4k-token micro-batches
    # (what bench_packed's baseline does); + Liger fits whole.
    baselines) stage baselines 110 python3 benchmarks/train/bench_train.py --steps 4 --warmup 1 \
      --records 1500 --case-timeout 100 --cases hf_sdpa --hf-micro-tokens 4096 --tag=-micro4k
      stage baselines_liger 100 python3 benchmarks/train/bench_train.py --steps 4 --warmup 1 \
      --records 1500 --case-timeout 95 --cases hf_sdpa_liger ;;
    train8text) stage train 260 python3 benchmarks/train/bench_train.py --compile --steps 20 \
      --warmup 4 --records 1500 --case-timeout 120 --cases text3b_16k text1p5b_16k ;;
    optimtests) stage optim_tests 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
      packages/lmms-optim/tests/test_triton_gpu.py ;;
    calibvl) stage calib_vl 200 python3 .calib/qwen2_5_vl.py 16384 ;;
    calib) stage calib_vl 200 python3 .calib/qwen2_5_vl.py 16384
      stage calib_text 150 python3 .calib/text_decoder.py fa4 16384 ac ;;
    # the sync-free step on the GPU: the VL tower from host grids, a profiled tiny VL trainer step
    # with a sync-free loss and with Liger's, the Triton linear CE against the torch one
    synctests) stage gpu_tests 130 python3 -m pytest -q -p no:cacheprovider -m gpu \
      packages/lmms-models/tests/test_gpu_packed.py::test_qwen2_5_vl_tower_runs_without_host_sync_from_host_grids \
      tests/test_one_process_fsdp.py::test_steady_state_step_never_waits_for_the_device \
      tests/test_one_process_fsdp.py::test_master_weights_match_fsdp2_on_the_gpu \
      packages/lmms-kernels/tests/test_flce_triton.py ;;
    flce) stage bench_flce 60 python3 benchmarks/kernels/bench_flce.py --tokens 16384 --iters 5 ;;
    rope) stage bench_rope 120 python3 benchmarks/models/bench_rope.py --tokens 16384 --layers 4 ;;
    # text 3B with a sync-free loss (LOSS=triton|torch), its step profiled for waits and operators
    text8sync) stage train 130 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 125 --profile-steps 25 25 \
      --loss-backend ${LOSS:-triton} --tag=-${LOSS:-triton} --cases text3b_16k ;;
    # lever 17: text 3B through FSDP2 on one rank (--fsdp), then with the one-process default (a
    # bf16 module with fp32 masters, lmms_parallel.MasterWeights), both profiled
    text8pair) stage train 130 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 125 --profile-steps 25 25 --fsdp --tag=-fsdp \
      --cases text3b_16k
      stage train_master 130 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 125 --profile-steps 25 25 --tag=-master \
      --cases text3b_16k ;;
    text8master) stage train_master 130 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 125 --profile-steps 25 25 --tag=-master \
      --cases ${TEXT_CASES:-text3b_16k} ;;
    # NOTES item 26: clip, AdamW and the bf16 write-back in one kernel per parameter, text 3B and
    # VL 16k (profiled); the baselines are text8master and vl8master in the same machine session
    fusedtests) stage fused_tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
      packages/lmms-optim/tests/test_flat_adamw.py packages/lmms-optim/tests/test_master_adamw.py \
      tests/test_one_process_fsdp.py::test_fused_master_step_matches_on_the_gpu ;;
    fusedstep) stage train_fused 560 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 270 --profile-steps 25 25 --fused-master-step \
      --tag=-fused --cases ${FUSED_CASES:-text3b_16k vl3b_16k} ;;
    # the three-pass optimizer step (clip multiply, torch's fused AdamW, bf16 copy) that
    # fused_master_step replaced as the default (2026-12-03): THREEPASS_CASES, profiled
    threepass) stage train_threepass 560 python3 benchmarks/train/bench_train.py --compile \
      --steps 21 --warmup 4 --records 1500 --case-timeout 270 --profile-steps 25 25 \
      --no-fused-master-step --tag=-threepass --cases ${THREEPASS_CASES:-text3b_16k vl3b_16k} ;;
    # the vision tower on aten's flash attention (less host time per call than FA4's interface)
    vlattn) stage train_vtorch 300 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 290 --profile-steps 25 25 --vision-attn torch \
      --tag=-vtorch --cases vl3b_16k ;;
    # VL 16k (AdamW, Muon) with the one-process default; a cold first case compiles both towers
    # (>220 s); VL_CASES="vl3b_32k" for the 32k case
    vl8master) stage train 570 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 270 --profile-steps 25 25 --tag=-master \
      --cases ${VL_CASES:-vl3b_16k vl3b_16k_muon} ;;
    # the vision patch embedding as one GEMM instead of cuDNN's Conv3d (NOTES item 31), profiled
    vlpatch) stage gpu_tests 60 python3 -m pytest -q -p no:cacheprovider -m gpu \
      packages/lmms-models/tests/test_gpu_packed.py -k linear_patch_embed
      stage train_patch 300 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 290 --profile-steps 25 25 --linear-patch-embed \
      --tag=-patch --cases vl3b_16k ;;
    # VL 16k with fewer checkpointed decoder blocks than half (NOTES item 30), after the default
    vl16ac) stage train 300 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 280 --tag=-master --cases vl3b_16k
      stage train_ac37 150 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 140 --ac-fraction 0.375 --tag=-ac37 \
      --cases vl3b_16k
      stage train_ac25 150 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 140 --ac-fraction 0.25 --tag=-ac25 \
      --cases vl3b_16k ;;
    # VL 32k with 3/4 of the decoder blocks checkpointed instead of all (NOTES item 29: the
    # all-blocks layout peaked at 104 GiB, ~30 GiB under the card), after the default layout
    vl32ac) stage train 570 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 280 --profile-steps 25 25 --tag=-master \
      --cases vl3b_32k
      stage train_ac75 290 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 280 --ac-fraction 0.75 --tag=-ac75 \
      --cases vl3b_32k ;;
    # Muon's overhead at a larger optimizer step: 4 packs (64k tokens) per step, AdamW then Muon.
    # At GA > 1 the fp32 master gradients live through the next packs' forward (+19 GiB): AdamW
    # ran out of memory at the GA-1 layout (2026-12-03), so both cases checkpoint 3/4 of the
    # decoder blocks (~13 GiB less, predicted) and compare at the same layout
    muonga) stage train 300 python3 benchmarks/train/bench_train.py --compile --steps 10 \
      --warmup 3 --records 1500 --case-timeout 145 --ga 4 --ac-fraction 0.75 --tag=-ga4 \
      --cases vl3b_16k vl3b_16k_muon ;;
    # Muon's former defaults against today's (NOTES items 32-34), each after the muon16/muon32
    # rows in the same machine session: the three-pass step (Muon + clip multiply + copy) ...
    muonthree) stage train_mthree 430 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 210 --no-muon-fused-step \
      --tag=-mthree --cases ${MUON_CASES:-vl3b_16k_muon vl3b_32k_muon} ;;
    # ... and the Gram form's products all on cuBLAS (LMMS_OPTIM_GRAM_TRITON=0)
    muongcub) LMMS_OPTIM_GRAM_TRITON=0 stage train_gcub 430 python3 benchmarks/train/bench_train.py \
      --compile --steps 21 --warmup 4 --records 1500 --case-timeout 210 \
      --tag=-gcub --cases ${MUON_CASES:-vl3b_16k_muon vl3b_32k_muon} ;;
    # issue 8's Muon target in one machine session: MasterMuon's GPU tests, then Muon and AdamW
    # at 16k (stage muon16), then both at 32k (muon32); compare median steps. The first case
    # carries the cold compile and, on 2026-12-04, took over 280 s with its profiled step 25
    muon16) stage gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
      packages/lmms-optim/tests/test_master_muon.py
      stage train_mf16 450 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 330 --tag=-mf16 --cases vl3b_16k_muon vl3b_16k ;;
    muon32) stage train_mf32 450 python3 benchmarks/train/bench_train.py --compile --steps 21 \
      --warmup 4 --records 1500 --case-timeout 275 --tag=-mf32 --cases vl3b_32k_muon vl3b_32k ;;
    # issue 24: masked diffusion (bidirectional, 1/t) against the causal LM, Qwen3-1.7B shape,
    # 16k packs, AdamW then Muon, one machine session; GPU tests of the objective first
    dllm) stage gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
      packages/lmms-models/tests/test_masked_diffusion.py packages/lmms-kernels/tests/test_flce_triton.py
      stage train_dllm 440 python3 benchmarks/train/bench_train.py --compile --steps 16 \
      --warmup 4 --records 1500 --case-timeout 105 --tag=-dllm \
      --cases qwen3_1p7b_16k qwen3_1p7b_16k_md qwen3_1p7b_16k_muon qwen3_1p7b_16k_md_muon ;;
    *) echo "unknown stage $s" ;;
  esac
done
