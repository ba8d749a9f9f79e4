# containerd 2, the runtime of every real-kubelet lane (device plugin, CSI, DRA with CDI, join,
# demo; tests/rigs/node.py says why not Debian's containerd 1.6.20): containerd, its runc shim and
# ctr from the module pinned in tools/containerd2/go.mod; Debian's runc runs the containers. One `go build` for the three so the packages they share compile once; CGO_ENABLED=0
# drops only the btrfs snapshotter. Installed under .tools/containerd2/bin, apart from .tools/bin,
# so nothing on PATH changes: the rig names the binaries by full path. Rebuilt only when one is
# missing or when that go.mod/go.sum change.
CONTAINERD2_NAMES := containerd containerd-shim-runc-v2 ctr
CONTAINERD2_BIN := $(TOOLS_DIR)/containerd2/bin
CONTAINERD2_TOOLS := $(addprefix $(CONTAINERD2_BIN)/,$(CONTAINERD2_NAMES))
TOOLS += $(CONTAINERD2_TOOLS)

CONTAINERD2_VERSION := $(shell sed -n 's|^[[:space:]]*github.com/containerd/containerd/v2 \(v[0-9][0-9.]*\).*|\1|p' tools/containerd2/go.mod)
CONTAINERD2_LDFLAGS := -s -w -X github.com/containerd/containerd/v2/version.Version=$(CONTAINERD2_VERSION)
CONTAINERD2_BUILD := $(TOOLS_DIR)/build/containerd2

$(CONTAINERD2_TOOLS) &: tools/containerd2/go.mod tools/containerd2/go.sum
	@echo "tools: building $(CONTAINERD2_NAMES) $(CONTAINERD2_VERSION) from tools/containerd2/go.mod (once; about 10 minutes on 2 busy cores)"
	rm -rf $(CONTAINERD2_BUILD) && mkdir -p $(CONTAINERD2_BUILD) $(CONTAINERD2_BIN)
	t=$$(date +%s) && cd tools/containerd2 && CGO_ENABLED=0 nice go build -trimpath -ldflags='$(CONTAINERD2_LDFLAGS)' -o $(CONTAINERD2_BUILD)/ \
	  $(addprefix github.com/containerd/containerd/v2/cmd/,$(CONTAINERD2_NAMES)) && \
	  echo "tools: containerd $(CONTAINERD2_VERSION) built in $$(( $$(date +%s) - t ))s"
	cd $(CONTAINERD2_BUILD) && mv -f $(CONTAINERD2_NAMES) $(CONTAINERD2_BIN)/
	rm -rf $(CONTAINERD2_BUILD)
