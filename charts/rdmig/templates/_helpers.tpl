{{/* Object name prefix: the release name when it contains "rdmig", else "<release>-rdmig". */}}
{{- define "rdmig.fullname" -}}
{{- if contains "rdmig" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-rdmig" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "rdmig.commonLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: rdmig
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Agent: selector labels (the controller finds agent pods by app.kubernetes.io/name). */}}
{{- define "rdmig.agent.selectorLabels" -}}
app.kubernetes.io/name: rdmig-agent
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- define "rdmig.agent.labels" -}}
app.kubernetes.io/name: rdmig-agent
app.kubernetes.io/component: agent
{{ include "rdmig.commonLabels" . }}
{{- end -}}

{{- define "rdmig.controller.selectorLabels" -}}
app.kubernetes.io/name: rdmig-controller
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- define "rdmig.controller.labels" -}}
app.kubernetes.io/name: rdmig-controller
app.kubernetes.io/component: controller
{{ include "rdmig.commonLabels" . }}
{{- end -}}

{{- define "rdmig.image" -}}
{{- $root := index . 0 -}}
{{- $own := index . 1 -}}
{{- $repo := $own.repository | default $root.Values.image.repository -}}
{{- $tag := $own.tag | default $root.Values.image.tag | default $root.Chart.AppVersion -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{- define "rdmig.tokenSecretName" -}}
{{- .Values.token.existingSecret | default (printf "%s-token" (include "rdmig.fullname" .)) -}}
{{- end -}}

{{- define "rdmig.tokenSecretKey" -}}
{{- if .Values.token.existingSecret -}}{{ .Values.token.existingSecretKey }}{{- else -}}token{{- end -}}
{{- end -}}

{{/* agent.yaml as the agent reads it: values' config plus what the chart owns. */}}
{{- define "rdmig.agent.config" -}}
{{- $cfg := deepCopy .Values.agent.config -}}
{{- $_ := set $cfg.api "tokenFile" "/etc/rdmig/token" -}}
{{- if and (not $cfg.rdma.resourceEnv) .Values.agent.rdma.resourceName -}}
{{- $_ := set $cfg.rdma "resourceEnv" .Values.agent.rdma.resourceName -}}
{{- end -}}
{{- if .Values.kubevirt.enabled -}}
{{- /* KubeVirt mode: on, with the hook socket the Plugin names (the rest of agent.config.kubevirt as given) */ -}}
{{- $kv := deepCopy (default dict $cfg.kubevirt) -}}
{{- $_ := set $kv "enabled" true -}}
{{- $_ := set $kv "hookSocket" .Values.kubevirt.hookSocket -}}
{{- if not $kv.discovery -}}{{- $_ := set $kv "discovery" "kubernetes" -}}{{- end -}}
{{- if not $kv.handlerNamespace -}}{{- $_ := set $kv "handlerNamespace" .Values.kubevirt.namespace -}}{{- end -}}
{{- $_ := set $cfg "kubevirt" $kv -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* controller.yaml: values' config plus the agent port and token path (namespace: $POD_NAMESPACE). */}}
{{- define "rdmig.controller.config" -}}
{{- $cfg := deepCopy .Values.controller.config -}}
{{- $_ := set $cfg.agents "port" .Values.agent.config.api.port -}}
{{- $_ := set $cfg.agents "tokenFile" "/etc/rdmig/token" -}}
{{- toYaml $cfg -}}
{{- end -}}
