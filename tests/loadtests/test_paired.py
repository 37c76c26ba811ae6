"""loadtests.harness.paired: the round-by-round verdict the peers section gives (ours ahead, behind
or tied with a peer), checked against binomial tails computed here by enumeration."""

import itertools
import math

import pytest

from loadtests.harness import ALPHA, paired, sign_test


@pytest.mark.parametrize("n", [1, 3, 5, 8, 10])
def test_sign_test_is_the_binomial_tail_by_enumeration(n):
    outcomes = list(itertools.product([0, 1], repeat=n))  # every sequence of n fair rounds
    for k in range(n + 1):
        tail = sum(sum(o) >= k for o in outcomes) / len(outcomes)
        assert math.isclose(sign_test(k, n), tail)
    assert sign_test(0, 0) == 1.0


def test_fewest_rounds_for_a_verdict():
    # 4 of 4 is still chance at 1 in 16; 5 of 5 is not; 8 of 10 is not enough, 9 of 10 is.
    assert sign_test(4, 4) > ALPHA > sign_test(5, 5)
    assert sign_test(8, 10) > ALPHA > sign_test(9, 10)


def test_throughput_higher_is_better():
    ours, theirs = [10.0, 11, 12, 10.5, 11.5], [9.0, 10, 11, 10, 11]
    p = paired(ours, theirs, higher_is_better=True)
    assert (p.ahead, p.behind, p.rounds, p.verdict) == (5, 0, 5, "ahead")
    assert p.ratios == pytest.approx([t / o for o, t in zip(ours, theirs)])
    assert paired(theirs, ours, higher_is_better=True).verdict == "behind"


def test_latency_lower_is_better():
    ours, theirs = [100.0, 101, 99, 100, 102, 98], [110.0, 108, 112, 111, 109, 113]
    assert paired(ours, theirs, higher_is_better=False).verdict == "ahead"
    assert paired(ours, theirs, higher_is_better=True).verdict == "behind"


def test_mixed_rounds_and_equal_rounds_are_a_tie():
    p = paired([10.0, 9, 10, 9, 10, 9], [9.0, 10, 9, 10, 9, 10], higher_is_better=True)
    assert (p.ahead, p.behind, p.verdict) == (3, 3, "tie")
    # Equal rounds count for neither side: 4 wins and 2 draws are 4 of 4, still chance.
    p = paired([10.0, 10, 11, 11, 11, 11], [10.0, 10, 9, 9, 9, 9], higher_is_better=True)
    assert (p.ahead, p.behind, p.verdict) == (4, 0, "tie")


def test_unequal_or_empty_windows_are_refused():
    with pytest.raises(ValueError):
        paired([1.0, 2.0], [1.0], higher_is_better=True)
    with pytest.raises(ValueError):
        paired([], [], higher_is_better=True)


@pytest.mark.parametrize("flag,value,why", [
    ("--peers-rounds", "0", "must be above 0, got 0"),
    ("--peers-rounds", "-3", "must be above 0, got -3"),
    ("--peers-seconds", "0", "must be above 0, got 0"),
    ("--peers-seconds", "x", "invalid float value: 'x'"),
])
def test_the_bench_refuses_rounds_or_windows_that_cannot_give_a_verdict(flag, value, why):
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run([sys.executable, "-m", "loadtests.bench", flag, value], cwd=Path(__file__).resolve().parents[2],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and why in r.stderr, r.stderr
    assert "machine:" not in r.stdout  # refused before anything ran
