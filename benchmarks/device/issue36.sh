#!/usr/bin/env bash
# Issue 36 on one GPU in one device call: the issue's failing GPU tests, then the family matrix.
# Two calls in a row (an idle machine goes back after 30 s):
#   call 1, carry [".gpu-fla-a"]:  cp -r .gpu-fla-a /tmp/gpu-fla-a
#   call 2, carry [".gpu-fla-b", ".m36"]:
#     R=$PWD; mkdir -p /tmp/src && tar xzf .m36/src.tgz -C /tmp/src && cd /tmp/src && \
#       R=$R bash benchmarks/device/issue36.sh
# .gpu-fla-a/b: ../shared/gpu/bundle_fla.sh (tilelang, fla 0.6.0, diffusers); .m36/whl: soundfile,
# cffi, pycparser, soxr (the audio families' data decoding); .m36/work: every family's data and
# processor, made on the CPU by `family_matrix.py --prepare --work .m36/work`; .m36/src.tgz:
# `git archive HEAD` (the run is of a commit, not of a working tree others are editing).
# Seen on an H100 (2026-12-05): 15 families take ~60 s together; the three linear-attention
# families each compile fla's Triton kernels and TileLang's backward on first use for over 100 s,
# so give them a call of their own: FAMILIES=fla_gated_deltanet,qwen3_5,qwen3_5_moe
# FAMILY_TIMEOUT=280 TESTS_CAP=0. wan's synthetic clips need PyAV (carry its wheel).
set -u
R=${R:-$PWD}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla /tmp/gpu-fla-a/*.whl \
  "$R"/.gpu-fla-b/*.whl "$R"/.m36/whl/*.whl || exit 1
P=/tmp/fla
for d in packages/*/src apps/trainer/src; do P=$P:$PWD/$d; done
export PYTHONPATH=$P PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import importlib, torch, triton, transformers
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__,
      "gpu", torch.cuda.get_device_name(0))
for m in ("tilelang", "fla", "diffusers", "soundfile", "soxr"):
    try:
        mod = importlib.import_module(m); print(m, getattr(mod, "__version__", "ok"))
    except Exception as e:  # noqa: BLE001
        print(m, "FAILED", type(e).__name__, e)
PY
t0=$(date +%s)
# the issue's failing GPU tests, quick ones first (the linear-attention ones autotune Triton)
[ "${TESTS_CAP:-120}" -gt 0 ] && timeout "${TESTS_CAP:-120}" python3 -m pytest -v --tb=short -p no:cacheprovider -m gpu -rA --durations=15 \
  packages/lmms-models/tests/test_gpu_llava_onevision.py \
  packages/lmms-models/tests/test_bagel.py::test_flex_block_mask_gradients_equal_sdpa_on_gpu \
  tests/test_diffusion_train.py::test_bagel_trains_on_the_gpu_like_on_the_cpu \
  packages/lmms-kernels/tests/test_linear_attention.py \
  packages/lmms-models/tests/test_linear_families.py > "$OUT/fixed_tests.txt" 2>&1
echo "[fixed tests] rc=$? after $(( $(date +%s) - t0 ))s"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/fixed_tests.txt" | tail -25
python3 benchmarks/device/family_matrix.py --out "$OUT" --work "$R/.m36/work" \
  --budget "${MATRIX_BUDGET:-390}" --family-timeout "${FAMILY_TIMEOUT:-100}" --families "${FAMILIES:-}"
