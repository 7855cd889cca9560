{{- define "pool.name" -}}
{{- printf "triton-%s" .Values.pool | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pool.labels" -}}
app.kubernetes.io/name: tritonserver
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
triton-pool: {{ .Values.pool | quote }}
{{- end -}}

{{- define "pool.selector" -}}
app.kubernetes.io/name: tritonserver
app.kubernetes.io/instance: {{ .Release.Name }}
triton-pool: {{ .Values.pool | quote }}
{{- end -}}

{{/* The signal's series for this pool, as prometheus-adapter and KEDA read it: one value
whatever the number of control plane pods that export it (each exports the same). */}}
{{- define "pool.wanted" -}}
max(controlplane_pool_nodes_wanted{pool="{{ .Values.pool }}"})
{{- end -}}

{{- define "pool.behavior" -}}
scaleUp:
  stabilizationWindowSeconds: 0
  tolerance: {{ .Values.autoscaling.tolerance | quote }}
  selectPolicy: Max
  policies:
    - {type: Percent, value: 100, periodSeconds: 15}
    - {type: Pods, value: 4, periodSeconds: 15}
scaleDown:
  stabilizationWindowSeconds: {{ .Values.autoscaling.scaleDownStabilizationSeconds }}
  tolerance: {{ .Values.autoscaling.tolerance | quote }}
  policies:
    - {type: Percent, value: 100, periodSeconds: 15}
{{- end -}}
