# accelnode — build, test and benchmark entry points.
#   make system-deps  Debian packages the tests need (tools/apt/*.txt; root)
#   make deps     Python virtualenv in .venv with accelnode installed (editable)
#   make tools    external test peers built from their Go modules into .tools/bin (cached)
#   make proto    regenerate accelnode/pb from proto/*.proto
#   make manifests  regenerate the Helm charts' templates (charts/) from daemonsets/ and overlays/
#   make demo     the whole node path, step by step: image, control plane, containerd + kubelet,
#                 kubectl apply -k daemonsets/, a pod with google.com/tpu and a cache (root)
#   make demo-plugin  quick: the device plugin alone on a simulated TPU host, as kubelet sees it
#   make image    the accelnode image as an OCI archive without a container engine (docs/image.md);
#                 PUSH=registry.example.com/team/accelnode:0.1.0 also pushes it there (docs/deploy.md)
#   make cluster  local etcd + kube-apiserver in the foreground (docs/local-cluster.md)
#   make gce-emulator  the GCE Compute API emulator on 127.0.0.1:$(GCE_PORT) (docs/tpu-node-groups.md)
#   make metadata-emulator  the GCE metadata server emulator on 127.0.0.1:$(METADATA_PORT) (docs/bootstrap.md)
#   make test     every test (unit + integration against real peers)
#   make bench    every benchmark; `make bench GROUP=device_plugin` for one group; fails when a printed
#                 target is missed unless `make bench BENCH_ARGS=--report-only` (bench/run.py)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TOOLS_DIR := $(CURDIR)/.tools
TOOLS_BIN := $(TOOLS_DIR)/bin
export PATH := $(TOOLS_BIN):$(PATH)
export ACCELNODE_TOOLS_BIN := $(TOOLS_BIN)
GROUP ?=
TESTS ?= tests
PYTEST_ARGS ?=
BENCH_ARGS ?=

TOOLS :=
# Each tools/mk/*.mk adds its binaries to TOOLS and says how to build them.
include $(wildcard tools/mk/*.mk)

.PHONY: system-deps deps tools proto manifests demo demo-plugin image gce-emulator metadata-emulator test bench clean
GCE_PORT ?= 8089
METADATA_PORT ?= 8090

system-deps:
	@tools/install-system-deps.sh

deps: $(VENV)/.stamp
$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev,test,triton]'
	touch $@

tools: system-deps
	@$(MAKE) --no-print-directory $(TOOLS)

PROTOS := $(wildcard proto/*.proto)
proto: deps
	$(PY) tools/protogen.py --out accelnode/pb $(PROTOS)

manifests: deps
	$(PY) tools/helmchart.py

demo: deps tools
	$(PY) -m tests.rigs.nodedemo --tools-bin $(TOOLS_BIN)

demo-plugin: deps
	$(PY) -m tests.rigs.demo

image: deps system-deps
	$(PY) -m tests.rigs.image $(if $(PUSH),--push $(PUSH))

gce-emulator: deps
	$(PY) -m tests.rigs.gce --port $(GCE_PORT)

metadata-emulator: deps
	$(PY) -m tests.rigs.metadata --port $(METADATA_PORT)

test: deps tools
	@echo "tests: $(TESTS)"
	$(PY) -m pytest $(TESTS) $(PYTEST_ARGS)

bench: deps tools
	$(PY) bench/run.py $(BENCH_ARGS) $(GROUP)

clean:
	rm -rf $(VENV) .pytest_cache .bench
