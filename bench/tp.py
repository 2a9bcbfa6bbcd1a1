"""Tensor parallelism on N GPUs of one host: decode steps of one engine of N ranks against one of one rank.

    python -m bench.tp --tokenizer DIR [--tp 2] [--config bench/configs/llama-3.1-8b.json] [--json rows.json]

The model is the config's layer shapes with DIR's tokenizer (bench/pd.py's model_dir_for), its weights random
(`--load-format dummy`). Each rank draws its own shard with the same seed, so a TP-N model is not the TP-1
model cut in N: the rows time the two, they do not compare their tokens. Both engines run as `LLM` does
(engine/tp_worker.py: rank 0 here, ranks 1..N-1 as child processes), CUDA graphs and all, so each step's
time includes the all-reduces of every layer and the mirroring of each call to the other ranks. The ratio
is the TP-1 step over N TP-N steps: 1.0 when N GPUs split the step's memory traffic perfectly.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from bench.measure import decode_step_time
from bench.pd import model_dir_for

HERE = os.path.dirname(os.path.abspath(__file__))


def tp_rows(model_dir: str, tp: int, ctx: int = 1024, steps: int = 64, batches=(1, 64), load_format: str = "dummy",
            **engine_args) -> list:
    from engine import LLM

    engine_args = {"max_total_tokens": max(batches) * (ctx + steps + 64) + 4096, "disable_radix_cache": True,
                   "load_format": load_format, **engine_args}
    times = {}
    for size in (1, tp):
        with LLM(model_dir, tp_size=size, **engine_args) as llm:
            for b in batches:
                times[(size, b)] = decode_step_time(llm.engine, b, ctx, steps)
                print(f"  TP-{size} batch {b}: {times[(size, b)] * 1e3:.3f} ms a step", flush=True)
    return [(f"decode step, batch {b}, {ctx} ctx: TP-{tp} ms (TP-1 ms); ratio TP-1 / ({tp} x TP-{tp})",
             times[(tp, b)] * 1e3, times[(1, b)] * 1e3, times[(1, b)] / (tp * times[(tp, b)]), "(for comparison)")
            for b in batches]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json")
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "llama-3.1-8b.json"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir_for(args.config, args.tokenizer, tmp)
        rows = tp_rows(model_dir, args.tp, args.ctx, args.steps)
    print("| figure | value | peer | ratio | target |\n|---|---|---|---|---|")
    for name, value, peer, ratio, target in rows:
        print(f"| {name} | {value:.3f} | {peer:.3f} | {ratio:.3f} | {target} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
