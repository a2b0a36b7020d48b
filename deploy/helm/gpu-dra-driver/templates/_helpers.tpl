{{/* The base name of every object: the release name, with the chart name unless it already has it. */}}
{{- define "gpu-dra-driver.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpu-dra-driver.namespace" -}}
{{- default .Release.Namespace .Values.namespace.name -}}
{{- end -}}

{{- define "gpu-dra-driver.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "gpu-dra-driver.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: kubelet-plugin
{{- end -}}

{{/* Host paths a release writes: each carries the driver name unless set, like the command line's defaults. */}}
{{- define "gpu-dra-driver.mpsRoot" -}}
{{- default (printf "/run/%s/mps" .Values.driverName) .Values.mpsRoot -}}
{{- end -}}

{{- define "gpu-dra-driver.stateDir" -}}
{{- default (printf "/run/%s/state" .Values.driverName) .Values.stateDir -}}
{{- end -}}

{{/* repository@digest when a digest is set (the schema checks its form), else repository:tag. */}}
{{- define "gpu-dra-driver.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* A DeviceClass selector: devices of this driver whose `type` attribute is the argument. */}}
{{- define "gpu-dra-driver.typeSelector" -}}
- cel:
    expression: >-
      device.driver == {{ .root.Values.driverName | quote }} &&
      device.attributes[{{ .root.Values.driverName | quote }}].type == {{ .type | quote }}
{{- if eq .type "gpu" }} &&
      !("migEnabled" in device.attributes[{{ .root.Values.driverName | quote }}] &&
        device.attributes[{{ .root.Values.driverName | quote }}].migEnabled)
{{- end }}
{{- end -}}
