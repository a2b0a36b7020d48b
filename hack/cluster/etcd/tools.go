//go:build tools

// Package tools pins etcd's server main package (the module root of
// go.etcd.io/etcd/server/v3), built here apart from Kubernetes so that the
// test cluster runs the etcd 3.6 line that kubeadm ships with Kubernetes 1.37.
package tools

import _ "go.etcd.io/etcd/server/v3"
