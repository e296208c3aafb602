{{/* The release's objects are named after it (or fullnameOverride). */}}
{{- define "r1sup.fullname" -}}
{{- .Values.fullnameOverride | default .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "r1sup.selectorLabels" -}}
app.kubernetes.io/name: {{ .Values.nameOverride | default "r1sup" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "r1sup.labels" -}}
{{ include "r1sup.selectorLabels" . }}
app.kubernetes.io/part-of: r1sup
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "r1sup.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}
{{- end -}}

{{/* One TOML value: strings, booleans, whole numbers (YAML numbers reach templates as floats), other
numbers, and arrays of those. */}}
{{- define "r1sup.tomlValue" -}}
{{- if kindIs "string" . -}}
{{ toJson . }}
{{- else if kindIs "bool" . -}}
{{ . }}
{{- else if kindIs "slice" . -}}
[{{ range $i, $v := . }}{{ if $i }}, {{ end }}{{ include "r1sup.tomlValue" $v }}{{ end }}]
{{- else if or (kindIs "float64" .) (kindIs "float32" .) -}}
{{ if eq (float64 (int64 .)) (float64 .) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else if or (kindIs "int" .) (kindIs "int64" .) -}}
{{ . }}
{{- else -}}
{{ fail (printf "config: %v is not a TOML value the chart writes (a string, number, boolean or array of them)" .) }}
{{- end -}}
{{- end -}}

{{/* r1sup.toml from .Values.config: one table per section; a key set to null is left out. Values that
still name the section [search] by its old name, ladder, keep that name (r1sup reads it for this release
and warns): the chart's [search] defaults go under it where it does not set the key itself. */}}
{{- define "r1sup.toml" -}}
{{- $config := .Values.config }}
{{- if kindIs "map" .Values.config.ladder }}
{{- $ladder := deepCopy .Values.config.ladder }}
{{- range $key, $value := (.Values.config.search | default dict) }}
{{- if not (hasKey $ladder $key) }}
{{- $_ := set $ladder $key $value }}
{{- end }}
{{- end }}
{{- $config = set (omit .Values.config "search" "ladder") "ladder" $ladder }}
{{- end }}
{{- range $section, $body := $config }}
{{- if not (kindIs "map" $body) }}
{{- fail (printf "config.%s: must be a table of settings" $section) }}
{{- end }}
[{{ $section }}]
{{- range $key, $value := $body }}
{{- if not (kindIs "invalid" $value) }}
{{ $key }} = {{ include "r1sup.tomlValue" $value }}
{{- end }}
{{- end }}
{{ end }}
{{- end -}}

{{/* A setting of the config in whole seconds (or a count), r1sup's default where absent:
(list $ "section" "key" default) */}}
{{- define "r1sup.setting" -}}
{{- $config := (index . 0).Values.config -}}
{{- $section := index $config (index . 1) | default dict -}}
{{- if and (hasKey $section (index . 2)) (not (kindIs "invalid" (index $section (index . 2)))) -}}
{{ index $section (index . 2) | int64 }}
{{- else -}}
{{ index . 3 }}
{{- end -}}
{{- end -}}

{{/* A setting of [search] as r1sup.setting reads it, (list $ "key" default): under the section's old
name, ladder, where the values set the key there (r1sup.toml writes it so). */}}
{{- define "r1sup.searchSetting" -}}
{{- $ladder := (index . 0).Values.config.ladder -}}
{{- if and (kindIs "map" $ladder) (hasKey $ladder (index . 1)) -}}
{{ include "r1sup.setting" (list (index . 0) "ladder" (index . 1) (index . 2)) }}
{{- else -}}
{{ include "r1sup.setting" (list (index . 0) "search" (index . 1) (index . 2)) }}
{{- end -}}
{{- end -}}

{{/* terminationGracePeriodSeconds: SIGTERM comes after the preStop pause; r1sup then drains the requests
in flight (daemon.drain_timeout_s, on SIGTERM at most server.stop_timeout_s), stops vLLM (grace
server.stop_timeout_s) and waits for the GPU memory and the port (server.memory_release_timeout_s).
Kubernetes' SIGKILL must come after all of it. */}}
{{- define "r1sup.graceSeconds" -}}
{{- $stop := include "r1sup.setting" (list . "server" "stop_timeout_s" 30) | int64 -}}
{{- $release := include "r1sup.setting" (list . "server" "memory_release_timeout_s" 60) | int64 -}}
{{- $drain := include "r1sup.setting" (list . "daemon" "drain_timeout_s" 120) | int64 -}}
{{- add .Values.preStopSleepSeconds $stop $release (min $drain $stop) .Values.terminationSpareSeconds -}}
{{- end -}}

