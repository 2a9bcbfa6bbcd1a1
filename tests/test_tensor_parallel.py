"""Tensor parallelism over 2 CPU processes (gloo) computes what one process and transformers compute."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from cluster import free_port
from conftest import rel_err
from test_models import PROMPTS, hf_logits, record_logits

STEPS = 8


def rank_main(rank: int, size: int, addr: str, path: str, out: str) -> None:
    from engine import Engine, SamplingParams

    engine = Engine(model_path=path, max_total_tokens=2048, tp_size=size, tp_rank=rank, dist_init_addr=addr)
    seen = record_logits(engine)
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    reqs = [engine.add_request(p, greedy, rid=f"g{i}") for i, p in enumerate(PROMPTS)]
    reqs.append(engine.add_request(PROMPTS[0], SamplingParams(temperature=1.0, seed=5, max_tokens=STEPS,
                                                              ignore_eos=True), rid="seeded"))
    while engine.has_work():
        engine.step()
    engine.check()
    torch.save({"outputs": {r.rid: r.output_ids for r in reqs}, "logits": {k: torch.stack(v) for k, v in seen.items()},
                "kv_heads": engine.pool.kv_heads}, f"{out}.{rank}")
    leave_group()


def run_ranks(target, path: str, out: str, size: int = 2) -> list:
    """Run target(rank, size, addr, path, out) in `size` spawned processes; what each rank saved to out.RANK."""
    ctx = mp.get_context("spawn")
    addr = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=target, args=(r, size, addr, path, out)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    return [torch.load(f"{out}.{r}") for r in range(size)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_ranks_match_one_and_transformers(family, tiny_models, tmp_path):
    from engine import Engine, SamplingParams

    path, hf = tiny_models[family]
    ranks = run_ranks(rank_main, path, str(tmp_path / "tp"))
    assert ranks[0]["outputs"] == ranks[1]["outputs"], "every rank takes the same decisions"
    assert ranks[0]["kv_heads"] == 1, "each rank keeps half of the 2 KV heads"

    single = Engine(model_path=path, max_total_tokens=2048, random_seed=0)
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        ids = ranks[0]["outputs"][f"g{i}"]
        ref = hf_logits(hf, p + ids)[len(p) - 1: len(p) + STEPS - 1]
        assert rel_err(ranks[0]["logits"][f"g{i}"], ref) < 1e-4
        r = single.add_request(p, greedy)
        while single.has_work():
            single.step()
        assert r.output_ids == ids
    seeded = single.add_request(PROMPTS[0], SamplingParams(temperature=1.0, seed=5, max_tokens=STEPS, ignore_eos=True))
    while single.has_work():
        single.step()
    assert seeded.output_ids == ranks[0]["outputs"]["seeded"]


def test_four_ranks_over_two_kv_heads_each_hold_the_head_their_queries_read(tiny_models, tmp_path):
    """More ranks than KV heads: ranks 0 and 1 hold KV head 0, ranks 2 and 3 head 1, each beside its one
    query head, and together they compute what transformers computes (Qwen2: q/k/v biases, tied head)."""
    path, hf = tiny_models["qwen2"]
    ranks = run_ranks(rank_main, path, str(tmp_path / "tp"), size=4)
    assert [r["kv_heads"] for r in ranks] == [1, 1, 1, 1]
    assert all(r["outputs"] == ranks[0]["outputs"] for r in ranks), "every rank takes the same decisions"
    for i, p in enumerate(PROMPTS):
        ids = ranks[0]["outputs"][f"g{i}"]
        ref = hf_logits(hf, p + ids)[len(p) - 1: len(p) + STEPS - 1]
        assert rel_err(ranks[0]["logits"][f"g{i}"], ref) < 1e-4


def test_a_tensor_parallel_size_must_divide_the_heads_or_be_a_multiple_of_the_kv_heads():
    import dataclasses

    from conftest import hf_config
    from engine.config import ModelConfig
    from engine.parallel import TensorParallel

    c = dataclasses.replace(ModelConfig.from_hf_dict(hf_config("llama").to_dict()), num_attention_heads=24,
                            num_key_value_heads=4, intermediate_size=192)
    assert TensorParallel(0, 2).shard_config(c).num_key_value_heads == 2
    assert TensorParallel(0, 8).shard_config(c).num_key_value_heads == 1  # each head held by two ranks
    with pytest.raises(ValueError, match="num_key_value_heads"):
        TensorParallel(0, 6).shard_config(c)
    with pytest.raises(ValueError, match="num_attention_heads"):
        TensorParallel(0, 16).shard_config(c)
    assert [TensorParallel(r, 8).first_kv_head(4) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [TensorParallel(r, 2).first_kv_head(4) for r in range(2)] == [0, 2]


def rank_bounds(rank: int, size: int, addr: str, path: str, out: str) -> None:
    from engine.kv_scales import kv_bounds
    from engine.loader import load_model
    from engine.parallel import init_tensor_parallel

    tp = init_tensor_parallel(rank, size, addr, torch.device("cpu"))
    model = load_model(path, torch.float32, torch.device("cpu"), tp)
    torch.save(kv_bounds(model), f"{out}.{rank}")
    leave_group()


def leave_group() -> None:
    """Both ranks done, then the group torn down: a rank that exits while the other's gloo threads still
    talk to it can abort at exit."""
    import torch.distributed as dist

    from engine.parallel import leave_group as leave

    dist.barrier()
    leave()


def test_ranks_agree_on_the_fp8_kv_bounds_of_the_whole_model(tiny_models, tmp_path):
    """Each rank holds half of the KV heads; the per-layer bound (and so the FP8 scale) is over all of them,
    so that every rank's pool, and a worker with another --tp, store the same values."""
    from engine.kv_scales import kv_bounds
    from engine.loader import load_model

    path, _ = tiny_models["qwen2"]
    ranks = run_ranks(rank_bounds, path, str(tmp_path / "bounds"))
    whole = kv_bounds(load_model(path, torch.float32, torch.device("cpu")))
    for bounds in ranks:
        assert torch.allclose(torch.tensor(bounds), torch.tensor(whole), rtol=1e-5)


