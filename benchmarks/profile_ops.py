"""One call of each fused op at [1,16384,3072] bf16, for Nsight Compute (ncu) to profile.

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section LaunchStats -k regex:"layer_norm|bias_gate" python benchmarks/profile_ops.py
"""

import torch

import qwen_absorb.ops as ops

g = torch.Generator(device="cuda").manual_seed(0)
shape = (1, 16384, 3072)
x = torch.randn(shape, generator=g, device="cuda").bfloat16()
r = torch.randn(shape, generator=g, device="cuda").bfloat16()
mod = torch.randn(1, 3 * 3072, generator=g, device="cuda").bfloat16()
shift, scale, gate = (t.unsqueeze(1) for t in mod.chunk(3, dim=-1))
bias = torch.randn(3072, generator=g, device="cuda").bfloat16()
ops.layer_norm_scale_shift(x, shift=shift, scale=scale)
ops.bias_residual_layer_norm_scale_shift(r, x, bias=bias, gate=gate, shift=shift, scale=scale)
ops.bias_gate_residual(r, x, bias=bias, gate=gate)
torch.cuda.synchronize()
