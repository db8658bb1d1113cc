{{/* HTTPS of the agents' REST API (agent.tls). The agents read tls.crt and tls.key, the controller
ca.crt, all from one Secret mounted under /etc/rdmig/tls. */}}

{{- define "rdmig.agentTls.enabled" -}}
{{- if ne .Values.agent.tls.mode "off" -}}true{{- end -}}
{{- end -}}

{{- define "rdmig.agentTls.secretName" -}}
{{- if eq .Values.agent.tls.mode "secret" -}}
{{- required "agent.tls.mode secret needs agent.tls.existingSecret (a Secret with tls.crt, tls.key and ca.crt)" .Values.agent.tls.existingSecret -}}
{{- else -}}
{{- printf "%s-agent-tls" (include "rdmig.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* generate: the CA and the agents' certificate, made once per render (the Secret and the
checksum annotations must agree): the ones in the cluster's Secret when it can be asked (helm
install/upgrade keep them), else new ones (helm template makes new ones on every render). */}}
{{- define "rdmig.agentTls.generated" -}}
{{- if not (hasKey .Values.agent.tls "_generated") -}}
{{- $name := .Values.agent.tls.serverName -}}
{{- $out := dict -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "rdmig.agentTls.secretName" .) -}}
{{- if and $existing $existing.data (index $existing.data "tls.crt") (index $existing.data "tls.key") (index $existing.data "ca.crt") -}}
{{- $_ := set $out "tls.crt" (index $existing.data "tls.crt") -}}
{{- $_ := set $out "tls.key" (index $existing.data "tls.key") -}}
{{- $_ := set $out "ca.crt" (index $existing.data "ca.crt") -}}
{{- else -}}
{{- $days := int .Values.agent.tls.validityDays -}}
{{- $ca := genCA (printf "%s-ca" $name) $days -}}
{{- $cert := genSignedCert $name nil (list $name) $days $ca -}}
{{- $_ := set $out "tls.crt" ($cert.Cert | b64enc) -}}
{{- $_ := set $out "tls.key" ($cert.Key | b64enc) -}}
{{- $_ := set $out "ca.crt" ($ca.Cert | b64enc) -}}
{{- end -}}
{{- $_ := set .Values.agent.tls "_generated" $out -}}
{{- end -}}
{{- toYaml (index .Values.agent.tls "_generated") -}}
{{- end -}}

{{/* checksum/tls for both pod templates: a new certificate or CA restarts agents and controller
together. cert-manager renews in place (same Secret): the agents pick a renewed certificate up
from the mounted files without a restart. */}}
{{- define "rdmig.agentTls.checksum" -}}
{{- $mode := .Values.agent.tls.mode -}}
{{- if eq $mode "generate" -}}
{{- include "rdmig.agentTls.generated" . | sha256sum -}}
{{- else if eq $mode "secret" -}}
{{- $value := "" -}}
{{- $secret := lookup "v1" "Secret" .Release.Namespace .Values.agent.tls.existingSecret -}}
{{- if and $secret $secret.data -}}{{- $value = index $secret.data "ca.crt" | default "" -}}{{- end -}}
{{- printf "secret/%s/%s" .Values.agent.tls.existingSecret $value | sha256sum -}}
{{- else -}}
{{- printf "%s/%s" $mode .Values.agent.tls.serverName | sha256sum -}}
{{- end -}}
{{- end -}}

{{/* Sets api.tls in the agent's config (a dict, the list's second item). */}}
{{- define "rdmig.agentTls.agentConfig" -}}
{{- $root := index . 0 -}}
{{- $cfg := index . 1 -}}
{{- if include "rdmig.agentTls.enabled" $root -}}
{{- $_ := set $cfg.api "tls" (dict "certFile" "/etc/rdmig/tls/tls.crt" "keyFile" "/etc/rdmig/tls/tls.key") -}}
{{- end -}}
{{- end -}}

{{/* Sets agents.tls in the controller's config (a dict, the list's second item). */}}
{{- define "rdmig.agentTls.controllerConfig" -}}
{{- $root := index . 0 -}}
{{- $cfg := index . 1 -}}
{{- if include "rdmig.agentTls.enabled" $root -}}
{{- $_ := set $cfg.agents "tls" (dict "caFile" "/etc/rdmig/tls/ca.crt" "serverName" $root.Values.agent.tls.serverName) -}}
{{- end -}}
{{- end -}}
