{{/*
The pod template every Etude service shares: (dict "ctx" $ "component" "envs").
One container running `etude serve <component>`, the run config from the ConfigMap,
the token from its Secret, gRPC health probes, and what the component's values add
(GPUs, /dev/shm, a model or checkpoint volume, a RuntimeClass).
*/}}

{{- define "etude.probe" -}}
{{- if .ctx.Values.tls.enabled -}}
httpGet:
  path: {{ ternary "/readyz" "/healthz" (eq .kind "readiness") }}
  port: {{ int .values.ports.http }}
{{- else -}}
grpc:
  port: {{ int .values.ports.grpc }}
  service: {{ .kind }}
{{- end }}
{{- end -}}

{{/* The directory of a file:// object store URL. */}}
{{- define "etude.objectStoreDir" -}}
{{- trimPrefix "file://" .Values.objectStore.url -}}
{{- end -}}

{{- define "etude.podTemplate" -}}
{{- $ctx := .ctx -}}
{{- $component := .component -}}
{{- $values := index $ctx.Values $component -}}
{{- /* The reconciler reads the task file of a jsonl feeder from the store (reconciler.feeder.key). */ -}}
{{- $usesStore := has $component (list "reconciler" "envs" "inference" "trainer" "evals") -}}
{{- $readsModel := has $component (list "envs" "inference" "trainer") -}}
{{- $model := $ctx.Values.model -}}
{{- if and $readsModel (not (hasPrefix (printf "%s/" (trimSuffix "/" $model.mountPath)) $model.dir)) -}}
{{- fail (printf "model.dir (%s) must lie under model.mountPath (%s), where the model volume is mounted" $model.dir $model.mountPath) -}}
{{- end -}}
{{- if and $model.initPreset $model.storePrefix -}}
{{- fail "model.initPreset and model.storePrefix are two sources of the model: set one" -}}
{{- end -}}
{{- $fileStore := and $usesStore (hasPrefix "file://" $ctx.Values.objectStore.url) -}}
{{- $gpus := int (default 0 $values.gpus) -}}
{{- $grace := int (default $ctx.Values.terminationGracePeriodSeconds $values.terminationGracePeriodSeconds) -}}
{{- $serviceConfig := index $ctx.Values.config $component | default dict -}}
{{- $shutdownGrace := (dig "grpc" "shutdown_grace_s" 10 $serviceConfig) | int -}}
{{- if le $grace $shutdownGrace -}}
{{- fail (printf "%s: terminationGracePeriodSeconds (%d) must exceed config.%s.grpc.shutdown_grace_s (%d), or in-flight calls are killed" $component $grace $component $shutdownGrace) -}}
{{- end -}}
metadata:
  labels:
    {{- include "etude.selectorLabels" (dict "ctx" $ctx "component" $component) | nindent 4 }}
    app.kubernetes.io/part-of: etude
    {{- with $values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include "etude.config" $ctx | sha256sum }}
    {{- with $values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "etude.serviceAccountName" $ctx }}
  automountServiceAccountToken: {{ $ctx.Values.serviceAccount.automountToken }}
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ $grace }}
  {{- with $values.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with $values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $ctx.Values.image.pullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  securityContext:
    {{- toYaml (mergeOverwrite (deepCopy $ctx.Values.podSecurityContext) $values.podSecurityContext) | nindent 4 }}
  {{- if and $readsModel $model.initPreset }}
  initContainers:
    - name: model-init
      image: {{ include "etude.image" (dict "ctx" $ctx "component" $component) }}
      imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
      command: ["/bin/sh", "-c"]
      args:
        - >-
          test -f "$MODEL_DIR/config.json" ||
          etude model init --preset {{ $model.initPreset }} --out "$MODEL_DIR"
      env:
        - name: MODEL_DIR
          value: {{ $model.dir | quote }}
        - name: HOME
          value: /var/lib/etude
      securityContext:
        {{- toYaml (mergeOverwrite (deepCopy $ctx.Values.securityContext) $values.securityContext) | nindent 8 }}
      volumeMounts:
        - {name: model, mountPath: {{ $model.mountPath }}}
        - {name: tmp, mountPath: /tmp}
        - {name: state, mountPath: /var/lib/etude}
  {{- end }}
  containers:
    - name: {{ $component }}
      image: {{ include "etude.image" (dict "ctx" $ctx "component" $component) }}
      imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
      {{- if eq $component "trainer" }}
      {{- $torchrun := $values.torchrun }}
      {{- $nnodes := printf "%d" (int $values.nodes) }}
      {{- if gt (int $torchrun.maxNodes) 0 }}
      {{- $nnodes = printf "%d:%d" (int $values.nodes) (int $torchrun.maxNodes) }}
      {{- end }}
      command: ["torchrun"]
      args:
        - --nnodes={{ $nnodes }}
        - --nproc-per-node={{ int $torchrun.nprocPerNode }}
        - --rdzv-backend=c10d
        - --rdzv-endpoint={{ include "etude.componentName" (dict "ctx" $ctx "component" "trainer") }}-0.{{ include "etude.componentName" (dict "ctx" $ctx "component" "trainer") }}-headless:{{ int $torchrun.rendezvousPort }}
        - --rdzv-id={{ $ctx.Release.Name }}-{{ $ctx.Values.config.run.name }}
        - --max-restarts={{ int $torchrun.maxRestarts }}
        - --no-python
        - etude
        - serve
        - trainer
        - --config
        - /etc/etude/config.toml
      {{- else }}
      command: ["etude"]
      args: ["serve", "{{ $component }}", "--config", "/etc/etude/config.toml"]
      {{- end }}
      ports:
        - {name: grpc, containerPort: {{ int $values.ports.grpc }}, protocol: TCP}
        - {name: http, containerPort: {{ int $values.ports.http }}, protocol: TCP}
        {{- if eq $component "trainer" }}
        - {name: rendezvous, containerPort: {{ int $values.torchrun.rendezvousPort }}, protocol: TCP}
        {{- end }}
      env:
        - name: ETUDE_AUTH__TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ include "etude.authSecretName" $ctx }}
              key: {{ $ctx.Values.auth.secretKey }}
        {{- if and (eq $component "reconciler") (not $ctx.Values.redis.bundled) $ctx.Values.redis.external.existingSecret }}
        - name: ETUDE_REDIS__URL
          valueFrom:
            secretKeyRef:
              name: {{ $ctx.Values.redis.external.existingSecret }}
              key: {{ $ctx.Values.redis.external.secretKey }}
        {{- end }}
        {{- if and $usesStore $ctx.Values.objectStore.credentials.existingSecret }}
        - name: AWS_ACCESS_KEY_ID
          valueFrom:
            secretKeyRef:
              name: {{ $ctx.Values.objectStore.credentials.existingSecret }}
              key: {{ $ctx.Values.objectStore.credentials.accessKeyIdKey }}
        - name: AWS_SECRET_ACCESS_KEY
          valueFrom:
            secretKeyRef:
              name: {{ $ctx.Values.objectStore.credentials.existingSecret }}
              key: {{ $ctx.Values.objectStore.credentials.secretAccessKeyKey }}
        {{- end }}
        - {name: HOME, value: /var/lib/etude}
        - {name: XDG_CACHE_HOME, value: /var/lib/etude/cache}
        {{- with $values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      startupProbe:
        {{- include "etude.probe" (dict "ctx" $ctx "values" $values "kind" "liveness") | nindent 8 }}
        periodSeconds: {{ int $values.probes.periodSeconds }}
        failureThreshold: {{ int $values.probes.startupFailureThreshold }}
      livenessProbe:
        {{- include "etude.probe" (dict "ctx" $ctx "values" $values "kind" "liveness") | nindent 8 }}
        periodSeconds: 10
        timeoutSeconds: 5
        failureThreshold: 3
      readinessProbe:
        {{- include "etude.probe" (dict "ctx" $ctx "values" $values "kind" "readiness") | nindent 8 }}
        periodSeconds: {{ int $values.probes.periodSeconds }}
        timeoutSeconds: 5
        failureThreshold: 3
      resources:
        {{- $resources := deepCopy $values.resources }}
        {{- if gt $gpus 0 }}
        {{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" $gpus) (default dict $resources.limits)) }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
      securityContext:
        {{- toYaml (mergeOverwrite (deepCopy $ctx.Values.securityContext) $values.securityContext) | nindent 8 }}
      volumeMounts:
        - {name: config, mountPath: /etc/etude/config.toml, subPath: config.toml, readOnly: true}
        - {name: tmp, mountPath: /tmp}
        - {name: state, mountPath: /var/lib/etude}
        {{- if $ctx.Values.tls.enabled }}
        - {name: tls, mountPath: /etc/etude/tls, readOnly: true}
        {{- end }}
        {{- if $fileStore }}
        - {name: object-store, mountPath: {{ include "etude.objectStoreDir" $ctx }}}
        {{- end }}
        {{- if hasKey $values "shmSize" }}
        - {name: dshm, mountPath: /dev/shm}
        {{- end }}
        {{- if $readsModel }}
        - {name: model, mountPath: {{ $model.mountPath }}, readOnly: {{ not (or $model.initPreset $model.storePrefix) }}}
        {{- end }}
        {{- if eq $component "trainer" }}
        - {name: checkpoints, mountPath: {{ $values.checkpoints.mountPath }}}
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "etude.fullname" $ctx }}-config
    - {name: tmp, emptyDir: {}}
    - {name: state, emptyDir: {}}
    {{- if $ctx.Values.tls.enabled }}
    - name: tls
      secret:
        secretName: {{ required "tls.secretName is required when tls.enabled is true" $ctx.Values.tls.secretName }}
    {{- end }}
    {{- if $fileStore }}
    - name: object-store
      persistentVolumeClaim:
        claimName: {{ required "objectStore.fileClaim (a ReadWriteMany PVC) is required for a file:// objectStore.url" $ctx.Values.objectStore.fileClaim }}
    {{- end }}
    {{- if hasKey $values "shmSize" }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $values.shmSize }}
    {{- end }}
    {{- if $readsModel }}
    - name: model
      {{- /* One volume source: the values' own (Helm would merge a default into it), or an emptyDir. */}}
      {{- toYaml (default (dict "emptyDir" dict) $model.volume) | nindent 6 }}
    {{- end }}
    {{- if and (eq $component "trainer") $values.checkpoints.existingClaim }}
    - name: checkpoints
      persistentVolumeClaim:
        claimName: {{ $values.checkpoints.existingClaim }}
    {{- end }}
  {{- with $values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* A component's ClusterIP Service (grpc + http). */}}
{{- define "etude.service" -}}
{{- $ctx := .ctx -}}
{{- $values := index $ctx.Values .component -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "etude.componentName" . }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "etude.labels" . | nindent 4 }}
    {{- with .extraLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $values.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ $values.service.type }}
  selector:
    {{- include "etude.selectorLabels" . | nindent 4 }}
    {{- with .extraSelector }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - {name: grpc, port: {{ int $values.ports.grpc }}, targetPort: grpc, protocol: TCP}
    - {name: http, port: {{ int $values.ports.http }}, targetPort: http, protocol: TCP}
{{- end -}}

{{/*
A component's headless Service: its DNS name resolves to every ready pod, so clients
(dns:/// targets, round_robin) spread their calls over all replicas and find new ones
when they resolve again. Not scraped: the component's ClusterIP Service selects the
same pods.
*/}}
{{- define "etude.headlessService" -}}
{{- $ctx := .ctx -}}
{{- $values := index $ctx.Values .component -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "etude.headlessName" . }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "etude.labels" . | nindent 4 }}
    etude/scrape: "false"
spec:
  clusterIP: None
  # Only ready pods: a replica still loading or shutting down gets no calls.
  publishNotReadyAddresses: false
  selector:
    {{- include "etude.selectorLabels" . | nindent 4 }}
  ports:
    - {name: grpc, port: {{ int $values.ports.grpc }}, targetPort: grpc, protocol: TCP}
{{- end -}}

{{/* A PodDisruptionBudget when more than one pod may run. */}}
{{- define "etude.pdb" -}}
{{- $ctx := .ctx -}}
{{- $values := index $ctx.Values .component -}}
{{- $replicas := int (default 1 (ternary $values.nodes $values.replicas (eq .component "trainer"))) -}}
{{- $autoscaled := or (dig "autoscaling" "enabled" false $values) (dig "keda" "enabled" false $values) -}}
{{- if and $values.enabled $values.pdb.enabled (or (gt $replicas 1) $autoscaled) }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "etude.componentName" . }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "etude.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ int $values.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "etude.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{/* A ServiceMonitor scraping a component's /metrics; adds release and component labels the dashboards and rules use. */}}
{{- define "etude.serviceMonitor" -}}
{{- $ctx := .ctx -}}
{{- $values := index $ctx.Values .component -}}
{{- $monitor := $ctx.Values.metrics.serviceMonitor -}}
{{- if and $values.enabled $monitor.enabled }}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "etude.componentName" . }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "etude.labels" . | nindent 4 }}
    {{- with $monitor.additionalLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "etude.selectorLabels" . | nindent 6 }}
    # The trainer's entry Service (pod 0 only) is not scraped: its headless Service covers every pod.
    matchExpressions:
      - {key: etude/scrape, operator: NotIn, values: ["false"]}
  namespaceSelector:
    matchNames: [{{ $ctx.Release.Namespace }}]
  endpoints:
    - port: http
      path: /metrics
      interval: {{ $monitor.interval }}
      scrapeTimeout: {{ $monitor.scrapeTimeout }}
      # The services' own labels win: etude_service_ready{service} must not become exported_service.
      honorLabels: true
      relabelings:
        - action: replace
          sourceLabels: [__meta_kubernetes_service_label_app_kubernetes_io_instance]
          targetLabel: release
        - action: replace
          sourceLabels: [__meta_kubernetes_service_label_app_kubernetes_io_component]
          targetLabel: component
{{- end }}
{{- end -}}
