"""A decode graph's inputs: the step's arrays, padded to the graph's bucket, in static buffers that two
host-to-device copies fill (engine/graph.py). No graph is captured on a CPU, but the forward a graph
captures runs here over the same buffers, and it must give the eager step's logits."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, SamplingParams
from engine.graph import DecodeGraphs

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def _few_programs(monkeypatch):
    """The Triton interpreter runs a launch's programs one after another, each in Python. The GPU's target (a
    few programs per SM) would cut these tests' short contexts into 16 mostly empty splits; a target of 8 keeps
    the few-requests launch and two splits to merge (tests/test_triton_attention.py covers the splitting)."""
    from kernels.attention.triton_backend import TritonBackend

    monkeypatch.setattr(TritonBackend, "target_programs", 8)


def test_graph_buffers_hold_the_eager_step_padded_to_the_bucket(tiny_llama):
    path, _ = tiny_llama
    pytest.importorskip("triton")
    # The backend graphs capture, run by the Triton interpreter (it reads the page list through kv_indptr, so
    # the graph's list can be longer than the step's).
    engine = Engine(model_path=path, max_total_tokens=4096, page_size=8, attention_backend="triton")
    prompts = [[(7 * i + j * 13) % 400 + 5 for j in range(20 + 9 * i)] for i in range(3)]
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    while any(r.num_output < 2 for r in reqs):
        engine.step()
    runner = engine.runner
    graphs = DecodeGraphs(engine.model, engine.pool, runner.backend, max_bs=8, max_context=512)
    for _ in range(3):  # both host mirrors, in turn, and the first again
        engine.step()  # leaves a step in flight: the next one's tokens come from its sampled tokens
        prev = engine._inflight.out.tokens
        chunks = engine.scheduler.schedule()
        a = runner.arrays(chunks)
        assert a.is_decode and len(a.fill_at) == 3, "every request's next token is still on the device"
        with torch.inference_mode():
            b = graphs.stage(a, prev)
            ids, positions, attn, rows = runner.to_device(a, prev)
            assert b == 4
            n, nnz = 3, attn.kv_indices.numel()
            # Every row waits for its token, which the graph's first kernel takes from `sampled`.
            assert graphs.fill_source[:n].tolist() == a.fill_from.tolist() and graphs.fill_source[n] == -1
            assert torch.equal(graphs.sampled[:n], prev)
            assert torch.equal(graphs.positions[:n], positions)
            assert torch.equal(graphs.seq_lens[:n], attn.seq_lens)
            assert torch.equal(graphs.kv_indptr[: n + 1], attn.kv_indptr)
            assert torch.equal(graphs.kv_indices[:nnz], attn.kv_indices)
            # The padding request: token 0 at position 0, one token of context, in page 0 after the real pages.
            assert graphs.ids[n] == 0 and graphs.positions[n] == 0 and graphs.seq_lens[n] == 1
            assert graphs.kv_indptr[n + 1] == nnz + 1 and graphs.kv_indices[nnz] == 0
            logits, tokens = graphs._forward(b)
            assert torch.equal(graphs.ids[:n], ids)
            ref = engine.model.compute_logits(engine.model(ids, positions, runner.backend.plan(attn))[rows])
        torch.testing.assert_close(logits[:n], ref, rtol=1e-5, atol=1e-5)
        # The graph ends in each row's greedy token, where the next step's graph reads it.
        assert torch.equal(tokens, logits.argmax(dim=-1)) and tokens.data_ptr() == graphs.sampled.data_ptr()
        engine.sync()


def test_a_graph_step_after_a_graph_step_reads_the_tokens_where_the_last_one_left_them(tiny_llama):
    """A greedy step's tokens are the graph's own `sampled` buffer, passed back as the next step's previous
    tokens: its first kernel fills each waiting row from the row of `sampled` its request was sampled in."""
    path, _ = tiny_llama
    pytest.importorskip("triton")
    engine = Engine(model_path=path, max_total_tokens=4096, page_size=8, attention_backend="triton")
    reqs = [engine.add_request([5 + i, 9, 11 + i, 40], GREEDY) for i in range(3)]
    while any(r.num_output < 2 for r in reqs):
        engine.step()
    runner = engine.runner
    graphs = DecodeGraphs(engine.model, engine.pool, runner.backend, max_bs=8, max_context=512)
    engine.step()
    chunks = engine.scheduler.schedule()
    a = runner.arrays(chunks)
    assert len(a.fill_at) == 3
    with torch.inference_mode():
        graphs.sampled.copy_(torch.arange(100, 108))  # what the last replay would have left there
        b = graphs.stage(a, graphs.sampled[:3])
        graphs._forward(b)
        assert graphs.ids[:3].tolist() == [100 + int(j) for j in a.fill_from]
    engine.sync()


def staged_step(tiny_llama, params):
    """An engine whose requests (one per SamplingParams) decode with a step in flight, a DecodeGraphs beside
    it, and the next decode step's arrays: (engine, graphs, arrays, the in-flight tokens, the step's requests)."""
    path, _ = tiny_llama
    pytest.importorskip("triton")
    engine = Engine(model_path=path, max_total_tokens=4096, page_size=8, attention_backend="triton")
    reqs = [engine.add_request([5 + i, 9, 11 + i, 40], p) for i, p in enumerate(params)]
    while any(r.num_output < 2 for r in reqs):
        engine.step()
    graphs = DecodeGraphs(engine.model, engine.pool, engine.runner.backend, max_bs=8, max_context=512)
    engine.step()
    prev = engine._inflight.out.tokens
    chunks = engine.scheduler.schedule()
    return engine, graphs, engine.runner.arrays(chunks), prev, [c.req for c in chunks]


def test_a_graph_draws_each_rows_token_at_its_temperature(tiny_llama):
    """Requests that set only a temperature (and a seed) take their tokens from the graph: it is staged with
    each row's temperature, seed and draw index, and ends in the tokens the sampler would have drawn from the
    same logits. Padding rows draw greedily."""
    from engine.sampler import SamplingBatch, plain_draw, sample

    params = [SamplingParams(temperature=0.9, seed=3, max_tokens=24), SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=1.4, seed=-5, max_tokens=24)]
    engine, graphs, a, prev, rows = staged_step(tiny_llama, params)
    assert all(plain_draw(r) for r in rows)
    with torch.inference_mode():
        b = graphs.stage(a, prev)
        assert graphs.temperature[:4].tolist() == [pytest.approx(r.params.temperature) for r in rows] + [0.0]
        assert graphs.seeds[:3].tolist() == [r.seed for r in rows]
        assert graphs.draws[:3].tolist() == [r.num_output + r.pending for r in rows]
        assert graphs.top_k[3] == 0 and graphs.top_p[3] == 1.0 and graphs.min_p[3] == 0.0  # padding: no truncation
        logits, tokens = graphs._forward(b)
        expect = sample(logits[:3], SamplingBatch.build(rows, logits.shape[1], "cpu")).tokens
        assert tokens[:3].tolist() == expect.tolist()
        assert tokens[3] == logits[3].argmax()
    engine.sync()


def test_a_truncating_batch_is_drawn_by_the_graphs_second_pass(tiny_llama):
    """Top-k, top-p and min-p requests: the step stages each row's truncation with its inputs, and the pass a
    second graph captures (DecodeGraphs._truncated) draws what the sampler draws from the same logits."""
    from engine.sampler import SamplingBatch, plain_draw, sample, truncating_draw

    params = [SamplingParams(temperature=0.9, top_k=5, seed=3, max_tokens=24),
              SamplingParams(temperature=1.2, top_p=0.7, seed=4, max_tokens=24),
              SamplingParams(temperature=0.8, min_p=0.2, seed=5, max_tokens=24),
              SamplingParams(temperature=0, top_p=0.5, max_tokens=24)]
    engine, graphs, a, prev, rows = staged_step(tiny_llama, params)
    assert all(truncating_draw(r) for r in rows) and not all(plain_draw(r) for r in rows)
    with torch.inference_mode():
        b = graphs.stage(a, prev)
        assert b == 4
        assert graphs.top_k[:4].tolist() == [r.params.top_k for r in rows]
        assert graphs.top_p[:4].tolist() == [pytest.approx(r.params.top_p) for r in rows]
        assert graphs.min_p[:4].tolist() == [pytest.approx(r.params.min_p) for r in rows]
        logits, _ = graphs._forward(b)
        graphs.logits[b] = logits  # (what capture() keeps as the bucket's output)
        graphs._truncated(b)
        expect = sample(logits[:4], SamplingBatch.build(rows, logits.shape[1], "cpu")).tokens
        assert graphs.sampled[:4].tolist() == expect.tolist()
    engine.sync()


class InPlaceGraphs(DecodeGraphs):
    """The decode graphs' path on a CPU, where nothing is captured: each replay runs the forward a graph
    captures (staging, fill, model, draw) and the truncation pass in place, over the same static buffers."""

    def run(self, a, prev_tokens):
        b = self.stage(a, prev_tokens)
        self._bucket = b
        self.logits[b], tokens = self._forward(b)
        return self.logits[b][: a.batch_size], tokens[: a.batch_size]

    def draw_truncated(self, n, rules=(True, True, True)):
        self._truncated(self._bucket, rules)
        return self.sampled[:n]


def test_graph_steps_across_aborts_and_sampling_modes_draw_what_eager_steps_draw(tiny_llama):
    """Sets of seeded requests, one sampling mode each (greedy, temperature, top-p, top-k, min-p, and the modes
    sampled after the graph: a penalty, logprobs, min_tokens), each set aborted mid-generation before the next: the graph path (its buffers staged step after step, batches
    growing and shrinking) draws the same tokens as eager steps, and every token is in the vocabulary."""
    from engine.graph import buckets

    path, _ = tiny_llama
    pytest.importorskip("triton")
    engines = [Engine(model_path=path, max_total_tokens=4096, page_size=8, attention_backend="triton")
               for _ in range(2)]
    g = InPlaceGraphs(engines[0].model, engines[0].pool, engines[0].runner.backend, max_bs=8, max_context=512)
    g.graphs = {b: None for b in buckets(8)}
    engines[0].runner.graphs = g
    modes = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.9, top_p=0.8),
             dict(temperature=1.1, top_k=7), dict(temperature=0.8, min_p=0.1),
             dict(temperature=0.7, repetition_penalty=1.3), dict(temperature=0.9, logprobs=2),
             dict(temperature=1.0, min_tokens=3)]
    outs = []
    for engine in engines:
        out = []
        for m, kw in enumerate(modes):
            reqs = [engine.add_request([5 + i + m, 9, 11 + 2 * i, 40 + m], SamplingParams(
                seed=10 * m + i, max_tokens=24, ignore_eos=True, **kw)) for i in range(3 + m % 2)]
            while any(r.num_output < 4 for r in reqs):
                engine.step()
            engine.sync()
            out.append([list(r.output_ids) for r in reqs])
            for r in reqs:
                engine.abort(r.rid)
        outs.append(out)
        assert all(0 <= t < engine.config.vocab_size for o in out for ids in o for t in ids)
    assert outs[0] == outs[1]


def test_a_step_of_one_token_chunks_that_do_not_all_sample_is_not_a_graph_step(tiny_llama):
    """With a small prefill budget, a prompt can advance one token at a time beside decoding requests: every
    chunk is one token long, but the prompt's chunk samples nothing. The graph draws a token for every row,
    so such a step must run eagerly; the tokens must be those of an engine without graphs."""
    path, _ = tiny_llama
    pytest.importorskip("triton")
    engines = [Engine(model_path=path, max_total_tokens=4096, page_size=8, attention_backend="triton",
                      chunked_prefill_size=4) for _ in range(2)]
    g = InPlaceGraphs(engines[0].model, engines[0].pool, engines[0].runner.backend, max_bs=8, max_context=512)
    g.graphs = {b: None for b in (1, 2, 4, 8)}
    engines[0].runner.graphs = g
    outs = []
    for engine in engines:
        reqs = [engine.add_request([5 + i, 9, 11 + i], SamplingParams(temperature=0.8, seed=i, max_tokens=12,
                                                                      ignore_eos=True)) for i in range(3)]
        while any(r.num_output < 2 for r in reqs):
            engine.step()
        reqs.append(engine.add_request(list(range(20, 32)), SamplingParams(temperature=0.8, seed=9, max_tokens=4,
                                                                            ignore_eos=True)))
        while engine.has_work():
            engine.step()
        outs.append([r.output_ids for r in reqs])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("rows", ["running limit", "largest graph"])
def test_a_graph_step_after_an_eager_step_with_more_rows_than_the_largest_graph(tiny_llama, rows):
    """Six prompts prefilled in one eager step sample six tokens; two are aborted while that step is in flight,
    and the four left decode in a graph step of at most four rows, taking their tokens from rows 2-5 of the
    eager step's. The graphs hold as many previous tokens as a step can sample (the running-request limit, as
    the engine builds them); graphs holding fewer run that step eagerly. Either way the tokens are those of
    an engine without graphs."""
    path, _ = tiny_llama
    pytest.importorskip("triton")
    engines = [Engine(model_path=path, max_total_tokens=4096, page_size=8, attention_backend="triton")
               for _ in range(2)]
    limit = engines[0].args.running_limit if rows == "running limit" else None
    g = InPlaceGraphs(engines[0].model, engines[0].pool, engines[0].runner.backend, max_bs=4, max_context=512,
                      max_rows=limit)
    g.graphs = {b: None for b in (1, 2, 4)}
    engines[0].runner.graphs = g
    staged = []
    real_stage = g.stage
    g.stage = lambda a, prev: staged.append(a.batch_size) or real_stage(a, prev)
    outs = []
    for engine in engines:
        reqs = [engine.add_request([5 + i, 9, 11 + i], SamplingParams(temperature=0.8, seed=i, max_tokens=10,
                                                                      ignore_eos=True)) for i in range(6)]
        engine.step()  # the six prefills, in flight
        for r in reqs[:2]:
            engine.abort(r.rid)
        while engine.has_work():
            engine.step()
        outs.append([r.output_ids for r in reqs[2:]])
    assert outs[0] == outs[1] and all(len(o) == 10 for o in outs[0])
    assert len(staged) == (9 if limit else 8), "every decode step in a graph, but the first one eager without room"


def test_graph_steps_through_retractions_draw_what_eager_steps_draw(tiny_llama):
    """A pool too small for every request at once: the newest are retracted and recomputed later, and the
    graph path's batches shrink and grow around them. Seeded draws must match an engine without graphs."""
    path, _ = tiny_llama
    pytest.importorskip("triton")
    engines = [Engine(model_path=path, max_total_tokens=128, page_size=8, attention_backend="triton")
               for _ in range(2)]
    g = InPlaceGraphs(engines[0].model, engines[0].pool, engines[0].runner.backend, max_bs=8, max_context=512)
    g.graphs = {b: None for b in (1, 2, 4, 8)}
    engines[0].runner.graphs = g
    outs = []
    for engine in engines:
        reqs = [engine.add_request([5 + i, 9, 11 + i] * 4, SamplingParams(temperature=0.9, seed=i, max_tokens=16,
                                                                          ignore_eos=True)) for i in range(5)]
        while engine.has_work():
            engine.step()
        outs.append([r.output_ids for r in reqs])
        assert all(len(o) == 16 for o in outs[-1])
    assert all(e.scheduler.num_retracted > 0 for e in engines), "the pool must be too small"
    assert outs[0] == outs[1]
