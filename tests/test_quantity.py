"""accelnode/kube/quantity.py: the one parser of Kubernetes quantities (PV capacities, view sizes)."""

import pytest

from accelnode.kube.quantity import to_bytes


@pytest.mark.parametrize("text, want", [
    ("1Gi", 1 << 30), ("3k", 3000), ("1048576", 1 << 20), ("1e3", 1000), ("2e+2", 200), ("1.5G", 1_500_000_000),
    (".5Ki", 512), ("3.", 3), ("1e-3", 1), ("1E", 10**18), ("1Ei", 1 << 60), ("0", 0),
])
def test_quantities(text, want):
    assert to_bytes(text) == want


@pytest.mark.parametrize("text", ["", "-1", " 1Gi", "1Gi ", "1Gi,nr_inodes=0", "1gi", "1e1000", "9" * 41, "9" * 5000])
def test_not_quantities(text):
    assert to_bytes(text) is None
