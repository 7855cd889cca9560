{{- define "triton-controlplane.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "triton-controlplane.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Takes (dict "root" $ "component" "web"). */}}
{{- define "triton-controlplane.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Non-secret settings: `config` over the defaults derived from `host`. */}}
{{- define "triton-controlplane.config" -}}
{{- $config := dict "PRODUCTION" "true" "ALLOWED_HOSTS" .Values.host "SITE_URL" (printf "https://%s" .Values.host) -}}
{{- range $name, $value := .Values.config -}}
{{- $_ := set $config $name (toString $value) -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* Secrets, by key from the existing Secret: a required key missing there stops the pod. */}}
{{- define "triton-controlplane.secretEnv" -}}
- name: ROLLOUT_WEBHOOK_URL
  valueFrom:
    secretKeyRef: {name: {{ .Values.existingSecret | quote }}, key: ROLLOUT_WEBHOOK_URL, optional: true}
{{- range list "SECRET_KEY" "DATABASE_URL" "CELERY_BROKER_URL" "PROMETHEUS_URL" }}
- name: {{ . }}
  valueFrom:
    secretKeyRef: {name: {{ $.Values.existingSecret | quote }}, key: {{ . }}}
{{- end }}
{{- end -}}

{{/* What every pod shares. */}}
{{- define "triton-controlplane.podSpec" -}}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: tmp
    emptyDir: {}
{{- end -}}

{{/* What every container shares; the root filesystem is read-only, /tmp is not. */}}
{{- define "triton-controlplane.container" -}}
image: {{ printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
volumeMounts:
  - {name: tmp, mountPath: /tmp}
{{- end -}}

{{/* Takes (dict "root" $ "component" "worker"): replicas of a component go to different hosts
while there are hosts to spare, and still schedule when there are not. */}}
{{- define "triton-controlplane.spread" -}}
- maxSkew: 1
  topologyKey: kubernetes.io/hostname
  whenUnsatisfiable: ScheduleAnyway
  labelSelector:
    matchLabels:
      {{- include "triton-controlplane.selectorLabels" . | nindent 6 }}
{{- end -}}

{{/* The proxies in front of the web pods: web.trustedProxies, else the Ingress controller's one. */}}
{{- define "triton-controlplane.trustedProxies" -}}
{{- if kindIs "invalid" .Values.web.trustedProxies -}}
{{- ternary 1 0 .Values.ingress.enabled -}}
{{- else -}}
{{- int .Values.web.trustedProxies -}}
{{- end -}}
{{- end -}}
