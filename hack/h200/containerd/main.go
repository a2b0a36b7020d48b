// Command containerd is one multi-call binary for containerd and its client ctr (v2.4.2),
// for the H200 device run, whose tool carries at most 64 MiB per call. It picks the program
// by the name it was started as (a hard link or symlink named `containerd` or `ctr`), or by
// its first argument. The runc shim stays its own upstream binary: shim.RunShim loads every
// plugin registered in the process, and containerd's builtins must not load inside a shim.
//
// Each case does what the upstream main package does; nothing else lives here.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/containerd/containerd/v2/cmd/containerd/command"
	"github.com/containerd/containerd/v2/cmd/ctr/app"

	_ "github.com/containerd/containerd/v2/cmd/containerd/builtins"
)

func main() {
	ctx := context.Background()
	name := filepath.Base(os.Args[0])
	if name != "containerd" && name != "ctr" && len(os.Args) > 1 {
		name = os.Args[1]
		os.Args = os.Args[1:]
	}
	var err error
	switch name {
	case "containerd":
		err = command.App().Run(ctx, os.Args)
	case "ctr":
		err = app.New().Run(ctx, os.Args)
	default:
		fmt.Fprintln(os.Stderr, "usage: link this binary as containerd or ctr, or run it as `containerd-ctr containerd|ctr ...`")
		os.Exit(2)
	}
	if err != nil {
		_, _ = fmt.Fprintf(os.Stderr, "%s: %s\n", name, err)
		os.Exit(1)
	}
}
