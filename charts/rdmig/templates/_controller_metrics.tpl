{{/* The controller's /metrics (controller.config.metrics, controller.metrics): HTTPS with
TokenReview and SubjectAccessReview (secure, the default), or plain HTTP on 127.0.0.1 only. */}}

{{- define "rdmig.controllerMetrics.secure" -}}
{{- if ne (toString .Values.controller.config.metrics.secure) "false" -}}true{{- end -}}
{{- end -}}

{{/* The name Prometheus checks in the metrics certificate (controller.metrics.tls.existingSecret). */}}
{{- define "rdmig.controllerMetrics.serverName" -}}
{{- .Values.controller.metrics.tls.serverName | default (printf "%s-controller-metrics.%s.svc" (include "rdmig.fullname" .) .Release.Namespace) -}}
{{- end -}}

{{/* Sets metrics.tls in the controller's config (a dict, the list's second item) when a Secret
holds the metrics certificate; refuses a Secret that the local-only mode would not use. */}}
{{- define "rdmig.controllerMetrics.controllerConfig" -}}
{{- $root := index . 0 -}}
{{- $cfg := index . 1 -}}
{{- $secret := $root.Values.controller.metrics.tls.existingSecret -}}
{{- if and $secret (not (include "rdmig.controllerMetrics.secure" $root)) -}}
{{- fail "controller.metrics.tls.existingSecret is for controller.config.metrics.secure=true (plain-HTTP metrics take no certificate)" -}}
{{- end -}}
{{- if $secret -}}
{{- $_ := set $cfg.metrics "tls" (dict "certFile" "/etc/rdmig/metrics-tls/tls.crt" "keyFile" "/etc/rdmig/metrics-tls/tls.key") -}}
{{- end -}}
{{- end -}}
