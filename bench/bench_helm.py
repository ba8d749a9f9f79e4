"""Installing with Helm against installing with kustomize, on the same real kubelet lane
(tests/node/conftest.py ``lane``: control plane, containerd 2 + kubelet, our image already in
containerd), alternately, ``ROUNDS`` times each, everything removed between two installs:

- ``helm_install_ready_s``: ``helm install`` of accelnode-crds, then of accelnode (no ``--wait``)
  -> every accelnode pod Ready (the same poll as kustomize's);
- ``kustomize_apply_ready_s``: ``kubectl apply --server-side -k daemonsets/crds/``, then
  ``-k`` the overlay -> every accelnode pod Ready;
- ``helm_vs_kustomize_ratio``: the two medians' ratio (both fitted to the lane by the same
  kustomize overlay; Helm's through its post-renderer);
- ``helm_template_s``: ``helm template`` of the chart alone (client side: values, schema, render).

Needs root and the tools of ``make tools``. Run it under ``flock /tmp/kubelet.lock``.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

G = "helm"
ROUNDS = 2


def emit(metric: str, value, fmt: str = ".2f") -> None:
    print(f"BENCH {G} {metric}={value:{fmt}}", flush=True)


def main() -> None:
    from tests.helm.chart import CHART, CRDS_CHART, NAMESPACE, HelmLane, template
    from tests.node.conftest import BASE, _build, fit, lane

    times: dict[str, list[float]] = {"helm": [], "kustomize": []}
    with tempfile.TemporaryDirectory(prefix="accelnode-bench-helm-") as tmp, \
            contextlib.redirect_stdout(sys.stderr), lane(Path(tmp), None) as world:
        h = HelmLane(world)
        overlay = world.workdir / "kustomize-overlay"
        fit(world, overlay, BASE, _build(BASE))

        def ready(what: str, t0: float) -> None:
            world.wait(world.system_ready, f"every accelnode pod Ready ({what})", timeout=300, interval=0.1)
            times[what].append(time.monotonic() - t0)
            world.wait(lambda: all(p["status"].get("phase") == "Running" for p in world.pods()), "Running")

        def gone() -> None:
            world.wait(lambda: not world.pods(), "every accelnode pod gone", timeout=300)

        for _ in range(ROUNDS):
            t0 = time.monotonic()
            h("install", "accelnode-crds", str(CRDS_CHART), "-n", NAMESPACE, "--create-namespace")
            h.release("install", str(CHART), wait=False)
            ready("helm", t0)
            h("uninstall", "accelnode", "-n", NAMESPACE, "--wait", "--timeout", "5m")
            h("uninstall", "accelnode-crds", "-n", NAMESPACE)  # the CRDs stay (keep)
            gone()
            t0 = time.monotonic()
            world.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(BASE / "crds"))
            world.kubectl("apply", "--server-side", "-k", str(overlay))
            ready("kustomize", t0)
            world.kubectl("delete", "-k", str(overlay), "--wait=true", "--timeout=300s")
            gone()
        t0 = time.monotonic()
        template(CHART)
        render = time.monotonic() - t0
    helm_s, kust_s = (statistics.median(times[k]) for k in ("helm", "kustomize"))
    emit("helm_install_ready_s", helm_s)
    emit("kustomize_apply_ready_s", kust_s)
    emit("helm_vs_kustomize_ratio", helm_s / kust_s)
    emit("helm_template_s", render)
    for k, v in times.items():
        emit(f"{k}_rounds", len(v), "d")
        print(f"# {k} rounds: {', '.join(f'{x:.1f}s' for x in v)}", file=sys.stderr)


if __name__ == "__main__":
    main()
