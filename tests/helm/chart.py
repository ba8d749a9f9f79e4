"""The charts as Helm renders them, the kustomize build they must equal, and Helm against the
real kubelet lane (tests/helm/, bench/bench_helm.py).

:func:`template` runs ``helm template``; :func:`kustomize` runs ``kubectl kustomize`` over the
base with the overlays and components of an overlay choice; :func:`normalised` drops only what
Helm adds on purpose (its standard labels, CRDs' ``helm.sh/resource-policy: keep``), so the two
compare object by object.
"""

from __future__ import annotations

import difflib
import os
import stat
import subprocess
from pathlib import Path

import yaml

from tests.conftest import ROOT, tool

CHART = ROOT / "charts" / "accelnode"
CRDS_CHART = ROOT / "charts" / "accelnode-crds"
NAMESPACE = "accelnode-system"
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance",
               "app.kubernetes.io/version")
# Each overlay choice: the values that mean it, and the kustomization (resources, components) that builds it.
CHOICES = {
    "default": ([], {"resources": ["daemonsets"]}),
    "cert-manager": (["webhook.certificates=cert-manager"], {"resources": ["overlays/cert-manager"]}),
    "monitoring": (["monitoring.enabled=true"], {"resources": ["overlays/monitoring"]}),
    "dra": (["draPlugin.enabled=true"], {"resources": ["daemonsets"], "components": ["overlays/dra"]}),
    "self-managed-device-plugin": (
        ["devicePlugin.selfManagedOnGkeNodePools=true"],
        {"resources": ["daemonsets"], "components": ["overlays/self-managed-device-plugin"]}),
}


def helm(*args: str, check: bool = True, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    out = subprocess.run([tool("helm"), *args], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    if check and out.returncode != 0:
        raise AssertionError(f"helm {' '.join(args[:2])}: {out.stderr.strip()}")
    return out


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def template(chart: Path = CHART, sets: list[str] = (), *extra: str) -> list[dict]:
    args = ["template", "accelnode", str(chart), "-n", NAMESPACE, *extra]
    for s in sets:
        args += ["--set", s]
    return docs(helm(*args).stdout)


def kustomize(tmp: Path, kustomization: dict) -> list[dict]:
    """``kubectl kustomize`` of an overlay in ``tmp`` made of ``kustomization``'s repository paths."""
    tmp.mkdir(parents=True, exist_ok=True)
    k = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
         **{key: [os.path.relpath(ROOT / p, tmp) for p in paths] for key, paths in kustomization.items()}}
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(k))
    out = subprocess.run([tool("kubectl"), "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(tmp)],
                         capture_output=True, text=True, check=True, timeout=120)
    return docs(out.stdout)


def key(d: dict) -> tuple:
    m = d["metadata"]
    return d["apiVersion"], d["kind"], m.get("namespace", ""), m["name"]


def _spaces(v):
    """Runs of white space as one space: kustomize's YAML writer doubles some line breaks of the
    multi-line CEL expressions (a plain scalar with more-indented lines), Helm's output keeps them."""
    if isinstance(v, dict):
        return {k: _spaces(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_spaces(x) for x in v]
    return " ".join(v.split()) if isinstance(v, str) and "\n" in v else v


def normalised(objs: list[dict]) -> dict[tuple, dict]:
    out = {}
    for d in map(_spaces, objs):
        # env in name order: a strategic-merge patch of one variable (overlays/monitoring) moves it
        # first; the order means something only to $(VAR) references, which none of ours makes
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            c.get("env", []).sort(key=lambda e: e["name"])
        meta = d["metadata"]
        labels = {k: v for k, v in (meta.get("labels") or {}).items() if k not in HELM_LABELS}
        meta.pop("labels", None)
        if labels:
            meta["labels"] = labels
        ann = {k: v for k, v in (meta.get("annotations") or {}).items() if k != "helm.sh/resource-policy"}
        meta.pop("annotations", None)
        if ann:
            meta["annotations"] = ann
        assert key(d) not in out, f"{key(d)} twice"
        out[key(d)] = d
    return out


def diff(want: dict, got: dict, names: tuple[str, str] = ("kustomize", "helm")) -> str:
    a, b = (yaml.safe_dump(x, sort_keys=True).splitlines() for x in (want, got))
    return "\n".join(difflib.unified_diff(a, b, *names, lineterm="", n=2))


class HelmLane:
    """Helm against the lane: its own config/cache dirs, the admin kubeconfig, the post-renderer."""

    def __init__(self, world):
        from tests.node.conftest import fit

        self.world = world
        home = world.workdir / "helm"
        self.env = {"HELM_CONFIG_HOME": str(home / "config"), "HELM_CACHE_HOME": str(home / "cache"),
                    "HELM_DATA_HOME": str(home / "data"), "KUBECONFIG": str(world.cp.kubeconfig("admin"))}
        self.base = base = world.workdir / "rendered"  # what Helm renders, as a kustomize base
        self.overlay = overlay = world.workdir / "overlay"
        base.mkdir()
        (base / "kustomization.yaml").write_text(yaml.safe_dump({"resources": ["all.yaml"]}))
        fit(world, overlay, base, template(CHART))
        self.post_renderer = world.workdir / "post-render"
        self.post_renderer.write_text(f"#!/bin/sh\nset -e\ncat > {base}/all.yaml\n"
                                      f"exec {tool('kubectl')} kustomize {overlay}\n")
        self.post_renderer.chmod(self.post_renderer.stat().st_mode | stat.S_IXUSR)

    def __call__(self, *args: str, check: bool = True):
        return helm(*args, env=self.env, check=check)

    def release(self, verb: str, chart: str, *args: str, wait: bool = True):
        """install/upgrade of the accelnode release, fitted to the lane, waiting for it."""
        return self(verb, "accelnode", chart, "-n", NAMESPACE, "--post-renderer", str(self.post_renderer),
                    *(["--wait", "--timeout", "5m"] if wait else []), *args)
