//go:build tools

// Package tools pins runc, which hack/h200/build.sh builds from this module as a static
// binary (cgo for its nsenter; seccomp linked from Debian's libseccomp.a), so that nothing
// it loads at run time has to be on the GPU host.
// `go install runc@version` refuses runc's module (its go.mod has an exclude block),
// hence this wrapper module.
package tools

import (
	_ "github.com/opencontainers/runc"
)
