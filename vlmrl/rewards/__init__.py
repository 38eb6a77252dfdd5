"""Rule-based verifiers: ``get_verifier(name)(response, answer) -> float``.

``math`` (the default) rewards a last ``\\boxed{}`` answer that is mathematically equal
to the label; ``geo3k_tol05`` and ``geo3k_strict`` also accept numeric answers within
0.05 (or exactly at) the label. A match scores 1.0; a well-formed wrong answer scores the
verifier's ``format_score`` (0.0 by default, so binary); no answer, or one that offers more
values than the label (``3 or 4`` for a label of one value), scores 0.0.
:class:`RewardPool` scores batches in worker processes with a hard per-call timeout. Nothing here evaluates model text with ``eval`` or a CAS.
"""

from vlmrl.rewards.answer import Answer, answer_values, normalize_answer, parse_answer, parse_label
from vlmrl.rewards.base import Verifier
from vlmrl.rewards.extract import last_boxed
from vlmrl.rewards.geo3k import Geo3kVerifier
from vlmrl.rewards.math import MathVerifier, math_equal
from vlmrl.rewards.pool import PoolStats, RewardPool
from vlmrl.rewards.registry import VERIFIER_NAMES, build_verifier, get_verifier

__all__ = [
    "VERIFIER_NAMES",
    "Answer",
    "Geo3kVerifier",
    "MathVerifier",
    "PoolStats",
    "RewardPool",
    "Verifier",
    "answer_values",
    "build_verifier",
    "get_verifier",
    "last_boxed",
    "math_equal",
    "normalize_answer",
    "parse_answer",
    "parse_label",
]
