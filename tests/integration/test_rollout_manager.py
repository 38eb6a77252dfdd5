"""The rollout manager with real embedded engines: groups, seeds, dispatch over several
engines, retries, and dropping (and counting) groups whose requests keep failing."""

from __future__ import annotations

import asyncio
import re
from collections import Counter

import pytest

from vlmrl.data.images import encode_data_uri as encode_image_data_uri
from vlmrl.rollout.embedded import EmbeddedEngine
from vlmrl.rollout.manager import RolloutManager, RolloutPrompt
from vlmrl.rollout.protocol import EngineError, SamplingParams


class FailingEngine(EmbeddedEngine):
    """A real embedded engine whose `generate` raises for chosen requests: `fail` maps a
    request-id prefix ("s0-p3" = prompt 3, "s0-p3-n1" = its sample 1) to how many calls
    fail before it works (-1: always)."""

    def __init__(self, *args, fail: dict[str, int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail = dict(fail or {})
        self.calls: Counter[str] = Counter()

    async def generate(self, requests):
        for r in requests:
            rid = _short(r.rid)
            self.calls[rid] += 1
            for prefix, times in self.fail.items():
                if rid == prefix or rid.startswith(prefix + "-"):
                    if times < 0 or self.calls[rid] <= times:
                        raise EngineError(f"injected failure for {r.rid}")
        return await super().generate(requests)


def _short(rid: str) -> str:
    """"s{step}-p{prompt}-n{sample}" of the manager's request id (run prefix, batch position
    and retry suffix dropped)."""
    return re.sub(r"^r[0-9a-f]+-|-g\d+|-r\d+$", "", rid)


def _image(seed: int) -> str:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (84, 84), (seed * 40 % 255, 90, 160))
    ImageDraw.Draw(img).rectangle([10, 10, 10 + seed * 7, 50], fill=(250, 250, 0))
    return encode_image_data_uri(img)


@pytest.fixture(scope="module")
def model_and_processor(tiny_checkpoint, tiny_config):
    d = tiny_config.data
    e = EmbeddedEngine(tiny_checkpoint, min_pixels=d.min_pixels, max_pixels=d.max_pixels)
    return e.model, e.processor


def _engine(tiny_checkpoint, model_and_processor, name, **fail):
    model, processor = model_and_processor
    return FailingEngine(tiny_checkpoint, model=model, processor=processor, name=name, **fail)


@pytest.fixture(scope="module")
def prompts(model_and_processor):
    _, proc = model_and_processor
    out = []
    for i in range(5):
        n_img = i % 2
        content = [{"type": "image"}] * n_img + [{"type": "text", "text": f"Find the value of x in figure {i}."}]
        text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=False)
        out.append(RolloutPrompt(index=10 + i, prompt_text=text, images=(_image(i),) * n_img, answer=str(i)))
    return out


SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8)


def test_groups_seeds_and_two_engines(tiny_checkpoint, model_and_processor, prompts):
    engines = [_engine(tiny_checkpoint, model_and_processor, "a"), _engine(tiny_checkpoint, model_and_processor, "b")]
    mgr = RolloutManager(engines, n_samples=3, sampling=SAMPLING, max_in_flight=4, seed=7, progress=False)
    batch = mgr.run(prompts)
    st = batch.stats
    assert st.dropped_groups == 0 and st.completed_groups == 5 and len(batch.records) == 15
    assert [(r.prompt_index, r.sample_index) for r in batch.records] == [(10 + i, j) for i in range(5) for j in range(3)]
    assert set(st.per_engine) == {"a", "b"} and sum(st.per_engine.values()) == 15
    for r in batch.records:
        assert 0 < len(r.response_ids) == len(r.logprobs) <= 8
        assert r.truncated == (r.finish_reason == "length") == (len(r.response_ids) == 8)
        assert r.prompt_ids and r.answer == str(r.prompt_index - 10)
    groups = batch.groups()
    assert all(len({tuple(r.response_ids) for r in g}) > 1 for g in groups.values())  # distinct seeds
    again = mgr.run(prompts)  # same seed and step: the same samples, whichever engine served them
    assert [r.response_ids for r in again.records] == [r.response_ids for r in batch.records]
    other_step = mgr.run(prompts, step=1)
    assert [r.response_ids for r in other_step.records] != [r.response_ids for r in batch.records]