def test_llm_with_tp_size_2_starts_its_other_rank_and_generates_what_one_process_does(tiny_models):
    from engine import LLM, SamplingParams

    path, _ = tiny_models["llama"]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=STEPS, ignore_eos=True, stop_token_ids=[7])]
    want = [[o.token_ids for o in LLM(path, max_total_tokens=2048).generate(prompts, p)] for p in params]
    with LLM(path, max_total_tokens=2048, tp_size=2) as llm:
        (rank1,) = llm.followers.procs
        got = [[o.token_ids for o in llm.generate(prompts, p)] for p in params]
        assert llm.engine.pool.kv_heads == 1
    assert got == want
    assert rank1.poll() is not None, "closing the LLM stops its other rank"


def test_the_tensor_parallel_bench_times_both_engines(tiny_models):
    """bench/tp.py, which a multi-GPU machine runs, on two CPU ranks: one row per batch, with both times."""
    from bench.tp import tp_rows

    path, _ = tiny_models["llama"]
    rows = tp_rows(path, 2, ctx=40, steps=4, batches=(1, 3), load_format="auto", chunked_prefill_size=64)
    assert [r[0].split(",")[1] for r in rows] == [" batch 1", " batch 3"]
    for _, t_tp, t_one, ratio, _ in rows:
        assert t_tp > 0 and t_one > 0 and abs(ratio - t_one / (2 * t_tp)) < 1e-9


def test_groups_draw_their_own_samples_for_unseeded_requests(tiny_models):
    """Each group's ranks share one seed for unseeded requests, drawn when the group starts: two groups (or one
    restarted) do not repeat each other's samples."""
    from engine import LLM, SamplingParams

    path, _ = tiny_models["llama"]
    unseeded = SamplingParams(temperature=1.0, max_tokens=STEPS, ignore_eos=True)
    outs = []
    for _ in range(2):
        with LLM(path, max_total_tokens=2048, tp_size=2) as llm:
            outs.append([o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], unseeded)])
    assert outs[0] != outs[1]