{{/* How the nodes of a group meet: mp (vLLM's own multi-node mode) or ray; anything else fails. */}}
{{- define "r1sup.multinodeBackend" -}}
{{- $backend := .Values.multinode.backend | default "mp" -}}
{{- if not (has $backend (list "mp" "ray")) -}}
{{- fail (printf "multinode.backend: must be mp or ray; got %q" $backend) -}}
{{- end -}}
{{- $backend -}}
{{- end -}}

{{/* The group's [multinode] settings that do not depend on the pod (the rank and the leader's address
come from LeaderWorkerSet's variables when the container starts). */}}
{{- define "r1sup.multinodeEnv" -}}
- name: R1SUP_MULTINODE_NNODES
  value: {{ .Values.multinode.size | int64 | quote }}
- name: R1SUP_MULTINODE_BACKEND
  value: {{ include "r1sup.multinodeBackend" . | quote }}
{{- if eq (include "r1sup.multinodeBackend" .) "mp" }}
- name: R1SUP_MULTINODE_MASTER_PORT
  value: {{ .Values.multinode.masterPort | int64 | quote }}
{{- end }}
{{- end -}}

{{/* terminationGracePeriodSeconds of an mp worker: r1sup's stop of its headless vLLM, then the spare. */}}
{{- define "r1sup.workerGraceSeconds" -}}
{{- $stop := include "r1sup.setting" (list . "server" "stop_timeout_s" 30) | int64 -}}
{{- $release := include "r1sup.setting" (list . "server" "memory_release_timeout_s" 60) | int64 -}}
{{- add $stop $release .Values.terminationSpareSeconds -}}
{{- end -}}

{{/* The start-up budget in seconds: a wait for another replica's tune (with a profile store; for a
LeaderWorkerSet on Ray, the wait for the Ray cluster too), then every launch the search may make. */}}
{{- define "r1sup.startupBudget" -}}
{{- $launch := include "r1sup.setting" (list . "server" "startup_timeout_s" 1800) | int64 -}}
{{- $attempts := include "r1sup.searchSetting" (list . "max_attempts" 8) | int64 -}}
{{- $wait := 0 -}}
{{- if .Values.profileStore.enabled -}}
{{- $wait = include "r1sup.setting" (list . "state" "profile_wait_s" 3600) | int64 -}}
{{- end -}}
{{- if and .Values.multinode.enabled (eq (include "r1sup.multinodeBackend" .) "ray") -}}
{{- $wait = add $wait .Values.multinode.rayInitTimeoutSeconds -}}
{{- end -}}
{{- add $wait (mul $attempts $launch) -}}
{{- end -}}

{{- define "r1sup.startupFailureThreshold" -}}
{{- $period := int64 .Values.probes.startupPeriodSeconds -}}
{{- div (add (include "r1sup.startupBudget" . | int64) $period -1) $period -}}
{{- end -}}

{{- define "r1sup.profileStoreClaim" -}}
{{- .Values.profileStore.existingClaim | default (printf "%s-profiles" (include "r1sup.fullname" .)) -}}
{{- end -}}

{{- define "r1sup.modelsClaim" -}}
{{- .Values.models.existingClaim | default (printf "%s-models" (include "r1sup.fullname" .)) -}}
{{- end -}}

{{- define "r1sup.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 0
fsGroup: 10001
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "r1sup.containerSecurityContext" -}}
allowPrivilegeEscalation: false
{{- if not (and .Values.multinode.enabled (eq (include "r1sup.multinodeBackend" .) "ray")) }}
{{- /* r1sup and vLLM (mp over nodes too) write to HOME, /tmp and /dev/shm only; Ray's pods keep a
writable root file system, as before */}}
readOnlyRootFilesystem: true
{{- end }}
capabilities:
  drop: ["ALL"]
  {{- with .Values.multinode.network.capabilities }}
  {{- if $.Values.multinode.enabled }}
  add: {{ toJson . }}
  {{- end }}
  {{- end }}
{{- end -}}

