"""Host cost of QwenImagePipeline.__call__ outside the models, on the CPU (issue 40 item 5).

A tiny pipeline (qwen_absorb.testing) runs 4 steps under cProfile; the pieces the pipeline itself runs
(``_execution_device``, the progress bar, the scheduler, ``cache_context``, latent packing, timesteps) are timed
one by one, ``_execution_device`` also over full-size module trees built on the meta device (its cost grows with
the number of modules), and the conversion of a 1024^2 image to PIL (``image_processor.postprocess``).

    python benchmarks/pipeline_host.py [--out benchmarks/results/pipeline/pipeline_host_cpu.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qwen_absorb import testing  # noqa: E402


def us(fn, n=200):
    fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/pipeline/pipeline_host_cpu.json")
    a = ap.parse_args()
    import diffusers

    torch.set_num_threads(2)
    res = {"torch": torch.__version__, "diffusers": diffusers.__version__, "host": "2-core CI-class CPU"}
    pipe = testing.tiny_pipeline()
    embeds, mask = testing.tiny_prompt_embeds(dim=pipe.transformer.config.joint_attention_dim)
    kw = dict(prompt_embeds=embeds, prompt_embeds_mask=mask, height=64, width=64, num_inference_steps=4,
              sigmas=[1.0, 0.9, 0.75, 0.5], output_type="latent", generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pipe(**kw)
        prof = cProfile.Profile()
        prof.enable()
        t = time.perf_counter()
        pipe(**kw)
        res["tiny_call_ms"] = (time.perf_counter() - t) * 1e3
        prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, name), (cc, nc, tt, ct, callers) in st.stats.items():
        rows.append((ct, f"{Path(file).name}:{line}:{name}", nc))
    rows.sort(reverse=True)
    res["cprofile_top_cumulative_ms"] = [(n, round(ct * 1e3, 3), c) for ct, n, c in rows[:40]]

    # the pipeline's own host time: the same calls with a transformer that returns its input at once
    tr = pipe.transformer
    object.__setattr__(tr, "forward", lambda hidden_states, **k: (hidden_states,))
    try:
        for steps, cfg in ((4, False), (50, False), (50, True)):
            extra = dict(negative_prompt_embeds=embeds, negative_prompt_embeds_mask=mask, true_cfg_scale=4.0) \
                if cfg else dict(true_cfg_scale=1.0)
            for bar_on in (False, True):
                pipe.set_progress_bar_config(disable=not bar_on)
                call = dict(kw, num_inference_steps=steps, sigmas=None, **extra)
                with torch.no_grad():
                    ms = us(lambda: pipe(**call), 5) / 1e3
                res[f"stub_{steps}step{'_cfg' if cfg else ''}{'_bar' if bar_on else ''}_ms"] = ms
    finally:
        del tr.__dict__["forward"]
    pipe.set_progress_bar_config(disable=True)

    # pieces, one by one (microseconds per call)
    from tqdm.auto import tqdm  # noqa: F401  (diffusers' progress bar)

    def bar():
        with pipe.progress_bar(total=4) as pb:
            for _ in range(4):
                pb.update()

    sched = pipe.scheduler
    pipe.set_progress_bar_config(disable=False)
    res["progress_bar_4_steps_us"] = us(bar, 50)
    pipe.set_progress_bar_config(disable=True)
    res["progress_bar_disabled_4_steps_us"] = us(bar, 50)
    res["execution_device_tiny_us"] = us(lambda: pipe._execution_device)
    with torch.no_grad():
        lat = torch.randn(1, 64 * 64 // 256, 64)
        sched.set_timesteps(sigmas=[1.0, 0.9, 0.75, 0.5], mu=0.8)

        def step():
            sched._step_index = None
            sched.set_begin_index(0)
            sched.step(lat, sched.timesteps[0], lat, return_dict=False)

        res["scheduler_step_us"] = us(step)
        res["set_timesteps_us"] = us(lambda: sched.set_timesteps(sigmas=[1.0, 0.9, 0.75, 0.5], mu=0.8))
        res["cache_context_us"] = us(lambda: pipe.transformer.cache_context("cond").__enter__())
        res["pack_latents_us"] = us(lambda: pipe._pack_latents(torch.randn(1, 16, 128, 128), 1, 16, 128, 128), 50)

    # _execution_device over full-size module trees (meta tensors: structure only)
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)

    with torch.device("meta"):
        tr = QwenImageTransformer2DModel(num_layers=60)
        vae = AutoencoderKLQwenImage()
    big = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                            transformer=tr)
    res["full_size_modules"] = sum(1 for _ in tr.modules()) + sum(1 for _ in vae.modules())
    res["execution_device_full_size_us"] = us(lambda: big._execution_device, 20)
    from diffusers.hooks.group_offloading import _get_group_onload_device

    def group_scan():
        for m in (tr, vae):
            try:
                _get_group_onload_device(m)
            except ValueError:
                pass

    res["group_offload_scan_full_size_us"] = us(group_scan, 20)

    # conversion of one 1024^2 image to PIL (what follows the decode)
    img = torch.rand(1, 3, 1024, 1024).mul(2).sub(1).to(torch.bfloat16)
    res["postprocess_pil_1024_ms"] = us(lambda: pipe.image_processor.postprocess(img, output_type="pil"), 10) / 1e3
    res["postprocess_np_1024_ms"] = us(lambda: pipe.image_processor.postprocess(img, output_type="np"), 10) / 1e3
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "cprofile_top_cumulative_ms"}, indent=1))
    for r in res["cprofile_top_cumulative_ms"][:25]:
        print(r)


if __name__ == "__main__":
    main()
