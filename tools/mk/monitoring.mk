# The Prometheus Operator's CRDs for PodMonitor and PrometheusRule, taken from its Go module (no
# build): tests/monitoring/ applies overlays/monitoring/ to the test API server with them, so the
# overlay's objects are checked against the real schemas.
PROM_OPERATOR_VERSION := v0.85.0
PROM_OPERATOR_CRDS := $(TOOLS_DIR)/prometheus-operator/crds
TOOLS += $(PROM_OPERATOR_CRDS)/.stamp

$(PROM_OPERATOR_CRDS)/.stamp:
	rm -rf $(PROM_OPERATOR_CRDS) && mkdir -p $(PROM_OPERATOR_CRDS)
	dir=$$(cd $(TOOLS_DIR) && GOFLAGS=-mod=mod go mod download -json github.com/prometheus-operator/prometheus-operator@$(PROM_OPERATOR_VERSION) \
	  | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$$/\1/p') && test -n "$$dir" \
	  && cp "$$dir"/example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml \
	        "$$dir"/example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml $(PROM_OPERATOR_CRDS)/ \
	  && chmod u+w $(PROM_OPERATOR_CRDS)/*.yaml && touch $@

# overlays/monitoring/prometheusrule.yaml is accelnode.rules.yml's groups in a PrometheusRule.
.PHONY: monitoring-rules
monitoring-rules: deps
	$(PY) -m tests.rigs.monitoring > overlays/monitoring/prometheusrule.yaml
