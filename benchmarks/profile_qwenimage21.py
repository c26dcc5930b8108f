"""Where Qwen-Image-2.1's patched call waits on the host (device diagnostic, ~1 min on an H200).

The 32-layer random full-size 2.1 transformer at 1024^2: bf16 with ``cuda_graph=True`` (the capture's outcome),
then ModelOpt FP8 (its eager fake-quant path, so no extension build) patched with defaults and with
``cuda_graph=True``: median wall of 5 calls, the host-synchronising ops of one profiled call, and its top
self-CPU ops. Output: stdout (``benchmarks/results/profile_qwenimage21_h200.log``).

    python benchmarks/profile_qwenimage21.py
"""
import time, statistics, warnings, torch
warnings.filterwarnings("ignore")
import qwen_absorb
from qwen_absorb import testing as T
from torch.profiler import profile, ProfilerActivity
torch.manual_seed(0)
m = T.random_qwenimage21_transformer(dtype=torch.bfloat16, device="cuda")
kw = T.qwenimage21_inputs(m, height=64, width=64, text_len=128, device="cuda", dtype=torch.bfloat16)
def call():
    with torch.inference_mode():
        return m(**kw)[0]
def wall(n=5):
    for _ in range(3): call()
    torch.cuda.synchronize(); ts = []
    for _ in range(n):
        t = time.perf_counter(); call(); torch.cuda.synchronize(); ts.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(ts), 2)
def prof(label):
    call(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        call(); torch.cuda.synchronize()
    ka = p.key_averages()
    print(f"== {label}: sync-ish ops")
    for e in ka:
        if any(s in e.key for s in ("Synchronize", "Memcpy", "item", "local_scalar", "nonzero", "cudaStreamWait", "EventSynchronize")):
            print(f"  {e.key:50s} count {e.count:6d} self_cpu_us {e.self_cpu_time_total:10.0f}")
    print(f"== {label}: top self CPU")
    for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:14]:
        print(f"  {e.key[:60]:60s} count {e.count:6d} self_cpu_ms {e.self_cpu_time_total/1e3:8.2f}")
rep = qwen_absorb.patch(m, cuda_graph=True)
print("bf16 graph ms", wall(), "cuda_graph", rep.cuda_graph, "graph_fallbacks", rep.graph_fallbacks)
qwen_absorb.unpatch(m)
import modelopt.torch.quantization.tensor_quant as tq
tq.get_cuda_ext_fp8 = lambda *a, **k: None  # ModelOpt's eager FP8 path: no 50 s extension build here
T.fp8_quantize(m, kw)
rep = qwen_absorb.patch(m)
print("fp8 default ms", wall(), "fallbacks", dict(rep.runtime_fallbacks))
prof("fp8 default")
qwen_absorb.unpatch(m)
rep = qwen_absorb.patch(m, cuda_graph=True)
print("fp8 graph ms", wall(), "cuda_graph", rep.cuda_graph, "graph_fallbacks", rep.graph_fallbacks, "fallbacks", dict(rep.runtime_fallbacks))
prof("fp8 graph")
