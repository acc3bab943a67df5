{{/*
Names, labels and the small lookups every template shares.
A "component" is one of the five services (reconciler, envs, inference, trainer,
evals) or "redis"; its values live at .Values.<component>.
*/}}

{{- define "etude.components" -}}
reconciler envs inference trainer evals
{{- end -}}

{{- define "etude.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of every object: the release name, so objects are <release>-<component>. */}}
{{- define "etude.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Name of a component's objects: (dict "ctx" $ "component" "envs") -> <fullname>-envs */}}
{{- define "etude.componentName" -}}
{{- printf "%s-%s" (include "etude.fullname" .ctx | trunc 52 | trimSuffix "-") .component -}}
{{- end -}}

{{/* A component's headless Service; the prefix is cut shorter so the name stays a 63-character DNS label. */}}
{{- define "etude.headlessName" -}}
{{- printf "%s-%s-headless" (include "etude.fullname" .ctx | trunc 43 | trimSuffix "-") .component -}}
{{- end -}}

{{- define "etude.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object; pass (dict "ctx" $ "component" "envs") or (dict "ctx" $) */}}
{{- define "etude.labels" -}}
helm.sh/chart: {{ include "etude.chart" .ctx }}
{{ include "etude.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: etude
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "etude.selectorLabels" -}}
app.kubernetes.io/name: {{ include "etude.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{- define "etude.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "etude.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* <registry>/<repository>:<tag> of a component: (dict "ctx" $ "component" "envs") */}}
{{- define "etude.image" -}}
{{- $values := index .ctx.Values .component -}}
{{- $tag := default (default .ctx.Chart.AppVersion .ctx.Values.image.tag) $values.image.tag -}}
{{- if .ctx.Values.image.registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" .ctx.Values.image.registry) $values.image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" $values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "etude.authSecretName" -}}
{{- default (printf "%s-auth" (include "etude.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* The components whose replicas share the load: each has a headless Service that clients resolve. */}}
{{- define "etude.balanced" -}}
reconciler inference evals
{{- end -}}

{{/*
The gRPC target of a service: an explicit endpoints.<svc>, else this release's Service;
for a balanced component its headless Service, as dns:/// so that clients spread their
calls over every ready replica (round_robin) and resolve again as connections age out.
*/}}
{{- define "etude.endpoint" -}}
{{- $explicit := index .ctx.Values.endpoints .component -}}
{{- $values := index .ctx.Values .component -}}
{{- if $explicit -}}
{{- $explicit -}}
{{- else if and $values.enabled (has .component (splitList " " (include "etude.balanced" .ctx))) -}}
{{- printf "dns:///%s:%d" (include "etude.headlessName" .) (int $values.ports.grpc) -}}
{{- else if $values.enabled -}}
{{- printf "%s:%d" (include "etude.componentName" .) (int $values.ports.grpc) -}}
{{- end -}}
{{- end -}}

{{/* Which other services a service calls; a release must reach each of them. */}}
{{- define "etude.dependencies" -}}
{{- $deps := dict "reconciler" (list) "inference" (list) "envs" (list "reconciler" "inference") "trainer" (list "reconciler") "evals" (list "reconciler" "inference") -}}
{{- toJson (index $deps .) -}}
{{- end -}}

{{/* Fails the render when an enabled service cannot reach a service it depends on. */}}
{{- define "etude.checkEndpoints" -}}
{{- $ctx := . -}}
{{- range $component := splitList " " (include "etude.components" $ctx) -}}
{{- if (index $ctx.Values $component).enabled -}}
{{- range $dependency := fromJsonArray (include "etude.dependencies" $component) -}}
{{- if not (include "etude.endpoint" (dict "ctx" $ctx "component" $dependency)) -}}
{{- fail (printf "%s is enabled and calls %s, which this release does not run: set endpoints.%s (host:port of the shared %s)" $component $dependency $dependency $dependency) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The Redis URL the services use when it is not a secret. */}}
{{- define "etude.redisUrl" -}}
{{- if not .Values.reconciler.enabled -}}
{{- /* Only the reconciler talks to Redis. */ -}}
{{- else if .Values.redis.bundled -}}
{{- printf "redis://%s:%d/0" (include "etude.componentName" (dict "ctx" . "component" "redis")) (int .Values.redis.port) -}}
{{- else if not .Values.redis.external.existingSecret -}}
{{- required "redis.external.url (or redis.external.existingSecret) is required when redis.bundled is false" .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/* Whether anything monitoring-related renders PromQL that filters on this release. */}}
{{- define "etude.promSelector" -}}
namespace="{{ .Release.Namespace }}", release="{{ .Release.Name }}"
{{- end -}}