def rank_collectives(rank: int, size: int, addr: str, path: str, out: str) -> None:
    import dataclasses

    import torch.distributed as dist

    from engine.parallel import init_tensor_parallel

    tp = init_tensor_parallel(rank, size, addr, torch.device("cpu"))
    got = {}
    for staged in (False, True):
        t = dataclasses.replace(tp, staged=staged)
        x = torch.arange(6, dtype=torch.float32).view(2, 3) * (rank + 1)
        summed = t.all_reduce(x)
        got[staged] = {"sum": summed.clone(), "in_place": summed is x,
                       "max": t.all_reduce(torch.tensor([float(rank), -float(rank)]), op=dist.ReduceOp.MAX),
                       "min": t.min_int(10 - rank),
                       "gathered": t.all_gather_last(torch.full((2, 2), float(rank)))}
    torch.save(got, f"{out}.{rank}")
    leave_group()


def test_collectives_through_the_host_give_what_direct_ones_give(tmp_path):
    """A gloo group of ranks on one GPU (PDSERVE_TP_BACKEND=gloo) stages every collective through host
    copies; each must return what the direct collective returns, all-reduce still in place."""
    for got in run_ranks(rank_collectives, "", str(tmp_path / "coll")):
        direct, staged = got[False], got[True]
        assert torch.equal(direct["sum"], torch.arange(6, dtype=torch.float32).view(2, 3) * 3)
        assert torch.equal(direct["max"], torch.tensor([1.0, 0.0])) and direct["min"] == 9
        assert torch.equal(direct["gathered"], torch.tensor([[0.0, 0.0, 1.0, 1.0]] * 2))
        assert direct["in_place"] and staged["in_place"]
        for key in ("sum", "max", "gathered"):
            assert torch.equal(staged[key], direct[key]), key
        assert staged["min"] == direct["min"]


def test_an_unknown_tensor_parallel_backend_is_refused(monkeypatch):
    from engine.parallel import init_tensor_parallel

    monkeypatch.setenv("PDSERVE_TP_BACKEND", "mpi2")
    with pytest.raises(ValueError, match="PDSERVE_TP_BACKEND must be nccl or gloo"):
        init_tensor_parallel(0, 2, "tcp://127.0.0.1:1", torch.device("cpu"))


def test_a_written_random_checkpoint_loads_as_the_model_it_was_drawn_from(tiny_models, tmp_path):
    """bench/tp.py --share-gpu writes one random checkpoint that engines of every --tp load."""
    import shutil

    from bench.tp import write_checkpoint
    from engine.config import ModelConfig
    from engine.loader import build_model, load_model

    path, _ = tiny_models["qwen2"]
    shutil.copy(f"{path}/config.json", tmp_path)
    write_checkpoint(str(tmp_path), seed=4)
    drawn = build_model(ModelConfig.from_dir(str(tmp_path)), torch.bfloat16, torch.device("cpu"), seed=4)
    loaded = load_model(str(tmp_path), torch.bfloat16, torch.device("cpu"))
    for (name, a), (_, b) in zip(drawn.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_the_shared_gpu_check_finds_two_ranks_computing_what_one_does(tiny_models):
    """bench/tp.py --share-gpu's rows, on CPU ranks: every prompt's greedy tokens equal, logits within float32
    rounding."""
    from bench.tp import shared_gpu_rows

    path, _ = tiny_models["llama"]
    (tokens, fp32, logits) = shared_gpu_rows(path, 2, prompts=3, tokens=6, chunked_prefill_size=2048)
    assert tokens[1:4] == (3, 3, 1.0)
    assert fp32[1:4] == (3, 3, 1.0)
    assert logits[1] < 1e-5
