#!/usr/bin/env python
"""How long the host spends in ``CUDAGraph.replay()`` for graphs of N kernel nodes, and whether splitting one
graph into several hides it: the speed benchmark's FP8 replay left the GPU idle for about as long as its host
took up to the launch (4.9 ms for ~1900 kernels), so this measures the launch alone.

For N in 250, 1000, 2000 (each node a small elementwise kernel, 1 us of GPU work) and for one graph vs the same
nodes captured as 4 or 8 consecutive graphs (one memory pool, replayed in order): the host time of the replay
calls (perf_counter, no synchronize) and the wall time until the GPU finished, medians of 9.

    python benchmarks/probe_graph_launch.py --out benchmarks/results      # ~10 s on the H200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def _capture(n: int, parts: int, x: torch.Tensor, pool) -> list[torch.cuda.CUDAGraph]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graphs = []
    with torch.cuda.stream(side):
        for _ in range(3):
            x.add_(1.0)  # warm-up outside the capture
        for p in range(parts):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=side):
                for _ in range(n // parts):
                    x.mul_(1.0000001)
            graphs.append(g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return graphs


def _measure(graphs: list) -> tuple[float, float]:
    host, wall = [], []
    for _ in range(9):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for g in graphs:
            g.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        wall.append((t2 - t0) * 1e6)
    return statistics.median(host), statistics.median(wall)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args()
    x = torch.randn(4096, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    rows = []
    for n in (250, 1000, 2000):
        for parts in (1, 4, 8):
            graphs = _capture(n, parts, x, pool)
            host, wall = _measure(graphs)
            rows.append({"nodes": n, "graphs": parts, "host_us": round(host, 1), "wall_us": round(wall, 1),
                         "host_us_per_node": round(host / n, 3)})
            print(rows[-1])
            del graphs
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "probe_graph_launch.json").write_text(json.dumps(res, indent=1))
    lines = [f"# CUDAGraph.replay() host cost ({res['gpu']}, torch {res['torch']}, {res['date']})", "",
             "| nodes | graphs | host us (replay calls) | wall us (to GPU done) | host us / node |", "|---|---|---|---|---|"]
    lines += [f"| {r['nodes']} | {r['graphs']} | {r['host_us']} | {r['wall_us']} | {r['host_us_per_node']} |" for r in rows]
    (a.out / "probe_graph_launch.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
