{{/* Helm's standard labels; selectors never use them (an adopted kustomize install keeps its own). */}}
{{- define "accelnode.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{/* Where every namespaced object goes: the release's namespace unless namespaceOverride. */}}
{{- define "accelnode.namespace" -}}
{{- .Values.namespaceOverride | default .Release.Namespace -}}
{{- end }}

{{/* The one image of every container and of the device-plugin DaemonSet the controller deploys. */}}
{{- define "accelnode.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end }}

{{/* devicePlugin.affinity, plus overlays/self-managed-device-plugin's term when selfManagedOnGkeNodePools. */}}
{{- define "accelnode.devicePlugin.affinity" -}}
{{- $a := deepCopy (.Values.devicePlugin.affinity | default dict) -}}
{{- if .Values.devicePlugin.selfManagedOnGkeNodePools -}}
{{- $req := dig "nodeAffinity" "requiredDuringSchedulingIgnoredDuringExecution" dict $a -}}
{{- $term := dict "matchExpressions" (list (dict "key" "cloud.google.com/gke-tpu-accelerator" "operator" "Exists") (dict "key" "accelnode.io/tpu-device-plugin" "operator" "In" "values" (list "true"))) -}}
{{- $_ := set $req "nodeSelectorTerms" (append (get $req "nodeSelectorTerms" | default list) $term) -}}
{{- $na := dig "nodeAffinity" dict $a -}}
{{- $_ := set $na "requiredDuringSchedulingIgnoredDuringExecution" $req -}}
{{- $_ := set $a "nodeAffinity" $na -}}
{{- end -}}
{{- toYaml $a -}}
{{- end }}

{{/* Extra environment of each container: the values' extraEnv, and the controller's capabilities. */}}
{{- define "accelnode.env.device-plugin" -}}
{{- with .Values.devicePlugin.extraEnv }}{{ toYaml . }}{{ end -}}
{{- end }}
{{- define "accelnode.env.dra-plugin" -}}
{{- with .Values.draPlugin.extraEnv }}{{ toYaml . }}{{ end -}}
{{- end }}
{{- define "accelnode.env.csi" -}}
{{- with .Values.csiDriver.extraEnv }}{{ toYaml . }}{{ end -}}
{{- end }}
{{- define "accelnode.env.agent" -}}
{{- with .Values.csiDriver.agent.extraEnv }}{{ toYaml . }}{{ end -}}
{{- end }}
{{- define "accelnode.env.controller" -}}
{{- $c := .Values.controller -}}
{{- $g := $c.tpuNodeGroups -}}
{{- if ne (toString $c.gkeTpuEnv) "auto" }}
- {name: ACCELNODE_GKE_TPU_ENV, value: {{ toString $c.gkeTpuEnv | quote }}}
{{- end }}
{{- with $g.gceProject }}
- {name: ACCELNODE_GCE_PROJECT, value: {{ . | quote }}}
{{- end }}
{{- with $g.gceEndpoint }}
- {name: ACCELNODE_GCE_ENDPOINT, value: {{ . | quote }}}
{{- end }}
{{- if and $g.enabled $g.placement }}
- {name: ACCELNODE_NODE_GROUP_PLACEMENT, value: /etc/accelnode/node-group-placement/rules.json}
{{- end }}
{{- if $c.captureRepositories }}
- {name: ACCELNODE_CAPTURE_REPOSITORIES, value: /etc/accelnode/capture-repositories/rules.json}
{{- end }}
{{- if ne (int $g.joinApiServerPort) 6443 }}
- {name: ACCELNODE_JOIN_API_SERVER_PORT, value: {{ $g.joinApiServerPort | quote }}}
{{- end }}
{{- if eq .Values.webhook.certificates "cert-manager" }}
- {name: ACCELNODE_TLS_CERT_FILE, value: /etc/accelnode/webhook-tls/tls.crt}
- {name: ACCELNODE_TLS_KEY_FILE, value: /etc/accelnode/webhook-tls/tls.key}
{{- end }}
{{- with $c.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The operator's rule files, each mounted from its ConfigMap: the node groups' placement rules
(controller/nodegroups/policy.py) and the capture repositories (accelnode/capture/settings.py). */}}
{{- define "accelnode.controller.volumeMounts" -}}
{{- if and .Values.controller.tpuNodeGroups.enabled .Values.controller.tpuNodeGroups.placement }}
- {name: node-group-placement, mountPath: /etc/accelnode/node-group-placement, readOnly: true}
{{- end }}
{{- if .Values.controller.captureRepositories }}
- {name: capture-repositories, mountPath: /etc/accelnode/capture-repositories, readOnly: true}
{{- end }}
{{- end }}
{{- define "accelnode.controller.volumes" -}}
{{- if and .Values.controller.tpuNodeGroups.enabled .Values.controller.tpuNodeGroups.placement }}
- {name: node-group-placement, configMap: {name: accelnode-node-group-placement}}
{{- end }}
{{- if .Values.controller.captureRepositories }}
- {name: capture-repositories, configMap: {name: accelnode-capture-repositories}}
{{- end }}
{{- end }}
