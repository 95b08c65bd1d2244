{{/* Names: every object is <release>-<part>, so edge ids (pod names) are predictable:
     <release>-edge-0, -1, ... (the release name is cut to 40 characters). */}}
{{- define "fedattn.fullname" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object; its part's selector labels go with them. */}}
{{- define "fedattn.labels" -}}
app.kubernetes.io/part-of: fedattn
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one part: (dict "root" $ "part" "server") */}}
{{- define "fedattn.selector" -}}
app.kubernetes.io/name: {{ printf "fl-%s" .part }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{/* One command-line argument: a whole number as digits (Helm reads numbers as floats,
     which print as 1e+06), anything else as it is. */}}
{{- define "fedattn.arg" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) -}}
{{- int64 . -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{- define "fedattn.image" -}}
{{- $tag := .image.tag | default .root.Chart.AppVersion -}}
image: {{ printf "%s:%s" .image.repository $tag | quote }}
imagePullPolicy: {{ .image.pullPolicy }}
{{- end -}}

{{/* The Secret and key holding the join token (plaintext runs). */}}
{{- define "fedattn.tokenSecret" -}}
{{- if .Values.token.existingSecret -}}
{{- .Values.token.existingSecret -}}
{{- else if .Values.token.value -}}
{{- printf "%s-token" (include "fedattn.fullname" .) -}}
{{- else -}}
{{- fail "token: set token.existingSecret or token.value (the join token of plaintext runs; or tls.enabled=true)" -}}
{{- end -}}
{{- end -}}

{{- define "fedattn.serverHost" -}}
{{- printf "%s-server" (include "fedattn.fullname" .) -}}
{{- end -}}

{{/* The pods' security context: the images' non-root user, files group-owned. */}}
{{- define "fedattn.podSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{- define "fedattn.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  capabilities: {drop: [ALL]}
{{- end -}}
