"""What every fuzz test shares: its hypothesis settings and strategies for hostile JSON.

In CI a run is bounded and repeatable: each test tries a fixed number of examples chosen from a
fixed seed (``derandomize``), no example database. ``ACCELNODE_FUZZ_EXAMPLES=N`` runs N examples
per test from a fresh random seed each time (hypothesis prints the seed of any failure; rerun it
with ``--hypothesis-seed``), for a longer hunt on a developer's machine:

    ACCELNODE_FUZZ_EXAMPLES=20000 pytest tests/fuzz -x
"""

from __future__ import annotations

import os
import string

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

LONG = int(os.environ.get("ACCELNODE_FUZZ_EXAMPLES", "0") or 0)


def fuzz_settings(ci_examples: int) -> settings:
    """``ci_examples`` per test in CI (deterministic), else ACCELNODE_FUZZ_EXAMPLES (random)."""
    return settings(max_examples=LONG or ci_examples, derandomize=not LONG, database=None, deadline=None,
                    print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                            HealthCheck.filter_too_much,
                                                            HealthCheck.function_scoped_fixture])


# Strings that reach the parsers' corners: empty, huge, control and non-ASCII characters, what
# references, digests, quantities and URLs are made of.
text = st.one_of(st.text(max_size=40), st.text(alphabet=string.printable, max_size=40),
                 st.sampled_from(["", "sha256:", "sha256:" + "a" * 64, "sha512:" + "b" * 128, "latest", "1Gi",
                                  "-1", "1e400", "NaN", "0x10", "../..", "/", "a" * 300, "\x00", "é", "☃",
                                  "http://", "https://x", "127.0.0.1:5000/r@sha256:" + "c" * 64]))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), text)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=5)), max_leaves=25)


def shaped(template: dict) -> st.SearchStrategy:
    """A dict shaped like ``template`` (a key -> strategy map), each key present or missing and
    some values swapped for any JSON value, plus stray keys: near-valid documents, which reach
    deeper than random ones."""
    def build(draw):
        out = {}
        for key, strategy in template.items():
            choice = draw(st.integers(0, 9))
            if choice == 0:
                continue  # missing
            out[key] = draw(json_values) if choice == 1 else draw(strategy)
        if draw(st.integers(0, 9)) == 0:
            out[draw(text)] = draw(json_values)
        return out
    return st.composite(lambda draw: build(draw))()
