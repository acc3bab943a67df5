{{/*
The run config every service reads (/etc/etude/config.toml): .Values.config with the
keys the chart owns laid over it (addresses, ports, TLS files, Redis, object store).
values.schema.json rejects those keys in .Values.config, so nothing is overridden
silently. Secrets never land here: the token, a Redis URL with a password and S3
credentials reach the pods as environment variables from Secrets.
*/}}

{{- define "etude.managedConfig" -}}
{{- $ctx := . -}}
{{- $endpoints := dict -}}
{{- $managed := dict "run" (dict "state_dir" "/var/lib/etude") "endpoints" $endpoints -}}
{{- range $component := splitList " " (include "etude.components" $ctx) -}}
{{- $values := index $ctx.Values $component -}}
{{- $target := include "etude.endpoint" (dict "ctx" $ctx "component" $component) -}}
{{- if $target -}}
{{- $_ := set $endpoints $component $target -}}
{{- end -}}
{{- $grpc := dict "port" (int $values.ports.grpc) -}}
{{- if $ctx.Values.tls.enabled -}}
{{- $_ := set $grpc "tls_cert_file" "/etc/etude/tls/tls.crt" -}}
{{- $_ := set $grpc "tls_key_file" "/etc/etude/tls/tls.key" -}}
{{- end -}}
{{- $section := dict "grpc" $grpc "http" (dict "port" (int $values.ports.http)) -}}
{{- if eq $component "trainer" -}}
{{- /* Local checkpoints, or the staging of checkpoints in the object store, on the checkpoint volume. */ -}}
{{- $_ := set $section "checkpoint_dir" $values.checkpoints.mountPath -}}
{{- end -}}
{{- $_ := set $managed $component $section -}}
{{- end -}}
{{- if $ctx.Values.tls.enabled -}}
{{- $_ := set $endpoints "tls_ca_file" "/etc/etude/tls/ca.crt" -}}
{{- end -}}
{{- $redisUrl := include "etude.redisUrl" $ctx -}}
{{- if $redisUrl -}}
{{- $_ := set $managed "redis" (dict "url" $redisUrl) -}}
{{- end -}}
{{- $store := dict "url" $ctx.Values.objectStore.url -}}
{{- with $ctx.Values.objectStore.endpointUrl -}}
{{- $_ := set $store "endpoint_url" . -}}
{{- end -}}
{{- with $ctx.Values.objectStore.region -}}
{{- $_ := set $store "region" . -}}
{{- end -}}
{{- $_ := set $managed "object_store" $store -}}
{{- /* The one model of the run: model.dir in every pod that reads it, synced from model.storePrefix when set. */ -}}
{{- $model := dict "dir" $ctx.Values.model.dir -}}
{{- with $ctx.Values.model.storePrefix -}}
{{- $_ := set $model "store_prefix" . -}}
{{- end -}}
{{- $_ := set $managed "model" $model -}}
{{- toJson $managed -}}
{{- end -}}

{{- define "etude.config" -}}
{{- $config := mergeOverwrite (deepCopy .Values.config) (fromJson (include "etude.managedConfig" .)) -}}
{{- include "etude.toml.table" (dict "table" $config "prefix" "") -}}
{{- end -}}

{{/* A TOML table: scalars and arrays first, then sub-tables, keys sorted. */}}
{{- define "etude.toml.table" -}}
{{- $table := .table -}}
{{- $prefix := .prefix -}}
{{- range $key := keys $table | sortAlpha -}}
{{- $value := index $table $key -}}
{{- if not (or (kindIs "map" $value) (kindIs "invalid" $value)) }}
{{ $key }} = {{ include "etude.toml.value" $value }}
{{- end -}}
{{- end -}}
{{- range $key := keys $table | sortAlpha -}}
{{- $value := index $table $key -}}
{{- if kindIs "map" $value -}}
{{- $name := $key -}}
{{- if $prefix -}}
{{- $name = printf "%s.%s" $prefix $key -}}
{{- end }}

[{{ $name }}]
{{- include "etude.toml.table" (dict "table" $value "prefix" $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A TOML value. Helm reads every YAML number as a float: whole ones are written as integers. */}}
{{- define "etude.toml.value" -}}
{{- if kindIs "string" . -}}
{{- toJson . -}}
{{- else if kindIs "bool" . -}}
{{- ternary "true" "false" . -}}
{{- else if kindIs "float64" . -}}
{{- if eq . (float64 (int64 .)) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else if or (kindIs "int" .) (kindIs "int64" .) -}}
{{- . -}}
{{- else if kindIs "slice" . -}}
[{{ range $i, $item := . }}{{ if $i }}, {{ end }}{{ include "etude.toml.value" $item }}{{ end }}]
{{- else -}}
{{- fail (printf "config: cannot write %v (a %s) to TOML" . (kindOf .)) -}}
{{- end -}}
{{- end -}}