def test_failed_request_is_retried(tiny_checkpoint, model_and_processor, prompts):
    eng = _engine(tiny_checkpoint, model_and_processor, "flaky", fail={"s0-p11-n1": 2})
    mgr = RolloutManager([eng], n_samples=2, sampling=SAMPLING, max_retries=3, backoff_s=0.01, progress=False)
    batch = mgr.run(prompts[:3])
    assert batch.stats.dropped_groups == 0 and len(batch.records) == 6
    assert batch.stats.failed_attempts == 2 and batch.stats.retries == 2
    rec = next(r for r in batch.records if r.prompt_index == 11 and r.sample_index == 1)
    assert rec.attempts == 3


def test_group_is_dropped_and_counted_after_retries(tiny_checkpoint, model_and_processor, prompts):
    eng = _engine(tiny_checkpoint, model_and_processor, "broken", fail={"s0-p12-n2": -1})
    mgr = RolloutManager([eng], n_samples=3, sampling=SAMPLING, max_retries=2, backoff_s=0.01, progress=False)
    batch = mgr.run(prompts)
    st = batch.stats
    assert st.dropped_groups == 1 and st.dropped_prompt_indices == [12] and st.completed_groups == 4
    assert eng.calls["s0-p12-n2"] == 3  # first try + 2 retries
    assert 2 not in batch.groups() and len(batch.records) == 12  # no partial group, nothing scored zero
    assert 12 not in {r.prompt_index for r in batch.records}
    assert all(len(g) == 3 for g in batch.groups().values())


def test_retry_moves_to_a_healthy_engine(tiny_checkpoint, model_and_processor, prompts):
    dead = _engine(tiny_checkpoint, model_and_processor, "dead", fail={"s0": -1})
    alive = _engine(tiny_checkpoint, model_and_processor, "alive")
    mgr = RolloutManager([dead, alive], n_samples=2, sampling=SAMPLING, max_retries=1, backoff_s=0.01,
                         max_in_flight=2, progress=False)
    batch = mgr.run(prompts)
    assert batch.stats.dropped_groups == 0 and len(batch.records) == 10
    assert batch.stats.per_engine == {"alive": 10}


def test_non_retryable_error_drops_at_once(tiny_checkpoint, model_and_processor, prompts):
    eng = _engine(tiny_checkpoint, model_and_processor, "e")
    bad = RolloutPrompt(index=99, prompt_text="no placeholder here", images=(_image(1),))
    mgr = RolloutManager([eng], n_samples=2, sampling=SAMPLING, max_retries=3, backoff_s=0.01, progress=False)
    batch = asyncio.run(mgr.generate([prompts[0], bad]))
    assert batch.stats.dropped_prompt_indices == [99] and batch.stats.retries == 0
    assert len(batch.records) == 2


def test_duck_typed_prompts_and_progress(tiny_checkpoint, model_and_processor, prompts):
    eng = _engine(tiny_checkpoint, model_and_processor, "e")
    dicts = [{"index": p.index, "prompt_text": p.prompt_text, "images": list(p.images), "answer": p.answer}
             for p in prompts[:2]]
    mgr = RolloutManager([eng], n_samples=1, sampling=SamplingParams(temperature=0.0, max_new_tokens=4),
                         progress=True)
    batch = mgr.run(dicts)
    assert len(batch.records) == 2
    assert batch.stats.generated_tokens == sum(len(r.response_ids) for r in batch.records) > 0