{{- define "r1sup.hfTokenEnv" -}}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.hfToken.secretName }}
      key: {{ .Values.hfToken.key }}
      optional: true
{{- end -}}

{{/* The init container that fetches the model into the Hugging Face cache (HF_HOME of the image). */}}
{{- define "r1sup.fetchModel" -}}
- name: fetch-model
  image: {{ include "r1sup.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - {{ .Values.image.vllmPython }}
    - -c
    - |
      import json, os
      from huggingface_hub import snapshot_download
      path = snapshot_download(
          os.environ["MODEL_ID"],
          revision=os.environ.get("MODEL_REVISION") or None,
          allow_patterns=json.loads(os.environ["MODEL_ALLOW_PATTERNS"]),
      )
      print("model in the cache:", path, flush=True)
  env:
    - name: MODEL_ID
      value: {{ .Values.config.model.name | quote }}
    - name: MODEL_REVISION
      value: {{ .Values.config.model.revision | default "" | quote }}
    - name: MODEL_ALLOW_PATTERNS
      value: {{ toJson .Values.modelFetch.allowPatterns | quote }}
    {{- include "r1sup.hfTokenEnv" . | nindent 4 }}
  resources:
    {{- toYaml .Values.modelFetch.resources | nindent 4 }}
  securityContext:
    {{- include "r1sup.containerSecurityContext" . | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: /var/cache/r1sup
    - name: tmp
      mountPath: /tmp
{{- end -}}

{{/* The model is fetched unless model.name is a local path. */}}
{{- define "r1sup.fetchEnabled" -}}
{{- if and .Values.modelFetch.enabled (not (hasPrefix "/" .Values.config.model.name)) -}}true{{- end -}}
{{- end -}}

{{/* The profile store r1sup reads: the HTTP store's URL, else the claim's mount. */}}
{{- define "r1sup.profileStoreClaimed" -}}
{{- if and .Values.profileStore.enabled (not .Values.profileStore.url) -}}true{{- end -}}
{{- end -}}

{{/* The load of each replica as a fraction of the capacity its profile proved, one series per pod:
vLLM's requests running (and waiting) over r1sup's service-level capacity when the profile proved one,
else over the requests at once it verified. The argument: (list $ "label matchers"). A replica that has
proven nothing yet (loading, tuning) has no series. Each vLLM engine's gauge is taken once per pod even
if two scrape jobs read it. */}}
{{- define "r1sup.loadPerCapacity" -}}
{{- $root := index . 0 -}}
{{- $sel := index . 1 -}}
(sum by (namespace, pod) (max by (namespace, pod, engine) (vllm:num_requests_running{ {{- $sel -}} }))
{{- if $root.Values.autoscaling.countWaiting }} + sum by (namespace, pod) (max by (namespace, pod, engine) (vllm:num_requests_waiting{ {{- $sel -}} })){{ end }})
/ on (namespace, pod)
(min by (namespace, pod) (r1sup_capacity_slo_requests{ {{- $sel -}} } > 0) or max by (namespace, pod) (r1sup_capacity_requests{ {{- $sel -}} } > 0))
{{- end -}}

{{/* The release's serving pods as the PodMonitor or ServiceMonitor label their series (a StatefulSet's
pods, a LeaderWorkerSet's leaders: RELEASE-<index>). */}}
{{- define "r1sup.podMatchers" -}}
namespace="{{ .Release.Namespace }}",pod=~"{{ include "r1sup.fullname" . }}-[0-9]+"
{{- end -}}

{{/* What the autoscaler scales. */}}
{{- define "r1sup.scaleTargetRef" -}}
{{- if .Values.multinode.enabled -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
{{- else -}}
apiVersion: apps/v1
kind: StatefulSet
{{- end }}
name: {{ include "r1sup.fullname" . }}
{{- end -}}

{{/* The upgrade gate's Job deadline: every launch the search may make, and the probe. */}}
{{- define "r1sup.gateDeadline" -}}
{{- add (mul (include "r1sup.searchSetting" (list . "max_attempts" 8) | int64) (include "r1sup.setting" (list . "server" "startup_timeout_s" 1800) | int64)) 600 -}}
{{- end -}}
