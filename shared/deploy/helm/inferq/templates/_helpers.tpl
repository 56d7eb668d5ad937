{{/*
Names, labels and the pieces every inferq pod shares. Each fact that two templates need is
computed here once.
*/}}

{{/* The release's base name: the release name, with the chart name appended unless it holds it. */}}
{{- define "inferq.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select one component's pods; call with (dict "root" $ "component" "worker"). */}}
{{- define "inferq.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Every object's labels; call like inferq.selectorLabels. */}}
{{- define "inferq.labels" -}}
{{ include "inferq.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* An image reference; call with (dict "root" $ "repository" "inferq-worker"). */}}
{{- define "inferq.image" -}}
{{- $registry := .root.Values.image.registry | trimSuffix "/" -}}
{{- $tag := .root.Values.image.tag | default .root.Chart.AppVersion -}}
{{- if $registry -}}
{{- printf "%s/%s:%s" $registry .repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The gateway Service's in-cluster URL (the batch worker sends batch lines to it). */}}
{{- define "inferq.gatewayUrl" -}}
{{- printf "http://%s-gateway:%d" (include "inferq.fullname" .) (int .Values.gateway.service.port) -}}
{{- end -}}

{{/*
The model name clients send, which labels the gateways' metrics (model_name): as
shared/model_source.py names it, the served name if set, else a folder's own name (its last
path element), else the name given.
*/}}
{{- define "inferq.servedModelName" -}}
{{- .Values.model.servedModelName | default (base .Values.model.name) -}}
{{- end -}}

{{/* True (non-empty) when KEDA may scale the workers to zero. */}}
{{- define "inferq.scalesToZero" -}}
{{- if and .Values.autoscaling.enabled (eq (int .Values.autoscaling.minReplicaCount) 0) -}}true{{- end -}}
{{- end -}}

{{/*
The gateway's readiness path. /ready answers 200 only while a worker for the model is ready.
With scale-to-zero there is none while idle, so /ready would take every gateway out of its
Service, no request could arrive to be queued, and KEDA would never see a reason to start a
worker: there the gateway is ready when it and Redis are up (/health) and requests queue until
a worker starts.
*/}}
{{- define "inferq.gatewayReadinessPath" -}}
{{- if include "inferq.scalesToZero" . -}}/health{{- else -}}/ready{{- end -}}
{{- end -}}

{{/* INFERQ_REDIS_URL as an EnvVar (redis.urlSecret, else redis.url, else the Sentinel URL). */}}
{{- define "inferq.redisUrlEnv" -}}
{{- $redis := .Values.redis -}}
- name: INFERQ_REDIS_URL
{{- if $redis.urlSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ $redis.urlSecret.name }}
      key: {{ required "redis.urlSecret.key is required with redis.urlSecret.name" $redis.urlSecret.key }}
{{- else if $redis.url }}
  value: {{ $redis.url | quote }}
{{- else if $redis.sentinel.hosts }}
  value: {{ printf "redis+sentinel://%s/%s/%d" (join "," $redis.sentinel.hosts) (required "redis.sentinel.masterSet is required" $redis.sentinel.masterSet) (int $redis.sentinel.db) | quote }}
{{- else }}
{{- fail "set redis.sentinel.hosts, redis.url or redis.urlSecret.name: every inferq process needs Redis" }}
{{- end }}
{{- end -}}

{{/* The settings every process of the deployment shares, as EnvVars. */}}
{{- define "inferq.commonEnv" -}}
{{ include "inferq.redisUrlEnv" . }}
- name: INFERQ_NAMESPACE
  value: {{ .Values.keyNamespace | quote }}
{{- end -}}

{{/* The model settings of gateways and workers, as EnvVars. */}}
{{- define "inferq.modelEnv" -}}
- name: INFERQ_MODEL
  value: {{ .Values.model.name | quote }}
{{- if .Values.model.servedModelName }}
- name: INFERQ_SERVED_MODEL_NAME
  value: {{ .Values.model.servedModelName | quote }}
{{- end }}
- name: INFERQ_MODEL_CACHE_DIR
  value: {{ .Values.model.mountPath | quote }}
{{- end -}}

{{/* A component's `env` map (INFERQ_NAME: value) as EnvVars, then its `extraEnv` list. */}}
{{- define "inferq.extraEnv" -}}
{{- range $name, $value := .env }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- with .extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Prometheus scrape annotations for a pod whose metrics are on `port`; call with (dict "root" $ "port" 8000). */}}
{{- define "inferq.scrapeAnnotations" -}}
{{- if .root.Values.monitoring.scrapeAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end -}}
{{- end -}}

{{/* The files volume (INFERQ_FILES_DIR), shared by gateways and batch workers. */}}
{{- define "inferq.filesVolume" -}}
- name: files
{{- if .Values.files.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.files.existingClaim }}
{{- else if .Values.files.persistence.enabled }}
  persistentVolumeClaim:
    claimName: {{ include "inferq.fullname" . }}-files
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}
