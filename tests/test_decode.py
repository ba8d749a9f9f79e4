"""accelnode.decode: the one bounded JSON decoder (issue 33). Its count of values and depth is
exact on valid JSON, whatever the strings hold (the budgets are checked on the bytes, before
anything is parsed), and what it refuses says which document and why."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelnode.decode import MANIFEST, Budget, DocumentError, check, decode, read_file
from tests.fuzz.fuzzing import fuzz_settings, json_values

tricky = st.one_of(json_values, st.text(alphabet='",:{}[]\\ \n\tu0é', max_size=30))
values = st.recursive(tricky, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(tricky.filter(lambda k: isinstance(k, str))
                                                                      .map(str), inner, max_size=4)), max_leaves=40)


def _finite(v) -> bool:
    try:
        json.dumps(v, allow_nan=False)
    except ValueError:
        return False
    return True


def count(v) -> int:
    if isinstance(v, dict):
        return 1 + sum(1 + count(x) for x in v.values())  # a member: its key and its value
    if isinstance(v, list):
        return 1 + sum(count(x) for x in v)
    return 1


def depth(v) -> int:
    if isinstance(v, dict):
        return 1 + max(map(depth, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(depth, v), default=0)
    return 0


@fuzz_settings(ci_examples=300)
@given(v=values.filter(_finite), indent=st.sampled_from([None, 1]))
def test_the_budget_is_exact_on_valid_json(v, indent):
    body = json.dumps(v, indent=indent, ensure_ascii=bool(indent)).encode()
    n, d = count(v), depth(v)
    assert decode(body, Budget(len(body), n, max(d, 1)), "doc", None) == v
    if n > 1:
        with pytest.raises(DocumentError, match=f"holds {n} JSON values"):
            check(body, Budget(len(body), n - 1, 64), "doc")
    if d > 1:
        with pytest.raises(DocumentError, match=f"nests arrays and objects {d} deep, over the budget of {d - 1}"):
            check(body, Budget(len(body), n, d - 1), "doc")


@pytest.mark.parametrize("body, problem", [
    (b"[" + b"{}," * 1_400_000 + b"{}]", "is 4200004 bytes, over the 4 MiB budget"),
    (b"[" + b"{}," * 1_000_000 + b"{}]", "holds 1000002 JSON values in 3000004 bytes, over the budget of 100000"),
    (b"[" + b'"",' * 1_000_000 + b'""]', "holds at least 1000001 JSON values (strings)"),
    (b"[" * 33 + b"]" * 33, "nests arrays and objects 33 deep, over the budget of 32"),
    (b'{"a": NaN}', "is not valid JSON: NaN is not JSON"),
    (b"\xef\xbb\xbf{}", "is not valid JSON: UTF-8 only"),
    ('{"a": 1}'.encode("utf-16-le"), "is not valid JSON: UTF-8 only"),
    (b"[1, 2]", "is not a JSON object"),
    (b"{", "is not valid JSON"),
    ("{\"\ud800\": 1}", "not UTF-8"),
    ([1, 2], "is not a JSON text but a list"),
])
def test_refusals_name_the_document_and_the_problem(body, problem):
    with pytest.raises(DocumentError) as info:
        decode(body, MANIFEST, "manifest sha256:abc of ghcr.io/x")
    assert str(info.value).startswith("manifest sha256:abc of ghcr.io/x "), info.value
    assert problem in str(info.value), info.value


def test_a_file_is_read_no_further_than_its_budget(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b'{"a": "' + b"x" * (2 << 20) + b'"}')
    with pytest.raises(DocumentError, match=f"{path} is 1048577 bytes, over the 1 MiB budget"):
        read_file(path, Budget(1 << 20, 10, 4))
    assert read_file(path, Budget(4 << 20, 10, 4))["a"] == "x" * (2 << 20)
