{{/* Prometheus's configuration in the chart (deploy/prometheus.yml is compose's). */}}
{{- define "fedattn.prometheusConfig" -}}
global:
  scrape_interval: {{ .Values.prometheus.scrapeInterval }}
  evaluation_interval: {{ .Values.prometheus.scrapeInterval }}
rule_files:
  - /etc/prometheus/fedattn/alerts.yml
scrape_configs:
  - job_name: fl-server
    static_configs:
      - targets: [{{ printf "%s:%s" (include "fedattn.serverHost" .) (include "fedattn.arg" .Values.server.metricsPort) | quote }}]
  - job_name: fl-edge
    kubernetes_sd_configs:
      - role: pod
        namespaces:
          names: [{{ .Release.Namespace | quote }}]
        selectors:
          - role: pod
            label: {{ printf "app.kubernetes.io/name=fl-edge,app.kubernetes.io/instance=%s" .Release.Name | quote }}
    relabel_configs:
      - source_labels: [__meta_kubernetes_pod_container_port_name]
        regex: metrics
        action: keep
      - source_labels: [__meta_kubernetes_pod_name]
        target_label: instance
{{- end -}}
