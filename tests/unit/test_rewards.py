"""Verifiers (math, geo3k) on GEO3K-style answers, answers offering several values, format
scores, their registry, and the RewardPool."""

from __future__ import annotations

import asyncio
import pickle
import time

import pytest

from vlmrl.rewards import (
    VERIFIER_NAMES,
    Geo3kVerifier,
    MathVerifier,
    RewardPool,
    answer_values,
    build_verifier,
    get_verifier,
    last_boxed,
    normalize_answer,
)

MATH = get_verifier("math")
TOL05 = get_verifier("geo3k_tol05")
STRICT = get_verifier("geo3k_strict")

# (response, label, math, geo3k_tol05, geo3k_strict)
CASES = [
    # integers and decimals
    ("The area is \\boxed{270}.", "270", 1, 1, 1),
    ("\\boxed{12.5}", "12.5", 1, 1, 1),
    ("\\boxed{12.50}", "12.5", 1, 1, 1),
    ("\\boxed{8.700}", "8.7", 1, 1, 1),
    ("\\boxed{ 8.7 }", "8.7", 1, 1, 1),
    ("\\boxed{12.5}", "12", 0, 0, 0),
    ("\\boxed{60}", "30", 0, 0, 0),
    ("\\boxed{-4}", "-4", 1, 1, 1),
    ("\\boxed{-4}", "4", 0, 0, 0),
    ("\\boxed{0}", "0", 1, 1, 1),
    ("\\boxed{0.04}", "0", 0, 1, 0),
    # fractions
    ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}", 1, 1, 1),
    ("\\boxed{0.75}", "\\frac{3}{4}", 1, 1, 1),
    ("\\boxed{3/4}", "\\frac{3}{4}", 1, 1, 1),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", 1, 1, 1),
    ("\\boxed{\\tfrac34}", "0.75", 1, 1, 1),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", 1, 1, 1),
    ("\\boxed{\\frac{40}{3}}", "\\frac { 40 } { 3 }", 1, 1, 1),
    ("\\boxed{13.3}", "\\frac { 40 } { 3 }", 0, 1, 0),
    ("\\boxed{0.33}", "\\frac{1}{3}", 0, 1, 0),
    ("\\boxed{\\left(\\frac{1}{2}\\right)}", "0.5", 1, 1, 1),
    # roots
    ("\\boxed{\\sqrt{3}}", "\\sqrt{3}", 1, 1, 1),
    ("\\boxed{\\sqrt3}", "\\sqrt{3}", 1, 1, 1),
    ("\\boxed{1.732}", "\\sqrt{3}", 0, 1, 0),
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 1, 1, 1),
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", 1, 1, 1),
    ("\\boxed{2 \\sqrt 3}", "2\\sqrt{3}", 1, 1, 1),
    ("\\boxed{3.46}", "2\\sqrt{3}", 0, 1, 0),
    ("\\boxed{3.5}", "2\\sqrt{3}", 0, 1, 0),
    ("\\boxed{3.6}", "2\\sqrt{3}", 0, 0, 0),
    ("\\boxed{4 \\sqrt { 3 }}", "4 \\sqrt { 3 }", 1, 1, 1),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1, 1, 1),
    ("\\boxed{\\sqrt{3}/2}", "\\frac{\\sqrt{3}}{2}", 1, 1, 1),
    ("\\boxed{0.8660254}", "\\frac{\\sqrt{3}}{2}", 1, 1, 1),
    ("\\boxed{0.866}", "\\frac{\\sqrt{3}}{2}", 0, 1, 0),
    ("\\boxed{\\sqrt{2}^2}", "2", 1, 1, 1),
    # rounding of GEO3K labels (one decimal)
    ("\\boxed{8.66}", "8.7", 0, 1, 0),
    ("\\boxed{8.65}", "8.7", 0, 1, 0),
    ("\\boxed{8.75}", "8.7", 0, 1, 0),
    ("\\boxed{8.64}", "8.7", 0, 0, 0),
    ("\\boxed{8.76}", "8.7", 0, 0, 0),
    ("\\boxed{8.7}", "8.7", 1, 1, 1),
    # pi
    ("\\boxed{3\\pi}", "3\\pi", 1, 1, 1),
    ("\\boxed{9.42}", "3\\pi", 0, 1, 0),
    ("\\boxed{\\frac{\\pi}{2}}", "\\frac{\\pi}{2}", 1, 1, 1),
    ("\\boxed{1.5708}", "\\frac{\\pi}{2}", 0, 1, 0),
    # angles and units
    ("\\boxed{30^\\circ}", "30", 1, 1, 1),
    ("\\boxed{30^{\\circ}}", "30", 1, 1, 1),
    ("\\boxed{30°}", "30", 1, 1, 1),
    ("\\boxed{30 \\text{ degrees}}", "30", 1, 1, 1),
    ("\\boxed{12 \\text{ cm}}", "12", 1, 1, 1),
    ("\\boxed{12\\,\\mathrm{cm}^2}", "12", 1, 1, 1),
    ("\\boxed{12 \\text{ square units}}", "12", 1, 1, 1),
    ("\\boxed{5 units}", "5", 1, 1, 1),
    ("\\boxed{7 m}", "7", 1, 1, 1),
    ("\\boxed{12.5\\%}", "12.5", 1, 1, 1),
    # assignments, separators, punctuation, arithmetic
    ("\\boxed{x = 5}", "5", 1, 1, 1),
    ("\\boxed{AB = 2\\sqrt{3}}", "\\sqrt{12}", 1, 1, 1),
    ("\\boxed{m \\angle ABC = 64}", "64", 1, 1, 1),
    ("\\boxed{1,000}", "1000", 1, 1, 1),
    ("\\boxed{1{,}250}", "1250", 1, 1, 1),
    ("\\boxed{42.}", "42", 1, 1, 1),
    ("So $\\boxed{42}$.", "42", 1, 1, 1),
    ("\\boxed{(2+3)*4}", "20", 1, 1, 1),
    ("\\boxed{2^{3}}", "8", 1, 1, 1),
    ("\\boxed{0.1+0.2}", "0.3", 1, 1, 1),
    # choices and text
    ("\\boxed{A}", "A", 1, 1, 1),
    ("\\boxed{(B)}", "B", 1, 1, 1),
    ("\\boxed{\\text{B}}", "b", 1, 1, 1),
    ("\\boxed{C}", "B", 0, 0, 0),
    ("\\boxed{\\text{right triangle}}", "Right Triangle", 1, 1, 1),
    ("\\boxed{5x}", "5", 0, 0, 0),
    # extraction: missing, malformed, several, nested, \fbox, \boxed without braces
    ("The answer is 270.", "270", 0, 0, 0),
    ("\\boxed{}", "270", 0, 0, 0),
    ("\\boxed{270", "270", 0, 0, 0),
    ("First \\boxed{5}, but on reflection \\boxed{7}.", "7", 1, 1, 1),
    ("First \\boxed{7}, but on reflection \\boxed{5}.", "7", 0, 0, 0),
    ("\\boxed{7} and then a broken \\boxed{5", "7", 0, 0, 0),
    ("\\boxed{\\frac{\\sqrt{\\frac{12}{1}}}{1}}", "2\\sqrt{3}", 1, 1, 1),
    ("\\fbox{15}", "15", 1, 1, 1),
    ("so $\\boxed 5$", "5", 1, 1, 1),
    ("\\boxed5", "5", 1, 1, 1),
    ("\\boxed{6}", "\\boxed{6}", 1, 1, 1),
    ("\\boxed{\\frac{1}}", "1", 0, 0, 0),
    ("\\boxed{10**10**10}", "10000000000", 0, 0, 0),
    ("\\boxed{9^9^9^9}", "1", 0, 0, 0),
]


