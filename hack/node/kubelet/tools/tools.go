//go:build tools

// Package tools pins the kubelet, built from the same k8s.io/kubernetes version and
// staging replaces as the control plane in hack/cluster, so `go mod tidy` keeps it.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kubelet"
)
