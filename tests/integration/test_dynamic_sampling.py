"""Dynamic sampling with real embedded engines: a step keeps the groups the filter keeps, draws
more prompts while it has too few, respects its bounds, and stops (aborts) the requests it no
longer needs, in process and over SGLang's HTTP protocol.

The rewards here are a rule of the test's own (groups of even rows split 0 / 1 by sample, odd
rows are all 0), so which groups are informative is known in advance; the engines generate
for real."""

from __future__ import annotations

import asyncio
import threading

import pytest

from vlmrl.algo.advantages import keeps_group
from vlmrl.rollout.client import HTTPEngine
from vlmrl.rollout.dynamic import SamplingPlan, run_step
from vlmrl.rollout.embedded import EmbeddedEngine
from vlmrl.rollout.manager import RolloutManager, RolloutPrompt
from vlmrl.rollout.protocol import GenerateRequest, SamplingParams
from vlmrl.rollout.server import ThreadedServer


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tiny_config) -> EmbeddedEngine:
    d = tiny_config.data
    return EmbeddedEngine(tiny_checkpoint, min_pixels=d.min_pixels, max_pixels=d.max_pixels, max_batch_size=8)


def _text(engine: EmbeddedEngine, i: int) -> str:
    msg = [{"role": "user", "content": [{"type": "text", "text": f"Find the value of x in figure {i}."}]}]
    return engine.processor.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)


class Stream:
    """Prompts 0, 1, 2, ... in order, as the data stream gives them; counts what was drawn."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine, self.position, self.calls = engine, 0, []

    def __call__(self, n: int) -> list[RolloutPrompt]:
        out = [RolloutPrompt(index=i, prompt_text=_text(self.engine, i), answer=str(i))
               for i in range(self.position, self.position + n)]
        self.position += n
        self.calls.append(n)
        return out


def even_rows_informative(records) -> list[float]:
    return [float(r.sample_index % 2) if r.prompt_index % 2 == 0 else 0.0 for r in records]


def _equal(rewards: list[float]) -> bool:
    return keeps_group(rewards, "equal_reward")


SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6)


def test_a_step_refills_the_groups_the_filter_drops(engine):
    """batch_size 3 from rows 0, 1, 2, ...: round 1 draws 3 (keeps 0 and 2), then one prompt a
    round until row 4 fills the batch. Kept groups carry their rewards; the dropped ones are
    counted, and their samples kept aside for the step's sampled-reward metrics."""
    mgr = RolloutManager([engine], n_samples=4, sampling=SAMPLING, seed=3, progress=False)
    stream = Stream(engine)
    plan = SamplingPlan(batch_size=3, filtering=True, oversample=1.0, max_rounds=5)
    loop_thread = threading.get_ident()

    def prepare(records):  # what the trainer's samples need of a group, built as it completes
        return records[0].group_index, [r.sample_index for r in records], threading.get_ident()

    out = run_step(mgr, stream, even_rows_informative, _equal, plan, step=0, prepare=prepare)
    assert stream.calls == [3, 1, 1] and out.rounds == 3 and not out.bound_hit
    # built for every kept group, whole, off the event loop's thread (beside the scoring)
    kept = sorted({r.group_index for r in out.records})
    assert sorted(out.prepared) == kept and all(out.prepared[g][:2] == (g, [0, 1, 2, 3]) for g in kept)
    assert all(out.prepared[g][2] != loop_thread for g in kept)
    assert [p.index for p in out.prompts] == [0, 1, 2, 3, 4]
    assert sorted({r.prompt_index for r in out.records}) == [0, 2, 4] and out.kept_groups == 3
    assert len(out.records) == 12 and out.rewards == [float(r.sample_index % 2) for r in out.records]
    assert sorted({r.prompt_index for r in out.rejected}) == [1, 3] and out.rejected_rewards == [0.0] * 8
    assert [r.group_index for r in out.records] == sorted(r.group_index for r in out.records)
    m = out.metrics()
    assert m["rollout/kept_groups"] == 3 and m["rollout/filtered_groups"] == 2
    assert m["rollout/sampling_rounds"] == 3 and m["rollout/prompts_drawn"] == 5
    assert m["rollout/sampling_bound_hit"] == 0
    # without a filter the same stream gives a plain step: 3 prompts, every group kept
    plain = run_step(mgr, Stream(engine), even_rows_informative, _equal, SamplingPlan(batch_size=3), step=0)
    assert plain.rounds == 1 and sorted({r.prompt_index for r in plain.records}) == [0, 1, 2]
    assert not plain.rejected and not plain.bound_hit
    # the same seeds give the same samples to the groups both steps kept
    same = [r.response_ids for r in plain.records if r.prompt_index in (0, 2)]
    assert same == [r.response_ids for r in out.records if r.prompt_index in (0, 2)]


