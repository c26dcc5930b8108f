# Sourced at the start of every GPU run on the device machine: installs the carried wheels
# (diffusers, nvidia-modelopt and the dependencies the image lacks) and records the environment.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, cupy, diffusers, modelopt; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| cupy', cupy.__version__, '| diffusers', diffusers.__version__, '| modelopt', modelopt.__version__); print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
} 2>&1 | tee "$OUT/env.txt"