@pytest.mark.parametrize(("response", "label", "math", "tol05", "strict"), CASES)
def test_verifier_table(response: str, label: str, math: int, tol05: int, strict: int) -> None:
    assert (MATH(response, label), TOL05(response, label), STRICT(response, label)) == (math, tol05, strict)


def test_table_is_large_and_consistent() -> None:
    assert len(CASES) >= 60
    # geo3k accepts everything math accepts: the table must say so too.
    assert all(tol05 >= math and strict >= math for _, _, math, tol05, strict in CASES)


def test_geo3k_accepts_everything_math_accepts() -> None:
    responses = [response for response, *_ in CASES[::2]]
    labels = [label for _, label, *_ in CASES[1::2]]
    for response in responses:
        for label in labels:
            if MATH(response, label):
                assert TOL05(response, label) == 1.0, (response, label)
                assert STRICT(response, label) == 1.0, (response, label)


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("\\boxed{99.5}", "100", 1.0),
        ("\\boxed{101}", "100", 1.0),
        ("\\boxed{98.9}", "100", 0.0),
        ("\\boxed{0.0101}", "0.01", 1.0),  # the bound, 1% of the label, is inclusive
        ("\\boxed{0.0102}", "0.01", 0.0),
        ("\\boxed{0}", "0", 1.0),
        ("\\boxed{0.001}", "0", 0.0),
    ],
)
def test_geo3k_relative_tolerance(response: str, label: str, expected: float) -> None:
    verifier = Geo3kVerifier(name="geo3k_rel", tolerance=0.01, relative=True)
    assert verifier(response, label) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{a{b}c}", "a{b}c"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{1} \\boxedtext{2}", "1"),
        ("\\fbox{1} then \\boxed{2}", "2"),
        ("\\boxed{1} then \\fbox{2}", "2"),
        ("\\boxed   {3}", "3"),
        ("\\boxed 12.5 cm", "12.5"),
        ("no box", None),
        ("\\boxed", None),
        ("\\boxed{" + "1" * 3000 + "}", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("x = \\dfrac{3}{4}", "\\frac{3}{4}"),
        ("45^{\\circ}", "45"),
        ("12\\text{ cm}^2", "12"),
        ("1,234,567", "1234567"),
        ("$5$.", "5"),
        ("(C)", "C"),
        ("m", "m"),
        ("\\text{units}", "units"),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


def test_non_string_label_is_converted() -> None:
    assert MATH("\\boxed{12}", 12) == 1.0  # type: ignore[arg-type]


def test_get_verifier_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown verifier 'gsm8k'") as error:
        get_verifier("gsm8k")
    for name in ("math", "geo3k_tol05", "geo3k_strict"):
        assert name in str(error.value)
    assert set(VERIFIER_NAMES) == {"math", "geo3k_tol05", "geo3k_strict", "coin_flip", "constant"}


def test_constant_control_scores_every_response_the_same() -> None:
    const = get_verifier("constant")
    assert const.format_score == 0.9
    responses = ["\\boxed{4}", "\\boxed{5}", "no answer", "\\boxed{x = 3, y = 4}", ""]
    assert {const(r, "4") for r in responses} == {0.9}
    assert get_verifier("constant", format_score=0.0)("\\boxed{4}", "4") == 0.0


def test_coin_flip_control_carries_no_information() -> None:
    """A fair coin per call: about half ones, the same response scored again is a new flip
    (no response always wins), and the sequence of flips is reproducible from the seed."""
    coin = get_verifier("coin_flip")
    same = [coin("Answer: \\boxed{7}", "7") for _ in range(200)]
    assert 70 <= sum(same) <= 130
    wrong = [coin("Answer: \\boxed{8}", "7") for _ in range(200)]
    assert 70 <= sum(wrong) <= 130  # correct and wrong answers alike
    again = get_verifier("coin_flip")
    assert [again("Answer: \\boxed{7}", "7") for _ in range(200)] == same


def test_presets() -> None:
    assert isinstance(MATH, MathVerifier)
    assert TOL05 == Geo3kVerifier(name="geo3k_tol05", tolerance=0.05)
    assert STRICT.tolerance == 0.0 and not STRICT.relative
    assert get_verifier("geo3k_tol05", relative=True).relative


@pytest.mark.parametrize(
    "cfg",
    [
        {"name": "math", "_target_": "vlmrl.rewards.math.MathVerifier", "timeout_s": 1.0, "num_workers": 2},
        {
            "name": "geo3k_tol05",
            "_target_": "vlmrl.rewards.geo3k.Geo3kVerifier",
            "tolerance": 0.05,
            "relative": False,
            "timeout_s": 1.0,
            "num_workers": 2,
        },
        {
            "name": "geo3k_strict",
            "_target_": "vlmrl.rewards.geo3k.Geo3kVerifier",
            "tolerance": 0.0,
            "relative": False,
            "timeout_s": 1.0,
            "num_workers": 2,
        },
    ],
)
def test_build_verifier_from_reward_config(cfg: dict) -> None:
    verifier = build_verifier(cfg)
    assert verifier.name == cfg["name"] and verifier.num_workers == 2 and verifier.timeout_s == 1.0
    assert verifier == get_verifier(cfg["name"], timeout_s=1.0, num_workers=2)
    assert pickle.loads(pickle.dumps(verifier)) == verifier


def test_build_verifier_errors() -> None:
    assert build_verifier({"name": "geo3k_strict"}) == STRICT
    with pytest.raises(ValueError, match="_target_"):
        build_verifier({"tolerance": 0.1})
    with pytest.raises(ValueError, match="cannot import"):
        build_verifier({"_target_": "vlmrl.rewards.nope.Verifier"})
    with pytest.raises(TypeError, match="not a vlmrl.rewards.base.Verifier"):
        build_verifier({"_target_": "collections.OrderedDict"})
    with pytest.raises(TypeError):
        build_verifier({"_target_": "vlmrl.rewards.math.MathVerifier", "tolerance": 0.1})
    with pytest.raises(ValueError, match="tolerance"):
        Geo3kVerifier(tolerance=-1.0)


def test_format_pattern_asks_for_the_whole_reply() -> None:
    """`format_pattern` scores 0 for a reply with anything around its answer, whatever the box
    says; a well-formed reply scores as without it (1, or format_score when wrong)."""
    pattern = r"Answer: \\boxed\{[^{}]*\}"
    strict = get_verifier("math", format_pattern=pattern, format_score=0.1)
    assert strict("Answer: \\boxed{4}", "4") == 1.0
    assert strict(" Answer: \\boxed{4}\n", "4") == 1.0  # surrounding whitespace is not the reply's shape
    assert strict("Answer: \\boxed{3}", "4") == 0.1
    for junk in ("Answer 146Answer: \\boxed{4}", "Answer: \\boxed{3} \\boxed{4}", "Answer: \\boxed{4} ok",
                 "Answer:\n\\boxed{4}"):
        assert MATH(junk, "4") == 1.0 and strict(junk, "4") == 0.0, junk
    assert get_verifier("math", format_pattern=r"(?s).*\\boxed\{.*\}")("a\nb \\boxed{4}", "4") == 1.0
    assert pickle.loads(pickle.dumps(strict)) == strict
    with pytest.raises(ValueError, match=r"format_pattern '\(' is not a regular expression"):
        get_verifier("math", format_pattern="(")
    for control in ("coin_flip", "constant"):
        with pytest.raises(ValueError, match="format_pattern must be unset"):
            get_verifier(control, format_pattern=pattern)


def test_the_answer_only_reward_config_builds_the_pattern_it_documents() -> None:
    from vlmrl.config import load
    from vlmrl.rewards.registry import verifier_params

    verifier = build_verifier(verifier_params(load(["reward=answer_only"]).reward))
    assert isinstance(verifier, MathVerifier)
    assert verifier("Answer: \\boxed{4}", "4") == 1.0
    assert verifier("Answer 146Answer: \\boxed{4}", "4") == 0.0


# -- RewardPool ---------------------------------------------------------------------------

POOL_RESPONSES = [response for response, *_ in CASES]
POOL_LABELS = [label for _, label, *_ in CASES]
POOL_PAIRS = list(zip(POOL_RESPONSES, POOL_LABELS))


class ScriptedScorer:
    """Test scorer: hangs on "hang", raises on "boom", else the math verifier."""

    def __call__(self, response: str, answer: str) -> float:
        if response == "hang":
            time.sleep(60)
        if response == "boom":
            raise RuntimeError("boom")
        return MATH(response, answer)


def test_pool_inline_matches_direct_calls() -> None:
    with RewardPool(TOL05, num_workers=0) as pool:
        assert pool.score(POOL_RESPONSES, POOL_LABELS) == [TOL05(r, a) for r, a in POOL_PAIRS]
        assert asyncio.run(pool.ascore(POOL_RESPONSES[:5], POOL_LABELS[:5])) == [
            TOL05(r, a) for r, a in POOL_PAIRS[:5]
        ]
        assert pool.stats.calls == len(CASES) + 5 and pool.stats.timeouts == pool.stats.errors == 0


def test_pool_inline_counts_overruns_and_errors() -> None:
    class Slow:
        def __call__(self, response: str, answer: str) -> float:
            if response == "boom":
                raise RuntimeError("boom")
            time.sleep(0.05)
            return 1.0

    with RewardPool(Slow(), num_workers=0, timeout_s=0.01) as pool:
        assert pool.score(["\\boxed{1}", "boom"], ["1", "1"]) == [0.0, 0.0]
        assert (pool.stats.timeouts, pool.stats.errors) == (1, 1)


def test_pool_workers_match_direct_calls_and_replace_stuck_worker() -> None:
    responses = [*POOL_RESPONSES, "hang", "boom", *POOL_RESPONSES[:10]]
    labels = [*POOL_LABELS, "1", "1", *POOL_LABELS[:10]]
    expected = [MATH(r, a) for r, a in zip(responses, labels)]
    with RewardPool(ScriptedScorer(), num_workers=2, timeout_s=1.0) as pool:
        start = time.perf_counter()
        assert pool.score(responses, labels) == expected
        assert time.perf_counter() - start < 20  # the hung call cost two timeouts, not 60 s
        # the stuck pair was tried on a second worker, which stuck too: 0.0
        assert (pool.stats.timeouts, pool.stats.errors, pool.stats.restarts, pool.stats.retries) == (2, 1, 2, 1)
        # The replacement worker is serving: the next batch is complete and correct.
        assert asyncio.run(pool.ascore(POOL_RESPONSES, POOL_LABELS)) == expected[: len(CASES)]
        assert pool.stats.calls == len(responses) + len(CASES)
    assert pool.stats.timeouts == 2
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(["\\boxed{1}"], ["1"])
    pool.close()  # idempotent


class DiesOnce:
    """Test scorer: the worker process dies (no reply, no cleanup) the first time it sees
    "die" (a marker file makes it once), then scores normally."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __call__(self, response: str, answer: str) -> float:
        import os

        if response.startswith("die") and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(9)
        return MATH(response.removeprefix("die"), answer)


def test_pool_scores_again_a_pair_whose_worker_died(tmp_path) -> None:
    responses = ["\\boxed{3}", "die\\boxed{4}", "\\boxed{5}"]
    with RewardPool(DiesOnce(str(tmp_path / "died")), num_workers=2, timeout_s=5.0) as pool:
        assert pool.score(responses, ["3", "4", "6"]) == [1.0, 1.0, 0.0]
        assert (pool.stats.retries, pool.stats.restarts, pool.stats.errors, pool.stats.timeouts) == (1, 1, 0, 0)


def test_pool_defaults_come_from_the_verifier() -> None:
    verifier = get_verifier("math", timeout_s=2.5)
    with RewardPool(verifier) as pool:
        assert (pool.num_workers, pool.timeout_s) == (0, 2.5)
        with pytest.raises(ValueError, match="2 responses but 1 answers"):
            pool.score(["a", "b"], ["a"])


# -- several candidates --------------------------------------------------------------------

FORMAT = 0.9
VERIFIERS = (MATH, TOL05, STRICT)
GRADED = tuple(get_verifier(name, format_score=FORMAT) for name in ("math", "geo3k_tol05", "geo3k_strict"))

# (box content, label): the prediction offers the label's value among others, or states a
# chain that contradicts itself. 0 under every verifier, with or without a format score.
HEDGES = [
    ("x = 3, y = 4", "3"),
    ("x = 3, y = 4", "4"),
    ("x=2 \\text{ or } x=3", "2"),
    ("x=2 \\text{ or } x=3", "3"),
    ("x = 2 \\text{ and } x = 3", "3"),
    ("3 or 4", "4"),
    ("3 or 4", "3"),
    ("3, 4", "4"),
    ("3,4", "3"),
    ("\\{3, 4\\}", "4"),
    ("\\left\\{3, 4\\right\\}", "3"),
    ("x \\in \\{3, 4\\}", "4"),
    ("3; 4", "4"),
    ("3 \\\\ 4", "4"),
    ("3 \\lor 4", "4"),
    ("x = 3 \\vee x = 4", "4"),
    ("2 \\pm 1", "3"),
    ("2 \\pm 1", "1"),
    ("2 ± 1", "3"),
    ("x = \\pm 3", "3"),
    ("5 \\mp 1", "4"),
    ("x = 5 = 6", "6"),
    ("x = 5 = 6", "5"),
    ("5 = 6", "6"),
    ("x = 5 \\approx 6", "6"),
    ("3 \\cdot 4 = 13", "13"),
    ("x = 2 \\quad x = 3", "3"),
    ("x = 2 y = 3", "3"),
    ("AB = 5 \\quad CD = 7", "7"),
    ("m\\angle A = 30 \\quad m\\angle B = 60", "60"),
    ("\\frac{1}{2}, \\frac{1}{3}", "\\frac{1}{2}"),
    ("2\\sqrt{3}, 3\\sqrt{2}", "2\\sqrt{3}"),
    ("30^\\circ \\text{ or } 60^\\circ", "30"),
    ("8.7, 8.6", "8.7"),
    ("8.66, 12", "8.7"),
    ("4, 4", "4"),
    ("A or B", "A"),
]

# (box content, label): one value, with or without a label. 1 under every verifier.
SINGLES = [
    ("x = 5", "5"),
    ("AB = 12", "12"),
    ("m\\angle ABC = 30^\\circ", "30"),
    ("m \\angle 1 = m \\angle 2 = 30", "30"),
    ("5", "5"),
    ("\\frac{1}{2}", "\\frac{1}{2}"),
    ("\\frac{1}{2}", "0.5"),
    ("2\\sqrt{3}", "2\\sqrt{3}"),
    ("y = 2\\sqrt{3}", "\\sqrt{12}"),
    ("x = 5 = 5", "5"),
    ("AB = CD = 4", "4"),
    ("\\frac{1}{2} \\cdot 6 \\cdot 4 = 12", "12"),
    ("A = \\pi r^2 = 25\\pi", "25\\pi"),  # formulas in the middle of a chain
    ("C = 2 \\pi r = 10\\pi", "10\\pi"),
    ("A = \\frac{1}{2} b h = 12", "12"),
    ("A = \\frac{1}{2} \\cdot AB \\cdot h = 12", "12"),
    ("x = 2\\sqrt{3} \\approx 3.4641016", "2\\sqrt{3}"),
    ("x = 8.66 = 8.66", "8.66"),
    ("OR = 5", "5"),
    ("1,000", "1000"),
    ("1,234,567", "1234567"),
    ("\\{7\\}", "7"),
    ("x = 7,", "7"),
]

# (box content, label): the label has several values; the same values in the same order match.
SEVERAL_VALUED_LABELS = [
    ("3, 4", "3, 4", 1.0),
    ("3,4", "3,4", 1.0),
    ("x = 3, y = 4", "3, 4", 1.0),
    ("x = 3 \\text{ or } x = 4", "3, 4", 1.0),
    ("\\{3, 4\\}", "\\{3,4\\}", 1.0),
    ("3, 4", "\\{3, 4\\}", 1.0),
    ("\\frac{1}{2}, 3", "0.5, 3", 1.0),
    ("2 \\pm 1", "2 \\pm 1", 1.0),
    ("3, 1", "2 \\pm 1", 1.0),
    ("(1, 2)", "(1,2)", 1.0),
    ("(x, y) = (1, 2)", "(1, 2)", 1.0),
    ("[0, 1)", "[0,1)", 1.0),
    ("4, 3", "3, 4", FORMAT),  # the order counts: a wrong answer
    ("3", "3, 4", FORMAT),  # fewer values: a wrong answer
    ("3, 4, 5", "3, 4", 0.0),  # more values: a hedge
    ("3, 4", "(3, 4)", 0.0),  # a tuple is one value
]


@pytest.mark.parametrize(("box", "label"), HEDGES)
def test_several_candidates_score_zero_under_every_verifier(box: str, label: str) -> None:
    response = f"So the answer is \\boxed{{{box}}}."
    assert [verifier(response, label) for verifier in (*VERIFIERS, *GRADED)] == [0.0] * 6


@pytest.mark.parametrize(("box", "label"), SINGLES)
def test_one_labelled_value_scores_one_under_every_verifier(box: str, label: str) -> None:
    response = f"So the answer is \\boxed{{{box}}}."
    assert [verifier(response, label) for verifier in (*VERIFIERS, *GRADED)] == [1.0] * 6


def test_hedge_tables_are_consistent() -> None:
    assert len(HEDGES) >= 30 and len(SINGLES) >= 15
    for box, label in HEDGES:  # the same label is matched by some single value
        assert any(MATH(f"\\boxed{{{b}}}", label) for b in (label, f"x = {label}")), (box, label)


@pytest.mark.parametrize(("box", "label", "expected"), SEVERAL_VALUED_LABELS)
def test_labels_with_several_values(box: str, label: str, expected: float) -> None:
    response = f"\\boxed{{{box}}}"
    assert [verifier(response, label) for verifier in GRADED] == [expected] * 3
    binary = 1.0 if expected == 1.0 else 0.0
    assert [verifier(response, label) for verifier in VERIFIERS] == [binary] * 3


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("x = 5", ("5",)),
        ("x = 3, y = 4", ("3", "4")),
        ("x=2 \\text{ or } x=3", ("2", "3")),
        ("\\{3, 4\\}", ("3", "4")),
        ("3; 4", ("3", "4")),
        ("2 \\pm 1", ("2+1", "2-1")),
        ("2 \\mp 1", ("2-1", "2+1")),
        ("(1, 2)", ("(1,2)",)),
        ("\\frac{1}{2}, (1, 2)", ("\\frac{1}{2}", "(1,2)")),
        ("1,000", ("1000",)),
        ("1{,}000", ("1000",)),
        ("x = 5 = 6", None),
        ("x = 2\\sqrt{3} \\approx 3.46", ("3.46",)),
        ("x = 2\\sqrt{3} = 3.5", ("3.5",)),  # one decimal: 3.5 rounds 3.464...
        ("x = 2\\sqrt{3} = 3.4", None),  # 3.4 does not
        ("x = 4.5 = 5", ("5",)),
        ("x = 4.4 = 5", None),
        ("x = 3.46 = 2\\sqrt{3}", ("2\\sqrt{3}",)),
        ("x =", None),
        ("", None),
        (" , ", None),
        ("OR = 3", ("3",)),
        ("\\text{right and isosceles}", ("right", "isosceles")),
    ],
)
def test_answer_values(raw: str, expected: tuple[str, ...] | None) -> None:
    assert answer_values(raw) == expected


# -- format_score --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["math", "geo3k_tol05", "geo3k_strict"])
@pytest.mark.parametrize("format_score", [0.0, 0.1, 0.5, 0.9])
def test_format_score(name: str, format_score: float) -> None:
    verifier = get_verifier(name, format_score=format_score)
    assert verifier("The answer is \\boxed{7}.", "7") == 1.0  # correct
    assert verifier("The answer is \\boxed{x = 7}.", "7") == 1.0
    assert verifier("The answer is \\boxed{8}.", "7") == format_score  # wrong but well-formed
    assert verifier("The answer is \\boxed{x = 12 \\text{ cm}}.", "7") == format_score
    assert verifier("The answer is \\boxed{\\text{seven}}.", "7") == format_score
    assert verifier("The answer is 7.", "7") == 0.0  # no box
    assert verifier("The answer is \\boxed{}.", "7") == 0.0  # empty box
    assert verifier("The answer is \\boxed{7", "7") == 0.0  # unbalanced box
    assert verifier("The answer is \\boxed{7 or 8}.", "7") == 0.0  # several candidates
    assert verifier("The answer is \\boxed{6, 8}.", "7") == 0.0  # several, all wrong
    assert verifier("The answer is \\boxed{x = 7 = 8}.", "7") == 0.0  # a contradiction
    assert verifier("The answer is \\boxed{8}.", "") == 0.0  # a label that does not parse


@pytest.mark.parametrize("format_score", [-0.1, 1.0, 1.5, float("nan"), float("inf")])
@pytest.mark.parametrize("cls", [MathVerifier, Geo3kVerifier])
def test_format_score_is_validated(cls: type, format_score: float) -> None:
    with pytest.raises(ValueError, match=f"{cls.__name__}: format_score must be >= 0 and < 1"):
        cls(format_score=format_score)


def test_coin_flip_refuses_a_format_score() -> None:
    with pytest.raises(ValueError, match="CoinFlipVerifier: format_score must be 0"):
        get_verifier("coin_flip", format_score=0.5)
    assert get_verifier("coin_flip", format_score=0.0).format_score == 0.0


def test_format_score_reaches_the_verifier_the_loop_builds() -> None:
    from vlmrl.config import load
    from vlmrl.rewards.registry import verifier_params

    for name in ("math", "geo3k_tol05", "geo3k_strict"):
        verifier = build_verifier(verifier_params(load([f"reward={name}", "reward.format_score=0.9"]).reward))
        assert verifier == get_verifier(name, format_score=0.9, timeout_s=1.0, num_workers=2)
        assert verifier("\\boxed{8}", "7") == 0.9 and verifier("\\boxed{7 or 8}", "7") == 0.0
        assert build_verifier(verifier_params(load([f"reward={name}"]).reward)).format_score == 0.0
    with pytest.raises(ValueError, match="format_score"):
        build_verifier(verifier_params(load(["reward=coin_flip", "reward.format_score=0.5"]).reward))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_pool_passes_non_binary_rewards_through(num_workers: int) -> None:
    verifier = get_verifier("geo3k_tol05", format_score=FORMAT)
    responses = ["\\boxed{7}", "\\boxed{8}", "7", "\\boxed{7 or 8}", "\\boxed{8.66}"]
    labels = ["7", "7", "7", "7", "8.7"]
    with RewardPool(verifier, num_workers=num_workers) as pool:
        assert pool.score(responses, labels) == [1.0, FORMAT, 0.0, 0.0, 1.0]
        assert pool.stats.errors == pool.stats.timeouts == 0