def test_the_bounds_hold_and_the_step_trains_on_what_it_has(engine):
    """Every group all-equal: rounds of ceil(2 x 1.5) = 3 prompts, then 2 (the 5-prompt budget),
    and the step ends with nothing kept and says so."""
    mgr = RolloutManager([engine], n_samples=2, sampling=SAMPLING, seed=3, progress=False)
    stream = Stream(engine)
    plan = SamplingPlan(batch_size=2, filtering=True, oversample=1.5, max_rounds=4, max_prompts=5)
    out = run_step(mgr, stream, lambda records: [0.0] * len(records), _equal, plan, step=0)
    assert stream.calls == [3, 2] and out.rounds == 2 and len(out.prompts) == 5
    assert out.kept_groups == 0 and out.records == [] and out.bound_hit
    assert out.stats.rejected_groups == 5 and out.metrics()["rollout/sampling_bound_hit"] == 1
    # max_rounds binds first when the budget is larger
    stream = Stream(engine)
    plan = SamplingPlan(batch_size=2, filtering=True, oversample=1.0, max_rounds=2)
    out = run_step(mgr, stream, lambda records: [0.0] * len(records), _equal, plan, step=0)
    assert stream.calls == [2, 2] and out.rounds == 2 and out.bound_hit


@pytest.mark.parametrize("http", [False, True], ids=["engine", "http"])
def test_groups_past_the_batch_are_aborted_not_awaited(engine, http):
    """Oversampling 4x for one group: once the first group in draw order is complete and kept,
    the other three are no longer needed. Their requests stop on the engine (queued ones never
    run, running ones at their next token) instead of generating their 64 tokens; the kept group
    is the first drawn, whatever finished first."""
    slow = SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True)

    def one_informative_group(records) -> list[float]:
        return [float(r.sample_index % 2) for r in records]

    before, tokens_before = engine.stats.get("aborted", 0), engine.stats["generated_tokens"]
    server = ThreadedServer(engine) if http else None
    try:
        target = HTTPEngine(server.url, max_retries=0) if http else engine
        # one group in flight at a time: group 0 runs first; group 1's requests reach the
        # engine while group 0 is scored, and the rest wait behind them
        mgr = RolloutManager([target], n_samples=2, sampling=slow, seed=3, progress=False, max_in_flight=2)
        plan = SamplingPlan(batch_size=1, filtering=True, oversample=4.0, max_rounds=1)
        out = run_step(mgr, Stream(engine), one_informative_group, _equal, plan, step=0)
    finally:
        if server is not None:
            server.stop()
    assert [p.index for p in out.prompts] == [0, 1, 2, 3]
    assert {r.prompt_index for r in out.records} == {0} and len(out.records) == 2
    assert all(len(r.response_ids) == 64 for r in out.records)
    st = out.stats
    assert st.surplus_groups == 3 and st.completed_groups == 1 and st.dropped_groups == 0
    assert st.aborted_requests >= 1  # group 1's requests had reached the engine
    if http:  # the server still held them when /abort_request came (in process, the cancelled
        # callers' requests leave the engine's queue unrun, before any abort reaches it)
        assert engine.stats.get("aborted", 0) > before
    _idle(engine)
    # the kept group's 128 tokens, and less than the whole of the one group that had started
    assert 128 <= engine.stats["generated_tokens"] - tokens_before < 2 * 2 * 64


def _idle(engine: EmbeddedEngine, timeout_s: float = 30.0) -> None:
    """Wait until the engine has nothing running or queued (an aborted batch ends at its next
    step, in the engine's worker thread)."""
    import time

    deadline = time.monotonic() + timeout_s
    while engine.load() != {"running": 0, "waiting": 0}:
        assert time.monotonic() < deadline, engine.load()
        time.sleep(0.01)


def test_the_engine_stops_an_aborted_request_where_it_is(engine):
    """A running request ends at its next decode step with finish_reason "abort" and the tokens
    it has (none when the abort came in its prefill), far short of its 1,000; one still queued behind it ends without running; other requests are untouched;
    ids the engine does not hold are ignored."""
    long = SamplingParams(temperature=1.0, max_new_tokens=1000, ignore_eos=True, seed=1)

    async def go():
        reqs = [GenerateRequest(text=_text(engine, i), sampling=long, rid=f"abort-test-{i}") for i in range(2)]
        running = asyncio.ensure_future(engine.generate([reqs[0]]))
        while engine.load()["running"] == 0:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)  # into its decode steps
        queued = asyncio.ensure_future(engine.generate([reqs[1]]))
        other = asyncio.ensure_future(engine.generate([GenerateRequest(
            text=_text(engine, 9), sampling=SamplingParams(max_new_tokens=3, temperature=1.0, seed=2))]))
        await asyncio.sleep(0.01)  # both are queued behind the running one
        await engine.abort_requests(["abort-test-0", "abort-test-1", "no-such-request"])
        return (await running)[0], (await queued)[0], (await other)[0]

    first, second, other = asyncio.run(go())
    assert first.finish_reason == "abort" and len(first.output_ids) < 1000
    assert len(first.logprobs) == len(first.output_ids)
    assert second.finish_reason == "abort" and second.output_ids == []
    assert other.finish_reason in ("stop", "length") and other.output_ids
    _idle(engine)
    assert not engine._live and not engine._aborted  # nothing left behind
