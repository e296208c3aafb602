{{/* The pod that runs r1sup: the StatefulSet's, and the LeaderWorkerSet's leader. */}}
{{- define "r1sup.podSpec" -}}
# Service links would put <SERVICE>_PORT=tcp://... variables in the environment; a Service whose name
# starts with r1sup-server would then set R1SUP_SERVER_PORT. r1sup needs none of them.
enableServiceLinks: false
# preStop pause + drain + stop + memory release + spare (see _helpers.tpl): r1sup stops vLLM itself
# and must not be SIGKILLed first
terminationGracePeriodSeconds: {{ include "r1sup.graceSeconds" . }}
securityContext:
  {{- include "r1sup.podSecurityContext" . | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.gpu.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.gpu.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if include "r1sup.fetchEnabled" . }}
initContainers:
  {{- include "r1sup.fetchModel" . | nindent 2 }}
{{- end }}
containers:
  - name: r1sup
    image: {{ include "r1sup.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    {{- if and .Values.multinode.enabled (eq (include "r1sup.multinodeBackend" .) "ray") }}
    # tini stays PID 1; the Ray head starts in the background and waits for the group's nodes, then r1sup
    # replaces the shell
    command: ["tini", "--", "sh", "-c"]
    args:
      - >-
        bash /vllm-workspace/examples/online_serving/multi-node-serving.sh leader
        --ray_cluster_size="${LWS_GROUP_SIZE}" --ray_port={{ .Values.multinode.rayPort }}
        --ray_init_timeout={{ .Values.multinode.rayInitTimeoutSeconds }}
        && exec r1sup --log-format json run
    {{- else if .Values.multinode.enabled }}
    # vLLM's own multi-node mode: r1sup launches vLLM as node 0 of the group (--nnodes, --node-rank 0,
    # --master-addr: this pod's own address, which the group's workers reach); tini stays PID 1
    command: ["tini", "--", "sh", "-c"]
    args:
      - >-
        R1SUP_MULTINODE_MASTER_ADDR="${LWS_LEADER_ADDRESS}" R1SUP_MULTINODE_NODE_RANK=0
        exec r1sup --log-format json run
    {{- end }}
    env:
      - name: R1SUP_CONFIG
        value: /etc/r1sup/r1sup.toml
      {{- if .Values.profileStore.enabled }}
      - name: R1SUP_STATE_PROFILE_STORE
        value: {{ .Values.profileStore.url | default .Values.profileStore.mountPath | quote }}
      {{- end }}
      - name: VLLM_API_KEY
        valueFrom:
          secretKeyRef:
            name: {{ .Values.apiKey.secretName }}
            key: {{ .Values.apiKey.key }}
      {{- include "r1sup.hfTokenEnv" . | nindent 6 }}
      {{- if include "r1sup.fetchEnabled" . }}
      # the init container fetched the model: nothing downloads while r1sup launches and tunes
      - name: HF_HUB_OFFLINE
        value: "1"
      {{- end }}
      {{- if .Values.multinode.enabled }}
      {{- include "r1sup.multinodeEnv" . | nindent 6 }}
      {{- range $name, $value := .Values.multinode.network.env }}
      - name: {{ $name }}
        value: {{ $value | quote }}
      {{- end }}
      {{- end }}
    ports:
      - name: http
        containerPort: {{ .Values.config.server.port | default 8000 | int64 }}
      - name: r1sup
        containerPort: {{ .Values.endpointPort }}
      {{- if and .Values.multinode.enabled (eq (include "r1sup.multinodeBackend" .) "mp") }}
      # vLLM's rendezvous (torch.distributed) for the group's workers
      - name: rendezvous
        containerPort: {{ .Values.multinode.masterPort }}
      {{- end }}
    resources:
      {{- $limits := merge (dict .Values.gpu.resource (toString .Values.gpu.count)) (.Values.resources.limits | default dict) }}
      {{- if .Values.multinode.enabled }}
      {{- $limits = merge $limits .Values.multinode.network.resources }}
      {{- end }}
      {{- with .Values.resources.requests }}
      requests:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      limits:
        {{- toYaml $limits | nindent 8 }}
    # Ready only after start-up and the load probe passed. Budget: {{ include "r1sup.startupBudget" . }} s =
    # the wait for another replica's tune (state.profile_wait_s){{ if and .Values.multinode.enabled (eq (include "r1sup.multinodeBackend" .) "ray") }} and
    # for the Ray cluster (multinode.rayInitTimeoutSeconds){{ end }}, then search.max_attempts launches of at
    # most server.startup_timeout_s each; usually one launch of minutes.
    startupProbe:
      httpGet:
        path: /readyz
        port: r1sup
      periodSeconds: {{ .Values.probes.startupPeriodSeconds }}
      timeoutSeconds: 5
      failureThreshold: {{ include "r1sup.startupFailureThreshold" . }}
    # Out of the Service while r1sup re-tunes, backs off, restarts vLLM, drains or stops.
    readinessProbe:
      httpGet:
        path: /readyz
        port: r1sup
      periodSeconds: {{ .Values.probes.readinessPeriodSeconds }}
      timeoutSeconds: 3
      failureThreshold: 2
    # The supervisor's loop turns (a re-tune or a restart of vLLM is not a reason to kill the pod;
    # r1sup's own limit covers a whole stop of vLLM).
    livenessProbe:
      httpGet:
        path: /livez
        port: r1sup
      periodSeconds: {{ .Values.probes.livenessPeriodSeconds }}
      timeoutSeconds: 5
      failureThreshold: 3
    lifecycle:
      # the pod leaves the endpoints first; SIGTERM (r1sup's drain) comes after this pause
      preStop:
        sleep:
          seconds: {{ .Values.preStopSleepSeconds }}
    # r1sup writes its one-line verdict there when it exits non-zero (kubectl describe pod shows it)
    terminationMessagePath: /dev/termination-log
    terminationMessagePolicy: FallbackToLogsOnError
    securityContext:
      {{- include "r1sup.containerSecurityContext" . | nindent 6 }}
    volumeMounts:
      - name: config
        mountPath: /etc/r1sup
        readOnly: true
      - name: state
        mountPath: /var/lib/r1sup
      - name: models
        mountPath: /var/cache/r1sup
      {{- if include "r1sup.profileStoreClaimed" . }}
      - name: profiles
        mountPath: {{ .Values.profileStore.mountPath }}
      {{- end }}
      - name: dshm
        mountPath: /dev/shm
      - name: tmp
        mountPath: /tmp
volumes:
  - name: config
    configMap:
      name: {{ include "r1sup.fullname" . }}
  {{- if include "r1sup.profileStoreClaimed" . }}
  - name: profiles
    persistentVolumeClaim:
      claimName: {{ include "r1sup.profileStoreClaim" . }}
  {{- end }}
  {{- if .Values.models.shared }}
  - name: models
    persistentVolumeClaim:
      claimName: {{ include "r1sup.modelsClaim" . }}
  {{- end }}
  # vLLM's processes share tensors through /dev/shm
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ .Values.shmSize }}
  - name: tmp
    emptyDir: {}
{{- end -}}
