{{/* Chart name, overridable. */}}
{{- define "dpserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's objects: the release name, plus the chart name unless the
release name already contains it. Truncated to 63 characters (DNS label).
*/}}
{{- define "dpserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Name of cluster-scoped objects (ClusterRole, ClusterRoleBinding): qualified with the
release namespace, so equally named releases in two namespaces do not collide.
*/}}
{{- define "dpserve.clusterName" -}}
{{- printf "%s-%s" (include "dpserve.fullname" .) .Release.Namespace }}
{{- end }}

{{/* chart label: name-version */}}
{{- define "dpserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the operator pod; never change them after install. */}}
{{- define "dpserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dpserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Standard labels on every object of the chart. */}}
{{- define "dpserve.labels" -}}
helm.sh/chart: {{ include "dpserve.chart" . }}
{{ include "dpserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dpserve
{{- end }}

{{/* The operator's ServiceAccount name. */}}
{{- define "dpserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dpserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Image reference "repository:tag" of one of the three images.
Usage: include "dpserve.image" (list . "worker")
The tag falls back to image.tag, then to the chart's appVersion.
*/}}
{{- define "dpserve.image" -}}
{{- $root := index . 0 }}
{{- $which := index . 1 }}
{{- $img := index $root.Values.image $which }}
{{- $tag := $img.tag | default $root.Values.image.tag | default $root.Chart.AppVersion }}
{{- printf "%s:%s" $img.repository $tag }}
{{- end }}

{{/*
The operator's permissions: exactly dpserve.operator.kube.required_rules(), one rule per
(apiGroup, resource). tests/chart/test_chart.py compares the rendered roles with that
set, so a permission added to the code without the chart (or the other way round)
fails the tests; tests/cluster/test_rbac.py asks a real apiserver what they allow.

Namespaced resources: bound cluster-wide, or in a Role per watched namespace.
- dpserve.dev diffusionservices: kopf watches and annotates the CRs; the reconcile reads them.
- diffusionservices/status: the reconcile writes status through the status subresource.
- pods: replica pods are created, listed, watched and deleted by the operator itself.
- services, serviceaccounts, deployments, roles, rolebindings, networkpolicies,
  poddisruptionbudgets: the
  headless and router Services, the router's Deployment, ServiceAccount and
  Role(Binding), the replicas' NetworkPolicy and PodDisruptionBudget, the routers'
  PodDisruptionBudget, by server-side
  apply (patch; an apply that creates the object is authorized as create too).
- secrets create only: the service's wire key, made once (409: it exists). No get,
  list or watch: the operator cannot read any Secret, its own included.
- deployments get/list/watch: Ready needs the router Deployment available.
- configmaps create: the control state; get/list/watch: the operator reports the
  replicas the routers say are out of sync; update: the router's Role grants it, and
  RBAC lets the operator grant only what it holds itself (escalation prevention).
- endpointslices list/watch: also granted to the router's Role (same reason).
- events create: the operator records an Event for each action; kopf posts its own.
*/}}
{{- define "dpserve.namespacedRules" -}}
- apiGroups: ["dpserve.dev"]
  resources: ["diffusionservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["dpserve.dev"]
  resources: ["diffusionservices/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["create", "delete", "list", "watch"]
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["create", "patch"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["create", "patch"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["create", "get", "list", "update", "watch"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "patch"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["create", "delete", "get"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["create", "get", "list", "patch", "watch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles"]
  verbs: ["create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["rolebindings"]
  verbs: ["create", "patch"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["list", "watch"]
{{- end }}

{{/*
Cluster-scoped, cluster-wide mode only: kopf watches the CRDs to notice resources that
appear later. A namespaced operator turns that scanning off and needs none of it.
*/}}
{{- define "dpserve.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}

{{/* The operator's ServiceAccount as the subject of a (Cluster)RoleBinding. */}}
{{- define "dpserve.rbacSubjects" -}}
- kind: ServiceAccount
  name: {{ include "dpserve.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end }}
