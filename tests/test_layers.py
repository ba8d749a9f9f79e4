"""The layout rule (docs/architecture.md, "Layers"), checked on every import statement of the tree.

* Components (device_plugin, csi_driver, agent, bootstrap, controller) never import each other.
* Inside the controller, the capabilities (caches, tpuenv, nodegroups) use the runtime and the
  webhook server, never each other; the runtime imports no capability and no webhook; the
  webhook server imports the runtime only; ``controller.cli`` is the wiring and may import all.
* Shared libraries under ``accelnode/`` import no component, no gRPC and no stubs; the libraries
  by concern (oci, kube, hw) import only the core modules and themselves.
* Nothing at run time imports the test rigs (``tests.rigs``), tests, tools or benchmarks, and the
  rigs are not part of the runtime tree at all (tests/test_package.py checks the wheel's contents).
* Runtime dependencies in pyproject are exactly the third-party packages runtime code imports;
  what only tests, rigs and tools import lives in the extras.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from tests.conftest import ROOT

COMPONENTS = ("device_plugin", "csi_driver", "agent", "bootstrap", "controller")
CORE = ("accelnode", "accelnode.cli", "accelnode.exitcodes", "accelnode.log", "accelnode.health",
        "accelnode.httpserve", "accelnode.grpcutil", "accelnode.decode")
LIBRARIES = ("accelnode.oci", "accelnode.kube", "accelnode.hw", "accelnode.gce")
# Generated code (``make proto``, tools/protogen.py): held to no rule.
NOT_RUNTIME = ("accelnode.pb",)
CONTROLLER_RUNTIME = ("controller.runtime",)
CONTROLLER_WEBHOOKS = ("controller.webhooks",)
CAPABILITIES = ("controller.caches", "controller.tpuenv", "controller.nodegroups")
# Imported only where present, inside a try (NVML on NVIDIA nodes, amdsmi on AMD nodes).
OPTIONAL = {"pynvml", "amdsmi"}
# Third-party imports that are not runtime dependencies of their own (they come with one that is).
# The ``google`` namespace package is shared: its second level says which distribution it is.
PROVIDED_BY = {"google.protobuf": "protobuf", "google.cloud": "google-cloud-compute",
               "google.api_core": "google-cloud-compute", "google.auth": "google-cloud-compute"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(path: Path) -> set[str]:
    """Every module a file imports, relative imports resolved, at any depth (function-level
    imports count: they run too)."""
    mod = _module_name(path)
    package = mod if _is_package(path) else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return out


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _python_files():
    for top in ("accelnode",) + COMPONENTS:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield _module_name(path), path


FILES = dict(_python_files())
OURS = ("accelnode", "tests", "bench") + COMPONENTS


def _ours(name: str) -> bool:
    return _within(name, OURS)


def _existing(names: set[str]) -> set[str]:
    """Our names that are modules or packages (``from pkg import function`` adds ``pkg.function``)."""
    return {n for n in names if n in FILES or any(f.startswith(n + ".") for f in FILES)}


def test_every_package_is_checked():
    assert _within("agent.core", COMPONENTS) and not _within("agents", COMPONENTS)
    assert {"accelnode.oci.registry", "accelnode.kube.client", "accelnode.hw.tpu", "agent.core",
            "bootstrap.poller", "controller.runtime.runner", "controller.caches.reconciler"} <= set(FILES)
    for pkg in CAPABILITIES + CONTROLLER_RUNTIME + CONTROLLER_WEBHOOKS:
        assert pkg in FILES, f"{pkg} is not a package"
    # every controller module belongs to exactly one layer, or is the wiring
    loose = [m for m in FILES if _within(m, ("controller",)) and m not in ("controller", "controller.cli")
             and not _within(m, CAPABILITIES + CONTROLLER_RUNTIME + CONTROLLER_WEBHOOKS)]
    assert loose == [], f"controller modules outside runtime, webhooks and the capabilities: {loose}"


def test_rigs_and_tools_are_not_in_the_runtime_tree():
    assert not (ROOT / "accelnode" / "testing").exists()
    assert not (ROOT / "accelnode" / "protogen.py").exists()
    assert [m for m in FILES if "testing" in m.split(".") or m.endswith("protogen")] == []


def test_controller_capabilities_use_the_runtime_never_each_other():
    wrong = []
    for mod, path in FILES.items():
        if not _within(mod, ("controller",)) or mod in ("controller", "controller.cli"):
            continue
        own_capability = next((c for c in CAPABILITIES if _within(mod, (c,))), None)
        for name in _existing(_imports(path)):
            if not _within(name, ("controller",)) or name == "controller":
                continue
            if _within(name, ("controller.cli",)):
                wrong.append(f"{mod} imports the wiring {name}")
            elif _within(mod, CONTROLLER_RUNTIME) and not _within(name, CONTROLLER_RUNTIME):
                wrong.append(f"{mod} (runtime) imports {name}")
            elif _within(mod, CONTROLLER_WEBHOOKS) and _within(name, CAPABILITIES):
                wrong.append(f"{mod} (webhook server) imports the capability {name}")
            elif own_capability and _within(name, CAPABILITIES) and not _within(name, (own_capability,)):
                wrong.append(f"{mod} ({own_capability}) imports another capability: {name}")
    assert wrong == []


def test_components_never_import_each_other():
    wrong = []
    for mod, path in FILES.items():
        if not _within(mod, COMPONENTS):
            continue
        own = mod.split(".")[0]
        for name in _existing(_imports(path)):
            if _within(name, COMPONENTS) and name.split(".")[0] != own:
                wrong.append(f"{mod} imports {name}")
    assert wrong == []


def test_shared_libraries_import_no_component_and_no_grpc():
    wrong = []
    for mod, path in FILES.items():
        if not mod.startswith("accelnode") or _within(mod, ("accelnode.pb",)):
            continue
        for name in _imports(path):
            if _within(name, COMPONENTS) or _within(name, ("tests", "bench")):
                wrong.append(f"{mod} imports {name}")
            if _within(mod, LIBRARIES) and _within(name, ("grpc", "accelnode.pb", "accelnode.grpcutil")):
                wrong.append(f"{mod} imports {name}")
            if _within(mod, LIBRARIES) and _ours(name) and name in _existing({name}):
                own = ".".join(mod.split(".")[:2])
                if not (_within(name, (own,)) or name in CORE):
                    wrong.append(f"{mod} imports {name} (a library imports the core and itself only)")
    assert wrong == []


def test_nothing_at_run_time_imports_the_test_rigs():
    wrong = []
    for mod, path in FILES.items():
        if _within(mod, NOT_RUNTIME):
            continue
        for name in _imports(path):
            if _within(name, ("tests", "bench", "tools", "pytest")):
                wrong.append(f"{mod} imports {name}")
    assert wrong == []


def test_runtime_dependencies_are_what_runtime_code_imports():
    imported = set()
    for mod, path in FILES.items():
        if _within(mod, NOT_RUNTIME):
            continue
        for name in _imports(path):
            top = name.split(".")[0]
            if top == "google":
                top = ".".join(name.split(".")[:2])
            if top not in sys.stdlib_module_names and not _ours(top) and top not in OPTIONAL and top != "__future__":
                imported.add(top)
    dists = packages_distributions()
    needed = set()
    for top in imported:
        if top in PROVIDED_BY:
            needed.add(PROVIDED_BY[top])
            continue
        assert top in dists, f"{top} is imported at run time but no installed distribution provides it"
        needed.update(_canonical(d) for d in dists[top])
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_canonical(_dist_name(r)) for r in meta["dependencies"]}
    assert declared == needed, (f"declared but not imported at run time: {sorted(declared - needed)}; "
                                f"imported but not declared: {sorted(needed - declared)}")
    extras = {_canonical(_dist_name(r)) for reqs in meta["optional-dependencies"].values() for r in reqs}
    assert {"kubernetes", "psutil", "pytest"} <= extras
    assert not extras & declared


def _dist_name(requirement: str) -> str:
    for sep in "=<>!~[; ":
        requirement = requirement.split(sep)[0]
    return requirement


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")
