{{/* The chart's name: "rdmig", or nameOverride. */}}
{{- define "rdmig.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{/* Object name prefix: fullnameOverride; else the release name when it contains the chart's
name, else "<release>-<name>". */}}
{{- define "rdmig.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "rdmig.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
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

{{/* repository:tag, or repository@digest; (list $root $own) where $own has repository/tag/digest. */}}
{{- define "rdmig.image" -}}
{{- $root := index . 0 -}}
{{- $own := index . 1 -}}
{{- $repo := $own.repository | default $root.Values.image.repository -}}
{{- if not $repo -}}
{{- fail "image.repository is required: build the rdmig image (docs/deploy.md, \"Build and push the image\"), push it to a registry you control and install with --set image.repository=<registry>/rdmig (and image.digest=sha256:... to pin it). No public image is published, and a privileged node agent must not come from a name anyone could claim" -}}
{{- end -}}
{{- $digest := $own.digest | default $root.Values.image.digest -}}
{{- if $digest -}}
{{- printf "%s@%s" $repo $digest -}}
{{- else -}}
{{- $tag := $own.tag | default $root.Values.image.tag | default $root.Chart.AppVersion -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}
{{- end -}}

{{/* An image that is not rdmig's (the `helm test` pod's kubectl): its own repository and its own
digest or tag, never image.* (rdmig's digest on kubectl's repository names no image). (list $image $key). */}}
{{- define "rdmig.otherImage" -}}
{{- $own := index . 0 -}}
{{- $key := index . 1 -}}
{{- if not $own.repository -}}
{{- fail (printf "%s.repository is required: the image is not rdmig's and takes nothing from image.*" $key) -}}
{{- end -}}
{{- if $own.digest -}}
{{- printf "%s@%s" $own.repository $own.digest -}}
{{- else if $own.tag -}}
{{- printf "%s:%s" $own.repository $own.tag -}}
{{- else -}}
{{- fail (printf "%s: set tag or digest" $key) -}}
{{- end -}}
{{- end -}}

{{- define "rdmig.agent.serviceAccountName" -}}
{{- .Values.agent.serviceAccount.name | default (printf "%s-agent" (include "rdmig.fullname" .)) -}}
{{- end -}}

{{- define "rdmig.controller.serviceAccountName" -}}
{{- .Values.controller.serviceAccount.name | default (printf "%s-controller" (include "rdmig.fullname" .)) -}}
{{- end -}}

{{- define "rdmig.tokenSecretName" -}}
{{- .Values.token.existingSecret | default (printf "%s-token" (include "rdmig.fullname" .)) -}}
{{- end -}}

{{- define "rdmig.tokenSecretKey" -}}
{{- if .Values.token.existingSecret -}}{{ .Values.token.existingSecretKey }}{{- else -}}token{{- end -}}
{{- end -}}

{{/* The token the chart's Secret holds (token.value, else the one in the cluster's Secret, else a
new random one), resolved once per render: the Secret and the checksum annotations must agree. */}}
{{- define "rdmig.token" -}}
{{- if not (hasKey .Values.token "_resolved") -}}
{{- $token := .Values.token.value -}}
{{- if not $token -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "rdmig.tokenSecretName" .) -}}
{{- if and $existing $existing.data (index $existing.data "token") -}}
{{- $token = index $existing.data "token" | b64dec -}}
{{- else -}}
{{- $token = randAlphaNum 48 -}}
{{- end -}}
{{- end -}}
{{- $_ := set .Values.token "_resolved" $token -}}
{{- end -}}
{{- index .Values.token "_resolved" -}}
{{- end -}}

{{/* checksum/token for both pod templates: the chart's token, or the existing Secret's value when
the cluster can be asked (helm install/upgrade); under `helm template` only its name and key. */}}
{{- define "rdmig.tokenChecksum" -}}
{{- if .Values.token.existingSecret -}}
{{- $value := "" -}}
{{- $secret := lookup "v1" "Secret" .Release.Namespace .Values.token.existingSecret -}}
{{- if and $secret $secret.data -}}
{{- $value = index $secret.data .Values.token.existingSecretKey | default "" -}}
{{- end -}}
{{- printf "%s/%s/%s" .Values.token.existingSecret .Values.token.existingSecretKey $value | sha256sum -}}
{{- else -}}
{{- include "rdmig.token" . | sha256sum -}}
{{- end -}}
{{- end -}}

{{/* Multus networks the agent asks for, as a JSON list: agent.rdma.network, or each rail's network. */}}
{{- define "rdmig.agent.networks" -}}
{{- $out := list -}}
{{- with .Values.agent.rdma.network -}}{{- $out = append $out . -}}{{- end -}}
{{- range (.Values.agent.config.rdma | default dict).devices -}}
{{- with .network -}}{{- $out = append $out . -}}{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* "true" when the agent may use RDMA: its transport is not tcp and it gets a device, from a
device plugin (agent.rdma.resourceName, a Multus network, whose resource Multus' injector adds, or a
config.rdma.resourceEnv whose resource is in agent.resources) or, privileged, from the node's
/dev/infiniband. An unprivileged container opens no device node it was not given (the device
cgroup), so a hostPath /dev/infiniband would give it nothing. */}}
{{- define "rdmig.agent.rdma" -}}
{{- $cfg := .Values.agent.config -}}
{{- if ne ($cfg.transport | default "auto") "tcp" -}}
{{- $networks := include "rdmig.agent.networks" . | fromJsonArray -}}
{{- if or .Values.agent.privileged .Values.agent.rdma.resourceName (gt (len $networks) 0) ($cfg.rdma | default dict).resourceEnv -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* The capabilities the unprivileged agent adds for its enabled modes (files/agent-capabilities.yaml),
as a sorted JSON list. */}}
{{- define "rdmig.agent.capabilities" -}}
{{- $table := .Files.Get "files/agent-capabilities.yaml" | fromYaml -}}
{{- $caps := list -}}
{{- if include "rdmig.agent.rdma" . -}}{{- $caps = concat $caps $table.rdma -}}{{- end -}}
{{- if .Values.kubevirt.enabled -}}{{- $caps = concat $caps $table.kubevirt -}}{{- end -}}
{{- toJson (sortAlpha (uniq $caps)) -}}
{{- end -}}

{{/* The agent container's securityContext: privileged (agent.privileged), or root with the
capabilities of its modes and nothing else, RuntimeDefault seccomp, a read-only root filesystem and
no privilege escalation (not with SYS_ADMIN, which Kubernetes refuses beside it: that capability
escalates anyway); agent.securityContext merged over it. docs/security.md "The agent's privileges". */}}
{{- define "rdmig.agent.securityContext" -}}
{{- $sc := dict -}}
{{- if .Values.agent.privileged -}}
{{- $sc = dict "privileged" true "runAsUser" 0 -}}
{{- else -}}
{{- $caps := include "rdmig.agent.capabilities" . | fromJsonArray -}}
{{- $capabilities := dict "drop" (list "ALL") -}}
{{- if $caps -}}{{- $_ := set $capabilities "add" $caps -}}{{- end -}}
{{- $sc = dict "privileged" false "runAsUser" 0 "capabilities" $capabilities "readOnlyRootFilesystem" true "seccompProfile" (dict "type" "RuntimeDefault") -}}
{{- if not (has "SYS_ADMIN" $caps) -}}{{- $_ := set $sc "allowPrivilegeEscalation" false -}}{{- end -}}
{{- end -}}
{{- toYaml (mergeOverwrite $sc (deepCopy (.Values.agent.securityContext | default dict))) -}}
{{- end -}}

{{/* agent.yaml as the agent reads it: values' config plus what the chart owns. */}}
{{- define "rdmig.agent.config" -}}
{{- $cfg := deepCopy .Values.agent.config -}}
{{- $_ := set $cfg.api "tokenFile" "/etc/rdmig/token" -}}
{{- include "rdmig.agentTls.agentConfig" (list . $cfg) -}}
{{- /* QMP sockets only under the directories the chart mounts, unless set explicitly */ -}}
{{- if not (hasKey (default dict $cfg.migration) "qmpSocketRoots") -}}
{{- $m := default dict $cfg.migration -}}
{{- $_ := set $m "qmpSocketRoots" .Values.agent.qmpHostPaths -}}
{{- $_ := set $cfg "migration" $m -}}
{{- end -}}
{{- $network := .Values.agent.rdma.network -}}
{{- if $network -}}
{{- /* Multus mode: the network's entry gives device, interface and address (the agent refuses them beside it). */ -}}
{{- range $k := list "device" "netdev" "address" "resourceEnv" -}}
{{- if index $cfg.rdma $k -}}
{{- fail (printf "agent.config.rdma.%s cannot be set beside agent.rdma.network: the network's entry in the pod's network-status gives the device, interface and address" $k) -}}
{{- end -}}
{{- end -}}
{{- if $cfg.rdma.devices -}}
{{- fail "agent.rdma.network is the single-rail form: with agent.config.rdma.devices give each rail its own network (agent.config.rdma.devices[i].network)" -}}
{{- end -}}
{{- $_ := set $cfg.rdma "network" $network -}}
{{- end -}}
{{- if include "rdmig.agent.networks" . | fromJsonArray -}}
{{- $_ := set $cfg.rdma "networkStatusFile" "/etc/podinfo/network-status" -}}
{{- else if and (not $cfg.rdma.resourceEnv) (not $cfg.rdma.devices) .Values.agent.rdma.resourceName -}}
{{- $_ := set $cfg.rdma "resourceEnv" .Values.agent.rdma.resourceName -}}
{{- end -}}
{{- if .Values.kubevirt.enabled -}}
{{- /* KubeVirt mode: on, with the hook socket the Plugin names (the rest of agent.config.kubevirt as given) */ -}}
{{- $kv := deepCopy (default dict $cfg.kubevirt) -}}
{{- $_ := set $kv "enabled" true -}}
{{- $_ := set $kv "hookSocket" .Values.kubevirt.hookSocket -}}
{{- if not $kv.discovery -}}{{- $_ := set $kv "discovery" "kubernetes" -}}{{- end -}}
{{- if not $kv.agentSelector -}}{{- $_ := set $kv "agentSelector" (printf "app.kubernetes.io/name=rdmig-agent,app.kubernetes.io/instance=%s" .Release.Name) -}}{{- end -}}
{{- if not $kv.handlerNamespace -}}{{- $_ := set $kv "handlerNamespace" .Values.kubevirt.namespace -}}{{- end -}}
{{- $_ := set $cfg "kubevirt" $kv -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* The controller's leader Lease: leaderElection.leaseName, or <fullname>-controller. */}}
{{- define "rdmig.leaseName" -}}
{{- .Values.controller.config.leaderElection.leaseName | default (printf "%s-controller" (include "rdmig.fullname" .)) -}}
{{- end -}}

{{/* controller.yaml: values' config plus the agent port and token path (namespace: $POD_NAMESPACE). */}}
{{- define "rdmig.controller.config" -}}
{{- $cfg := deepCopy .Values.controller.config -}}
{{- $_ := set $cfg.agents "port" .Values.agent.config.api.port -}}
{{- $_ := set $cfg.agents "tokenFile" "/etc/rdmig/token" -}}
{{- include "rdmig.agentTls.controllerConfig" (list . $cfg) -}}
{{- include "rdmig.controllerMetrics.controllerConfig" (list . $cfg) -}}
{{- /* Two releases in one namespace: each controller finds only its own agents and holds its own Lease. */ -}}
{{- if eq (toString $cfg.agents.labelSelector) "app.kubernetes.io/name=rdmig-agent" -}}
{{- $_ := set $cfg.agents "labelSelector" (printf "app.kubernetes.io/name=rdmig-agent,app.kubernetes.io/instance=%s" .Release.Name) -}}
{{- end -}}
{{- $_ := set $cfg.leaderElection "leaseName" (include "rdmig.leaseName" .) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* A byte quantity as the agent reads it ("2Gi", "512Mi", "1G", "1048576") in bytes. */}}
{{- define "rdmig.bytes" -}}
{{- $q := toString . -}}
{{- if or (kindIs "float64" .) (kindIs "int64" .) (kindIs "int" .) -}}{{- $q = printf "%.0f" (float64 .) -}}{{- end -}}
{{- $mult := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 -}}
{{- $suffix := regexFind "[A-Za-z]+$" $q -}}
{{- if and $suffix (not (hasKey $mult $suffix)) -}}
{{- fail (printf "%q: not a byte quantity (use Ki, Mi, Gi, Ti, k, M, G, T or plain bytes)" $q) -}}
{{- end -}}
{{- $num := trimSuffix $suffix $q -}}
{{- if not (regexMatch "^[0-9]+$" $num) -}}
{{- fail (printf "%q: not a byte quantity (a whole number, then Ki, Mi, Gi, Ti, k, M, G, T or nothing)" $q) -}}
{{- end -}}
{{- if $suffix -}}{{- mul (int64 $num) (get $mult $suffix) -}}{{- else -}}{{- int64 $num -}}{{- end -}}
{{- end -}}

{{/* The agent container's resources: agent.resources, plus the memory the agent can pin. The
ring buffers of running migrations (up to migration.bufferBudget) are locked pages charged to the
pod's memory cgroup, on top of the agent's own agent.memoryOverhead. With no memory request in
agent.resources, the request is the two together (so the scheduler places the agent on a node
that can hold it); a memory limit that cannot hold them is refused, naming both. */}}
{{- define "rdmig.agent.resources" -}}
{{- $res := deepCopy (.Values.agent.resources | default dict) -}}
{{- $budget := include "rdmig.bytes" (.Values.agent.config.migration.bufferBudget | default "2Gi") | int64 -}}
{{- $overhead := include "rdmig.bytes" .Values.agent.memoryOverhead | int64 -}}
{{- $need := add $budget $overhead -}}
{{- $needMi := div (add $need 1048575) 1048576 -}}
{{- $requests := $res.requests | default dict -}}
{{- if not (hasKey $requests "memory") -}}
{{- $_ := set $requests "memory" (printf "%dMi" $needMi) -}}
{{- end -}}
{{- $_ := set $res "requests" $requests -}}
{{- with ($res.limits | default dict).memory -}}
{{- if lt (include "rdmig.bytes" . | int64) $need -}}
{{- fail (printf "agent.resources.limits.memory %s cannot hold agent.config.migration.bufferBudget (%s, locked while migrations run) plus agent.memoryOverhead (%s): set the limit to at least %dMi, or lower the budget" (toString .) (toString $.Values.agent.config.migration.bufferBudget) (toString $.Values.agent.memoryOverhead) $needMi) -}}
{{- end -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* "true" when the chart's ServiceMonitors are rendered: serviceMonitor.enabled true, or auto and
the cluster serves monitoring.coreos.com/v1 ServiceMonitor; "" otherwise. */}}
{{- define "rdmig.serviceMonitor.enabled" -}}
{{- $on := .Values.serviceMonitor.enabled -}}
{{- if eq (toString $on) "auto" -}}
{{- $on = .Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor" -}}
{{- end -}}
{{- if $on }}true{{ end -}}
{{- end -}}

{{/* Other rdmig releases in this namespace, from (list $ $found): $found is a dict of lists
"daemonsets", "deployments" and "configmaps", what `lookup` finds there at install (nothing under
`helm template`: "rdmig.lookupNamespace"). Returns JSON {"conflicts": [..], "warnings": [..]}:
a conflict is a controller that would reconcile the same RdmaMigrations as this release's (either
watches every namespace, or both the same one), or "crds" (found CRDs) owned by another release
while crds.install is on (Helm would refuse them less clearly); a warning, agents that collide on a node both
releases' agents run on (host ports: hostNetwork; stateDir; kubevirt.hookSocket). */}}
{{- define "rdmig.otherReleases" -}}
{{- $root := index . 0 -}}
{{- $found := index . 1 -}}
{{- $conflicts := list -}}
{{- $warnings := list -}}
{{- $configs := dict -}}
{{- range $cm := $found.configmaps | default list }}{{ $_ := set $configs $cm.metadata.name ($cm.data | default dict) }}{{ end -}}
{{- $ourWatch := $root.Values.controller.config.watchNamespace | default "" -}}
{{- range $d := $found.deployments | default list -}}
{{- $l := $d.metadata.labels | default dict -}}
{{- if and (eq (get $l "app.kubernetes.io/name") "rdmig-controller") (ne (get $l "app.kubernetes.io/instance") $root.Release.Name) -}}
{{- $release := get $l "app.kubernetes.io/instance" -}}
{{- $data := get $configs (printf "%s-config" $d.metadata.name) | default dict -}}
{{- if not (hasKey $data "controller.yaml") -}}
{{- $warnings = append $warnings (printf "release %s runs an rdmig controller here (Deployment %s) whose configuration was not found: if it watches the RdmaMigrations this release's controller watches, both act on them" $release $d.metadata.name) -}}
{{- else -}}
{{- $watch := (fromYaml (get $data "controller.yaml")).watchNamespace | default "" -}}
{{- if or (eq $watch "") (eq $ourWatch "") (eq $watch $ourWatch) -}}
{{- $conflicts = append $conflicts (printf "release %s's controller (Deployment %s) watches %s and this one would watch %s: both would act on the same RdmaMigrations. Give each a namespace of its own (controller.config.watchNamespace) or install one release" $release $d.metadata.name (ternary "every namespace" (printf "namespace %s" $watch) (eq $watch "")) (ternary "every namespace" (printf "namespace %s" $ourWatch) (eq $ourWatch ""))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $crd := $found.crds | default list -}}
{{- $a := $crd.metadata.annotations | default dict -}}
{{- if and $root.Values.crds.install (or (ne (get $a "meta.helm.sh/release-name") $root.Release.Name) (ne (get $a "meta.helm.sh/release-namespace") $root.Release.Namespace)) -}}
{{- $owner := ternary (printf "release %s in namespace %s" (get $a "meta.helm.sh/release-name") (get $a "meta.helm.sh/release-namespace")) "no Helm release (applied by hand)" (hasKey $a "meta.helm.sh/release-name") -}}
{{- $conflicts = append $conflicts (printf "the CRD %s (cluster-wide) belongs to %s: install this release with crds.install=false" $crd.metadata.name $owner) -}}
{{- end -}}
{{- end -}}
{{- $cfg := $root.Values.agent.config -}}
{{- $ourPorts := list (int $cfg.api.port) (int $cfg.api.probePort) (int $cfg.dataPlane.port) (int $cfg.dataPlane.rdmaPort) -}}
{{- range $d := $found.daemonsets | default list -}}
{{- $l := $d.metadata.labels | default dict -}}
{{- if and (eq (get $l "app.kubernetes.io/name") "rdmig-agent") (ne (get $l "app.kubernetes.io/instance") $root.Release.Name) -}}
{{- $release := get $l "app.kubernetes.io/instance" -}}
{{- $shared := list -}}
{{- $spec := $d.spec.template.spec -}}
{{- range $c := $spec.containers -}}
{{- range $p := $c.ports | default list }}{{ if has (int $p.containerPort) $ourPorts }}{{ $shared = append $shared (printf "host port %d" (int $p.containerPort)) }}{{ end }}{{ end -}}
{{- end -}}
{{- range $v := $spec.volumes | default list -}}
{{- if and (eq $v.name "state") $v.hostPath (eq $v.hostPath.path $cfg.stateDir) }}{{ $shared = append $shared (printf "stateDir %s" $cfg.stateDir) }}{{ end -}}
{{- end -}}
{{- $agentData := get $configs (printf "%s-config" $d.metadata.name) | default dict -}}
{{- if and $root.Values.kubevirt.enabled (hasKey $agentData "agent.yaml") -}}
{{- $kv := (fromYaml (get $agentData "agent.yaml")).kubevirt | default dict -}}
{{- if and $kv.enabled (eq ($kv.hookSocket | default "") $root.Values.kubevirt.hookSocket) }}{{ $shared = append $shared (printf "kubevirt.hookSocket %s" $root.Values.kubevirt.hookSocket) }}{{ end -}}
{{- end -}}
{{- if $shared -}}
{{- $warnings = append $warnings (printf "release %s's agents (DaemonSet %s) use the same %s: on a node where both releases run an agent they collide (a host port cannot be bound twice; the paths would be shared). Keep the releases on different nodes (agent.nodeSelector) or change these values" $release $d.metadata.name (join ", " (uniq $shared))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- dict "conflicts" $conflicts "warnings" $warnings | toJson -}}
{{- end -}}

{{/* What `lookup` finds of other releases in the release namespace (empty under `helm template`). */}}
{{- define "rdmig.lookupNamespace" -}}
{{- $ns := .Release.Namespace -}}
{{- dict "daemonsets" ((lookup "apps/v1" "DaemonSet" $ns "").items | default list)
         "deployments" ((lookup "apps/v1" "Deployment" $ns "").items | default list)
         "configmaps" ((lookup "v1" "ConfigMap" $ns "").items | default list)
         "crds" (without (list (lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" "rdmamigrations.rdmig.io")
                               (lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" "rdmapathchecks.rdmig.io")
                               (lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" "rdmadrainplans.rdmig.io")) dict) | toJson -}}
{{- end -}}
