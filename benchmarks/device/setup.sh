# Source this on the lent GPU machine, from the repo root, to get liger-kernel + flash-attn 4 and
# the lmms sources on the path. It expects /tmp/gpu-a (copied by an earlier call that carried
# .gpu-a) and .gpu-b carried by this call; see ../../../shared/gpu/bundle.sh for how they are made.
# Idempotent: reuses /tmp/site when a previous call on the same warm machine built it.
if [ ! -f /tmp/site/.lmms-ready ]; then
  if [ -d /tmp/gpu-a ] && [ -f .gpu-b/fa4libs.part ]; then
    rm -rf /tmp/site && mkdir -p /tmp/site &&
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/gpu-a/*.whl &&
      cat /tmp/gpu-a/fa4libs.part .gpu-b/fa4libs.part | (cd /tmp/site && tar xJf -) &&
      touch /tmp/site/.lmms-ready
  else
    echo "setup.sh: no FA4/Liger bundle on this machine (run without them)" >&2
  fi
fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:packages/lmms-pack/src:packages/lmms-optim/src:packages/lmms-kernels/src:packages/lmms-parallel/src:packages/lmms-data/src:packages/lmms-models/src:apps/trainer/src:$PYTHONPATH
export PYTHONUNBUFFERED=1
python3 - <<'PY'
import torch, transformers, triton
print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__,
      "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for m in ("liger_kernel", "flash_attn.cute"):
    try:
        __import__(m); print(m, "ok")
    except Exception as e:  # noqa: BLE001
        print(m, "missing:", type(e).__name__, e)
PY
