"""Parameters of a test of which some are slow: ``make test`` leaves those out (``-m "not slow"``) and keeps the
others, so every property a test checks is still checked there.

A test is slow where it is defined: ``@pytest.mark.slow`` on the test, or :func:`slow_where` on some of its
parameters (``make test-slow`` runs them). They were chosen from one full run's durations (pytest --durations=0,
2026-12-03, 2 cores shared with two model runs: 6,991 s in all, 1,180 s on CI's idle machine), keeping in
``make test`` every property at least once: the whole-run tests have faster siblings in the same files (a run
refused, resumed, reused), and the parametrized ones keep their other parameters (int8 and int2 against the
reference perplexity; float32 and float16 states; prompts of 5 and 23 tokens; one split of the fused kernel)."""

import pytest


def slow_where(values, slow) -> list:
    """``values`` as pytest parameters (a tuple is one case's arguments), those for which ``slow(value)`` holds
    marked ``slow``; their ids are what pytest gives the plain values."""
    def marked(value):
        return pytest.param(*value if isinstance(value, tuple) else (value,), marks=pytest.mark.slow)

    return [marked(v) if slow(v) else v for v in values]
